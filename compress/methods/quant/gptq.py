"""GPTQ: accurate post-training quantization for generative transformers (Frantar et al. 2022).

Per linear ``W [out, in]`` (rows quantized independently, all sharing one Hessian), the layer-wise
objective ``argmin_Q || W X - Q X ||_2^2`` over the calibration inputs ``X [in, n]`` (n tokens)::

    H = 2 X X^T / n                      (float32, streamed: H_sum += x_c^T x_c per chunk c)

Dead inputs (``H_jj = 0``: the column never sees a non-zero input) get ``H_jj = 1`` and
``W[:, j] = 0``, as GPTQ does. Dampening: ``H += damp * mean(diag H) * I`` (``damp`` 0.01).

Optimal Brain Quantization, one column ``j`` at a time in a fixed order, with ``F`` the columns
not yet quantized::

    q_j   = Q(w_j)                                        (the group's grid)
    e_j   = (w_j - q_j) / [H_F^-1]_jj
    W_F  -= e_j [H_F^-1]_{j, F}                           (compensate on the rest)
    H_F^-1 <- H_F^-1 - [H_F^-1]_{:, j} [H_F^-1]_{j, :} / [H_F^-1]_jj     (drop j)

The rows ``[H_F^-1]_{j, F} / sqrt([H_F^-1]_jj)`` for the successive ``j`` are the rows of the
upper Cholesky factor ``U`` of ``H^-1`` (``H^-1 = U^T U``), so GPTQ computes ``U`` once and uses
``e_j = (w_j - q_j) / U_jj`` and ``W_F -= e_j U_{j, F}``.

Lazy batch updates: columns go in blocks of ``block_size`` (128). Inside a block ``B = [i1, i2)``
the update touches only the block's columns; the rest of W gets the block's errors at once,
``W[:, i2:] -= E_B U[B, i2:]`` (one matmul instead of ``block_size`` rank-1 updates).

Groups (``group_size`` input columns of one row share a scale and zero point, the same
asymmetric grid as RTN/AWQ, ``compress.formats.quantizer``, so the AutoAWQ GEMM packing and every
loader work unchanged): the parameters of a group are fixed when its first column is reached,
from the group's weights as updated by every earlier column (inside a block, the columns past the
block get the block's pending errors for this). With ``act_order`` the columns go in order of
decreasing ``H_jj`` (the inputs with the most energy first) and the groups are *static*: their
parameters come from the original weights in the original column order, before any update, so
each group is still ``group_size`` consecutive input columns and the result needs no ``g_idx``.

A group's grid comes from its min and max (``scale_search: minmax``), or (``mse``) from the
range shrunk by the factor ``p`` in ``{1, 0.99, ..., min_range}`` that minimizes the group's
rounding error weighted by the Hessian's diagonal, ``sum_j H_jj (w_j - Q_p(w_j))^2`` (the layer's
output error when the inputs are uncorrelated), as GPTQ's reference code's ``mse`` option
searches with an unweighted norm (its floor ``min_range`` is 0.2; llm-compressor's ``mse``
observer's is 0.8).

In a decoder layer (true-sequential, the default) the linears go in steps, each step's linears
reading one input: ``q, k, v`` (MLA: ``q, k_rope, kv_a``), then MLA's ``k_b, v_b``, then ``o``, then
``gate, up``, then ``down`` (:data:`SEQUENTIAL`, over the adapter's roles). A step's Hessian comes
from a forward of the layer whose earlier steps are already quantized, so it sees the inputs
the quantized linears produce. ``true_sequential=false``: every Hessian from one forward of
the float layer. The layer's output, the next layer's input, is computed with the quantized
layer. Calibration runs on ``ctx.device``, one decoder layer at a time (``compress.io.offload``).
"""

import torch
from torch import nn
from tqdm import tqdm

from compress.arch.adapters import Adapter, get_adapter, set_module
from compress.errors import CompressError
from compress.formats.quantizer import QuantizedWeight, codes, group_params
from compress.io.offload import (
    calibration_bytes,
    capture_inputs,
    check_fits,
    layer_on,
)
from compress.layers import QuantLinear
from compress.layers.experts import unfuse_experts
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

