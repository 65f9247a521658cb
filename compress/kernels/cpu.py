"""CPU paths of ``quant_matmul``, and the modules that run them inside a compiled graph.

Each layer gets a form prepared at first use and kept in ``layer.cache``:

* ``int4pack`` (bfloat16 inputs; M <= 32 for INT2..4, M <= 8 for INT5..8):
  ATen's tinygemm CPU kernel on 4-bit codes, ``w =
  _convert_weight_to_int4pack_for_cpu(n [out, in])`` with ``scales_and_zeros
  [in/g, out, 2]``; it computes ``sum_k x (n - 8) s' + z'``. INT2..INT4 is one
  call (0.5 byte/weight: INT3 too, re-encoded); INT5..INT8 two, on the high and
  the low nibble (1 byte/weight)::

      q - z = sum_i m_i (n_i - 8) + b,   m = [1] or [16, 1],
      n_0 = top nibble + c,  c = 8 - 2^(top bits - 1),  b = 8 sum(m) - m_0 c - z

  so call ``i`` gets ``s' = m_i s`` and ``z' = b s`` (first call) or 0; ``c``
  centres the top nibble on 8, which keeps ``b``, stored in bfloat16, small.
  Its float32 path is scalar code, so float32 inputs never take it.
* ``kplanes`` (float32 and float16 inputs, and larger M): the codes re-packed
  along K in the layer's own bit planes, int32 ``[in*p/32, out]`` per plane,
  ``bits/8`` byte/weight. A word holds ``32/p`` consecutive input channels of
  one output column, so a ``torch.compile``d loop (C++, vectorized over output
  columns) unpacks it with a shift and a mask and accumulates in fp32, per
  group ``G``::

      y[m] = sum_G s_G * (x[m, G] @ q_G) - (sum_{i in G} x[m, i]) * (z_G * s_G)

  For M > 8 (prefill) it dequantizes ``W_hat`` into a reused buffer instead,
  and ``x @ W_hat`` runs as a dense matmul.
* ``w4a8`` (layers whose ``kernel`` is ``"w4a8"``, any input dtype, M <= ``W4A8_MAX_M``, or
  every M with ``kernel_every_m``): the activations rounded to int8 per token and 32-channel
  block, integer dot products against the codes repacked for them (``w4a8_cpu``, C++); not
  bit-faithful: ``w4a8_ref`` is its arithmetic. Above ``W4A8_MAX_M`` a layer loaded lean
  (only the W4A8 form kept) dequantizes that form for a dense matmul (``w4a8-dequant``), as
  ``kplanes-dequant`` does: prefill stays a dense matmul (``bench_linear --alternatives --m
  512``: the integer kernel is several times slower there).

The paths and their M limits are the fastest of all candidates per dtype and M; ``python
eval/bench/bench_linear.py --quick --threads 1 --alternatives`` re-measures them (figures in the
README, "Kernel measurements").

Both are exact up to the rounding of their dtype: ``kplanes`` matches the
float64 reference to ~1e-6 in float32; ``int4pack`` to ~3e-3 (bfloat16 output
and scales). Layers under 2^16 weights (test models), ``COMPRESS_KERNELS=eager``
(no C++ compiler, debugging) and a failed compile (with a warning) run the same
``kplanes`` code eagerly.

:class:`Int4PackLinear` and :class:`KPlanesLinear` hold a layer's prepared form as buffers and
compute the same products as modules that ``torch.compile`` traces (the compiled decode step);
:class:`Eager` runs any other layer outside the graph.
"""

import os
import warnings

import torch
from torch import nn

import compress.kernels.native as native
import compress.kernels.w4a8_cpu as w4a8_cpu
from compress.errors import CompressError
from compress.formats.bitplanes import pack_planes
from compress.kernels.layout import cached, check_layer, planes, stamp
from compress.kernels.workspace import workspace

W4A8_MAX_M = 32  # the int8-activation kernel up to here (larger M: the exact paths' dense matmul)
GEMV_MAX_M = 8  # compiled GEMV up to here, dequantize + dense matmul above
INT4PACK_MAX_M = {1: 32, 2: 8}  # ATen int4pack (bfloat16) up to this M, by calls per code
RECOMPILE_LIMIT = 64  # one compiled graph per (layer shape, M <= 8)
COMPILE_MIN_WEIGHTS = 2**16  # smaller layers run eagerly: compiling them costs more than it saves


