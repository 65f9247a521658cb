"""Our bit-plane layout of integer codes (quant_method "compress", every width but INT4).

Codes ``q`` of shape ``[rows, N]`` with values in ``[0, 2**bits)`` are split into
power-of-two planes, widest first: 3 = 2 + 1, 5 = 4 + 1, 6 = 4 + 2, 7 = 4 + 2 + 1,
2 = 2, 8 = 8. Plane "w{p}" holds bit slice ``[lo, lo + p)`` of every code, where ``lo``
is the sum of the wider planes' widths (the widest plane holds bits 0..p-1)::

    packed["w{p}"][r, j] : int32, j in [0, N*p/32)
    bits p*i..p*i+p-1 of packed["w{p}"][r, j] = slice of q[r, (32/p)*j + i]

So INT3 = a 2-bit plane of the low bits (16 codes per int32) plus a 1-bit plane of
the high bit (32 codes per int32): exactly 3 bits per weight, and each plane is read
with one shift and one mask. As in AutoAWQ's GEMM format, rows are input channels
(or groups of them) and the *output* dimension is packed into int32 words.
"""

import torch


def check_codes(q: torch.Tensor, bits: int, per_word: int) -> None:
    """Raise ``ValueError`` unless ``q`` is 2-D with whole words of ``per_word`` columns."""
    if q.dim() != 2:
        raise ValueError(f"expected 2-D codes, got shape {tuple(q.shape)}")
    if q.shape[1] % per_word:
        raise ValueError(
            f"cannot pack {bits}-bit codes: the packed dimension {q.shape[1]} is not a "
            f"multiple of {per_word}"
        )


def pack_words(q: torch.Tensor, width: int) -> torch.Tensor:
    """Pack ``32/width`` consecutive columns of ``q`` (values < 2**width) into one int32."""
    per = 32 // width
    q = q.to(torch.int32).reshape(q.shape[0], -1, per)
    shifts = torch.arange(per, dtype=torch.int32, device=q.device) * width
    # int32 shifts wrap into the sign bit, which is what a packed word wants.
    return (q << shifts).sum(dim=-1, dtype=torch.int32)


def unpack_words(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_words`: int32 ``[rows, N*width/32]`` to int32 ``[rows, N]``."""
    per = 32 // width
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * width
    q = (packed.unsqueeze(-1) >> shifts) & ((1 << width) - 1)
    return q.reshape(packed.shape[0], -1)


def plane_widths(bits: int) -> list[int]:
    """Power-of-two planes of a width, in the order they take bits from the code.

    The widest plane holds the low bits: 3 -> [2, 1], 7 -> [4, 2, 1], 6 -> [4, 2].
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    return [p for p in (8, 4, 2, 1) if bits & p]


def pack_planes(q: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """Pack ``bits``-bit codes ``[rows, N]`` into bit planes ``{"w{p}": int32 [rows, N*p/32]}``."""
    check_codes(q, bits, 32)
    q = q.to(torch.int32)
    out, lo = {}, 0
    for p in plane_widths(bits):
        out[f"w{p}"] = pack_words((q >> lo) & ((1 << p) - 1), p)
        lo += p
    return out


def unpack_planes(planes: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_planes`: returns int32 codes ``[rows, N]``."""
    q, lo = None, 0
    for p in plane_widths(bits):
        part = unpack_words(planes[f"w{p}"], p) << lo
        q = part if q is None else q | part
        lo += p
    return q
