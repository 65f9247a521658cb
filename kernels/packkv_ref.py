"""PackKV (arXiv 2512.24449) storage format and its pure-PyTorch attention products.

Quantization, per token ``s`` of one head (``x [T, D]``, K after RoPE, or V)::

    step[s] = rel * (max_c x[s, c] - min_c x[s, c])
    code[s, c] = round((x[s, c] - min_c x[s, c]) / step[s])        in 0 .. ceil(1/rel)
    x_hat[s, c] = tmin[s] + tstep[s] * code[s, c],    |x - x_hat| <= tstep[s] / 2

Bit packing, per pack ``r`` = 16 consecutive stored tokens x 1 channel ``c``::

    code[16r + i, c] = pmin[r, c] + rest[i],    0 <= rest[i] < 2 ** width[r, c]
    width[r, c] = bit length of max_i code - min_i code (0 when the pack is constant)

Memory layout of one ``Packed`` tensor (K or V of one layer), ``BH = batch * kv_heads``,
``cap`` the token capacity, slots ``0 .. n-1`` in use::

    tmin, tstep : fp16  [BH, cap]          per-token minimum and step
    pmin        : uint8 [BH, cap/16, D]    per-pack minimum code
    pwidth      : uint8 [BH, cap/16, D/2]  per-pack width, channel 2j in the low nibble of byte j
    poff        : int32 [BH, cap/16]       first word of pack row r (16 tokens x D channels)
    data        : int16 [words]            the bit stream, grown one block at a time

Pack (r, c) holds ``width[r, c]`` words starting at ``poff[r] + sum_{c'<c} width[r, c']``:
rest[i] sits at bits ``[i*w, (i+1)*w)`` of that 16w-bit little-endian string, so a
code straddles at most two 16-bit words. ``data`` ends with a zero guard word, so that
a constant pack (width 0) at the very end still points inside it.

``qk`` and ``pv`` here unpack into a scratch tensor and call matmul; the Triton kernels in
``packkv.py`` compute the same products decoding in registers.
"""

from dataclasses import dataclass

import torch

PACK = 16  # tokens per pack
MAX_CODE = 255  # codes are stored in uint8 minima, so 1/rel <= 254


def bit_width(m: torch.Tensor) -> torch.Tensor:
    """Bit length of non-negative ints ``m`` <= 255: 0 -> 0, 1 -> 1, 2..3 -> 2, ..., 128..255 -> 8."""
    pow2 = 2 ** torch.arange(8, device=m.device)
    return (m.unsqueeze(-1) >= pow2).sum(-1)


def quantize_tokens(x: torch.Tensor, rel: float):
    """Error-bounded per-token quantization of ``x [..., T, D]``: ``(codes int64, tmin fp16, tstep fp16)``.

    The fp16 minimum and step are used to compute the codes, so the bound
    ``|x - x_hat| <= tstep / 2`` holds for the stored values.
    """
    x = x.float()
    lo, hi = x.amin(-1), x.amax(-1)
    tmin = lo.half()
    tstep = ((hi - lo) * rel).clamp(min=2.0 ** -14).half()
    codes = torch.round((x - tmin.float()[..., None]) / tstep.float()[..., None])
    return codes.clamp(0, MAX_CODE).long(), tmin, tstep