__all__ = ["gptq", "gptq_quantize", "Hessian", "sequential_steps", "check", "SEQUENTIAL"]

# the true-sequential steps over the adapters' roles; a step's linears read the same input
SEQUENTIAL = (
    ("q", "k", "v", "k_rope", "kv_a"),
    ("k_b", "v_b"),
    ("o",),
    ("gate", "up"),
    ("down",),
)


class Hessian:
    """``H = 2 X X^T / n`` over every token of the chunks given to :meth:`add`, in float32; the
    memory is one ``[in, in]`` matrix whatever the number of samples."""

    def __init__(self, in_features: int, device=None):
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.n = 0

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        """Accumulate a chunk ``x [..., in]`` (every leading axis is tokens)."""
        x = x.reshape(-1, x.shape[-1]).to(self.sum.device, torch.float32)
        self.sum.addmm_(x.t(), x)
        self.n += x.shape[0]

    def value(self) -> torch.Tensor:
        if self.n == 0:
            raise CompressError("gptq: a linear saw no calibration tokens (calib.samples >= 1).")
        return self.sum * (2.0 / self.n)


SCALE_SEARCHES = ("minmax", "mse")
MIN_RANGE = 0.2  # the ``mse`` search's default floor (GPTQ's reference ``maxshrink``)


def shrinks(min_range: float = MIN_RANGE) -> list[float]:
    """The ``mse`` search's range factors: 1, 0.99, ... down to ``min_range`` (in hundredths)."""
    return [k / 100 for k in range(100, round(min_range * 100) - 1, -1)]


def searched_params(
    wg: torch.Tensor, bits: int, symmetric: bool, weight: torch.Tensor, min_range: float = MIN_RANGE
):
    """``(s, z)`` of the groups along ``wg``'s last axis: the grid of the range shrunk by the
    factor of :func:`shrinks` that minimizes ``sum_j weight_j (w_j - W_hat_j)^2`` (``weight``
    broadcast against ``wg``); of equal errors the larger factor wins (1: the min/max grid)."""
    best_s = best_z = best = None
    for p in shrinks(min_range):
        s, z = group_params(wg * p, bits, symmetric)
        s1, z1 = s.unsqueeze(-1), z.unsqueeze(-1)
        err = (((codes(wg, s1, z1, bits) - z1) * s1 - wg) ** 2 * weight).sum(-1)
        if best is None:
            best_s, best_z, best = s, z, err
            continue
        better = err < best
        best = torch.where(better, err, best)
        best_s = torch.where(better, s, best_s)
        best_z = torch.where(better, z, best_z)
    return best_s, best_z


