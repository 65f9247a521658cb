"""CPU paths of ``quant_matmul``, chosen by measurement (``eval/bench_linear.py``).

Each layer gets a form prepared at first use and kept in ``layer.cache``:

* ``int4pack`` (bfloat16 inputs, M <= 64): ATen's tinygemm CPU kernel on
  4-bit codes, ``w = _convert_weight_to_int4pack_for_cpu(n [out, in])`` and
  ``scales_and_zeros [in/g, out, 2]``; it computes ``sum_k x (n - 8) s' + z'``.
  INT2..INT4 is one call (0.5 byte/weight); INT5..INT8 two, on the high and
  low nibble (1 byte/weight)::

      q - z = sum_i m_i (n_i - 8) + b,   m = [1] or [16, 1],
      n_0 = top nibble + c,  c = 8 - 2^(top bits - 1),  b = 8 sum(m) - m_0 c - z

  so call ``i`` gets ``s' = m_i s`` and ``z' = b s`` (first call) or 0. ``c``
  centres the top nibble on 8, which keeps ``b`` small: ``s'`` and ``z'`` are
  bfloat16 there. Its float32 path is not vectorized
  (10-60x slower than bfloat16 here), so float32 inputs never take it.
* ``kplanes`` (everything else): the codes re-packed along K in the layer's
  own bit planes, int32 ``[in*p/32, out]`` per plane, ``bits/8`` byte/weight.
  A word holds ``32/p`` consecutive input channels of one output column, so a
  ``torch.compile``d loop (C++, vectorized over output columns) unpacks it with
  a shift and a mask and accumulates, in fp32, per group ``G``::

      y[m] = sum_G s_G * (x[m, G] @ q_G) - (sum_{i in G} x[m, i]) * (z_G * s_G)

  For ``M > 8`` (prefill) the compiled code dequantizes ``W_hat`` instead and
  ``x @ W_hat`` runs as a dense matmul.

Set ``COMPRESS_KERNELS=eager`` to run the ``kplanes`` code without
``torch.compile`` (no C++ compiler, debugging); it also falls back to eager,
with a warning, if compiling fails.
"""

import os
import warnings

import torch

from compress.kernels.layout import planes

GEMV_MAX_M = 8  # compiled GEMV up to here, dequantize + dense matmul above
INT4PACK_MAX_M = 64  # ATen int4pack (bfloat16) up to here
RECOMPILE_LIMIT = 64  # one compiled graph per (layer shape, M <= 8)


def _stamp(layer) -> tuple:
    """Identity of the packed tensors, so a cached form is rebuilt after they change."""
    ts = [layer.scales] + [t for _, qw, qz in planes(layer) for t in (qw, qz)]
    return tuple((t.data_ptr(), t._version) for t in ts)


def _cached(layer, key, build):
    stamp = _stamp(layer)
    hit = layer.cache.get(key)
    if hit is None or hit[0] != stamp:
        hit = layer.cache[key] = (stamp, build())
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

def _pack_k(q: torch.Tensor, p: int) -> torch.Tensor:
    """Bits ``[0, p)`` of codes ``q [K, N]`` -> int32 ``[K*p/32, N]``: bits ``p*i..`` of word ``j`` = row ``(32/p)*j + i``."""
    per = 32 // p
    q = (q & ((1 << p) - 1)).reshape(-1, per, q.shape[1])
    shifts = torch.arange(0, 32, p, dtype=torch.int32).view(1, per, 1)
    return (q << shifts).sum(dim=1, dtype=torch.int32)


def _prepare_kplanes(layer) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...], torch.Tensor, torch.Tensor]:
    q, z = _codes(layer)
    widths = tuple(p for p, _, _ in planes(layer))
    packed, lo = [], 0
    for p in widths:
        packed.append(_pack_k(q >> lo, p))
        lo += p
    return tuple(packed), widths, layer.scales.float(), z.float()


def _unpack_k(packed: tuple[torch.Tensor, ...], widths: tuple[int, ...]) -> torch.Tensor:
    """Inverse of the K packing: int32 codes ``[K, N]``."""
    q, lo = 0, 0
    for w, p in zip(packed, widths):
        shifts = torch.arange(0, 32, p, dtype=torch.int32, device=w.device).view(1, -1, 1)
        q = q | (((w.unsqueeze(1) >> shifts) & ((1 << p) - 1)).reshape(-1, w.shape[1]) << lo)
        lo += p
    return q


def _gemv(x, packed, widths, s, z):
    """fp32 ``x [M, K] @ W_hat^T`` for small M; one unpack of the weight serves all M rows."""
    G, N = s.shape
    M, K = x.shape
    q = _unpack_k(packed, widths).reshape(G, K // G, N).float()
    rows = [((x[m].reshape(G, -1, 1) * q).sum(1) * s).sum(0) for m in range(M)]
    return torch.stack(rows) - x.reshape(M, G, -1).sum(-1) @ (z * s)


def _dequant(packed, widths, s, z):
    """fp32 ``W_hat^T [K, N]``."""
    G, N = s.shape
    q = _unpack_k(packed, widths).reshape(G, -1, N).float()
    return ((q - z[:, None]) * s[:, None]).reshape(-1, N)


class _Compiled:
    """``torch.compile(fn)`` that falls back to ``fn`` (with one warning) when compiling fails."""

    def __init__(self, fn):
        self.fn, self.compiled, self.failed = fn, None, False

    def __call__(self, *args):
        if self.failed or os.environ.get("COMPRESS_KERNELS") == "eager":
            return self.fn(*args)
        if self.compiled is None:
            dynamo = torch._dynamo.config
            dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
            self.compiled = torch.compile(self.fn, dynamic=False)
        try:
            return self.compiled(*args)
        except Exception as e:  # no C++ compiler, inductor bug: the eager code computes the same
            self.failed = True
            warnings.warn(f"torch.compile of the CPU dequant kernel failed ({type(e).__name__}: {e}); "
                          f"running it eagerly, which is slower.")
            return self.fn(*args)


gemv_compiled = _Compiled(_gemv)
dequant_compiled = _Compiled(_dequant)


def kplanes_gemv(x: torch.Tensor, layer) -> torch.Tensor:
    """``x [M, in] @ W_hat^T`` for small M from the K-packed planes, in fp32, returned in ``x``'s dtype."""
    packed, widths, s, z = _cached(layer, "kplanes", lambda: _prepare_kplanes(layer))
    return gemv_compiled(x.float(), packed, widths, s, z).to(x.dtype)


def kplanes_dequant_mm(x: torch.Tensor, layer) -> torch.Tensor:
    """``x @ W_hat^T`` with ``W_hat`` dequantized from the K-packed planes (prefill)."""
    packed, widths, s, z = _cached(layer, "kplanes", lambda: _prepare_kplanes(layer))
    return x @ dequant_compiled(packed, widths, s, z).to(x.dtype)


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


def cpu_path(x: torch.Tensor, layer) -> str:
    """Name of the measured-fastest exact CPU path for ``x``'s dtype, the layer and ``M``."""
    if int4pack_fits(x, layer) and x.shape[0] <= INT4PACK_MAX_M:
        return "int4pack"
    if not kplanes_fit(layer):
        return "reference"
    return "kplanes-gemv" if x.shape[0] <= GEMV_MAX_M else "kplanes-dequant"


def cpu_quant_matmul(x: torch.Tensor, layer) -> torch.Tensor:
    return PATHS[cpu_path(x, layer)](x, layer)
