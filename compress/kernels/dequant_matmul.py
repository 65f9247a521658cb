"""Fused dequant-matmul for group-quantized weights, in Triton.

    y[m, o] = sum_i x[m, i] * (q[i, o] - z[i // g, o]) * s[i // g, o]

A program loads a ``[BLOCK_K, BLOCK_N]`` tile of int32 words per bit plane,
unpacks the codes in registers (a shift and a mask per plane, AWQ's nibble
order or the planes' natural order), subtracts the group's zero point,
multiplies by its scale and accumulates in fp32. ``BLOCK_K`` divides the group
size, so a K block has one scale and one zero point per column.

Two launch shapes, picked by ``M``:

* GEMM (``M > 8``, prefill): ``[BLOCK_M, BLOCK_N]`` output tiles, ``tl.dot`` over K.
* GEMV (``M <= 8``, decode): one program per ``BLOCK_N`` columns and K split;
  each row is a multiply-and-sum in registers; with several K splits the
  programs write fp32 partials that are summed afterwards.

Runs on CUDA; the tests run it on the CPU under ``TRITON_INTERPRET=1``.
"""

import torch
import triton
import triton.language as tl

from compress.errors import CompressError
from compress.kernels.layout import check_inputs, planes

GEMV_MAX_M = 8
MIN_BLOCK_K = 16  # tl.dot's smallest K