def _inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor ``U`` of ``(H + damp * mean(diag H) I)^-1``."""
    h = h.clone()
    idx = torch.arange(h.shape[0], device=h.device)
    h[idx, idx] += damp * h.diagonal().mean()
    try:
        low = torch.linalg.cholesky(h)
        return torch.linalg.cholesky(torch.cholesky_inverse(low), upper=True)
    except torch.linalg.LinAlgError:
        raise CompressError(
            f"gptq: the calibration Hessian is not positive definite even with damp={damp} "
            f"(too few distinct calibration tokens for the layer's width, or degenerate inputs). "
            f"Raise gptq.damp (e.g. 0.1) or calib.samples."
        ) from None


@torch.no_grad()
def gptq_quantize(
    w: torch.Tensor,
    h: torch.Tensor,
    bits: int,
    group_size: int,
    block_size: int = 128,
    damp: float = 0.01,
    act_order: bool = False,
    symmetric: bool = False,
    scale_search: str = "minmax",
    min_range: float = MIN_RANGE,
) -> QuantizedWeight:
    """GPTQ of ``w [out, in]`` with Hessian ``h [in, in]`` (see the module docstring); computes in
    float64 when ``w`` is float64, else float32, on ``w``'s device. ``group_size=-1``: one group
    per row."""
    dt = torch.float64 if w.dtype == torch.float64 else torch.float32
    W = w.detach().to(dt).clone()
    H = h.detach().to(W.device, dt).clone()
    out_f, n = W.shape
    g = n if group_size == -1 else int(group_size)
    if n % g:
        raise CompressError(f"gptq: group size {g} does not divide in_features={n}.")
    dead = H.diagonal() == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    ng = n // g
    scales = torch.zeros(out_f, ng, dtype=dt, device=W.device)
    zeros = torch.zeros(out_f, ng, dtype=dt, device=W.device)
    diag = H.diagonal().clone()

    def params(wg, cols):  # the grid of the groups ``wg [out, k, c]`` over the columns ``cols``
        if scale_search == "mse":
            weight = diag[cols].reshape(wg.shape[1:])
            return searched_params(wg, bits, symmetric, weight, min_range)
        return group_params(wg, bits, symmetric)

    perm = group_of = None
    if act_order:  # static groups: the parameters of the original columns, before any update
        s, z = params(W.reshape(out_f, ng, g), slice(None))
        scales.copy_(s)
        zeros.copy_(z)
        perm = torch.argsort(H.diagonal(), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
        group_of = (perm // g).tolist()  # the static group of the j-th column taken
    U = _inverse_cholesky(H, damp)
    Q = torch.zeros_like(W)
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        W1, U1 = W[:, i1:i2].clone(), U[i1:i2, i1:i2]
        E1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            j = i1 + i
            if group_of is not None:
                gi = group_of[j]
            else:
                gi = j // g
                if j % g == 0:  # the group's first column: its current (updated) weights
                    cur = W1[:, i : i + g]
                    if j + g > i2:  # columns past the block still owe the block's errors
                        rest = W[:, i2 : j + g] - E1[:, :i] @ U[i1:j, i2 : j + g]
                        cur = torch.cat([cur, rest], 1)
                    s, z = params(cur.unsqueeze(1), slice(j, j + cur.shape[1]))
                    scales[:, gi], zeros[:, gi] = s[:, 0], z[:, 0]
            s, z = scales[:, gi], zeros[:, gi]
            col = W1[:, i]
            q = codes(col, s, z, bits)
            Q[:, j] = q
            err = (col - (q - z) * s) / U1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * U1[i, i:].unsqueeze(0)
            E1[:, i] = err
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    if perm is not None:
        Q = Q[:, torch.argsort(perm)]
    return QuantizedWeight(
        q=Q.to(torch.int32),
        scales=scales.half(),
        zeros=zeros.to(torch.int32),
        bits=bits,
        group_size=g,
    )


def sequential_steps(adapter: Adapter, layer: nn.Module) -> list[list[tuple[str, str]]]:
    """The layer's ``(role, path)`` in true-sequential steps (:data:`SEQUENTIAL`); a role the table
    does not place is refused."""
    present = {r: p for r, p in adapter.linears if p in adapter.named_linears(layer)}
    placed = {r for step in SEQUENTIAL for r in step}
    unknown = sorted(set(present) - placed)
    if unknown:
        raise CompressError(
            f"gptq: the {adapter.family} adapter's linear roles {unknown} have no place in "
            f"GPTQ's true-sequential order; add them to compress.methods.quant.gptq.SEQUENTIAL."
        )
    steps = [[(r, present[r]) for r in step if r in present] for step in SEQUENTIAL]
    return [s for s in steps if s]


@torch.no_grad()
def _hessians(layer, linears: list[nn.Module], x: torch.Tensor, kwargs: dict, batch: int):
    """One ``Hessian`` per linear from one forward of the layer over ``x``, chunk by chunk."""
    hs = [Hessian(m.in_features, x.device) for m in linears]
    hooks = [
        m.register_forward_hook(lambda _m, args, _out, h=h: h.add(args[0]))
        for m, h in zip(linears, hs)
    ]
    try:
        for chunk in x.split(batch):
            layer(chunk, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return [h.value() for h in hs]


@torch.no_grad()
def gptq_layer(layer, adapter, x, kwargs, settings: dict, batch: int, true_sequential: bool = True):
    """GPTQ of one decoder layer on ``x``'s device; returns the quantized layer's output."""
    packed = {}
    _attention_steps(layer, adapter, x, kwargs, settings, batch, true_sequential, packed)
    x = torch.cat([layer(c, **kwargs) for c in x.split(batch)])
    for path, module in packed.items():
        set_module(layer, path, module)
    return x


@torch.no_grad()
def _attention_steps(layer, adapter, x, kwargs, settings, batch, true_sequential, packed):
    """GPTQ of the layer's attention linears (the adapter's roles), in true-sequential steps."""
    steps = sequential_steps(adapter, layer)
    passes = [[step] for step in steps] if true_sequential else [steps]
    for todo in passes:
        if not todo:
            continue
        # one Hessian per step, on its first linear's input (the step's linears share it)
        firsts = [layer.get_submodule(step[0][1]) for step in todo]
        for step, h in zip(todo, _hessians(layer, firsts, x, kwargs, batch)):
            for _role, path in step:
                _quantize_into(layer.get_submodule(path), path, h, settings, packed)


def _quantize_into(lin: nn.Module, path: str, h: torch.Tensor, settings: dict, packed: dict):
    """GPTQ of ``lin`` with Hessian ``h``: its packed layer into ``packed[path]``, and its
    weight set to W_hat for what the layer computes next."""
    qw = gptq_quantize(lin.weight.data, h, **settings)
    packed[path] = QuantLinear.from_quantized(qw, lin.bias)
    lin.weight.data = qw.dequantize().to(lin.weight.dtype)


def _hessian_of(x: torch.Tensor, batch_rows: int = 4096) -> torch.Tensor:
    h = Hessian(x.shape[-1], x.device)
    for chunk in x.reshape(-1, x.shape[-1]).split(batch_rows):
        h.add(chunk)
    return h.value()


@torch.no_grad()
def gptq_moe_layer(layer, adapter, x, kwargs, settings, batch, true_sequential, cfg, record):
    """:func:`gptq_layer` for a mixture-of-experts family's layer (module docstring)."""
    packed = {}
    _attention_steps(layer, adapter, x, kwargs, settings, batch, true_sequential, packed)
    feats, routed = moe_layer_inputs(layer, adapter, x, kwargs, batch)
    if routed is not None:
        record["routed"] = routed_counts(layer, adapter, routed)
    x_mlp = feats.pop("mlp_in").reshape(-1, x.shape[-1])
    feats.clear()
    paths = {id(m): p for p, m in adapter.named_linears(layer).items()}
    for label, m, act in gated_parts(layer, adapter):
        rows = expert_rows(cfg, label, routed, record)
        x_in = x_mlp if rows is None else x_mlp[rows]
        g, u, d = (getattr(m, n) for n in linear_names(m))
        h = _hessian_of(x_in)
        for lin in (g, u):
            _quantize_into(lin, paths[id(lin)], h, settings, packed)
        _quantize_into(d, paths[id(d)], _hessian_of(down_input(m, act, x_in)), settings, packed)
    x = torch.cat([layer(c, **kwargs) for c in x.split(batch)])
    for path, module in packed.items():
        set_module(layer, path, module)
    return x


