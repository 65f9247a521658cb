"""Kernels: one entry point per kernel family, each implementation beside its reference.

    quant_matmul(x, layer)       group-quantized linear    dequant_matmul.py (Triton), cpu.py,
                                 (a QuantLinear)           reference: x @ layer.dequantize()^T;
                                                           layer.kernel "w4a8": int8 activations,
                                                           w4a8_cpu.py (C++), w4a8_ref.py
    int8_matmul(a, b, c_a, c_b)  LLM.int8's int8 GEMM and  int8_triton.py, int8_cpu.py,
                                 its epilogue              int8_matmul_ref.py
    packkv_qk(q, k)              PackKV's two attention    packkv.py (Triton), packkv_cpu.py
    packkv_pv(p, v)              products                  (C++, built on first use),
                                                           packkv_ref.py
    packkv_order(codes)          PackKV's greedy token     packkv_cpu.py (C++), packkv_ref.py
                                 order of a block          (also on CUDA)
    kivi_qk(q, codes, z, s, ..)  KIVI's two attention      kivi_cpu.py (C++, built on first
    kivi_pv(p, codes, z, s, ..)  products                  use), kivi_ref.py (also on CUDA)
    linear(x, weight, bias)      a dense fp32 linear of a   skinny_cpu.py (C++, 2-8 rows),
                                 few rows (verification)    reference: F.linear
    rms_norm(x, w, eps, offset)  the decoder's RMSNorm      cpu_ops.cpp (one pass a row, a
                                                            fixed order), rms_norm_ref.py

Every family picks its implementation by one rule, :func:`backend`: ``COMPRESS_KERNELS=ref``
forces the PyTorch reference (for debugging); otherwise a CUDA input runs the Triton kernel and
a CPU input the CPU path. ``COMPRESS_KERNELS=eager`` runs the CPU paths without
``torch.compile`` or other compiled code (PackKV's products then run the reference). Triton is
imported only when a CUDA input needs it. The kernels own the bit layouts (``bitplanes.py``, ``awq_gemm.py``; ``compress.layers`` reads them)
and import no method package.
"""

import os

import torch
import torch.nn.functional as F

from compress.kernels import (
    cpu,
    int8_cpu,
    int8_matmul_ref,
    kivi_cpu,
    kivi_ref,
    native,
    packkv_cpu,
    packkv_ref,
    skinny_cpu,
    w4a8_ref,
)
from compress.kernels.layout import check_inputs
from compress.kernels.rms_norm_ref import rms_norm as rms_norm_reference


def backend(x: torch.Tensor) -> str:
    """``"ref"``, ``"triton"`` or ``"cpu"``: which implementation a kernel family runs for ``x``."""
    if os.environ.get("COMPRESS_KERNELS") == "ref":
        return "ref"
    return "triton" if x.is_cuda else "cpu"


