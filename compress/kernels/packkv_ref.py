"""PackKV (arXiv 2512.24449) storage format and its pure-PyTorch attention products.

Quantization, per token ``s`` of one head (``x [T, D]``, K after RoPE, or V)::

    step[s] = rel * (max_c x[s, c] - min_c x[s, c])
    lstep[s] = floor(8 log2 step[s])                    int8: the step, rounded down to 2^(1/8)
    tstep[s] = 2 ** (lstep[s] / 8)                      in (step / 1.091, step]
    code[s, c] = round((x[s, c] - tmin[s]) / tstep[s])  in 0 .. cmax = ceil(1.091 / rel) + 1
    x_hat[s, c] = tmin[s] + tstep[s] * code[s, c],    |x - x_hat| <= tstep[s] / 2 <= step[s] / 2

with ``tmin`` the fp16 minimum. The step costs one byte instead of fp16's two; rounding it
down keeps the error bound, for at most 2^(1/8) more codes.

Bit packing, per pack ``r`` = 16 consecutive stored tokens x 1 channel ``c``::

    code[16r + i, c] = pmin[r, c] + rest[i],    0 <= rest[i] < 2 ** width[r, c]
    width[r, c] = bit length of max_i code - min_i code (0 when the pack is constant)

Memory layout of one ``Packed`` tensor (K or V of one layer), ``BH = batch * kv_heads``,
``cap`` the token capacity, slots ``0 .. n-1`` in use, ``m`` = bit length of cmax and
``f = m + bit length of m`` (7 bits for rel = 0.1)::

    tmin        : fp16  [BH, cap]                   per-token minimum
    lstep       : int8  [BH, cap]                   per-token step, tstep = 2^(lstep/8)
    pmeta       : int16 [BH, cap/16, ceil(D f/16)]  per pack the f-bit field pmin | width << m,
                                                    channel c at bits [c f, (c+1) f) of its row
    poff        : int32 [BH, cap/16]                first word of pack row r
                                                    (16 tokens x D channels)
    data        : int16 [words]                     the bit stream, grown by appends, cut back
                                                    by truncate

Pack (r, c) holds ``width[r, c]`` words starting at ``poff[r] + sum_{c'<c} width[r, c']``:
rest[i] sits at bits ``[i*w, (i+1)*w)`` of that 16w-bit little-endian string. Every field
and code straddles at most two 16-bit words. Once anything is stored ``data`` ends with a
zero guard word, so that a constant pack (width 0) at the very end still points inside it.

``qk`` and ``pv`` here unpack into a scratch tensor and call matmul; the Triton kernels in
``packkv.py`` compute the same products decoding in registers.
"""

import math
from dataclasses import dataclass

import torch

PACK = 16  # tokens per pack
MAX_CODE = 255  # codes and pack minima fit 8 bits


def bit_width(m: torch.Tensor) -> torch.Tensor:
    """Bit length of non-negative ints ``m`` <= 255: 0 -> 0, 1 -> 1, 2..3 -> 2, ...,
    128..255 -> 8."""
    pow2 = 2 ** torch.arange(8, device=m.device)
    return (m.unsqueeze(-1) >= pow2).sum(-1)


STEPS_PER_OCTAVE = 8  # lstep's resolution: the stored step is within 2^(1/8) below rel * range
MIN_LSTEP = -14 * STEPS_PER_OCTAVE  # steps below 2^-14 (fp16's normal range) are raised to it
MIN_REL = 2 ** (1 / STEPS_PER_OCTAVE) / (MAX_CODE - 1)  # the finest rel whose codes fit 8 bits


def max_code(rel: float) -> int:
    """Largest code of ``rel``: the range over the stored step (up to 2^(1/8)/rel), plus one for
    fp16 rounding."""
    return min(math.ceil(2 ** (1 / STEPS_PER_OCTAVE) / rel) + 1, MAX_CODE)


def step_of(lstep: torch.Tensor) -> torch.Tensor:
    """``tstep = 2^(lstep / 8)``, fp32."""
    return torch.exp2(lstep.float() / STEPS_PER_OCTAVE)


