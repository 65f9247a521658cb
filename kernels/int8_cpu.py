"""CPU path of the LLM.int8 GEMM: ``torch._int_mm`` (oneDNN, VNNI on AVX-512) + the epilogue.

Same contract as ``int8_matmul_ref.int8_matmul_dequant_ref``. ``torch._int_mm``
takes the weight as its transposed view ``b.t()`` (``[K, N]``, column-major), so
the row-major ``[N, K]`` bitsandbytes layout is used as stored, without a copy.

Shapes: on the CPU, torch 2.13's ``_int_mm`` accepts any M, K, N (M = 1 included;
the CUDA kernel wants M > 16 and multiples of 8). Measured on this machine's
AVX-512 EPYC, one thread: M = 1 against a [4096, 4096] weight takes ~0.4 ms with
the transposed view and ~1.6 ms with a contiguous ``[K, N]`` copy, so no padding
or fallback is used.
"""

import torch


def int8_matmul_dequant_cpu(a: torch.Tensor, b: torch.Tensor, row_absmax: torch.Tensor,
                            col_absmax: torch.Tensor, bias: torch.Tensor | None = None,
                            out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(a @ b.T) * row_absmax[:, None] * col_absmax[None, :] / 127^2 + bias`` via ``torch._int_mm``."""
    acc = torch._int_mm(a, b.t())
    out = acc.float().mul_(row_absmax.float().mul(1.0 / 127)[:, None]).mul_(col_absmax.float().mul(1.0 / 127))
    if bias is not None:
        out.add_(bias.float())
    return out.to(out_dtype)
