"""Triton int8 GEMM for LLM.int8, the dequantizing epilogue fused in (CUDA).

Computes, for ``a [M, K]`` int8 (per-token quantized activations), ``b [N, K]``
int8 (the bitsandbytes row-major weight) and the absmax vectors ``c_a [M]``,
``c_b [N]`` (``SCB``)::

    C[m, n] = (sum_k a[m, k] * b[n, k]) * c_a[m] * c_b[n] / 127^2  (+ bias[n])

One program owns a ``BLOCK_M x BLOCK_N`` tile of C: it accumulates int8 x int8
products in int32 along K, then scales the int32 tile by the outer product of
the two scale vectors and writes ``out_dtype`` once. The int32 product never
reaches memory. Programs are ordered in groups of ``GROUP_M`` row tiles so that
neighbouring programs share tiles of ``b`` in L2.

Reference: ``int8_matmul_ref.int8_matmul_dequant_ref``. Tested under
``TRITON_INTERPRET=1`` (set before this module is imported). The block sizes
are plain defaults, not tuned on a GPU.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _int8_matmul_dequant_kernel(
    a_ptr,
    b_ptr,
    ra_ptr,
    rb_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BM, BK]
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk  # [BK, BN]: b^T

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    # epilogue: int32 -> float, times c_a[m] / 127 and c_b[n] / 127, plus bias
    ra = tl.load(ra_ptr + offs_m, mask=offs_m < M, other=0.0).to(tl.float32)
    rb = tl.load(rb_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    out = acc.to(tl.float32) * (ra[:, None] * (1.0 / 127.0)) * (rb[None, :] * (1.0 / 127.0))
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=c_mask)


def _blocks(M: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): small row tiles for decode-sized M, 128 x 128 for prefill."""
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128
    return block_m, 128, 64


def int8_matmul_dequant_triton(
    a: torch.Tensor,
    b: torch.Tensor,
    row_absmax: torch.Tensor,
    col_absmax: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``C [M, N]`` from ``a [M, K]`` int8, ``b [N, K]`` int8 and absmax vectors ``[M]``, ``[N]``.

    ``out`` (optional, ``[M, N]``) is written in place; otherwise a new ``out_dtype`` tensor is
    returned.
    """
    M, K = a.shape
    N = b.shape[0]
    if a.dtype != torch.int8 or b.dtype != torch.int8 or b.shape[1] != K:
        raise ValueError(
            f"int8 GEMM wants a [M, K] and b [N, K] int8, got {a.dtype} "
            f"{tuple(a.shape)} and {b.dtype} {tuple(b.shape)}"
        )
    c = torch.empty(M, N, dtype=out_dtype, device=a.device) if out is None else out
    block_m, block_n, block_k = _blocks(M)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _int8_matmul_dequant_kernel[grid](
        a,
        b,
        row_absmax.contiguous(),
        col_absmax.contiguous(),
        bias.contiguous() if bias is not None else c,
        c,
        M,
        N,
        K,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        c.stride(1),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=8,
        num_warps=4,
        num_stages=3,
    )
    return c