def quantize_tokens(x: torch.Tensor, rel, cmax: torch.Tensor | None = None):
    """Error-bounded per-token quantization of ``x [..., T, D]``: ``(codes int64, tmin fp16,
    lstep int8)``.

    The stored minimum and step are used to compute the codes, so the bound
    ``|x - x_hat| <= tstep / 2 <= rel * range / 2`` holds for the stored values. ``rel`` is a
    float, or an fp32 tensor broadcasting against ``x[..., 0]`` with ``cmax`` (its
    :func:`max_code`, fp32) beside it: K and V, stacked, quantized in one pass.
    """
    x = x.float()
    lo, hi = x.amin(-1), x.amax(-1)
    tmin = lo.half()
    step = ((hi - lo) * rel).clamp(min=2.0**-14)
    lstep = torch.floor(torch.log2(step) * STEPS_PER_OCTAVE).clamp(MIN_LSTEP, 127)
    lstep = lstep - (step_of(lstep) > step).float()  # log2's rounding must not put tstep above step
    codes = torch.round((x - tmin.float()[..., None]) / step_of(lstep)[..., None])
    if cmax is None:
        codes = codes.clamp(0, max_code(rel))
    else:
        codes = torch.minimum(codes.clamp_(min=0), cmax[..., None])
    return codes.long(), tmin, lstep.to(torch.int8)


