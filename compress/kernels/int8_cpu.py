"""CPU path of the LLM.int8 GEMM: ``torch._int_mm`` (oneDNN) + the dequantizing epilogue.

Same contract as ``int8_matmul_ref.int8_matmul_dequant_ref``::

    C[m, n] = (sum_k a[m, k] * b[n, k]) * c_a[m] * c_b[n] / 127^2  (+ bias[n])

``torch._int_mm`` takes the weight as its transposed view ``b.t()`` (``[K, N]``,
column-major), so the row-major ``[N, K]`` bitsandbytes layout is used as stored, without a
copy. On the CPU, torch's ``_int_mm`` accepts any M, K, N (M = 1 included; the CUDA kernel
wants M > 16 and multiples of 8), so no padding or fallback is used. The transposed view is
several times faster than a contiguous ``[K, N]`` copy at M = 1, one thread::

    python -m timeit -s "import torch; torch.set_num_threads(1); i8 = dict(dtype=torch.int8);
        a = torch.ones(1, 4096, **i8); b = torch.ones(4096, 4096, **i8); c = b.t().contiguous()"
        "torch._int_mm(a, b.t())"       # against "torch._int_mm(a, c)"
"""

import torch


def int8_matmul_dequant_cpu(
    a: torch.Tensor,
    b: torch.Tensor,
    row_absmax: torch.Tensor,
    col_absmax: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(a @ b.T) * row_absmax[:, None] * col_absmax[None, :] / 127^2 + bias`` via
    ``torch._int_mm``."""
    acc = torch._int_mm(a, b.t())
    out = acc.float().mul_(row_absmax.float().mul(1.0 / 127)[:, None])
    out.mul_(col_absmax.float().mul(1.0 / 127))
    if bias is not None:
        out.add_(bias.float())
    return out.to(out_dtype)
