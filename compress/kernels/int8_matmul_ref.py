"""Reference for the LLM.int8 GEMM: int8 x int8 -> int32, then the dequantizing epilogue.

Vector-wise quantization (Dettmers et al. 2022, eq. 4-5) keeps one absmax per
row of the activations ``A [M, K]`` (``c_a[m]``, per token) and one per row of
the weight ``B [N, K]`` (``c_b[n]``, bitsandbytes' ``SCB``)::

    A_i8 = round(127 * A / c_a),   B_i8 = round(127 * B / c_b)
    C[m, n] = (sum_k A_i8[m, k] * B_i8[n, k]) * c_a[m] * c_b[n] / 127^2  (+ bias[n])

The sum is exact in float64 (|sum| <= 127^2 * K < 2^53), so this reference is
the ground truth the CPU path (``int8_cpu.py``) and the Triton kernel
(``int8_triton.py``) are tested against.
"""

import torch


def int8_matmul_dequant_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    row_absmax: torch.Tensor,
    col_absmax: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``C [M, N]`` from ``a [M, K]`` int8, ``b [N, K]`` int8 and the absmax vectors ``[M]``,
    ``[N]``."""
    acc = a.double() @ b.double().t()
    out = acc * row_absmax.double()[:, None] * col_absmax.double()[None, :] / 127.0**2
    if bias is not None:
        out = out + bias.double()
    return out.to(out_dtype)
