"""LLM.int8 (Dettmers et al. 2022): vector-wise int8 with mixed-precision outlier decomposition.

The method: every decoder linear becomes an ``Int8Linear`` (``compress.layers.int8_linear``
has bitsandbytes' on-disk layout and the forward's equations), with weights quantized per
output row and activation dims whose magnitude exceeds ``threshold`` kept in full precision.
Before quantizing, the ``llm_int8`` stage measures on calibration samples how many input dims
of each linear cross the threshold (:func:`outlier_stats`), and records it in the run.

``threshold = auto`` measures it: on windows of calibration text (``calib``, validation text,
never the test windows), the candidates are tried from the largest down and the first whose
perplexity is within ``auto_tolerance`` (0.5%) of the source's is kept, i.e. the largest such
threshold: the fewest dims in the fp path at the quality asked for::

    a* = max { a in candidates : ppl(a) <= (1 + tolerance) * ppl(source) }

When none is, the candidate with the lowest perplexity is kept, and the report says so.

Families: the decoder linears of every family (``adapter.linears``) become ``Int8Linear``; norms
(Gemma's four (1 + w) norms, the per-head q/k norms of Qwen3 and Gemma 3), biases (Qwen2's q/k/v),
the embedding and the tied head stay in float, as bitsandbytes' ``load_in_8bit`` leaves them, so
transformers with bitsandbytes loads the folder of any family.
"""

import copy
import math

import torch
from torch import nn
from tqdm import tqdm

from compress.arch.adapters import get_adapter, set_module
from compress.errors import CompressError
from compress.eval.perplexity import evaluate
from compress.io.offload import capture_inputs, layer_on
from compress.layers.int8_linear import Int8Linear, check_threshold


def quantization_config(threshold: float) -> dict:
    """config.json's ``quantization_config``, as transformers' ``BitsAndBytesConfig(load_in_8bit=True)``."""
    return {
        "quant_method": "bitsandbytes",
        "load_in_8bit": True,
        "load_in_4bit": False,
        "llm_int8_threshold": threshold,
        "llm_int8_has_fp16_weight": False,
        "llm_int8_skip_modules": None,
        "llm_int8_enable_fp32_cpu_offload": False,
    }


@torch.no_grad()
def outlier_stats(model: nn.Module, samples: torch.Tensor, threshold: float, device=None) -> dict:
    """Per decoder linear, how many input dims cross ``threshold`` on ``samples [n, seqlen]``, and how often.

    One decoder layer at a time on ``device`` (``compress.io.offload.layer_on``), one sample at a
    time through it, hooks on the linears' inputs. Per layer: ``dims`` (distinct
    dims that ever crossed), ``dims_per_sample`` (mean |O| of a forward over one sample,
    i.e. the width of the fp path), ``sample_frac`` / ``token_frac`` (share of samples /
    tokens with any outlier), ``max_abs`` and ``top_dims`` ([dim, tokens crossing]).
    """
    linears = get_adapter(model.config).all_linears(model)
    hits = {name: torch.zeros(m.in_features, dtype=torch.int64) for name, m in linears.items()}
    acc = {name: {"outlier_dims": 0, "samples": 0, "tokens": 0, "max_abs": 0.0} for name in linears}

    last = {}  # q/k/v (and gate/up) get the same input tensor object: count it once

    def count(x: torch.Tensor):
        if (
            last.get("x") is not x or last["version"] != x._version
        ):  # holding x keeps its identity unique
            mag = x.detach().reshape(-1, x.shape[-1]).abs().float()
            over = mag > threshold
            per_dim = over.sum(dim=0).cpu()
            last.update(
                x=x,
                version=x._version,
                value=(
                    per_dim,
                    int((per_dim > 0).sum()),
                    int(over.any(dim=1).sum()),
                    float(mag.max()),
                ),
            )
        return last["value"]

    def hook(name):
        def fn(module, args):
            per_dim, n_dims, tokens, max_abs = count(args[0])
            hits[name] += per_dim
            a = acc[name]
            a["outlier_dims"] += n_dims
            a["samples"] += n_dims > 0
            a["tokens"] += tokens
            a["max_abs"] = max(a["max_abs"], max_abs)

        return fn

    adapter = get_adapter(model.config)
    x, per_layer = capture_inputs(model, adapter, samples, 1, device)
    for i in tqdm(
        range(len(adapter.decoder_layers(model))),
        desc=f"llm_int8 outliers > {threshold:g}",
        unit="layer",
    ):
        with layer_on(model, i, device) as layer:
            handles = [
                m.register_forward_pre_hook(hook(f"{adapter.layers}.{i}.{path}"))
                for path, m in adapter.named_linears(layer).items()
            ]
            try:  # one sample at a time, as a whole-model forward per sample
                x = torch.cat([layer(c, **per_layer[i]) for c in x.split(1)])
            finally:
                for h in handles:
                    h.remove()

    n, tokens = samples.shape[0], samples.numel()
    table = {}
    for name, h in hits.items():
        a = acc[name]
        top = torch.argsort(h, descending=True)[:5]
        table[name] = {
            "in_features": h.numel(),
            "dims": int((h > 0).sum()),
            "dims_per_sample": a["outlier_dims"] / n,
            "sample_frac": a["samples"] / n,
            "token_frac": a["tokens"] / tokens,
            "max_abs": round(a["max_abs"], 3),
            "top_dims": [[int(d), int(h[d])] for d in top if h[d] > 0],
        }
    return table


