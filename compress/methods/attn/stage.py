"""The attention-conversion stages ``gqa``, ``cla`` and ``mla``, and ``fit``, the layer-local fitting
after them (``(model, ctx) -> model``).

Recipe keys::

    attn.kv_heads:   gqa: KV heads after mean-pooling (null keeps the model's)
    attn.gqa_init:   gqa: aligned (heads grouped, turned and the key norm restored) | mean
    attn.share:      cla: layers sharing one layer's K/V (1: no sharing)
    attn.cla_init:   cla: lstsq | first
    mla.d_kv:        mla: latent values per KV head (the layer's latent: d_kv x KV heads)
    mla.rope_pairs:  mla: RoPE frequency pairs kept per KV head (2 x rope_pairs dims)
    mla.rope_select: mla: 2norm | uniform | high | low
    mla.svd:         mla: weights (MHA2MLA's SVD_joint) | activations (in E[x x^T]'s metric)
    mla.style:       mla: mha2mla (the keys above; a compress_mla folder) | deepseek_v3 (a stock
                     deepseek_v3 folder, ``compress.methods.attn.deepseek_mla``: one shared RoPE
                     key of mla.rope_dim channels, a latent of mla.kv_lora_rank, its RMSNorm)
    fit.steps:       fit: Adam steps per layer (a CLA group) of layer-local fitting; 0 skips it
    fit.lr:          fit: Adam's learning rate, cosine-decayed to 0
    fit.batch:       fit: calibration sequences a step (one batch is held out)

``cla`` and ``mla`` give models of their own type (``compress.formats.attention``), whose modeling files
the run folder carries; ``mla.style=deepseek_v3`` gives transformers' own DeepseekV3ForCausalLM. report.json gets ``attn`` (what was converted, with which settings).
"""

import logging

from compress.errors import CompressError
from compress.formats.attention import folder_files
from compress.io.source import load_model
from compress.methods.attn.checks import check_llama_layers, check_rope, check_source
from compress.methods.attn.cla import check_share, convert_cla
from compress.methods.attn.deepseek_mla import check_deepseek_mla, convert_deepseek_mla
from compress.methods.attn.fit import fit_attention
from compress.methods.attn.gqa import INITS, aligned_pool_kv, check_kv_heads, mean_pool_kv
from compress.methods.attn.mla import check_mla, convert_mla

log = logging.getLogger(__name__)


def _record(ctx, **fields) -> None:
    ctx.record.setdefault("attn", {}).update(fields)


def gqa(model, ctx):
    """Mean-pool K/V heads to ``attn.kv_heads`` (a no-op when null or equal to the model's)."""

    check_source(model.config, "gqa")
    kv_heads = ctx.cfg.attn.get("kv_heads")
    source = model.config.num_key_value_heads
    if kv_heads is not None:
        check_kv_heads(model.config, int(kv_heads))
    if kv_heads is None or int(kv_heads) == source:
        return model
    init = _gqa_init(ctx.cfg.attn)
    log.info("gqa: %d -> %d KV heads (%s)", source, int(kv_heads), init)
    _record(ctx, kv_heads=int(kv_heads), source_kv_heads=source, gqa_init=init)
    if init == "mean":
        return mean_pool_kv(model, int(kv_heads))
    return aligned_pool_kv(model, int(kv_heads), ctx.calibration())


def _gqa_init(a) -> str:
    init = str(a.get("gqa_init") or "aligned")
    if init not in INITS:
        raise CompressError(f"attn.gqa_init={init!r}: use one of {', '.join(INITS)}.")
    return init


def cla(model, ctx):
    """Share each group of ``attn.share`` layers' K/V (``attn.cla_init`` initialisation)."""

    a = ctx.cfg.attn
    share, init = int(a.get("share") or 1), str(a.get("cla_init") or "lstsq")
    check_source(model.config, "cla")
    check_llama_layers(model.config, "cla")
    check_share(model.config, share, init)
    tokens = ctx.calibration() if init == "lstsq" and share > 1 else None
    log.info("cla: K/V shared by groups of %d layers (%s)", share, init)
    out = convert_cla(model, share, init, tokens)
    ctx.files.update(folder_files(out.config.model_type))
    _record(ctx, share=share, cla_init=init, kv_heads=out.config.num_key_value_heads)
    return out


def fit(model, ctx):
    """Fit each converted attention block to the source's on the source's own inputs
    (``compress.methods.attn.fit``), before any end-to-end training."""

    f = ctx.cfg.fit
    steps, lr, batch = int(f.steps), float(f.lr), int(f.batch)
    if steps == 0:
        return model
    m = ctx.cfg.model
    home = next(model.parameters()).device
    source = load_model(m.path, m.dtype, m.trust_remote_code)[0].float().to(ctx.device)
    model.float().to(ctx.device)  # float32 weights to fit, where calibration runs (``device``)
    log.info("fit: %d steps per layer (lr %g, %d sequences a step)", steps, lr, batch)
    report = fit_attention(source, model, ctx.calibration().to(ctx.device), steps, lr, batch)
    del source
    model.to(home)
    first, last = sum(report["before"]), sum(report["after"])
    log.info("fit: mean relative error of the attention outputs %.4f -> %.4f (%.0f s)",
             first / len(report["before"]), last / len(report["after"]), report["seconds"])  # fmt: skip
    ctx.record["fit"] = report
    return model


