"""CPU paths of ``quant_matmul``, chosen by measurement (``eval/bench_linear.py``).

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
  Its float32 path is scalar code (60x slower, below), so float32 inputs
  never take it.
* ``kplanes`` (float32 and float16 inputs, and larger M): the codes re-packed
  along K in the layer's own bit planes, int32 ``[in*p/32, out]`` per plane,
  ``bits/8`` byte/weight. A word holds ``32/p`` consecutive input channels of
  one output column, so a ``torch.compile``d loop (C++, vectorized over output
  columns) unpacks it with a shift and a mask and accumulates in fp32, per
  group ``G``::

      y[m] = sum_G s_G * (x[m, G] @ q_G) - (sum_{i in G} x[m, i]) * (z_G * s_G)

  For M > 8 (prefill) it dequantizes ``W_hat`` into a reused buffer instead,
  and ``x @ W_hat`` runs as a dense matmul.

Measured (``bench_linear --quick --threads 1 --alternatives``, 4096x4096, M=1,
weights cold, min ms; dense fp32 2.7, bf16 1.9): INT4 int4pack 0.95,
kplanes 1.5 (bf16 in) / 0.94 (fp32 in), ATen's fp32 int4pack 57; INT3
re-encoded int4pack 0.58 (0.5 byte/weight), kplanes on its 3-bit planes 2.0
(bf16) / 1.2 (fp32); INT8 two int4pack calls 1.16, kplanes 2.2 (bf16) / 1.35
(fp32). At M=512 both prefill paths cost what the dense matmul of their
dtype costs, within 1.0-1.5x.

Both are exact up to the rounding of their dtype: ``kplanes`` matches the
float64 reference to ~1e-6 in float32; ``int4pack`` to ~3e-3 (bfloat16 output
and scales). Layers under 2^16 weights (test models), ``COMPRESS_KERNELS=eager``
(no C++ compiler, debugging) and a failed compile (with a warning) run the same
``kplanes`` code eagerly.
"""

import os
import warnings

import torch

from compress.errors import CompressError
from compress.kernels.layout import check_layer, planes, stamp
from compress.quant.packing import pack_planes

GEMV_MAX_M = 8  # compiled GEMV up to here, dequantize + dense matmul above
INT4PACK_MAX_M = {1: 32, 2: 8}  # ATen int4pack (bfloat16) up to this M, by calls (nibbles per code)
RECOMPILE_LIMIT = 64  # one compiled graph per (layer shape, M <= 8)
COMPILE_MIN_WEIGHTS = 2**16  # smaller layers run eagerly: compiling them costs more than it saves


def _cached(layer, key, build):
    """``build()``, kept in ``layer.cache[key]`` until the layer's tensors change."""
    current = stamp(layer)
    hit = layer.cache.get(key)
    if hit is None or hit[0] != current:
        hit = layer.cache[key] = (current, build())
    return hit[1]


def _codes(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 codes ``q [in, out]`` and zero points ``z [in/g, out]``."""
    q, z = layer.codes()
    return q.to(torch.int32), z.to(torch.int32)


# ---- int4pack: ATen's bfloat16 kernel, one call per nibble of the codes --------------------------

def _prepare_int4pack(layer, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(w, scales_and_zeros)`` per nibble: ``q - z = sum_i m_i (n_i - 8) + b`` (see the module docstring)."""
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


def int4pack_mm(x: torch.Tensor, layer) -> torch.Tensor:
    """``x [M, in] @ W_hat^T`` through ``_weight_int4pack_mm_for_cpu``, one call per nibble of the codes."""
    y = None
    for w, sz in _cached(layer, ("int4pack", x.dtype), lambda: _prepare_int4pack(layer, x.dtype)):
        part = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, layer.group_size, sz)
        y = part if y is None else y + part
    return y


# ---- kplanes: codes packed along K, compiled unpack-and-accumulate -----------------------------

def _prepare_kplanes(layer) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...], torch.Tensor, torch.Tensor]:
    """The codes packed along K: ``pack_planes`` of ``q^T``, each plane transposed to ``[in*p/32, out]``."""
    q, z = _codes(layer)
    widths = tuple(p for p, _, _ in planes(layer))
    along_k = pack_planes(q.t().contiguous(), layer.bits)
    return tuple(along_k[f"w{p}"].t().contiguous() for p in widths), widths, layer.scales.float(), z.float()


def _unpack_k(packed: tuple[torch.Tensor, ...], widths: tuple[int, ...]) -> torch.Tensor:
    """Inverse of the K packing: int32 codes ``[K, N]``."""
    q, lo = 0, 0
    for w, p in zip(packed, widths):
        shifts = torch.arange(0, 32, p, dtype=torch.int32, device=w.device).view(1, -1, 1)
        q = q | (((w.unsqueeze(1) >> shifts) & ((1 << p) - 1)).reshape(-1, w.shape[1]) << lo)
        lo += p
    return q