def _codes(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 codes ``q [in, out]`` and zero points ``z [in/g, out]``."""
    q, z = layer.codes()
    return q.to(torch.int32), z.to(torch.int32)


# ---- int4pack: ATen's bfloat16 kernel, one call per nibble of the codes ------------------------


def prepare_int4pack(layer, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(w, scales_and_zeros)`` per nibble: ``q - z = sum_i m_i (n_i - 8) + b`` (see the module
    docstring)."""
    q, z = _codes(layer)
    s = layer.scales.float()
    if layer.bits <= 4:
        nibbles, mults, top = [q], [1], layer.bits
    else:
        nibbles, mults, top = [q >> 4, q & 15], [16, 1], layer.bits - 4
    c = 8 - 2 ** (top - 1)  # centre the top nibble on 8 so the zero term stays small in bfloat16
    nibbles[0] = nibbles[0] + c
    b = 8 * sum(mults) - mults[0] * c - z
    out = []
    for i, (n, m) in enumerate(zip(nibbles, mults)):
        w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(n.t().contiguous(), 1)
        zero = b * s if i == 0 else torch.zeros_like(s)
        out.append((w, torch.stack([m * s, zero], dim=-1).to(dtype).contiguous()))
    return out


def int4pack_apply(x: torch.Tensor, parts, group_size: int) -> torch.Tensor:
    """``x [M, in] @ W_hat^T`` from the :func:`prepare_int4pack` form ``parts``, one
    ``_weight_int4pack_mm_for_cpu`` call per nibble of the codes."""
    y = None
    for w, sz in parts:
        part = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, group_size, sz)
        y = part if y is None else y + part
    return y


def int4pack_mm(x: torch.Tensor, layer) -> torch.Tensor:
    """``x [M, in] @ W_hat^T`` through ATen's int4pack kernel."""
    parts = cached(layer, ("int4pack", x.dtype), lambda: prepare_int4pack(layer, x.dtype))
    return int4pack_apply(x, parts, layer.group_size)


# ---- kplanes: codes packed along K, compiled unpack-and-accumulate -----------------------------


def prepare_kplanes(
    layer,
) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...], torch.Tensor, torch.Tensor]:
    """``(planes, widths, s, z)``: the codes packed along K (``pack_planes`` of ``q^T``, each
    plane transposed to ``[in*p/32, out]``), their widths, and fp32 scales and zeros."""
    q, z = _codes(layer)
    widths = tuple(p for p, _, _ in planes(layer))
    along_k = pack_planes(q.t().contiguous(), layer.bits)
    packed = tuple(along_k[f"w{p}"].t().contiguous() for p in widths)
    return packed, widths, layer.scales.float(), z.float()


def _unpack_k(packed: tuple[torch.Tensor, ...], widths: tuple[int, ...]) -> torch.Tensor:
    """Inverse of the K packing: int32 codes ``[K, N]``."""
    q, lo = 0, 0
    for w, p in zip(packed, widths):
        shifts = torch.arange(0, 32, p, dtype=torch.int32, device=w.device).view(1, -1, 1)
        q = q | (((w.unsqueeze(1) >> shifts) & ((1 << p) - 1)).reshape(-1, w.shape[1]) << lo)
        lo += p
    return q