def check_family(adapter: Adapter) -> None:
    """Refuse cross-layer attention: its later layers read K/V an earlier layer computes in the
    same forward, which a one-layer-at-a-time calibration does not run."""
    if adapter.attention == "cla":
        raise CompressError(
            f"gptq: a {adapter.family} model (cross-layer attention) shares K/V between layers, "
            f"so it cannot be calibrated one decoder layer at a time. Quantize the source model "
            f"before the conversion, or use rtn (no calibration)."
        )


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check(cfg, hf_config=None) -> None:
    """Refuse ``gptq.*`` before the model loads: bits, group size (dividing every quantized
    in_features when config.json is at hand), damp in (0, 1), block_size, batch, the flags, and
    cross-layer attention (:func:`check_family`)."""
    c = cfg.gptq
    check_width(c, "gptq", hf_config)
    stored_format(cfg)
    if hf_config is not None:
        check_family(get_adapter(hf_config))
    damp = c.get("damp")
    if not _number(damp) or not 0 < damp < 1:
        raise CompressError(
            f"gptq.damp={damp!r}: the dampening is a fraction of the Hessian's mean diagonal, "
            f"strictly between 0 and 1 (GPTQ uses 0.01; raise it, e.g. 0.1, if the Cholesky "
            f"factorization fails)."
        )
    for key, what in (
        ("block_size", "columns per lazy-batch block (128 in GPTQ)"),
        ("batch", "calibration samples per forward chunk"),
    ):
        v = c.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise CompressError(f"gptq.{key}={v!r}: gptq.{key} takes an integer >= 1 ({what}).")
    for key in ("act_order", "true_sequential", "symmetric"):
        v = c.get(key, False)
        if not isinstance(v, bool):
            raise CompressError(f"gptq.{key}={v!r}: gptq.{key} takes true or false.")
    search = c.get("scale_search", "minmax")
    if search not in SCALE_SEARCHES:
        raise CompressError(
            f"gptq.scale_search={search!r}: takes one of {', '.join(SCALE_SEARCHES)} (minmax: each "
            f"group's grid from its min and max; mse: the shrunk range with the least "
            f"Hessian-weighted rounding error)."
        )
    floor = c.get("min_range", MIN_RANGE)
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0.01 <= floor <= 1:
        raise CompressError(
            f"gptq.min_range={floor!r}: the smallest fraction of a group's min-max range the mse "
            f"search tries, between 0.01 and 1 (0.2: GPTQ's reference; 0.8: llm-compressor's "
            f"mse observer)."
        )
    expert_calib.check(c, "gptq")