def pack_rows(codes: torch.Tensor):
    """Bit-pack ``codes [N, 16, D]`` (ints in 0..255): ``(pmin [N, D], width [N, D], words int64 [W])``.

    ``words`` holds the N pack rows back to back, each channel's ``width`` words in turn.
    """
    N, P, D = codes.shape
    pmin = codes.amin(1)
    width = bit_width(codes.amax(1) - pmin)                                  # [N, D]
    rest = (codes - pmin[:, None]).transpose(1, 2)                            # [N, D, 16]
    bitpos = torch.arange(P, device=codes.device) * width[..., None]          # [N, D, 16]
    shifted = rest << (bitpos % 16)
    words = torch.zeros(N, D, 9, dtype=torch.int64, device=codes.device)     # 16 * 8 bits + carry
    words.scatter_add_(2, bitpos // 16, shifted & 0xFFFF)
    words.scatter_add_(2, bitpos // 16 + 1, shifted >> 16)
    used = torch.arange(9, device=codes.device) < width[..., None]
    return pmin, width, words[used]


def nibbles(width: torch.Tensor) -> torch.Tensor:
    """Widths ``[..., D]`` (0..8) to bytes ``[..., D/2]``: channel 2j low nibble, 2j+1 high."""
    return (width[..., 0::2] | (width[..., 1::2] << 4)).to(torch.uint8)


def to_int16(words: torch.Tensor) -> torch.Tensor:
    """16-bit unsigned words (int64 0..65535) as int16 bit patterns."""
    return (words - ((words >> 15) << 16)).to(torch.int16)


@dataclass
class Packed:
    """One PackKV-compressed tensor ``[BH, n, D]`` (layout in the module docstring)."""

    tmin: torch.Tensor
    tstep: torch.Tensor
    pmin: torch.Tensor
    pwidth: torch.Tensor
    poff: torch.Tensor
    data: torch.Tensor
    n: int = 0

    @classmethod
    def empty(cls, bh: int, cap: int, d: int, device="cpu") -> "Packed":
        rows = cap // PACK
        return cls(tmin=torch.zeros(bh, cap, dtype=torch.float16, device=device),
                   tstep=torch.zeros(bh, cap, dtype=torch.float16, device=device),
                   pmin=torch.zeros(bh, rows, d, dtype=torch.uint8, device=device),
                   pwidth=torch.zeros(bh, rows, d // 2, dtype=torch.uint8, device=device),
                   poff=torch.zeros(bh, rows, dtype=torch.int32, device=device),
                   data=torch.zeros(1, dtype=torch.int16, device=device))

    def append(self, codes: torch.Tensor, tmin: torch.Tensor, tstep: torch.Tensor) -> None:
        """Store ``codes [BH, T, D]`` (T a multiple of 16) with their per-token ``tmin``, ``tstep`` [BH, T]."""
        bh, T, D = codes.shape
        s, r = self.n, self.n // PACK
        pmin, width, words = pack_rows(codes.reshape(bh * T // PACK, PACK, D))
        sizes = width.sum(-1)
        offs = self.data.numel() - 1 + sizes.cumsum(0) - sizes
        self.tmin[:, s:s + T], self.tstep[:, s:s + T] = tmin, tstep
        self.pmin[:, r:r + T // PACK] = pmin.view(bh, -1, D).to(torch.uint8)
        self.pwidth[:, r:r + T // PACK] = nibbles(width).view(bh, -1, D // 2)
        self.poff[:, r:r + T // PACK] = offs.view(bh, -1).to(torch.int32)
        self.data = torch.cat([self.data[:-1], to_int16(words), self.data[-1:]])
        self.n += T

    def nbytes(self) -> int:
        """Bytes held for the ``n`` stored tokens: per-token and per-pack metadata plus the bit stream."""
        bh, rows = self.tmin.shape[0], self.n // PACK
        per_token = self.tmin[:, :self.n].nbytes + self.tstep[:, :self.n].nbytes
        per_pack = self.pmin[:, :rows].nbytes + self.pwidth[:, :rows].nbytes + self.poff[:, :rows].nbytes
        return per_token + per_pack + self.data.nbytes


def unpack_codes(p: Packed) -> torch.Tensor:
    """Codes ``[BH, n, D]`` (int32) of the ``n`` stored tokens: the inverse of :func:`pack_rows`."""
    bh, rows, D = p.tmin.shape[0], p.n // PACK, p.pmin.shape[-1]
    wb = p.pwidth[:, :rows].int()
    width = torch.stack([wb & 15, wb >> 4], -1).flatten(-2)                          # [BH, rows, D]
    first = p.poff[:, :rows, None] + width.cumsum(-1, dtype=torch.int32) - width     # first word of each pack
    d = p.data.int() & 0xFFFF
    pairs = d | torch.cat([d[1:], d[:1] * 0]) << 16                                   # word j and j+1
    bitpos = torch.arange(PACK, dtype=torch.int32, device=wb.device)[:, None] * width[:, :, None]
    idx = (bitpos >> 4).add_(first[:, :, None]).long()                               # [BH, rows, 16, D]
    rest = pairs[idx].bitwise_right_shift_(bitpos.bitwise_and_(15)).bitwise_and_(((1 << width) - 1)[:, :, None])
    return rest.add_(p.pmin[:, :rows, None]).view(bh, rows * PACK, D)


def dequantize(p: Packed) -> torch.Tensor:
    """``x_hat [BH, n, D]`` fp32 = tmin + tstep * code."""
    n = p.n
    return p.tmin[:, :n, None].float() + p.tstep[:, :n, None].float() * unpack_codes(p).float()


def qk(q: torch.Tensor, k: Packed, out: torch.Tensor | None = None) -> torch.Tensor:
    """Scores ``q [BH, M, D] @ k_hat^T -> [BH, M, n]`` (fp32), through a scratch copy of ``k_hat``."""
    return torch.matmul(q.float(), dequantize(k).transpose(1, 2), out=out)


def pv(p: torch.Tensor, v: Packed, out: torch.Tensor | None = None) -> torch.Tensor:
    """``p [BH, M, n] @ v_hat -> [BH, M, D]`` (fp32), through a scratch copy of ``v_hat``."""
    return torch.matmul(p.float(), dequantize(v), out=out)
