"""W4A8 on the CPU: a group-quantized linear (INT3, INT4 or INT8 codes) against int8 activations,
integer dot products (``w4a8_cpu.cpp``; the arithmetic is ``w4a8_ref``'s).

A layer computes through it when its ``kernel`` attribute is ``"w4a8"`` (:func:`use`; the
default ``"exact"`` keeps the weight-only paths of ``cpu.py``). Each call quantizes ``x [M, K]``
per token and 32-channel block to int8 (scale ``d``, and ``xs``, the group sums of the zero-point
term), then, per 16 output columns and 32-channel block, sums ``q * xq`` in int32 and scales in
fp32::

    y[m, o] = sum_G s[G, o] sum_{b in G} d[m, b] I[m, b, o] - sum_G sz[G, o] xs[m, G]
    I[m, b, o] = sum_{i in b} q[i, o] xq[m, i]     sz = s z  (fp32, precomputed)

The weight is repacked once (kept in ``layer.cache["w4a8"]``) into tiles of 16 output columns
``t``, each a run of 32-channel blocks ``b`` (``uint8 [N/16, K/32, bytes]``). Byte ``4 j + u``
of a 64-byte chunk belongs to column ``16 t + j`` (one int32 lane of a 512-bit vector: the four
consecutive input channels ``vpdpbusd`` multiplies by a broadcast 4-byte word of ``xq``)::

    INT8  512 B per block: chunk c (0..7) holds q[32 b + 4 c + u]
    INT4  256 B per block: chunk c (0..3): low nibble q[32 b + 8 c + u], high q[32 b + 8 c + 4 + u]
    INT3  192 B per block: chunks 0, 1: bits 2 r .. 2 r + 1 hold the low two bits of
          q[32 b + 16 c + 4 r + u] (r = 0..3); chunk 2: bit r (0..7) the third bit of
          q[32 b + 4 r + u]

So INT4 reads 0.5 byte per weight and INT3 0.375, plus 8 bytes per group and column (fp32 ``s``
and ``sz``, ``[G, N]``), or 2 for symmetric codes with fp16 scales (``s`` fp16 ``[G, N]``, one
zero point ``z``: ``y[m, o] = sum_G s[G, o] (sum_{b in G} d[m, b] I[m, b, o] - z xs[m, G])``;
:func:`prepare`). The paths (``w4a8_cpu.cpp``): ``vnni`` (AVX-512 VNNI ``vpdpbusd``,
several tiles per pass for one row so the sums are independent chains), ``avx2``
(``vpmaddubsw`` into int16, widened once per block by ``vpmaddwd``; INT8 codes split into
nibbles so the int16 sums cannot saturate), ``portable`` (C++ loops), and ``ref`` (PyTorch:
``w4a8_ref.matmul`` in fp32). The fastest the CPU runs is chosen at run time;
``COMPRESS_W4A8=vnni|avx2|portable|ref`` forces one. Tiles are spread over
``torch.get_num_threads()`` OpenMP threads.

It needs ``K % 32 == 0``, ``g % 32 == 0`` and ``N % 16 == 0`` (:func:`fits`); other layers, and
machines where the library does not build (one warning, from ``native``), keep the exact path.
"""

import ctypes
import threading

import torch

import compress.kernels.native as native
from compress.errors import CompressError
from compress.kernels.layout import cached, recache
from compress.kernels.w4a8_ref import BLOCK
from compress.kernels.w4a8_ref import matmul as ref_matmul
from compress.kernels.workspace import workspace

TILE = 16
BITS = (3, 4, 8)
PATHS = {"portable": 0, "avx2": 1, "vnni": 2}  # the C++ paths, by their code in w4a8_cpu.cpp
CAPS = {"vnni": 4, "avx2": 2, "portable": 1}  # their bit in w4a8_caps(), fastest first


def fits(layer) -> bool:
    """Whether ``layer``'s shape and width fit the kernel's tiles and blocks."""
    return (
        layer.bits in BITS
        and layer.in_features % BLOCK == 0
        and layer.group_size % BLOCK == 0
        and layer.out_features % TILE == 0
    )


