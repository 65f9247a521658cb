"""AWQ: activation-aware weight quantization (Lin et al. 2023).

Faithful to mit-han-lab/llm-awq (``auto_scale.py``, ``auto_clip.py``) and
AutoAWQ (``quantizer.py``). One decoder layer at a time, with only that
layer's calibration inputs in memory:

1. **Scale search**, per group of linears sharing an input x (adapter roles)::

       norm1 -> q,k,v     v -> o (only if shapes match)     norm2 -> gate,up     up -> down

   for alpha in {0, 1/20, ..., 19/20}::

       s = mean|x|^alpha                          (duo: mean|x|^a / mean|w_hat|^(1-a))
       s = s / sqrt(max(s) * min(s))
       loss(alpha) = || block(x; Q(W*s)/s) - block(x; W) ||^2 / numel

   keep the best s; fold 1/s into the previous op (norm weight, or the previous
   linear's output rows) and s into the linears' input columns.

   The groups come from the architecture spec (``compress.arch.spec``), one rule for every family:
   norm1 is ``adapter.input_norm`` and norm2 ``adapter.post_norm`` (Gemma 3:
   ``pre_feedforward_layernorm``, the norm that feeds the MLP). Why each fold is exact:

   - norm -> linears: a norm computes ``(o + w) * x_hat`` (o = ``spec.norm_offset``: 0, or 1 for
     Gemma's ``(1 + w)``), so ``W diag(s) ((o + w') * x_hat)`` with ``w' = (o + w)/s - o`` equals
     ``W ((o + w) * x_hat)``. Per-head q/k norms (Qwen3, Gemma 3) come *after* q_proj/k_proj,
     so scaling the projections' input columns leaves their outputs, hence the norms, unchanged.
   - v -> o and up -> down scale the previous linear's output rows by 1/s and the next one's
     input columns by s: attention is linear in v (``P v``, heads kept apart), the gated MLP is
     linear in up (``act(gate) * up``), so o's and down's outputs are unchanged; Gemma 3's norms
     on those outputs (``attn_out_norm``, ``mlp_out_norm``) therefore see the same input. No
     group scales k_proj's (or q_proj's) output rows: a per-head k-norm is not invariant to a
     per-channel scale of its input, and RoPE mixes channel pairs.
   - The scale search runs each layer with its own mask and RoPE table (``layer_kwargs``):
     sliding-window layers (Mistral, Qwen2's upper layers, Gemma 3's local layers) see their
     banded mask and Gemma 3's local and global layers their own theta.
   - The head stays unquantized (``quant.lm_head``); Gemma 3's tied 262k-row head is the
     embedding, which no group touches.

2. **Clip search** (not for q and k), per output channel and group, over
   max|w| * (1 - i/20), i = 0..9, minimising the error of the group's partial
   dot products ``x_g . w_g`` on 512 sampled tokens; then clamp W.

   **Mixture of experts** (the groups come from the spec here too): the MLP input norm feeds
   the router, every expert's gate/up and the shared expert's gate/up (and qwen2_moe's
   shared-expert gate), so one scale s over the hidden channels is folded into that norm, those
   linears' input columns and, exactly, the router's and the shared gate's weights (``W_r (x/s)``
   with ``W_r diag(s)`` is ``W_r x``: routing is unchanged); its loss is the whole sparse
   block's output. Each expert's up -> down pair (and the shared expert's) is a group of its
   own. **All-experts calibration** (``awq.experts: all``, the default): every expert's
   statistics and loss use every calibration token (its down input ``act(gate_e x) * up_e x``
   computed for all of them), while the layer's output, the next layer's input, is the routed
   one. ``awq.experts: routed`` uses the tokens routed to the expert, and an expert routed fewer
   than ``awq.expert_min_tokens`` tokens falls back to all tokens (reported in
   ``awq_experts_fallback``); the report gives each expert's routed count
   (``awq_experts_routed``). Nothing is left unquantized or scaled by a NaN.

3. Quantize the layer (group-wise, zero point), replace its linears by
   ``QuantLinear``, and pass the *quantized* layer's output to the next layer.

   ``awq.quantize=false`` (AWQ then GPTQ, recipes ``awq_gptq_int*``): the scales are folded and,
   with ``awq.clip``, the weights clamped to the searched clip, but nothing is rounded; the
   linears stay float, the next layer sees the float layer's output, and a later stage
   (``gptq``, or ``rtn``) quantizes.
"""