def put_bits(vals: torch.Tensor, bitpos: torch.Tensor, n_words: int) -> torch.Tensor:
    """Little-endian 16-bit words ``[..., n_words]`` (int64) holding ``vals`` (< 2**12) at
    ``bitpos`` (both ``[..., K]``, bits along the last axis)."""
    shifted = vals << (bitpos % 16)
    words = torch.zeros(*vals.shape[:-1], n_words + 1, dtype=torch.int64, device=vals.device)
    words.scatter_add_(-1, bitpos // 16, shifted & 0xFFFF)  # bit ranges do not overlap: add is or
    words.scatter_add_(-1, bitpos // 16 + 1, shifted >> 16)
    return words[..., :n_words]


def word_pairs(words: torch.Tensor) -> torch.Tensor:
    """int32 ``word[j] | word[j+1] << 16`` along the last axis of int16 ``words`` (0 past the
    end)."""
    w = words.int() & 0xFFFF
    return w | torch.cat([w[..., 1:], torch.zeros_like(w[..., :1])], -1) << 16


def field(pairs: torch.Tensor, bitpos: torch.Tensor, width) -> torch.Tensor:
    """The ``width``-bit field at ``bitpos`` of the word pairs starting at its word."""
    return (pairs >> (bitpos & 15)) & ((1 << width) - 1)


def pack_rows(codes: torch.Tensor):
    """Bit-pack ``codes [N, 16, D]``: ``(pmin [N, D], width [N, D], words int64 [W])``.

    ``words`` holds the N pack rows back to back, each channel's ``width`` words in turn.
    """
    N, P, D = codes.shape
    pmin = codes.amin(1)
    width = bit_width(codes.amax(1) - pmin)  # [N, D]
    bitpos = torch.arange(P, device=codes.device) * width[..., None]  # [N, D, 16]
    words = put_bits((codes - pmin[:, None]).transpose(1, 2), bitpos, 8)  # [N, D, 8]
    return pmin, width, words[torch.arange(8, device=codes.device) < width[..., None]]


def to_int16(words: torch.Tensor) -> torch.Tensor:
    """16-bit unsigned words (int64 0..65535) as int16 bit patterns."""
    return (words - ((words >> 15) << 16)).to(torch.int16)


@dataclass
class Packed:
    """One PackKV-compressed tensor ``[BH, n, D]`` (layout in the module docstring)."""

    tmin: torch.Tensor
    lstep: torch.Tensor
    pmeta: torch.Tensor
    poff: torch.Tensor
    data: torch.Tensor
    dim: int  # D, channels per token
    mbits: int  # bits of a pack minimum; a pack's field is mbits + bit length of mbits
    n: int = 0

    @property
    def fbits(self) -> int:
        return self.mbits + self.mbits.bit_length()

    @classmethod
    def empty(cls, bh: int, cap: int, d: int, cmax: int = MAX_CODE, device="cpu") -> "Packed":
        """Room for ``cap`` tokens (a multiple of 16) of codes up to ``cmax``."""
        rows, mbits = cap // PACK, cmax.bit_length()
        meta_words = -(-d * (mbits + mbits.bit_length()) // 16)
        return cls(
            tmin=torch.zeros(bh, cap, dtype=torch.float16, device=device),
            lstep=torch.zeros(bh, cap, dtype=torch.int8, device=device),
            pmeta=torch.zeros(bh, rows, meta_words, dtype=torch.int16, device=device),
            poff=torch.zeros(bh, rows, dtype=torch.int32, device=device),
            data=torch.zeros(0, dtype=torch.int16, device=device),
            dim=d,
            mbits=mbits,
        )

    def append(self, codes: torch.Tensor, tmin: torch.Tensor, lstep: torch.Tensor) -> None:
        """Store ``codes [BH, T, D]`` (T a multiple of 16, codes < 2**mbits) with their per-token
        ``tmin``, ``lstep`` [BH, T]."""
        bh, T, D = codes.shape
        s, r, nr = self.n, self.n // PACK, T // PACK
        pmin, width, words = pack_rows(codes.reshape(bh * nr, PACK, D))
        meta_pos = (torch.arange(D, device=codes.device) * self.fbits).expand_as(pmin)
        meta = put_bits(pmin | width << self.mbits, meta_pos, self.pmeta.shape[-1])
        sizes = width.sum(-1)
        offs = max(self.data.numel() - 1, 0) + sizes.cumsum(0) - sizes
        self.tmin[:, s : s + T], self.lstep[:, s : s + T] = tmin, lstep
        self.pmeta[:, r : r + nr] = to_int16(meta).view(bh, nr, -1)
        self.poff[:, r : r + nr] = offs.view(bh, nr).to(torch.int32)
        guard = torch.zeros(1, dtype=torch.int16, device=words.device)
        self.data = torch.cat([self.data[:-1], to_int16(words), guard])
        self.n += T

    def pop(self, n: int):
        """``(codes uint8, tmin, lstep)`` of slots ``n ..``, which are then forgotten (see
        :meth:`truncate`)."""
        out = (
            unpack_codes(self, n).to(torch.uint8),
            self.tmin[:, n : self.n],
            self.lstep[:, n : self.n],
        )
        self.truncate(n)
        return out

    def truncate(self, n: int) -> None:
        """Forget slots ``n ..`` (``n`` a slot where an ``append`` began); the next append
        overwrites them.

        An append writes its pack rows head after head, so slot ``n``'s first word over all heads is
        where that append's words begin, and everything after it belongs to slots ``n ..``.
        """
        if n < self.n:
            end = int(self.poff[:, n // PACK].min())
            guard = torch.zeros(1, dtype=torch.int16, device=self.data.device)
            self.data = torch.cat([self.data[:end], guard])
            self.n = n

    def nbytes(self) -> int:
        """Bytes held for the ``n`` stored tokens: per-token and per-pack metadata plus the bit
        stream."""
        n, rows = self.n, self.n // PACK
        per_token = self.tmin[:, :n].nbytes + self.lstep[:, :n].nbytes
        per_pack = self.pmeta[:, :rows].nbytes + self.poff[:, :rows].nbytes
        return per_token + per_pack + self.data.nbytes


def unpack_meta(p: Packed, start: int = 0):
    """``(pmin, width)``, int32 ``[BH, rows, D]`` of the pack rows of slots ``start .. n-1``."""
    bitpos = torch.arange(p.dim, device=p.data.device, dtype=torch.int32) * p.fbits
    pairs = word_pairs(p.pmeta[:, start // PACK : p.n // PACK])
    fields = field(pairs[..., bitpos >> 4], bitpos, p.fbits)
    return fields & ((1 << p.mbits) - 1), fields >> p.mbits


def unpack_codes(p: Packed, start: int = 0) -> torch.Tensor:
    """Codes ``[BH, n - start, D]`` (int32) of slots ``start .. n-1`` (``start`` a multiple of 16):
    the inverse of :func:`pack_rows`."""
    bh, r0, r1 = p.tmin.shape[0], start // PACK, p.n // PACK
    pmin, width = unpack_meta(p, start)
    first = p.poff[:, r0:r1, None] + width.cumsum(-1, dtype=torch.int32) - width  # pack starts
    bitpos = torch.arange(PACK, dtype=torch.int32, device=width.device)[:, None] * width[:, :, None]
    idx = (bitpos >> 4).add_(first[:, :, None]).long()  # [BH, rows, 16, D]
    rest = field(word_pairs(p.data)[idx], bitpos, width[:, :, None])
    return rest.add_(pmin[:, :, None]).view(bh, (r1 - r0) * PACK, p.dim)


def values(codes: torch.Tensor, tmin: torch.Tensor, lstep: torch.Tensor) -> torch.Tensor:
    """``x_hat [..., T, D]`` fp32 = tmin + tstep * code, from per-token ``tmin``,
    ``lstep [..., T]``."""
    return tmin[..., None].float() + step_of(lstep[..., None]) * codes.float()


def dequantize(p: Packed) -> torch.Tensor:
    """``x_hat [BH, n, D]`` fp32 of the stored tokens."""
    return values(unpack_codes(p), p.tmin[:, : p.n], p.lstep[:, : p.n])


def order_greedy(codes: torch.Tensor, pack: int = PACK) -> torch.Tensor:
    """Permutation ``[N, T]`` of each block row of ``codes [N, T, C]`` (K and V codes side by
    side) filling packs of ``pack`` one token at a time.

    Each pack starts from the remaining token with the lowest (lower) median code, then takes,
    ``pack - 1`` times, the remaining token with the smallest
    ``key = sum_c bit_length(span_c) * 256 C + sum_c span_c``, ``span_c = max(hi_c, x_c) -
    min(lo_c, x_c)`` over the pack's channel ranges ``[lo, hi]``: the fewest bits, ties to the
    smallest growth of the ranges, then to the first token.
    """
    N, T, C = codes.shape
    x = codes.long()
    rows = torch.arange(N, device=codes.device)
    lengths = bit_width(torch.arange(MAX_CODE + 1, device=codes.device))
    seed_key = codes.median(-1).values.long()
    taken = torch.zeros(N, T, dtype=torch.bool, device=codes.device)
    perm = torch.empty(N, T, dtype=torch.long, device=codes.device)
    never = torch.iinfo(torch.long).max
    for s in range(T):
        if s % pack == 0:
            pick = seed_key.masked_fill(taken, never).argmin(-1)
            lo = hi = x[rows, pick]
        else:
            span = torch.maximum(hi[:, None], x) - torch.minimum(lo[:, None], x)  # [N, T, C]
            key = lengths[span].sum(-1) * (256 * C) + span.sum(-1)
            pick = key.masked_fill(taken, never).argmin(-1)
            lo, hi = torch.minimum(lo, x[rows, pick]), torch.maximum(hi, x[rows, pick])
        taken[rows, pick] = True
        perm[:, s] = pick
    return perm


def qk(q: torch.Tensor, k: Packed, out: torch.Tensor | None = None) -> torch.Tensor:
    """Scores ``q [BH, M, D] @ k_hat^T -> [BH, M, n]`` (fp32), through a scratch copy of
    ``k_hat``."""
    return torch.matmul(q.float(), dequantize(k).transpose(1, 2), out=out)


def pv(p: torch.Tensor, v: Packed, out: torch.Tensor | None = None) -> torch.Tensor:
    """``p [BH, M, n] @ v_hat -> [BH, M, D]`` (fp32), through a scratch copy of ``v_hat``."""
    return torch.matmul(p.float(), dequantize(v), out=out)
