"""PackKV attention products in Triton, decompressing the packed cache in registers.

Same format and signatures as ``packkv_ref.qk`` / ``packkv_ref.pv`` (the format is described
there). One tile is ``BLOCK_T = 64`` stored slots x D channels of one row ``bh``; a thread block
decodes it straight from the bit stream::

    w[s, c]     = nibble c of pwidth[row(s)]           row(s) = s // 16, i(s) = s % 16
    word[s, c]  = poff[row(s)] + sum_{c'<c} w[s, c'] + (i(s) * w[s, c]) // 16
    rest[s, c]  = (data[word] | data[word + 1] << 16) >> ((i(s) * w) % 16)  &  (2^w - 1)
    x_hat[s, c] = tmin[s] + tstep[s] * (pmin[row(s), c] + rest[s, c])

and multiplies it with the tile of queries or probabilities:

    qk: grid (BH, n/64)      scores[bh, :, tile] = q[bh] @ x_hat(tile)^T
    pv: grid (BH, splits)    each program sums p[bh, :, tile] @ x_hat(tile) over its tiles;
                             the per-split partials are added on the host.

All arithmetic is fp32 (``tl.dot`` with ``input_precision="ieee"``), so the kernels agree with
the reference to rounding; the Triton interpreter (``TRITON_INTERPRET=1``) runs them on the CPU.
"""

import torch
import triton
import triton.language as tl

from compress.kernels.packkv_ref import PACK, Packed

BLOCK_T = 64


@triton.jit
def _decode_tile(tmin, tstep, pmin, pwidth, poff, data, n_words, bh, s0, n, cap,
                 D: tl.constexpr, BLOCK_T: tl.constexpr):
    """``x_hat [BLOCK_T, D]`` fp32 of slots ``s0 ..`` of row ``bh``; zeros past ``n``."""
    slot = s0 + tl.arange(0, BLOCK_T)
    ok = slot < n
    row = bh * (cap // 16) + slot // 16
    ch = tl.arange(0, D)
    wb = tl.load(pwidth + row[:, None] * (D // 2) + ch[None, :] // 2, mask=ok[:, None], other=0).to(tl.int32)
    w = (wb >> ((ch[None, :] % 2) * 4)) & 15
    bitpos = (slot % 16)[:, None] * w
    word = tl.load(poff + row, mask=ok, other=0)[:, None] + tl.cumsum(w, axis=1) - w + (bitpos >> 4)
    lo = tl.load(data + word, mask=ok[:, None], other=0).to(tl.int32) & 0xFFFF
    hi = tl.load(data + word + 1, mask=ok[:, None] & (word + 1 < n_words), other=0).to(tl.int32) & 0xFFFF
    rest = ((lo | (hi << 16)) >> (bitpos & 15)) & ((1 << w) - 1)
    code = rest + tl.load(pmin + row[:, None] * D + ch[None, :], mask=ok[:, None], other=0).to(tl.int32)
    mn = tl.load(tmin + bh * cap + slot, mask=ok, other=0.0).to(tl.float32)
    st = tl.load(tstep + bh * cap + slot, mask=ok, other=0.0).to(tl.float32)
    return mn[:, None] + st[:, None] * code.to(tl.float32)


@triton.jit
def _qk_kernel(q, out, tmin, tstep, pmin, pwidth, poff, data, n_words, n, cap, M,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr):
    bh, s0 = tl.program_id(0), tl.program_id(1) * BLOCK_T
    x = _decode_tile(tmin, tstep, pmin, pwidth, poff, data, n_words, bh, s0, n, cap, D, BLOCK_T)
    m, ch = tl.arange(0, BLOCK_M), tl.arange(0, D)
    qt = tl.load(q + (bh * M + m[:, None]) * D + ch[None, :], mask=m[:, None] < M, other=0.0)
    s = tl.dot(qt, tl.trans(x), input_precision="ieee")
    slot = s0 + tl.arange(0, BLOCK_T)
    tl.store(out + (bh * M + m[:, None]) * n + slot[None, :], s, mask=(m[:, None] < M) & (slot[None, :] < n))


@triton.jit
def _pv_kernel(p, part, tmin, tstep, pmin, pwidth, poff, data, n_words, n, cap, M, BH, tiles,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr):
    bh, split = tl.program_id(0), tl.program_id(1)
    m, ch = tl.arange(0, BLOCK_M), tl.arange(0, D)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for t in range(split * tiles, (split + 1) * tiles):
        s0 = t * BLOCK_T
        x = _decode_tile(tmin, tstep, pmin, pwidth, poff, data, n_words, bh, s0, n, cap, D, BLOCK_T)
        slot = s0 + tl.arange(0, BLOCK_T)
        pt = tl.load(p + (bh * M + m[:, None]) * n + slot[None, :], mask=(m[:, None] < M) & (slot[None, :] < n),
                     other=0.0)
        acc += tl.dot(pt, x, input_precision="ieee")
    tl.store(part + ((split * BH + bh) * M + m[:, None]) * D + ch[None, :], acc, mask=m[:, None] < M)


def supports(head_dim: int) -> bool:
    """The kernels tile whole heads: head_dim must be a power of two, at least 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def _args(x: Packed):
    return (x.tmin, x.tstep, x.pmin, x.pwidth, x.poff, x.data, x.data.numel(), x.n, x.tmin.shape[1])


def qk(q: torch.Tensor, k: Packed, out: torch.Tensor | None = None) -> torch.Tensor:
    """Scores ``q [BH, M, D] @ k_hat^T -> [BH, M, n]`` fp32, decoding ``k`` in registers."""
    BH, M, D = q.shape
    out = torch.empty(BH, M, k.n, dtype=torch.float32, device=q.device) if out is None else out
    if k.n:
        grid = (BH, triton.cdiv(k.n, BLOCK_T))
        _qk_kernel[grid](q.float().contiguous(), out, *_args(k), M, D=D,
                         BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_T=BLOCK_T)
    return out


def pv(p: torch.Tensor, v: Packed, out: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """``p [BH, M, n] @ v_hat -> [BH, M, D]`` fp32, decoding ``v`` in registers."""
    BH, M, n = p.shape
    D = v.pmin.shape[-1]
    n_tiles = triton.cdiv(n, BLOCK_T)
    splits = max(1, min(n_tiles, splits or triton.cdiv(n_tiles, 8)))
    tiles = triton.cdiv(n_tiles, splits)
    part = torch.empty(splits, BH, M, D, dtype=torch.float32, device=p.device)
    _pv_kernel[(BH, splits)](p.float().contiguous(), part, *_args(v), M, BH, tiles, D=D,
                             BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_T=BLOCK_T)
    return torch.sum(part, 0, out=out)


assert PACK == 16  # _decode_tile hard-codes 16-token packs