_LOCAL = threading.local()  # per thread: (M, K, G) -> (xq, d, xs), the activations' buffers


def available() -> list[str]:
    """The paths this machine runs, fastest first (``ref`` always)."""
    return native.runnable("w4a8_caps", CAPS)


def path() -> str:
    """The path calls take: ``COMPRESS_W4A8`` if set (it must be one this CPU runs), else the
    fastest."""
    return native.chosen("COMPRESS_W4A8", available(), "W4A8")


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``q [K, N]`` (input channels x output columns) -> the kernel's ``uint8 [N/16, K/32,
    bytes]`` (layout in the module docstring)."""
    K, N = q.shape
    q = q.to(torch.int32)
    T, B = N // TILE, K // BLOCK
    if bits == 8:  # [B, c, u, T, j] -> [T, B, c, j, u]
        t = q.reshape(B, 8, 4, T, TILE).permute(3, 0, 1, 4, 2)
        return t.reshape(T, B, 512).to(torch.uint8).contiguous()
    if bits == 4:  # [B, c, hi, u, T, j] -> [T, B, c, j, u, hi]
        t = q.reshape(B, 4, 2, 4, T, TILE).permute(4, 0, 1, 5, 3, 2)
        return (t[..., 0] | (t[..., 1] << 4)).reshape(T, B, 256).to(torch.uint8).contiguous()
    if bits == 3:
        lo = (q & 3).reshape(B, 2, 4, 4, T, TILE).permute(4, 0, 1, 5, 3, 2)  # [T, B, c, j, u, r]
        lo = (lo << (2 * torch.arange(4, dtype=torch.int32))).sum(-1).reshape(T, B, 128)
        hi = ((q >> 2) & 1).reshape(B, 8, 4, T, TILE).permute(3, 0, 4, 2, 1)  # [T, B, j, u, r]
        hi = (hi << torch.arange(8, dtype=torch.int32)).sum(-1).reshape(T, B, 64)
        return torch.cat([lo, hi], -1).to(torch.uint8).contiguous()
    raise ValueError(f"the W4A8 kernel packs 3, 4 or 8-bit codes, not {bits}")


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: int32 codes ``[K, N]``."""
    T, B = packed.shape[:2]
    v = packed.to(torch.int32)
    if bits == 8:  # [T, B, c, j, u] -> [B, c, u, T, j]
        q = v.view(T, B, 8, TILE, 4).permute(1, 2, 4, 0, 3)
    elif bits == 4:  # [T, B, c, j, u, hi] -> [B, c, hi, u, T, j]
        v = v.view(T, B, 4, TILE, 4)
        q = torch.stack([v & 15, v >> 4], -1).permute(1, 2, 5, 4, 0, 3)
    else:
        lo = v[..., :128].reshape(T, B, 2, TILE, 4, 1) >> (2 * torch.arange(4, dtype=torch.int32))
        lo = (lo & 3).permute(1, 2, 5, 4, 0, 3).reshape(B * 32, T * TILE)  # [B, ch, r, u, T, j]
        hi = v[..., 128:].reshape(T, B, TILE, 4, 1) >> torch.arange(8, dtype=torch.int32)
        hi = (hi & 1).permute(1, 4, 3, 0, 2).reshape(B * 32, T * TILE)  # [B, r, u, T, j]
        return lo | (hi << 2)
    return q.reshape(B * BLOCK, T * TILE)


def dequantize_into(out: torch.Tensor, packed, s, sz, bits: int, group_size: int) -> None:
    """``out [K, N] = W_hat^T = q s - s z`` (in ``out``'s dtype) from the packed form (either
    form of the scales, :func:`prepare`)."""
    q = unpack(packed, bits).float().view(s.shape[0], group_size, -1)
    if s.dtype == torch.float16:  # symmetric: (q - z) s
        out.copy_(((q - sz) * s.float()[:, None]).view_as(out))
    else:
        out.copy_((q * s[:, None] - sz[:, None]).view_as(out))