def check_fit_stage(cfg, hf_config=None) -> None:
    """Refuse ``fit.*`` settings the fitting cannot run with."""
    f = cfg.get("fit") or {}
    rules = (
        ("steps", 0, "Adam steps per layer; 0 skips the stage"),
        ("batch", 1, "sequences a step"),
    )
    for key, low, what in rules:
        v = f.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise CompressError(f"fit.{key}={v!r}: fit.{key} takes an integer >= {low} ({what}).")
    lr = f.get("lr")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise CompressError(f"fit.lr={lr!r}: fit.lr takes a number > 0 (Adam's learning rate).")
    samples = (cfg.get("calib") or {}).get("samples", 2)
    if f.get("steps") and isinstance(samples, int) and samples < 2:
        raise CompressError(
            f"calib.samples={samples} with fit.steps={f.get('steps')}: the fitting holds one batch "
            f"of calibration sequences out and trains on the rest; use calib.samples >= 2, or "
            f"fit.steps=0 to skip it."
        )


STYLES = ("mha2mla", "deepseek_v3")


def _style(m) -> str:
    style = str(m.get("style") or "mha2mla")
    if style not in STYLES:
        raise CompressError(
            f"mla.style={style!r}: use mha2mla (a compress_mla folder) or deepseek_v3 (a stock "
            f"deepseek_v3 folder: recipe=mla mla=deepseek_v3)."
        )
    return style


def mla(model, ctx):
    """Partial RoPE + joint low-rank K/V (``mla.*``)."""

    m = ctx.cfg.mla
    if _style(m) == "deepseek_v3":
        return deepseek_v3(model, ctx)
    d_kv, pairs, select = int(m.d_kv), int(m.rope_pairs), str(m.rope_select)
    svd = str(m.get("svd") or "weights")
    check_source(model.config, "mla")
    check_llama_layers(model.config, "mla")
    check_rope(model.config, "mla")
    check_mla(model.config, d_kv, pairs, select, svd)
    tokens = ctx.calibration() if select == "2norm" or svd == "activations" else None
    log.info("mla: d_kv %d per KV head, %d RoPE pairs (%s), svd %s", d_kv, pairs, select, svd)
    out = convert_mla(model, d_kv, pairs, select, tokens, svd)
    ctx.files.update(folder_files(out.config.model_type))
    _record(
        ctx,
        d_kv=d_kv,
        kv_lora_rank=out.config.kv_lora_rank,
        rope_pairs=pairs,
        rope_select=select,
        svd=svd,
        kv_heads=out.config.num_key_value_heads,
    )
    return out


def deepseek_v3(model, ctx):
    """Our MLA as a stock DeepSeek V3 model (``mla.kv_lora_rank``, ``mla.rope_dim``)."""
    m = ctx.cfg.mla
    rank, rope_dim, anchor = int(m.kv_lora_rank), int(m.rope_dim), bool(m.latent_anchor)
    check_deepseek_source(model.config, rank, rope_dim, anchor)
    log.info("mla: deepseek_v3 style, latent %d, shared RoPE key of %d", rank, rope_dim)
    out = convert_deepseek_mla(model, rank, rope_dim, ctx.calibration(), anchor)
    _record(ctx, style="deepseek_v3", kv_lora_rank=rank, rope_dim=rope_dim, latent_anchor=anchor)
    return out


def check_deepseek_source(config, rank: int, rope_dim: int, anchor: bool) -> None:
    check_source(config, "mla")
    check_llama_layers(config, "mla")
    check_rope(config, "mla")
    kind = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if kind != "default":
        raise CompressError(
            f"mla.style=deepseek_v3 keeps the source's RoPE frequencies for DeepSeek's own RoPE, "
            f"which it writes unscaled; this model's RoPE is '{kind}'-scaled. Use "
            f"mla.style=mha2mla for it."
        )
    check_deepseek_mla(config, rank, rope_dim, anchor)


def check_gqa_stage(cfg, hf_config=None) -> None:
    """Refuse ``attn.kv_heads`` that mean-pooling cannot meet, from config.json alone."""
    kv_heads = (cfg.get("attn") or {}).get("kv_heads")
    _gqa_init(cfg.get("attn") or {})
    if hf_config is not None and kv_heads is not None:
        check_kv_heads(hf_config, int(kv_heads))


def check_cla_stage(cfg, hf_config=None) -> None:
    """Refuse a family the converted Llama cannot compute, or a share the layers cannot meet."""
    if hf_config is not None:
        attn = cfg.get("attn") or {}
        check_source(hf_config, "cla")
        check_llama_layers(hf_config, "cla")
        check_share(hf_config, int(attn.get("share") or 1), str(attn.get("cla_init") or "lstsq"))


def check_mla_stage(cfg, hf_config=None) -> None:
    """Refuse a family the converted Llama cannot compute, or a deepseek_v3 style it cannot
    meet."""
    m = cfg.get("mla") or {}
    if _style(m) == "deepseek_v3":
        if hf_config is not None:
            anchor = m.get("latent_anchor", True)
            if not isinstance(anchor, bool):
                raise CompressError(f"mla.latent_anchor={anchor!r}: true or false.")
            check_deepseek_source(hf_config, int(m.kv_lora_rank), int(m.rope_dim), anchor)
        return
    if hf_config is not None:
        check_source(hf_config, "mla")
        check_llama_layers(hf_config, "mla")