def gemv(x, packed, widths, s, z, unroll: int):
    """fp32 ``x [M, K] @ W_hat^T`` for small M; one unpack of the weight serves all M rows.

    Each row sums ``unroll`` interleaved partial sums: independent add chains, so
    the compiled loop is not bound by the latency of one accumulator.
    """
    G, N = s.shape
    M, K = x.shape
    q = _unpack_k(packed, widths).reshape(G, K // G // unroll, unroll, N).float()
    xg = x.reshape(M, G, -1, unroll, 1)
    rows = [
        (sum((xg[m, :, :, u] * q[:, :, u]).sum(1) for u in range(unroll)) * s).sum(0)
        for m in range(M)
    ]
    return torch.stack(rows) - x.reshape(M, G, -1).sum(-1) @ (z * s)


def _dequant_into(out, packed, widths, s, z):
    """``out [K, N] = W_hat^T``, cast to ``out``'s dtype."""
    G, N = s.shape
    q = _unpack_k(packed, widths).reshape(G, -1, N).float()
    out.copy_(((q - z[:, None]) * s[:, None]).reshape(-1, N))


class _Compiled:
    """``torch.compile(fn)``, used for layers of at least ``COMPILE_MIN_WEIGHTS`` weights.

    Smaller layers, ``COMPRESS_KERNELS=eager``, and any failure to compile (with
    one warning) run ``fn`` eagerly: it computes the same.
    """

    def __init__(self, fn):
        self.fn, self.compiled, self.failed = fn, None, False

    def __call__(self, layer, *args):
        small = layer.in_features * layer.out_features < COMPILE_MIN_WEIGHTS
        if small or self.failed or os.environ.get("COMPRESS_KERNELS") == "eager":
            return self.fn(*args)
        if self.compiled is None:
            dynamo = torch._dynamo.config
            dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
            self.compiled = torch.compile(self.fn, dynamic=False)
        try:
            return self.compiled(*args)
        except Exception as e:  # no C++ compiler, an inductor bug
            self.failed = True
            warnings.warn(
                f"torch.compile of the CPU dequant kernel failed "
                f"({type(e).__name__}: {e}); running it eagerly, which is slower."
            )
            return self.fn(*args)


gemv_compiled = _Compiled(gemv)
dequant_compiled = _Compiled(_dequant_into)


def kplanes_gemv(x: torch.Tensor, layer) -> torch.Tensor:
    """``x [M, in] @ W_hat^T`` for small M from the K-packed planes, in fp32, returned in
    ``x``'s dtype."""
    packed, widths, s, z = cached(layer, "kplanes", lambda: prepare_kplanes(layer))
    unroll = gemv_unroll(layer, x.shape[0])
    return gemv_compiled(layer, x.float(), packed, widths, s, z, unroll).to(x.dtype)


def gemv_unroll(layer, m: int) -> int:
    """Accumulator chains of :func:`gemv` for ``m`` rows.

    8 chains speed up one-plane widths at M <= 2 and slow down several planes and larger M
    (``python eval/bench/bench_linear.py --quick --threads 1 --m 1 4``, with and without them).
    """
    return 8 if len(planes(layer)) == 1 and m <= 2 and layer.group_size % 8 == 0 else 1


def kplanes_dequant_mm(x: torch.Tensor, layer) -> torch.Tensor:
    """``x @ W_hat^T`` with ``W_hat`` dequantized from the K-packed planes into a reused buffer
    (prefill).

    The buffer, the size of the largest layer seen, is shared by all layers: a fresh one per call
    costs more in page faults than the dequantization itself (``python -m timeit -s "import
    torch; b = torch.empty(2**24)" "torch.empty(2**24).fill_(1)"`` against ``"b.fill_(1)"``).
    """
    if x.dtype == torch.float16:  # CPUs without AVX512-FP16 multiply float16 slowly
        return kplanes_dequant_mm(x.float(), layer).half()
    packed, widths, s, z = cached(layer, "kplanes", lambda: prepare_kplanes(layer))
    w = workspace(x.dtype, layer.in_features, layer.out_features)
    dequant_compiled(layer, w, packed, widths, s, z)
    return x @ w


def reference_mm(x: torch.Tensor, layer) -> torch.Tensor:
    return x @ layer.dequantize(x.dtype).t()


PATHS = {
    "w4a8": w4a8_cpu.w4a8_mm,
    "w4a8-dequant": w4a8_cpu.dequant_mm,
    "int4pack": int4pack_mm,
    "kplanes-gemv": kplanes_gemv,
    "kplanes-dequant": kplanes_dequant_mm,
    "reference": reference_mm,
}


def int4pack_fits(x: torch.Tensor, layer) -> bool:
    """ATen's int4pack kernel takes bfloat16, out % 16 == 0 and g in 32..256."""
    return (
        x.dtype == torch.bfloat16
        and layer.out_features % 16 == 0
        and layer.group_size in (32, 64, 128, 256)
    )


def kplanes_fit(layer) -> bool:
    """Packing along K needs ``in_features`` to fill whole 32-entry words (``pack_planes``
    packs 32 codes of each plane to a word, whatever the plane's width)."""
    return layer.in_features % 32 == 0


def takes_w4a8(layer) -> bool:
    """Whether ``layer`` computes through the W4A8 kernel: it asks for it (``kernel``), fits it,
    and the C++ library builds (else it keeps the exact path, after ``native``'s one warning)."""
    return (
        getattr(layer, "kernel", "exact") == "w4a8"
        and w4a8_cpu.fits(layer)
        and os.environ.get("COMPRESS_KERNELS") != "eager"
        and native.library() is not None
    )


def keep_w4a8_only(layer) -> None:
    """Prepare the W4A8 form, then free the packed codes it duplicates (``lean`` loading of a
    ``kernel="w4a8"`` layer): it then computes from that form at every ``M`` (the kernel, or
    ``w4a8-dequant`` for long prefills)."""
    check_layer(layer)
    form = w4a8_cpu.form(layer)
    for name, t in layer._buffers.items():
        if name.startswith(("qweight", "qzeros")):
            layer._buffers[name] = t.new_empty(0)
    now = stamp(layer)
    layer.cache = {"w4a8": (now, form), "checked": now, "lean": "w4a8"}


def keep_lean_form(layer) -> None:
    """``lean`` loading: one in-memory form per layer, the W4A8 one where the layer takes it,
    else the bfloat16 int4pack one."""
    if takes_w4a8(layer):
        keep_w4a8_only(layer)
    else:
        keep_int4pack_only(layer)


def keep_int4pack_only(layer) -> None:
    """Prepare the bfloat16 int4pack form, then free the packed codes it duplicates (``lean``
    loading).

    The layer then computes through int4pack at every ``M`` and only from bfloat16 inputs: it
    holds its weights once, at 0.5 byte each (1 byte from INT5 up), for ~2x slower prefill than
    dequantize + matmul (``python eval/bench/bench_linear.py --quick --threads 1
    --alternatives --m 512``).
    """
    check_layer(layer)
    bf16 = torch.bfloat16
    form = cached(layer, ("int4pack", bf16), lambda: prepare_int4pack(layer, bf16))
    for name, t in layer._buffers.items():
        if name.startswith(("qweight", "qzeros")):
            layer._buffers[name] = t.new_empty(0)
    now = stamp(layer)
    layer.cache = {("int4pack", torch.bfloat16): (now, form), "checked": now, "lean": True}


def cpu_path(x: torch.Tensor, layer) -> str:
    """Name of the measured-fastest exact CPU path for ``x``'s dtype, the layer and ``M``."""
    lean = layer.cache.get("lean")
    small = x.shape[0] <= W4A8_MAX_M or getattr(layer, "kernel_every_m", False)
    if lean == "w4a8":
        return "w4a8" if small else "w4a8-dequant"
    if takes_w4a8(layer) and small:
        return "w4a8"
    if lean:
        if x.dtype != torch.bfloat16:
            raise CompressError(
                f"this quantized layer [{layer.in_features} -> "
                f"{layer.out_features}] was loaded lean (only its bfloat16 "
                f"int4pack form is kept), so it takes bfloat16 inputs, not "
                f"{x.dtype}; load without lean to compute in other dtypes."
            )
        return "int4pack"
    if int4pack_fits(x, layer) and x.shape[0] <= INT4PACK_MAX_M[1 if layer.bits <= 4 else 2]:
        return "int4pack"
    if not kplanes_fit(layer):
        return "reference"
    return "kplanes-gemv" if x.shape[0] <= GEMV_MAX_M else "kplanes-dequant"


def cpu_quant_matmul(x: torch.Tensor, layer) -> torch.Tensor:
    return PATHS[cpu_path(x, layer)](x, layer)


# ---- the same products as modules, for a torch.compile'd graph ---------------------------------


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias.to(y.dtype)


class Int4PackLinear(nn.Module):
    """A ``QuantLinear`` through ATen's int4pack kernel, its :func:`prepare_int4pack` form held
    as buffers (shared with the layer's own cache)."""

    def __init__(self, layer, dtype: torch.dtype):
        super().__init__()
        self.group_size, self.out_features = layer.group_size, layer.out_features
        parts = cached(layer, ("int4pack", dtype), lambda: prepare_int4pack(layer, dtype))
        self.parts = len(parts)
        for i, (w, sz) in enumerate(parts):
            self.register_buffer(f"w{i}", w)
            self.register_buffer(f"sz{i}", sz)
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [(getattr(self, f"w{i}"), getattr(self, f"sz{i}")) for i in range(self.parts)]
        y = int4pack_apply(x.reshape(-1, x.shape[-1]), parts, self.group_size)
        return _add_bias(y.reshape(*x.shape[:-1], self.out_features), self.bias)


class KPlanesLinear(nn.Module):
    """A ``QuantLinear`` through the K-packed planes' :func:`gemv` with ``unroll`` accumulator
    chains, its :func:`prepare_kplanes` form held as buffers; traced into the graph."""

    def __init__(self, layer, unroll: int):
        super().__init__()
        packed, self.widths, s, z = cached(layer, "kplanes", lambda: prepare_kplanes(layer))
        for p, t in zip(self.widths, packed):
            self.register_buffer(f"q{p}", t)
        self.register_buffer("s", s)
        self.register_buffer("z", z)
        self.unroll, self.out_features, self.bias = unroll, layer.out_features, layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = tuple(getattr(self, f"q{p}") for p in self.widths)
        y = gemv(
            x.reshape(-1, x.shape[-1]).float(), packed, self.widths, self.s, self.z, self.unroll
        )
        return _add_bias(y.to(x.dtype).reshape(*x.shape[:-1], self.out_features), self.bias)


class Eager(nn.Module):
    """Any other layer (e.g. LLM.int8's, whose outlier columns depend on the data), run outside
    the graph."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)