import logging
import math

import torch
from torch import nn
from tqdm import tqdm

from compress.arch.adapters import Adapter, get_adapter, set_module
from compress.arch.spec import model_spec
from compress.errors import CompressError
from compress.formats.quantizer import fake_quantize, quantize
from compress.io.offload import (
    calibration_bytes,
    capture_inputs,
    check_fits,
    layer_kwargs,
    layer_on,
)
from compress.layers import QuantLinear
from compress.layers.experts import LinearExperts, unfuse_experts
from compress.methods.quant import expert_calib
from compress.methods.quant.expert_calib import (
    down_input,
    expert_rows,
    gated_parts,
    linear_names,
    moe_layer_inputs,
    routed_counts,
)
from compress.methods.quant.rtn import (
    check_width,
    float_linears,
    quantization_config,
    resolve_group_size,
    stored_format,
)

log = logging.getLogger(__name__)
__all__ = [
    "awq",
    "capture_inputs",
    "layer_kwargs",
    "search_scale",
    "search_clip",
    "apply_scale",
    "scale_groups",
]


def scale_groups(layer: nn.Module, adapter: Adapter, attention_only: bool = False) -> list[dict]:
    """The four AWQ groups: previous op, the linears it feeds, their input role, the block to
    inspect (see the module docstring for why each fold is exact in every family);
    ``attention_only``: the first two (a mixture of experts' MLP: :func:`moe_groups`)."""
    lin = lambda role: adapter.linear(layer, role)  # noqa: E731
    groups = [
        dict(
            name="qkv",
            prev=layer.get_submodule(adapter.input_norm),
            linears=[lin("q"), lin("k"), lin("v")],
            inp="q",
            block="attn",
        )
    ]
    if lin("v").weight.shape == lin("o").weight.shape:  # skipped for GQA, as upstream does
        groups.append(dict(name="o", prev=lin("v"), linears=[lin("o")], inp="o", block=None))
    if attention_only:
        return groups
    groups.append(
        dict(
            name="gate_up",
            prev=layer.get_submodule(adapter.post_norm),
            linears=[lin("gate"), lin("up")],
            inp="gate",
            block="mlp",
        )
    )
    groups.append(dict(name="down", prev=lin("up"), linears=[lin("down")], inp="down", block=None))
    return groups


def moe_groups(layer: nn.Module, adapter: Adapter) -> list[dict]:
    """The groups of a mixture-of-experts family's layer (module docstring): the attention's as
    :func:`scale_groups` makes them (where its entry lists them), then the MLP input group
    (``absorb``: weights scaled exactly, never quantized) and one up -> down group per expert,
    per shared expert, or of the dense MLP."""
    roles = dict(adapter.linears)
    groups = scale_groups(layer, adapter, attention_only=True) if "q" in roles else []
    for group in groups:
        group["absorb"] = []
    mlp = layer.get_submodule(adapter.mlp)
    parts = gated_parts(layer, adapter)
    sparse = isinstance(getattr(mlp, "experts", None), LinearExperts)
    absorb = [mlp.gate] if sparse else []
    absorb += [mlp.shared_expert_gate] if hasattr(mlp, "shared_expert_gate") else []
    linears = [getattr(m, n) for _, m, _ in parts for n in linear_names(m)[:2]]
    prev = layer.get_submodule(adapter.post_norm)
    groups.append(
        dict(name="gate_up", prev=prev, linears=linears, absorb=absorb, inp="mlp_in", block="mlp")
    )
    for label, m, _ in parts:
        _, u, d = (getattr(m, n) for n in linear_names(m))
        groups.append(
            dict(
                name=f"down.{label}",
                prev=u,
                linears=[d],
                absorb=[],
                inp=("down", label),
                block=None,
            )
        )
    return groups