def quantize_model(model: nn.Module, threshold: float, device=None) -> nn.Module:
    """Replace every decoder linear by an ``Int8Linear`` (embeddings and head stay fp), one
    decoder layer at a time on ``device`` (None: where the layers are)."""
    adapter = get_adapter(model.config)
    for i in range(len(adapter.decoder_layers(model))):
        with layer_on(model, i, device, write=True) as layer:
            for path, lin in adapter.named_linears(layer).items():
                name = f"{adapter.layers}.{i}.{path}"
                set_module(layer, path, Int8Linear.from_linear(lin, threshold, name=name))
    return model


def score(
    model: nn.Module,
    windows: torch.Tensor,
    make,
    compare: bool = True,
    desc: str = "eval",
    cache=None,
    source_sha: str = "",
) -> dict:
    """``evaluate`` figures of ``make(copy of model)`` on ``windows [n, seqlen]``; with ``compare``,
    KL and top-1 against ``model`` itself (``model`` is left as it is)."""

    return evaluate(
        make(copy.deepcopy(model)),
        windows,
        model if compare else None,
        desc=desc,
        cache=cache,
        source_sha=source_sha,
    )


def check_candidates(candidates, tolerance) -> tuple[list[float], float]:
    """``auto``'s settings, validated: candidates largest first, and the tolerance."""

    def number(a) -> bool:
        return isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a)

    if not candidates or not all(number(a) and a > 0 for a in candidates):
        raise CompressError(
            f"llm_int8.auto_candidates={candidates!r}: give a list of thresholds "
            f"> 0, e.g. [8.0, 6.0, 4.0, 3.0, 2.0, 1.0]."
        )
    if not number(tolerance) or not 0 < tolerance < 1:
        raise CompressError(
            f"llm_int8.auto_tolerance={tolerance!r}: give the allowed relative "
            f"perplexity increase over the source, a number in (0, 1), e.g. 0.005 "
            f"for 0.5%."
        )
    return sorted({float(a) for a in candidates}, reverse=True), float(tolerance)


def choose_threshold(model: nn.Module, windows: torch.Tensor, candidates, tolerance: float = 0.005):
    """``(threshold, reason, record)``: the largest candidate whose perplexity on ``windows`` is
    within ``tolerance`` of ``model``'s (see the module docstring), why, and the perplexities
    tried."""
    candidates, tolerance = check_candidates(candidates, tolerance)
    source = score(model, windows, lambda m: m, compare=False, desc="llm_int8 auto: source")["ppl"]
    where = f"{len(windows)} calibration windows of {windows.shape[1]} tokens"
    tried = {}
    for a in candidates:
        tried[a] = score(
            model,
            windows,
            lambda m, a=a: quantize_model(m, a),
            compare=False,
            desc=f"llm_int8 auto: t={a:g}",
        )["ppl"]
        if tried[a] <= (1 + tolerance) * source:
            chosen = a
            reason = (
                f"largest of {candidates} whose ppl on {where} ({tried[a]:.4f}) is within "
                f"{tolerance:.2%} of the source's ({source:.4f})"
            )
            break
    else:
        chosen = min(tried, key=tried.get)
        reason = (
            f"no candidate of {candidates} is within {tolerance:.2%} of the source's ppl "
            f"({source:.4f}) on {where}; kept the lowest ppl ({tried[chosen]:.4f})"
        )
    record = {
        "source_ppl": source,
        "tolerance": tolerance,
        "ppl": {f"{a:g}": p for a, p in tried.items()},
    }
    return chosen, reason, record


def check_settings(cfg) -> float | str:
    """The ``llm_int8`` group's threshold, validated: a number >= 0, or ``auto`` with valid
    ``auto_candidates`` and ``auto_tolerance``. Cheap: for config checks before any work."""
    threshold = (cfg or {}).get("threshold", 6.0)
    if isinstance(threshold, str) and threshold != "auto":
        raise CompressError(
            f"llm_int8.threshold={threshold!r}: give a number >= 0 (6.0 is "
            f"LLM.int8's default, 0 turns the decomposition off) or auto "
            f"(measured on calibration text)."
        )
    if threshold == "auto":
        check_candidates(list(cfg.get("auto_candidates") or []), cfg.get("auto_tolerance", 0.005))
        return threshold
    return check_threshold(threshold)


def llm_int8(model: nn.Module, ctx) -> nn.Module:
    """Stage: LLM.int8 with ``ctx.cfg.llm_int8`` = {threshold (a number or auto), outlier_stats,
    auto_candidates, auto_tolerance}."""
    cfg = ctx.cfg.get("llm_int8") or {}
    threshold = check_settings(cfg)
    if threshold == "auto":
        candidates, tolerance = check_candidates(
            list(cfg.get("auto_candidates") or []), cfg.get("auto_tolerance", 0.005)
        )
        threshold, reason, record = choose_threshold(
            model, ctx.calibration(), candidates, tolerance
        )
        ctx.record["llm_int8_auto"] = record
    else:
        reason = "set in the recipe (llm_int8.threshold)"
    ctx.record["llm_int8_threshold"], ctx.record["llm_int8_threshold_reason"] = threshold, reason
    device = getattr(ctx, "device", None)
    if threshold > 0 and cfg.get("outlier_stats", True):
        table = outlier_stats(model, ctx.calibration(), threshold, device)
        ctx.record["outliers"] = table
        ctx.record["outlier_summary"] = {
            "layers_with_outliers": sum(r["dims"] > 0 for r in table.values()),
            "layers": len(table),
            "mean_fp_dims_per_sample": sum(r["dims_per_sample"] for r in table.values())
            / len(table),
        }
    ctx.record["threshold"] = threshold
    ctx.quantization_config = quantization_config(threshold)
    return quantize_model(model, threshold, device)


def check(cfg, hf_config=None) -> None:
    """Refuse ``llm_int8.*`` before the model loads."""
    check_settings(cfg.llm_int8)
