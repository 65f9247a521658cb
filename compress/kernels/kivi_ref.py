"""KIVI (Liu et al. 2024) storage layout of one layer, and its pure-PyTorch attention products.

Per row ``bh`` (batch x KV head), ``cap`` token slots of which ``0 .. n-1`` are in use, ``b``
bits, ``G`` the group size::

    codes        int32 [BH, cap, D b / 32]  word j of token t holds channel (32 / b) j + i at
                                            bits [b i, b i + b)  (compress.formats.bitplanes)
    K zero/scale fp16  [BH, cap / G, D]     per G-token group and channel:
                                            K_hat[t, c] = z[t // G, c] + s[t // G, c] code[t, c]
    V zero/scale fp16  [BH, cap, D / G]     per token and G-channel group:
                                            V_hat[t, c] = z[t, c // G] + s[t, c // G] code[t, c]

``qk`` and ``pv`` here dequantize into a scratch tensor (in the query's dtype) and call matmul;
``kivi_cpu.py`` computes the same products reading the codes in place.
"""

import torch

from compress.formats.bitplanes import unpack_planes


def codes(words: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """int32 codes ``[BH, n, D]`` of tokens ``0 .. n-1``."""
    BH, _, W = words.shape
    flat = words[:, :n].reshape(BH * n, W)
    return unpack_planes({f"w{bits}": flat}, bits).view(BH, n, -1)


def k_hat(words, zero, scale, n: int, bits: int, dtype=torch.float32) -> torch.Tensor:
    """``K_hat [BH, n, D]`` in ``dtype``: zero and scale per group of ``cap / zero.shape[1]``
    tokens."""
    G = words.shape[1] // zero.shape[1]
    z, s = (t[:, : n // G].repeat_interleave(G, 1).to(dtype) for t in (zero, scale))
    return z + s * codes(words, n, bits).to(dtype)


def v_hat(words, zero, scale, n: int, bits: int, dtype=torch.float32) -> torch.Tensor:
    """``V_hat [BH, n, D]`` in ``dtype``: zero and scale per group of ``D / zero.shape[2]``
    channels."""
    c = codes(words, n, bits)
    G = c.shape[2] // zero.shape[2]
    z, s = (t[:, :n].repeat_interleave(G, 2).to(dtype) for t in (zero, scale))
    return z + s * c.to(dtype)


def qk(q: torch.Tensor, words, zero, scale, n: int, bits: int) -> torch.Tensor:
    """Scores ``q [BH, M, D] @ K_hat^T -> [BH, M, n]`` in ``q``'s dtype."""
    return q @ k_hat(words, zero, scale, n, bits, q.dtype).transpose(1, 2)


def pv(p: torch.Tensor, words, zero, scale, n: int, bits: int) -> torch.Tensor:
    """``p [BH, M, n] @ V_hat -> [BH, M, D]`` in ``p``'s dtype."""
    return p @ v_hat(words, zero, scale, n, bits, p.dtype)