@torch.no_grad()
def layer_inputs(layer: nn.Module, adapter: Adapter, x: torch.Tensor, kwargs: dict, batch: int):
    """Inputs of the q, o, gate and down projections for every token, and the layer's output."""
    roles = ("q", "o", "gate", "down")
    feats = {r: [] for r in roles}
    hooks = [
        adapter.linear(layer, r).register_forward_hook(
            lambda _m, args, _out, r=r: feats[r].append(args[0])
        )
        for r in roles
    ]
    try:
        out = torch.cat([layer(chunk, **kwargs) for chunk in x.split(batch)])
    finally:
        for h in hooks:
            h.remove()
    return {r: torch.cat(v) for r, v in feats.items()}, out


def _block_forward(layer, adapter, group, x, kwargs, batch):
    """Output of what the group feeds: the attention block, the MLP, or the lone linear."""
    if group["block"] == "attn":
        attn = layer.get_submodule(adapter.attn)
        return torch.cat([attn(hidden_states=c, **kwargs)[0] for c in x.split(batch)])
    if group["block"] == "mlp":
        mlp = layer.get_submodule(adapter.mlp)
        return torch.cat([mlp(c) for c in x.split(batch)])
    return group["linears"][0](x)


@torch.no_grad()
def search_scale(
    layer, adapter, group, x, x_search, kwargs, bits, group_size, duo, n_grid, batch, sym=False
):
    """Grid search of alpha; returns (best scales [in], best alpha, losses)."""
    linears = group["linears"]
    x_mean = x.abs().reshape(-1, x.shape[-1]).float().mean(0)
    w = torch.cat([m.weight for m in linears])
    wg = w.abs().reshape(w.shape[0], -1, group_size)
    w_mean = (wg / (wg.amax(-1, keepdim=True) + 1e-6)).reshape_as(w).mean(0)
    reference = _block_forward(layer, adapter, group, x_search, kwargs, batch)
    originals = [m.weight.data.clone() for m in linears]
    best, losses = (math.inf, None, 0.0), []
    for i in range(n_grid):
        alpha = i / n_grid
        if duo:
            s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
        else:
            s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        s[~torch.isfinite(s)] = 1
        for m, w0 in zip(linears, originals):
            m.weight.data = fake_quantize(w0 * s, bits, group_size, sym) / s
        out = _block_forward(layer, adapter, group, x_search, kwargs, batch)
        loss = (reference - out).float().pow(2).mean().item()
        losses.append(loss)
        if loss < best[0]:
            best = (loss, s.clone(), alpha)
    for m, w0 in zip(linears, originals):
        m.weight.data = w0
    return best[1], best[2], losses


@torch.no_grad()
def apply_scale(
    prev: nn.Module, linears: list[nn.Module], s: torch.Tensor, norm_offset: float = 0.0
) -> None:
    """Fold ``1/s`` into the previous op's output and ``s`` into the linears' input columns.

    A norm computes ``(offset + w) * x_hat``; its new weight is ``w' = (offset + w) / s - offset``
    (offset 1 for Gemma's ``(1 + w)``, ``spec.norm_offset``)."""
    if isinstance(prev, nn.Linear):
        prev.weight.div_(s.view(-1, 1))
        if getattr(prev, "bias", None) is not None:
            prev.bias.div_(s)
    else:  # RMSNorm-like: y = (offset + w) * norm(x)
        w = prev.weight
        w.copy_(((norm_offset + w.double()) / s.double() - norm_offset).to(w.dtype))
    for m in linears:
        m.weight.mul_(s.view(1, -1))