def dequant_mm(x: torch.Tensor, layer) -> torch.Tensor:
    """``x @ W_hat^T`` (exact, no activation rounding) with ``W_hat`` dequantized from the
    packed form into a reused buffer: a lean W4A8 layer's long prefills, where the dense
    matmul is faster than the integer kernel (``bench_linear --alternatives --m 512``)."""
    dtype = torch.float32 if x.dtype == torch.float16 else x.dtype
    w = workspace(dtype, layer.in_features, layer.out_features)
    dequantize_into(w, *form(layer), layer.bits, layer.group_size)
    return (x.to(dtype) @ w).to(x.dtype)


def prepare(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed, s, sz)``: the layer's codes in the kernel's layout and its scales, in one of two
    forms: fp32 scales ``[G, N]`` and ``s * z`` (8 bytes per group and column), or, for
    symmetric codes (one zero point ``z``) whose scales are fp16 values, fp16 scales ``[G, N]``
    and ``z`` (float32 ``[1]``; 2 bytes per group and column, Q4_0's bytes at g = 32)."""
    q, z = layer.codes()
    s = layer.scales.float().contiguous()
    if z.numel() and bool((z == z.flatten()[0]).all()):
        half = layer.scales if layer.scales.dtype == torch.float16 else s.half()
        if torch.equal(half.float(), s):  # the layer's own fp16 scales, where it holds them
            return pack(q, layer.bits), half.contiguous(), z.flatten()[:1].float()
    return pack(q, layer.bits), s, (s * z.float()).contiguous()


def form(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`prepare`'s form of ``layer``, kept in its cache."""
    return cached(layer, "w4a8", lambda: prepare(layer))


def linear(x: torch.Tensor, packed, s, sz, bits: int, group_size: int, which: str | None = None):
    """``y [..., N]`` of ``x [..., K]`` (in ``x``'s dtype) through the C++ path ``which`` (default
    :func:`path`): the operator :func:`op`."""
    return op()(x, packed, s, sz, bits, group_size, PATHS[which or path()])


def ctypes_linear(x: torch.Tensor, packed, s, sz, bits: int, group_size: int, which: int):
    """fp32 ``y [M, N]`` of ``x [M, K]`` through C++ path number ``which``, called through
    ``ctypes`` with per-thread scratch: the operator where its C++ form does not build."""
    lib = native.library()
    x = x.float().contiguous()
    M, K = x.shape
    N = s.shape[1]
    y = torch.empty(M, N, dtype=torch.float32)
    key, held = (M, K, K // group_size), _LOCAL.__dict__.setdefault("scratch", {})
    if (scratch := held.get(key)) is None:
        if len(held) > 64:
            held.clear()
        scratch = held[key] = (
            torch.empty(M, K, dtype=torch.int8),
            torch.empty(M, K // BLOCK, dtype=torch.float32),
            torch.empty(M, K // group_size, dtype=torch.float32),
        )
    xq, d, xs = scratch
    lib.w4a8_linear(
        x.data_ptr(), xq.data_ptr(), d.data_ptr(), xs.data_ptr(),
        packed.data_ptr(), s.data_ptr(), sz.data_ptr(), y.data_ptr(),
        M, K, N, group_size, bits, which, torch.get_num_threads(), s.dtype == torch.float16,
    )  # fmt: skip
    return y


def w4a8_mm(x: torch.Tensor, layer) -> torch.Tensor:
    """``x_hat @ W_hat^T`` (``w4a8_ref``'s arithmetic) for a CPU ``QuantLinear``, in ``x``'s
    dtype."""
    which = path()
    if which == "ref":
        return ref_matmul(x, layer, torch.float32).to(x.dtype)
    return linear(x, *form(layer), layer.bits, layer.group_size, which)


def use(model: torch.nn.Module, kernel: str = "w4a8", every_m: bool = False) -> int:
    """Set ``kernel`` (``"w4a8"`` or ``"exact"``) on every group-quantized layer of ``model``;
    returns how many layers take it. ``every_m``: the kernel at every M (batch-invariant
    serving: a row's bits must not depend on how many rows a step holds), else up to
    ``cpu.W4A8_MAX_M`` rows and the exact path above."""
    if kernel not in KERNELS:
        raise CompressError(
            f"kernel={kernel!r}: the quantized layers compute exactly (exact: weight-only, the "
            f"bit-faithful path) or with int8 activations (w4a8); use one of {', '.join(KERNELS)}."
        )
    n = 0
    for m in model.modules():
        if hasattr(m, "kernel") and hasattr(m, "group_size") and hasattr(m, "bits"):
            m.kernel = kernel if kernel == "exact" or fits(m) else "exact"
            m.kernel_every_m = every_m and m.kernel == "w4a8"
            n += m.kernel == kernel
    return n


KERNELS = ("exact", "w4a8")


# ---- the product as a torch op: in C++ (``cpu_ops.cpp``), else through ctypes ---------------

SCHEMA = (
    "w4a8_linear(Tensor x, Tensor packed, Tensor s, Tensor sz, int bits, int g, int path) -> Tensor"
)


def _ctypes_op(x, packed, s, sz, bits, g, which):
    y = ctypes_linear(x.reshape(-1, x.shape[-1]), packed, s, sz, bits, g, which)
    return y.to(x.dtype).reshape(*x.shape[:-1], s.shape[1])


def _fake(x, packed, s, sz, bits, g, which):
    return x.new_empty(*x.shape[:-1], s.shape[1])


def op():
    """``torch.ops.compress.w4a8_linear`` (``SCHEMA``, ``native.operator``): the C++ operator
    where it builds (no Python between the dispatcher and the kernel: ``bench_linear
    --alternatives`` measures the difference), else the same product through
    :func:`ctypes_linear`."""
    return native.operator("w4a8_linear", SCHEMA, _ctypes_op, _fake)


# ---- a mixture of experts over a few rows: every routed expert's two projections in one call ---

EXPERTS_SCHEMA = (
    "w4a8_experts(Tensor x, Tensor w, Tensor e, Tensor gu_packed, Tensor gu_s, Tensor gu_sz, "
    "Tensor dn_packed, Tensor dn_s, Tensor dn_sz, int gu_bits, int gu_g, int dn_bits, int dn_g, "
    "int path) -> Tensor"
)


def _pointers(ts) -> ctypes.Array:
    """One pointer per tensor of ``ts``, or per expert of a stacked form ``[E, ...]``."""
    if isinstance(ts, torch.Tensor):
        step = ts.stride(0) * ts.element_size()
        return (ctypes.c_void_p * ts.shape[0])(*[ts.data_ptr() + i * step for i in range(len(ts))])
    return (ctypes.c_void_p * len(ts))(*[t.data_ptr() for t in ts])


def _ctypes_experts(x, w, e, gp, gs, gz, dp, ds, dz, gu_bits, gu_g, dn_bits, dn_g, which):
    xf, M, H = x.float().contiguous(), x.shape[0], x.shape[1]
    ec, wc = e.long().contiguous(), w.float().contiguous()
    y = torch.empty(M, H, dtype=torch.float32)
    native.library().w4a8_experts(
        xf.data_ptr(), ec.data_ptr(), wc.data_ptr(), M, e.shape[1], H, ds.shape[1] * dn_g,
        _pointers(gp), _pointers(gs), _pointers(gz), gu_g, gu_bits, gs.dtype == torch.float16,
        _pointers(dp), _pointers(ds), _pointers(dz), dn_g, dn_bits, ds.dtype == torch.float16,
        y.data_ptr(), which, torch.get_num_threads(),
    )  # fmt: skip
    return y.to(x.dtype)


def _experts_fake(x, w, e, *rest):
    return x.new_empty(x.shape)


class Experts:
    """SiLU-gated experts through the kernel, every routed expert's two projections in one call:
    ``Experts(gate_up, down)(x [M, H], w [M, k], e [M, k]) -> y [M, H]`` in ``x``'s dtype::

        y[m] = sum_j w[m, j] down_e(silu(gate_e(x_m)) * up_e(x_m)),  e = e[m, j], ascending e

    each product as :func:`linear`'s (int8 activations; the hidden ``silu(gate) * up`` in fp32,
    quantized again). The activations are quantized once, an expert routed from several rows is
    read once for all of them, and each projection of all the routed experts is one parallel
    loop (``w4a8_experts`` in ``w4a8_cpu.cpp``). ``gate_up`` and ``down``: the experts'
    ``QuantLinear`` layers, one per expert (the gate_up layer's ``2I`` columns gate first), of one
    width and group size per list, fitting the kernel. Their :func:`form` is taken once, here,
    and stacked: ``forms`` holds six tensors ``[E, ...]`` (packed, s, sz of gate_up, then of
    down), and each layer's cached form becomes its view into them, so the experts are held
    once; six operands instead of six per expert keep the call's cost off the decode step."""

    def __init__(self, gate_up: list, down: list):
        lists = [list(ts) for ms in (gate_up, down) for ts in zip(*[form(m) for m in ms])]
        # one form of the scales per projection (an asymmetric layer whose zero points happen
        # to be equal takes the fp16 form, its neighbours the fp32 one)
        self.uniform = all(len({t.dtype for t in lists[i]}) == 1 for i in (1, 4))
        g, d = gate_up[0], down[0]
        self.args = (g.bits, g.group_size, d.bits, d.group_size)
        self.op = experts_op()
        self.forms = None
        if self.uniform:
            self.forms = [torch.stack(ts) for ts in lists]
            for j, layers in ((0, gate_up), (3, down)):
                for i, m in enumerate(layers):
                    own = lists[j + 1][i].data_ptr() == m.scales.data_ptr()  # its fp16 scales
                    buffers = {"scales": self.forms[j + 1][i]} if own else None
                    recache(m, "w4a8", tuple(f[i] for f in self.forms[j : j + 3]), buffers)

    def __call__(self, x, w, e, which: str | None = None) -> torch.Tensor:
        return self.op(x, w, e, *self.forms, *self.args, PATHS[which or path()])


def experts_op():
    """``torch.ops.compress.w4a8_experts`` (``EXPERTS_SCHEMA``), as :func:`op`."""
    return native.operator("w4a8_experts", EXPERTS_SCHEMA, _ctypes_experts, _experts_fake)


class W4A8Linear(torch.nn.Module):
    """A ``QuantLinear`` through the kernel, its :func:`prepare` form held as buffers (shared with
    the layer's cache); an opaque op inside a ``torch.compile`` graph."""

    def __init__(self, layer):
        super().__init__()
        packed, s, sz = form(layer)
        self.register_buffer("packed", packed)
        self.register_buffer("s", s)
        self.register_buffer("sz", sz)
        self.bits, self.group_size, self.bias = layer.bits, layer.group_size, layer.bias
        self.path, self.op = PATHS[path()], op()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.op(x, self.packed, self.s, self.sz, self.bits, self.group_size, self.path)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class W4A8Experts(torch.nn.Module):
    """:class:`Experts` as a module, its stacked forms held as (non-persistent) buffers: one
    opaque op inside a ``torch.compile`` graph, so a compiled decode step runs a sparse layer
    whole."""

    def __init__(self, experts: Experts):
        super().__init__()
        self.args, self.op = experts.args, experts.op
        for j, t in enumerate(experts.forms):
            self.register_buffer(f"f{j}", t, persistent=False)
        self.path = PATHS[path()]

    def forward(self, x, w, e):
        forms = [getattr(self, f"f{j}") for j in range(6)]
        return self.op(x, w, e, *forms, *self.args, self.path)