@triton.jit
def _plane(ptr, rows, cols, col_mask, N, P: tl.constexpr, AWQ: tl.constexpr):
    """Bits of one ``P``-bit plane, int32 ``[rows, cols]``; the plane is int32 ``[*, N*P/32]``."""
    PER: tl.constexpr = 32 // P
    words = tl.load(
        ptr + rows[:, None] * (N // PER) + (cols // PER)[None, :], mask=col_mask[None, :], other=0
    )
    if AWQ:
        slot = (cols % 8) // 2 + (cols % 2) * 4  # nibble of column 8*j + r: AWQ_ORDER inverted
    else:
        slot = cols % PER
    return (words >> (slot * P)[None, :]) & ((1 << P) - 1)


@triton.jit
def _codes(
    ptrs,
    rows,
    cols,
    col_mask,
    N,
    WIDTHS: tl.constexpr,
    LOWS: tl.constexpr,
    NUM_PLANES: tl.constexpr,
    AWQ: tl.constexpr,
):
    """Codes ``[rows, cols]`` from their bit planes: plane ``i`` holds bits ``LOWS[i] ..
    LOWS[i] + WIDTHS[i]``."""
    q = _plane(ptrs[0], rows, cols, col_mask, N, WIDTHS[0], AWQ)
    for i in tl.static_range(1, NUM_PLANES):
        q = q | (_plane(ptrs[i], rows, cols, col_mask, N, WIDTHS[i], AWQ) << LOWS[i])
    return q


@triton.jit
def _dequant_tile(
    qw,
    qz,
    s_ptr,
    k0,
    rk,
    rn,
    n_mask,
    N,
    G: tl.constexpr,
    WIDTHS: tl.constexpr,
    LOWS: tl.constexpr,
    NUM_PLANES: tl.constexpr,
    AWQ: tl.constexpr,
):
    """fp32 ``W_hat^T[k0 + rk, rn]``; the K block lies inside group ``k0 // G``."""
    g = k0 // G
    q = _codes(qw, k0 + rk, rn, n_mask, N, WIDTHS, LOWS, NUM_PLANES, AWQ)
    z = _codes(qz, g + tl.arange(0, 1), rn, n_mask, N, WIDTHS, LOWS, NUM_PLANES, AWQ)
    s = tl.load(s_ptr + g * N + rn, mask=n_mask, other=0.0).to(tl.float32)
    return (q - z).to(tl.float32) * s[None, :]


@triton.jit
def _gemm_kernel(
    x_ptr,
    out_ptr,
    qw,
    qz,
    s_ptr,
    M,
    N,
    K,
    stride_xm,
    G: tl.constexpr,
    WIDTHS: tl.constexpr,
    LOWS: tl.constexpr,
    NUM_PLANES: tl.constexpr,
    AWQ: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask, n_mask = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=m_mask[:, None], other=0.0
        )
        w = _dequant_tile(qw, qz, s_ptr, k0, rk, rn, n_mask, N, G, WIDTHS, LOWS, NUM_PLANES, AWQ)
        acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")
    out = out_ptr + rm[:, None] * N + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gemv_kernel(
    x_ptr,
    out_ptr,
    qw,
    qz,
    s_ptr,
    M,
    N,
    K,
    K_SPLIT,
    stride_xm,
    G: tl.constexpr,
    WIDTHS: tl.constexpr,
    LOWS: tl.constexpr,
    NUM_PLANES: tl.constexpr,
    AWQ: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Writes ``out[split, m, n]``: the sum over K split ``split`` (program axis 1) of rows
    ``m < M``."""
    split = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = split * K_SPLIT
    for k0 in range(k_start, tl.minimum(k_start + K_SPLIT, K), BLOCK_K):
        w = _dequant_tile(qw, qz, s_ptr, k0, rk, rn, n_mask, N, G, WIDTHS, LOWS, NUM_PLANES, AWQ)
        for m in tl.static_range(BLOCK_M):  # rows m >= M repeat row M - 1 and are not stored
            x = tl.load(x_ptr + tl.minimum(m, M - 1) * stride_xm + k0 + rk).to(tl.float32)
            row = tl.sum(x[:, None] * w, axis=0)
            acc = tl.where(rm[:, None] == m, acc + row[None, :], acc)
    out = out_ptr + (split * M + rm[:, None]) * N + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & n_mask[None, :])


def block_k(group_size: int, cap: int = 64) -> int:
    """Largest power of two dividing the group size, at most ``cap``; a K block never straddles
    groups."""
    bk = min(group_size & -group_size, cap)
    if bk < MIN_BLOCK_K:
        raise CompressError(
            f"group size {group_size} is not a multiple of {MIN_BLOCK_K}, the Triton kernel's "
            f"smallest K block; re-quantize with a group size that is a multiple of {MIN_BLOCK_K} "
            f"(e.g. 32, 64, 128)."
        )
    return bk


def _launch_args(layer) -> tuple[tuple, tuple, dict]:
    ps = planes(layer)
    widths = tuple(p for p, _, _ in ps)
    lows = tuple(sum(widths[:i]) for i in range(len(widths)))
    meta = dict(
        G=layer.group_size, WIDTHS=widths, LOWS=lows, NUM_PLANES=len(ps), AWQ=layer.format == "awq"
    )
    return tuple(t.contiguous() for _, t, _ in ps), tuple(t.contiguous() for _, _, t in ps), meta


def gemv(
    x: torch.Tensor, layer, out: torch.Tensor, split_k: int = 1, block_n: int = 64
) -> torch.Tensor:
    """``out [M, N] = x @ W_hat^T`` for ``M <= 8``, with K split over ``split_k`` programs."""
    M, K = x.shape
    N = layer.out_features
    bk = block_k(layer.group_size, cap=32)
    blocks = K // bk
    split_k = max(1, min(split_k, blocks))
    k_split = triton.cdiv(blocks, split_k) * bk
    split_k = triton.cdiv(K, k_split)
    part = out if split_k == 1 else torch.empty(split_k, M, N, dtype=torch.float32, device=x.device)
    qw, qz, meta = _launch_args(layer)
    grid = (triton.cdiv(N, block_n), split_k)
    _gemv_kernel[grid](
        x,
        part,
        qw,
        qz,
        layer.scales,
        M,
        N,
        K,
        k_split,
        x.stride(0),
        BLOCK_M=triton.next_power_of_2(M),
        BLOCK_N=block_n,
        BLOCK_K=bk,
        **meta,
    )
    if split_k > 1:
        out.copy_(part.sum(0))
    return out


def gemm(
    x: torch.Tensor, layer, out: torch.Tensor, block_m: int = 64, block_n: int = 64
) -> torch.Tensor:
    """``out [M, N] = x @ W_hat^T`` as tiles of ``block_m x block_n``."""
    M, K = x.shape
    N = layer.out_features
    block_m = min(block_m, max(16, triton.next_power_of_2(M)))
    qw, qz, meta = _launch_args(layer)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _gemm_kernel[grid](
        x,
        out,
        qw,
        qz,
        layer.scales,
        M,
        N,
        K,
        x.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k(layer.group_size),
        **meta,
    )
    return out


def _default_split(x: torch.Tensor, n_blocks: int, k_blocks: int) -> int:
    """Enough K splits for about two programs per SM (one on the interpreter)."""
    if x.device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    return max(1, min(k_blocks, (2 * sms) // n_blocks))


def triton_quant_matmul(x: torch.Tensor, layer, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, in] @ W_hat^T`` in ``x``'s dtype (into ``out`` if given): GEMV for ``M <= 8``,
    GEMM above."""
    check_inputs(x, layer)
    block_k(layer.group_size)
    x = x.contiguous()
    if out is None:
        out = torch.empty(x.shape[0], layer.out_features, dtype=x.dtype, device=x.device)
    if out.shape != (x.shape[0], layer.out_features) or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous [{x.shape[0]}, {layer.out_features}] tensor, "
            f"got {tuple(out.shape)} with strides {out.stride()}"
        )
    if x.shape[0] == 0:
        return out
    if x.shape[0] <= GEMV_MAX_M:
        k_blocks = x.shape[1] // block_k(layer.group_size, 32)
        split = _default_split(x, triton.cdiv(layer.out_features, 64), k_blocks)
        return gemv(x, layer, out, split_k=split)
    return gemm(x, layer, out)