@torch.no_grad()
def search_clip(
    w: torch.Tensor,
    x: torch.Tensor,
    bits: int,
    group_size: int,
    n_grid: int = 20,
    max_shrink: float = 0.5,
    n_tokens: int = 512,
    symmetric: bool = False,
) -> torch.Tensor:
    """Best max|w| per output row and group, ``[out, in/g]``, minimising the partial-dot-product error.

    err(c) = mean_t ( x_tg . (Q(clamp(w_g, -c, c)) - w_g) )^2    for each (row, group g)
    """
    x = x.reshape(-1, x.shape[-1])
    x = x[:: max(1, x.shape[0] // n_tokens)][:n_tokens].float()
    out_f, in_f = w.shape
    ng = in_f // group_size
    xg = x.reshape(-1, ng, group_size).transpose(0, 1)  # [ng, t, g]
    wg = w.float().reshape(out_f, ng, group_size)
    reference = torch.bmm(xg, wg.permute(1, 2, 0))  # [ng, t, out]
    org_max = wg.abs().amax(-1)  # [out, ng]
    best_max, best_err = org_max.clone(), torch.full_like(org_max, math.inf)
    for i in range(int(max_shrink * n_grid)):
        c = org_max * (1 - i / n_grid)
        q = fake_quantize(w, bits, group_size, symmetric, clip_max=c).reshape(out_f, ng, group_size)
        err = (torch.bmm(xg, q.permute(1, 2, 0)) - reference).pow(2).mean(1).t()  # [out, ng]
        better = err < best_err
        best_err[better], best_max[better] = err[better], c[better]
    return best_max


def check_grouped(group_size) -> None:
    """AWQ searches per group: refuse -1 (one group per row)."""
    if group_size == -1:
        raise CompressError(
            "awq.group_size=-1 (one group per row) is not supported: AWQ's scale "
            "and clip search work on groups. Use auto, 128, 64 or 32."
        )


def check(cfg, hf_config=None) -> None:
    """Refuse, before the model loads, ``awq.*`` settings the search cannot run with: the
    bits, the group size, and whole numbers (``search_samples`` null: every calibration sample)."""
    a = cfg.awq
    check_width(a, "awq", hf_config)
    stored_format(cfg)
    check_grouped(a.group_size)
    rules = (
        ("n_grid", False, "the alpha values the scale search tries (20 upstream)"),
        ("batch", False, "calibration samples per forward chunk"),
        ("search_samples", True, "calibration samples in the alpha-search loss; null: all of them"),
    )
    for key, null_ok, what in rules:
        v = a.get(key)
        if (v is None and null_ok) or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            continue
        raise CompressError(
            f"awq.{key}={v!r}: awq.{key} takes an integer >= 1{' or null' if null_ok else ''} "
            f"({what})."
        )
    expert_calib.check(a, "awq")
    if not isinstance(a.get("symmetric", False), bool):
        raise CompressError(f"awq.symmetric={a.get('symmetric')!r}: true or false.")
    if not isinstance(a.get("quantize", True), bool):
        raise CompressError(
            f"awq.quantize={a.get('quantize')!r}: awq.quantize takes true (round and pack) or "
            f"false (fold the scales into float weights for a later gptq or rtn stage)."
        )
    if a.get("clip") and a.n_grid < 2:
        raise CompressError(
            f"awq.n_grid={a.n_grid} with awq.clip=true: the clip search tries n_grid/2 shrink "
            f"steps, none at n_grid=1. Use awq.n_grid=2 or more, or awq.clip=false."
        )


def awq(model: nn.Module, ctx) -> nn.Module:
    """Stage: AWQ with ``ctx.cfg.awq`` = {bits, group_size, duo_scaling, n_grid, search_samples,
    clip, quantize}."""
    cfg = ctx.cfg.awq
    adapter = get_adapter(model.config)
    unfuse_experts(model, adapter)  # a mixture of experts: one linear per expert's projection
    check_grouped(cfg.group_size)
    g = resolve_group_size(model, cfg.group_size)
    bits, batch = int(cfg.bits), int(cfg.batch)
    device = getattr(ctx, "device", None)  # one decoder layer at a time there (offload.layer_on)
    tokens = ctx.calibration()
    check_fits(model, device or "cpu", calibration_bytes(model.config, tokens.numel()), "awq")
    x, per_layer = capture_inputs(model, adapter, tokens, batch, device)
    norm_offset = model_spec(model).norm_offset
    n_search = min(int(cfg.search_samples or len(x)), len(x))
    alphas, experts = {}, {}
    n_layers = len(adapter.decoder_layers(model))
    what = f"awq int{bits} g{g}" + ("" if _quantizes(cfg) else " (scales only)")
    for i in tqdm(range(n_layers), desc=what, unit="layer"):
        with layer_on(model, i, device, write=True) as layer:
            args = (layer, adapter, x, per_layer[i], cfg, bits, g, batch, n_search, alphas, i)
            if adapter.router is None:
                x = _awq_layer(*args, norm_offset)
            else:
                experts[i] = {}
                x = _awq_moe_layer(*args, norm_offset, experts[i])
    ctx.record.update(expert_calib.report("awq", experts))
    if not _quantizes(cfg):  # the scaled float model, for the stage after (gptq)
        ctx.record.update(awq_alpha=alphas, awq_group_size=g)
        return model
    sym = bool(cfg.get("symmetric", False))
    fmt = stored_format(ctx.cfg)
    ctx.quantization_config = quantization_config(bits, g, sym, fmt, float_linears(model))
    ctx.record.update(
        bits=bits,
        group_size=g,
        awq_alpha=alphas,
        calib_samples=int(tokens.shape[0]),
        calib_seqlen=int(tokens.shape[1]),
    )
    return model


@torch.no_grad()
def _awq_layer(layer, adapter, x, kwargs, cfg, bits, g, batch, n_search, alphas, i, norm_offset):
    """Scale search, clip search and packing of one decoder layer (on x's device); returns the
    quantized layer's output, the next layer's input."""
    skip_clip = {"q", "k"}
    feats, _ = layer_inputs(layer, adapter, x, kwargs, batch)
    alphas[i] = {}
    for group in scale_groups(layer, adapter):
        inp = feats[group["inp"]]
        s, alpha, _ = search_scale(
            layer,
            adapter,
            group,
            inp,
            inp[:n_search],
            kwargs,
            bits,
            g,
            cfg.duo_scaling,
            cfg.n_grid,
            batch,
        )
        apply_scale(group["prev"], group["linears"], s, norm_offset)
        inp.div_(s)  # the linears now see x / s
        alphas[i][group["name"]] = alpha
    packed = {}
    for role, path in adapter.linears:
        lin = layer.get_submodule(path)
        clip = None
        if cfg.clip and role not in skip_clip:
            clip = search_clip(lin.weight.data, feats[_input_role(role)], bits, g, cfg.n_grid)
        if not _quantizes(cfg):  # AWQ before GPTQ: scaled (and clipped) float weights
            if clip is not None:
                lin.weight.data = apply_clip(lin.weight.data, clip, g)
            continue
        qw = quantize(lin.weight.data, bits, g, bool(cfg.get("symmetric", False)), clip_max=clip)
        packed[path] = QuantLinear.from_quantized(qw, lin.bias)
        lin.weight.data = qw.dequantize().to(lin.weight.dtype)  # W_hat, for the next layer's inputs
    del feats
    with torch.no_grad():  # the quantized layer's output feeds the next layer
        x = torch.cat([layer(c, **kwargs) for c in x.split(batch)])
    for path, module in packed.items():
        set_module(layer, path, module)
    return x


@torch.no_grad()
def _awq_moe_layer(
    layer, adapter, x, kwargs, cfg, bits, g, batch, n_search, alphas, i, norm_offset, record
):
    """:func:`_awq_layer` for a mixture-of-experts family's layer (module docstring)."""
    sym = bool(cfg.get("symmetric", False))
    feats, routed = moe_layer_inputs(layer, adapter, x, kwargs, batch)
    if routed is not None:
        record["routed"] = routed_counts(layer, adapter, routed)
    parts = {label: (m, act) for label, m, act in gated_parts(layer, adapter)}
    flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731

    def down_rows(label, limit=None):
        m, act = parts[label]
        x_in = flat(feats["mlp_in"])
        rows = expert_rows(cfg, label, routed, record)
        x_in = x_in if rows is None else x_in[rows]
        return down_input(
            m, act, x_in if limit is None else x_in[:: max(1, x_in.shape[0] // limit)]
        )

    alphas[i] = {}
    for group in moe_groups(layer, adapter):
        key = group["inp"]
        if isinstance(key, tuple):
            inp = down_rows(key[1])
            search = inp[: n_search * x.shape[1]]
        else:
            inp = feats[key]
            search = inp[:n_search]
        s, alpha, _ = search_scale(
            layer,
            adapter,
            group,
            inp,
            search,
            kwargs,
            bits,
            g,
            cfg.duo_scaling,
            cfg.n_grid,
            batch,
            sym,
        )
        apply_scale(group["prev"], group["linears"] + group["absorb"], s, norm_offset)
        if not isinstance(key, tuple):
            inp.div_(s)  # the linears now see x / s
        alphas[i][group["name"]] = alpha
    reads = {}  # each linear's input, for the clip search
    for role, path in adapter.linears:
        reads[id(layer.get_submodule(path))] = lambda r=_input_role(role): feats[r]
    for label, (m, _) in parts.items():
        gate, up, down = (getattr(m, n) for n in linear_names(m))
        reads[id(gate)] = reads[id(up)] = lambda: feats["mlp_in"]
        reads[id(down)] = lambda label=label: down_rows(label, 512)
    packed = {}
    for path, lin in adapter.named_linears(layer).items():
        clip = None
        if cfg.clip and not path.endswith(("q_proj", "k_proj")):
            x_in = reads[id(lin)]()
            clip = search_clip(lin.weight.data, x_in, bits, g, cfg.n_grid, symmetric=sym)
        if not _quantizes(cfg):
            if clip is not None:
                lin.weight.data = apply_clip(lin.weight.data, clip, g)
            continue
        qw = quantize(lin.weight.data, bits, g, sym, clip_max=clip)
        packed[path] = QuantLinear.from_quantized(qw, lin.bias)
        lin.weight.data = qw.dequantize().to(lin.weight.dtype)
    feats.clear()
    x = torch.cat([layer(c, **kwargs) for c in x.split(batch)])
    for path, module in packed.items():
        set_module(layer, path, module)
    return x


def _quantizes(cfg) -> bool:
    """``awq.quantize`` (default true); false leaves the scaled weights in float."""
    return cfg.get("quantize", True) is not False


@torch.no_grad()
def apply_clip(w: torch.Tensor, clip: torch.Tensor, group_size: int) -> torch.Tensor:
    """``w [out, in]`` clamped to ``[-c, c]``, ``c = clip [out, in/g]`` per row and group (what
    ``quantize(..., clip_max=clip)`` does before rounding), in ``w``'s dtype."""
    out_f, in_f = w.shape
    c = clip.to(w.dtype).unsqueeze(-1)
    wg = w.reshape(out_f, in_f // group_size, group_size)
    return torch.maximum(torch.minimum(wg, c), -c).reshape(out_f, in_f)


def _input_role(role: str) -> str:
    """Which captured input a linear reads: q/k/v share q's, gate/up share gate's."""
    return {"k": "q", "v": "q", "up": "gate"}.get(role, role)
