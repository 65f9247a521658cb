"""PackKV attention products in Triton, decompressing the packed cache in registers.

Same format and signatures as ``packkv_ref.qk`` / ``packkv_ref.pv`` (the format is described
there). One tile is ``BLOCK_T = 64`` stored slots x D channels of one row ``bh``; a thread block
decodes it straight from the bit stream::

    pmin, w     = the f-bit field c of pmeta[row(s)]    row(s) = s // 16, i(s) = s % 16
    word[s, c]  = poff[row(s)] + sum_{c'<c} w[s, c'] + (i(s) * w[s, c]) // 16
    rest[s, c]  = (data[word] | data[word + 1] << 16) >> ((i(s) * w) % 16)  &  (2^w - 1)
    x_hat[s, c] = tmin[s] + 2^(lstep[s] / 8) * (pmin + rest[s, c])

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

from compress.kernels.packkv_ref import PACK, STEPS_PER_OCTAVE, Packed

BLOCK_T = 64
STEPS = tl.constexpr(
    STEPS_PER_OCTAVE
)  # a global a compiled kernel may read (annotating it is not enough)


@triton.jit
def _bits(words, idx, n_words, bitpos, width, mask):
    """The ``width``-bit field at ``bitpos`` of the little-endian 16-bit ``words[idx],
    words[idx + 1]``."""
    lo = tl.load(words + idx, mask=mask, other=0).to(tl.int32) & 0xFFFF
    hi = tl.load(words + idx + 1, mask=mask & (idx + 1 < n_words), other=0).to(tl.int32) & 0xFFFF
    return ((lo | (hi << 16)) >> (bitpos & 15)) & ((1 << width) - 1)


@triton.jit
def _decode_tile(
    tmin,
    lstep,
    pmeta,
    poff,
    data,
    n_words,
    n,
    cap,
    meta_words,
    mbits,
    fbits,
    bh,
    s0,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """``x_hat [BLOCK_T, D]`` fp32 of slots ``s0 ..`` of row ``bh``; zeros past ``n``."""
    slot = s0 + tl.arange(0, BLOCK_T)
    ok = (slot < n)[:, None]
    row = bh * (cap // 16) + slot // 16
    mpos = tl.arange(0, D)[None, :] * fbits
    meta = _bits(pmeta + row[:, None] * meta_words, mpos >> 4, meta_words, mpos, fbits, ok)
    pmin, w = meta & ((1 << mbits) - 1), meta >> mbits
    bitpos = (slot % 16)[:, None] * w
    first = tl.load(poff + row, mask=slot < n, other=0)[:, None] + tl.cumsum(w, axis=1) - w
    code = pmin + _bits(data, first + (bitpos >> 4), n_words, bitpos, w, ok)
    mn = tl.load(tmin + bh * cap + slot, mask=slot < n, other=0.0).to(tl.float32)
    st = tl.exp2(tl.load(lstep + bh * cap + slot, mask=slot < n, other=0).to(tl.float32) / STEPS)
    return mn[:, None] + st[:, None] * code.to(tl.float32)


@triton.jit
def _qk_kernel(
    q,
    out,
    tmin,
    lstep,
    pmeta,
    poff,
    data,
    n_words,
    n,
    cap,
    meta_words,
    mbits,
    fbits,
    M,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    bh, s0 = tl.program_id(0), tl.program_id(1) * BLOCK_T
    x = _decode_tile(
        tmin,
        lstep,
        pmeta,
        poff,
        data,
        n_words,
        n,
        cap,
        meta_words,
        mbits,
        fbits,
        bh,
        s0,
        D,
        BLOCK_T,
    )
    m, ch = tl.arange(0, BLOCK_M), tl.arange(0, D)
    qt = tl.load(q + (bh * M + m[:, None]) * D + ch[None, :], mask=m[:, None] < M, other=0.0)
    s = tl.dot(qt, tl.trans(x), input_precision="ieee")
    slot = s0 + tl.arange(0, BLOCK_T)
    tl.store(
        out + (bh * M + m[:, None]) * n + slot[None, :],
        s,
        mask=(m[:, None] < M) & (slot[None, :] < n),
    )


@triton.jit
def _pv_kernel(
    p,
    part,
    tmin,
    lstep,
    pmeta,
    poff,
    data,
    n_words,
    n,
    cap,
    meta_words,
    mbits,
    fbits,
    M,
    BH,
    tiles,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    bh, split = tl.program_id(0), tl.program_id(1)
    m, ch = tl.arange(0, BLOCK_M), tl.arange(0, D)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for t in range(split * tiles, (split + 1) * tiles):
        s0 = t * BLOCK_T
        x = _decode_tile(
            tmin,
            lstep,
            pmeta,
            poff,
            data,
            n_words,
            n,
            cap,
            meta_words,
            mbits,
            fbits,
            bh,
            s0,
            D,
            BLOCK_T,
        )
        slot = s0 + tl.arange(0, BLOCK_T)
        pt = tl.load(
            p + (bh * M + m[:, None]) * n + slot[None, :],
            mask=(m[:, None] < M) & (slot[None, :] < n),
            other=0.0,
        )
        acc += tl.dot(pt, x, input_precision="ieee")
    tl.store(
        part + ((split * BH + bh) * M + m[:, None]) * D + ch[None, :], acc, mask=m[:, None] < M
    )


def supports(head_dim: int) -> bool:
    """The kernels tile whole heads: head_dim must be a power of two, at least 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def _args(x: Packed):
    return (
        x.tmin,
        x.lstep,
        x.pmeta,
        x.poff,
        x.data,
        x.data.numel(),
        x.n,
        x.tmin.shape[1],
        x.pmeta.shape[-1],
        x.mbits,
        x.fbits,
    )


def qk(q: torch.Tensor, k: Packed, out: torch.Tensor | None = None) -> torch.Tensor:
    """Scores ``q [BH, M, D] @ k_hat^T -> [BH, M, n]`` fp32, decoding ``k`` in registers."""
    BH, M, D = q.shape
    out = torch.empty(BH, M, k.n, dtype=torch.float32, device=q.device) if out is None else out
    if k.n:
        grid = (BH, triton.cdiv(k.n, BLOCK_T))
        _qk_kernel[grid](
            q.float().contiguous(),
            out,
            *_args(k),
            M,
            D=D,
            BLOCK_M=max(16, triton.next_power_of_2(M)),
            BLOCK_T=BLOCK_T,
        )
    return out


def pv(
    p: torch.Tensor, v: Packed, out: torch.Tensor | None = None, splits: int | None = None
) -> torch.Tensor:
    """``p [BH, M, n] @ v_hat -> [BH, M, D]`` fp32, decoding ``v`` in registers."""
    BH, M, n = p.shape
    D = v.dim
    n_tiles = triton.cdiv(n, BLOCK_T)
    splits = max(1, min(n_tiles, splits or triton.cdiv(n_tiles, 8)))
    tiles = triton.cdiv(n_tiles, splits)
    part = torch.empty(splits, BH, M, D, dtype=torch.float32, device=p.device)
    _pv_kernel[(BH, splits)](
        p.float().contiguous(),
        part,
        *_args(v),
        M,
        BH,
        tiles,
        D=D,
        BLOCK_M=max(16, triton.next_power_of_2(M)),
        BLOCK_T=BLOCK_T,
    )
    return torch.sum(part, 0, out=out)


assert PACK == 16  # _decode_tile hard-codes 16-token packs