def _gemv(x, packed, widths, s, z, unroll: int):
    """fp32 ``x [M, K] @ W_hat^T`` for small M; one unpack of the weight serves all M rows.

    Each row sums ``unroll`` interleaved partial sums: independent add chains, so
    the compiled loop is not bound by the latency of one accumulator.
    """
    G, N = s.shape
    M, K = x.shape
    q = _unpack_k(packed, widths).reshape(G, K // G // unroll, unroll, N).float()
    xg = x.reshape(M, G, -1, unroll, 1)
    rows = [(sum((xg[m, :, :, u] * q[:, :, u]).sum(1) for u in range(unroll)) * s).sum(0) for m in range(M)]
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
            warnings.warn(f"torch.compile of the CPU dequant kernel failed ({type(e).__name__}: {e}); "
                          f"running it eagerly, which is slower.")
            return self.fn(*args)


gemv_compiled = _Compiled(_gemv)
dequant_compiled = _Compiled(_dequant_into)
_workspace: dict[torch.dtype, torch.Tensor] = {}  # W_hat of the prefill path, per dtype


def kplanes_gemv(x: torch.Tensor, layer) -> torch.Tensor:
    """``x [M, in] @ W_hat^T`` for small M from the K-packed planes, in fp32, returned in ``x``'s dtype."""
    packed, widths, s, z = _cached(layer, "kplanes", lambda: _prepare_kplanes(layer))
    return gemv_compiled(layer, x.float(), packed, widths, s, z, gemv_unroll(layer, x.shape[0])).to(x.dtype)


def gemv_unroll(layer, m: int) -> int:
    """Accumulator chains of :func:`_gemv` for ``m`` rows. Measured (4096x4096, 1 thread): 8 chains
    take INT4 from 0.82 to 0.50 ms and INT8 from 2.0 to 1.1 ms at M = 1; they lose on several
    planes (INT3: 0.91 -> 2.0 ms) and at M = 4."""
    return 8 if len(planes(layer)) == 1 and m <= 2 and layer.group_size % 8 == 0 else 1


def kplanes_dequant_mm(x: torch.Tensor, layer) -> torch.Tensor:
    """``x @ W_hat^T`` with ``W_hat`` dequantized from the K-packed planes into a reused buffer (prefill).

    The buffer, the size of the largest layer seen, is shared by all layers: a
    fresh one per call costs more in page faults than the dequantization itself
    (a 64 MB tensor: 80 ms to first touch here, 2 ms to rewrite).
    """
    if x.dtype == torch.float16:  # CPUs without AVX512-FP16 multiply float16 slowly
        return kplanes_dequant_mm(x.float(), layer).half()
    packed, widths, s, z = _cached(layer, "kplanes", lambda: _prepare_kplanes(layer))
    k, n = layer.in_features, layer.out_features
    buf = _workspace.get(x.dtype)
    if buf is None or buf.numel() < k * n:
        buf = _workspace[x.dtype] = torch.empty(k * n, dtype=x.dtype)
    w = buf[: k * n].view(k, n)
    dequant_compiled(layer, w, packed, widths, s, z)
    return x @ w


def reference_mm(x: torch.Tensor, layer) -> torch.Tensor:
    return x @ layer.dequantize(x.dtype).t()


PATHS = {"int4pack": int4pack_mm, "kplanes-gemv": kplanes_gemv,
         "kplanes-dequant": kplanes_dequant_mm, "reference": reference_mm}


def int4pack_fits(x: torch.Tensor, layer) -> bool:
    """ATen's int4pack kernel takes bfloat16, out % 16 == 0 and g in 32..256."""
    return (x.dtype == torch.bfloat16 and layer.out_features % 16 == 0
            and layer.group_size in (32, 64, 128, 256))


def kplanes_fit(layer) -> bool:
    """Packing along K needs ``in_features`` to fill whole words of the narrowest plane."""
    return layer.in_features % (32 // min(p for p, _, _ in planes(layer))) == 0


def keep_int4pack_only(layer) -> None:
    """Prepare the bfloat16 int4pack form, then free the packed codes it duplicates (``lean`` loading).

    The layer then computes through int4pack at every ``M`` and only from bfloat16 inputs: it
    holds its weights once, at 0.5 byte each (1 byte from INT5 up), for ~2x slower prefill than
    dequantize + matmul (SmolLM2 layers at M = 512, 1 thread: qkv 3.3 against 1.5 ms, gate_up
    10.6 against 4.9 ms).
    """
    check_layer(layer)
    form = _cached(layer, ("int4pack", torch.bfloat16), lambda: _prepare_int4pack(layer, torch.bfloat16))
    for name, t in layer._buffers.items():
        if name.startswith(("qweight", "qzeros")):
            layer._buffers[name] = t.new_empty(0)
    now = stamp(layer)
    layer.cache = {("int4pack", torch.bfloat16): (now, form), "checked": now, "lean": True}


def cpu_path(x: torch.Tensor, layer) -> str:
    """Name of the measured-fastest exact CPU path for ``x``'s dtype, the layer and ``M``."""
    if layer.cache.get("lean"):
        if x.dtype != torch.bfloat16:
            raise CompressError(f"this quantized layer [{layer.in_features} -> {layer.out_features}] was loaded "
                                f"lean (only its bfloat16 int4pack form is kept), so it takes bfloat16 "
                                f"inputs, not {x.dtype}; load without lean to compute in other dtypes.")
        return "int4pack"
    if int4pack_fits(x, layer) and x.shape[0] <= INT4PACK_MAX_M[1 if layer.bits <= 4 else 2]:
        return "int4pack"
    if not kplanes_fit(layer):
        return "reference"
    return "kplanes-gemv" if x.shape[0] <= GEMV_MAX_M else "kplanes-dequant"


def cpu_quant_matmul(x: torch.Tensor, layer) -> torch.Tensor:
    return PATHS[cpu_path(x, layer)](x, layer)
