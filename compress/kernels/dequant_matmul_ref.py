"""Reference dequant-matmul, decoded straight from the packed-format spec.

    y = x @ W_hat^T,   W_hat[o, i] = (q[i, o] - z[i // g, o]) * s[i // g, o]

Bit ``p*i .. p*i+p-1`` of word ``j`` of a ``p``-bit plane holds column
``(32/p)*j + i`` (natural order), or ``8*j + AWQ_ORDER[i]`` for AWQ INT4;
planes hold consecutive bit slices of the code, low bits first. Plain
PyTorch in any float dtype (float64 for the tests); slow, for checking the
kernels. It decodes on its own, without the unpacking of ``compress.layers``.
"""

import torch

from compress.formats.awq_gemm import AWQ_ORDER
from compress.kernels.layout import planes


def _decode_plane(words: torch.Tensor, p: int, awq: bool) -> torch.Tensor:
    """int32 ``[rows, cols*p/32]`` -> int64 ``[rows, cols]`` codes of one ``p``-bit plane."""
    per = 32 // p
    u = words.to(torch.int64) & 0xFFFFFFFF  # the word as unsigned
    out = torch.empty(words.shape[0], words.shape[1] * per, dtype=torch.int64, device=words.device)
    for i in range(per):
        col = AWQ_ORDER[i] if awq else i
        out[:, col::per] = (u >> (p * i)) & ((1 << p) - 1)
    return out


def decode(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``q [in, out]`` and zero points ``z [in/g, out]`` (int64) of a ``QuantLinear``."""
    q = z = 0
    lo = 0
    for p, qw, qz in planes(layer):
        q = q + (_decode_plane(qw, p, layer.format == "awq") << lo)
        z = z + (_decode_plane(qz, p, layer.format == "awq") << lo)
        lo += p
    return q, z


def dequantize_ref(layer, dtype=torch.float64) -> torch.Tensor:
    """``W_hat [out, in]`` in ``dtype``."""
    q, z = decode(layer)
    g = layer.group_size
    s = layer.scales.to(dtype).repeat_interleave(g, dim=0)
    return ((q - z.repeat_interleave(g, dim=0)).to(dtype) * s).t()


def dequant_matmul_ref(x: torch.Tensor, layer, dtype=torch.float64) -> torch.Tensor:
    """``x [M, in] @ W_hat^T`` computed in ``dtype``."""
    return x.to(dtype) @ dequantize_ref(layer, dtype).t()