def gptq(model: nn.Module, ctx) -> nn.Module:
    """Stage: GPTQ with ``ctx.cfg.gptq`` = {bits, group_size, damp, block_size, act_order,
    scale_search, min_range, true_sequential, batch}; writes the same packed layers as AWQ."""
    cfg = ctx.cfg.gptq
    adapter = get_adapter(model.config)
    check_family(adapter)
    unfuse_experts(model, adapter)  # a mixture of experts: one linear per expert's projection
    g = resolve_group_size(model, cfg.group_size)
    bits, batch = int(cfg.bits), int(cfg.batch)
    settings = dict(
        bits=bits,
        group_size=g,
        block_size=int(cfg.block_size),
        damp=float(cfg.damp),
        act_order=bool(cfg.act_order),
        symmetric=bool(cfg.get("symmetric", False)),
        scale_search=str(cfg.get("scale_search", "minmax")),
        min_range=float(cfg.get("min_range", MIN_RANGE)),
    )
    device = getattr(ctx, "device", None)
    tokens = ctx.calibration()
    check_fits(model, device or "cpu", calibration_bytes(model.config, tokens.numel()), "gptq")
    x, per_layer = capture_inputs(model, adapter, tokens, batch, device)
    n_layers = len(adapter.decoder_layers(model))
    order = " act-order" if settings["act_order"] else ""
    order += " mse" if settings["scale_search"] == "mse" else ""
    experts = {}
    for i in tqdm(range(n_layers), desc=f"gptq int{bits} g{g}{order}", unit="layer"):
        with layer_on(model, i, device, write=True) as layer:
            args = (layer, adapter, x, per_layer[i], settings, batch, bool(cfg.true_sequential))
            if adapter.router is None:
                x = gptq_layer(*args)
            else:
                experts[i] = {}
                x = gptq_moe_layer(*args, cfg, experts[i])
    ctx.record.update(expert_calib.report("gptq", experts))
    ctx.quantization_config = quantization_config(
        bits, g, settings["symmetric"], stored_format(ctx.cfg), float_linears(model)
    )
    ctx.record.update(
        bits=bits,
        group_size=g,
        gptq_damp=settings["damp"],
        gptq_act_order=settings["act_order"],
        gptq_scale_search=settings["scale_search"],
        gptq_min_range=settings["min_range"],
        calib_samples=int(tokens.shape[0]),
        calib_seqlen=int(tokens.shape[1]),
    )
    return model