def quant_matmul(x: torch.Tensor, layer) -> torch.Tensor:
    """``x [M, in] @ W_hat^T`` for a ``QuantLinear``, in ``x``'s dtype."""
    where = backend(x)
    if where == "ref" or (x.requires_grad and torch.is_grad_enabled()):
        if where == "ref" and getattr(layer, "kernel", "exact") == "w4a8":  # its arithmetic
            return w4a8_ref.matmul(x, layer, torch.float32).to(x.dtype)
        return x @ layer.dequantize(x.dtype).t()  # the kernels have no backward
    check_inputs(x, layer)
    if x.shape[0] == 0:
        return x.new_empty(0, layer.out_features)
    if where == "triton":
        if getattr(layer, "kernel", "exact") == "w4a8":  # no CUDA kernel: the same arithmetic
            return w4a8_ref.matmul(x, layer, torch.float32).to(x.dtype)
        from compress.kernels.dequant_matmul import triton_quant_matmul  # heavy: Triton

        return triton_quant_matmul(x, layer)
    return cpu.cpu_quant_matmul(x, layer)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear(x, weight, bias)``; fp32 CPU products of 2 to 8 rows through the skinny kernel
    (``skinny_cpu.chosen_path``), which reads the weight once for all rows."""
    if backend(x) == "cpu":
        if which := skinny_cpu.chosen_path(x, weight):
            return skinny_cpu.linear(x, weight, bias, which)
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0):
    """RMSNorm of ``x [..., D]`` (``rms_norm_ref``'s formula): on the CPU the C++ operator
    ``compress::rms_norm`` where it builds (one pass over each row instead of ~8 eager ops),
    else, and under autograd or ``torch.compile``, the PyTorch reference."""
    if (
        backend(x) == "cpu"
        and x.dtype == weight.dtype
        and os.environ.get("COMPRESS_KERNELS") != "eager"
        and not torch.compiler.is_compiling()
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        if native.ops():
            return torch.ops.compress.rms_norm(x, weight, eps, offset)
    return rms_norm_reference(x, weight, eps, offset)


def int8_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    row_absmax: torch.Tensor,
    col_absmax: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(a @ b^T) * row_absmax[:, None] * col_absmax / 127^2 + bias`` -> ``[M, N]`` in
    ``out_dtype``, from int8 ``a [M, K]``, ``b [N, K]`` and absmax vectors ``[M]``, ``[N]``."""
    where = backend(a)
    if where == "ref":
        fn = int8_matmul_ref.int8_matmul_dequant_ref
    elif where == "triton":
        from compress.kernels.int8_triton import int8_matmul_dequant_triton as fn  # heavy: Triton
    else:
        fn = int8_cpu.int8_matmul_dequant_cpu
    return fn(a, b, row_absmax, col_absmax, bias, out_dtype)


def _packkv(x: torch.Tensor, head_dim: int):
    """The module computing PackKV's products for ``x``: ``packkv_triton``, ``packkv_cpu``
    (when it builds and ``COMPRESS_KERNELS`` is not ``eager``) or ``packkv_ref``."""
    where = backend(x)
    if where == "triton":
        from compress.kernels import packkv_triton  # heavy: Triton

        if packkv_triton.supports(head_dim):
            return packkv_triton
    elif (
        where == "cpu"
        and os.environ.get("COMPRESS_KERNELS") != "eager"
        and not (x.requires_grad and torch.is_grad_enabled())
    ):  # the kernel has no backward
        if native.library() is not None:
            return packkv_cpu
    return packkv_ref


def packkv_qk(q: torch.Tensor, k, out: torch.Tensor | None = None) -> torch.Tensor:
    """Scores ``q [BH, M, D] @ k_hat^T -> [BH, M, n]`` fp32 of a PackKV-packed ``k``."""
    return _packkv(q, k.dim).qk(q, k, out=out)


def packkv_pv(p: torch.Tensor, v, out: torch.Tensor | None = None) -> torch.Tensor:
    """``p [BH, M, n] @ v_hat -> [BH, M, D]`` fp32 of a PackKV-packed ``v``."""
    return _packkv(p, v.dim).pv(p, v, out=out)


def packkv_order(codes: torch.Tensor) -> torch.Tensor:
    """PackKV's greedy permutation ``[N, T]`` of each block row of codes ``[N, T, C]`` (the rule
    in ``packkv_ref.order_greedy``): C++ on the CPU where it builds, else the reference."""
    if backend(codes) == "cpu" and os.environ.get("COMPRESS_KERNELS") != "eager":
        if native.library() is not None:
            return packkv_cpu.order_greedy(codes)
    return packkv_ref.order_greedy(codes)


def _kivi(x: torch.Tensor, zero: torch.Tensor, head_dim: int, which: str):
    """The module computing KIVI's products for ``x``: ``kivi_cpu`` (fp32 CPU inputs, when it
    builds and ``COMPRESS_KERNELS`` is not ``eager``) or ``kivi_ref``."""
    if (
        backend(x) == "cpu"
        and os.environ.get("COMPRESS_KERNELS") != "eager"
        and not (x.requires_grad and torch.is_grad_enabled())
    ):
        if kivi_cpu.supports(x, zero, head_dim, which) and native.library() is not None:
            return kivi_cpu
    return kivi_ref


def kivi_qk(
    q: torch.Tensor, codes: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, n: int, bits: int
) -> torch.Tensor:
    """Scores ``q [BH, M, D] @ K_hat^T -> [BH, M, n]`` of KIVI's K of one layer (layout in
    ``kivi_ref``), in ``q``'s dtype."""
    return _kivi(q, zero, q.shape[-1], "k").qk(q, codes, zero, scale, n, bits)


def kivi_pv(
    p: torch.Tensor, codes: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, n: int, bits: int
) -> torch.Tensor:
    """``p [BH, M, n] @ V_hat -> [BH, M, D]`` of KIVI's V of one layer, in ``p``'s dtype."""
    return _kivi(p, zero, codes.shape[-1] * 32 // bits, "v").pv(p, codes, zero, scale, n, bits)
