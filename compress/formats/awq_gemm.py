"""AutoAWQ's GEMM layout of INT4 codes (quant_method "awq", version "gemm").

Codes ``q`` of shape ``[rows, N]`` with values in ``[0, 16)``; rows are input channels
(or groups of them), and the *output* dimension is packed eight codes to an int32::

    packed[r, j] : int32, j in [0, N/8)
    nibble i (bits 4i..4i+3) of packed[r, j] = q[r, 8*j + AWQ_ORDER[i]]
    with AWQ_ORDER (0, 2, 4, 6, 1, 3, 5, 7): columns 0, 2, 4, 6 in the low nibbles

That is a 4-bit plane of :mod:`compress.formats.bitplanes` with the columns of each word
permuted by ``AWQ_ORDER``.
"""

import torch

from compress.formats.bitplanes import check_codes, pack_words, unpack_words

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8*j + AWQ_ORDER[i]
AWQ_REVERSE_ORDER = tuple(AWQ_ORDER.index(c) for c in range(8))  # column c sits in this nibble


def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes ``[rows, N]`` into AutoAWQ's int32 ``[rows, N/8]``."""
    check_codes(q, 4, 8)
    q = q.reshape(q.shape[0], -1, 8)[:, :, list(AWQ_ORDER)].reshape(q.shape[0], -1)
    return pack_words(q, 4)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_awq`: int32 ``[rows, N/8]`` to codes ``[rows, N]`` (int32)."""
    q = unpack_words(packed, 4)
    return q.reshape(q.shape[0], -1, 8)[:, :, list(AWQ_REVERSE_ORDER)].reshape(q.shape[0], -1)
