"""Group-wise uniform quantization of a weight matrix ``W [out, in]``.

Each group is ``group_size`` consecutive input channels of one output row.

Asymmetric (zero point), as AutoAWQ's ``pseudo_quantize_tensor``::

    s = (max - min) / (2^b - 1)          (stored as fp16)
    z = clamp(round(-min / s), 0, 2^b - 1)
    q = clamp(round(W / s) + z, 0, 2^b - 1)
    W_hat = (q - z) * s

Symmetric: ``s = absmax / (2^(b-1) - 1)``, ``z = 2^(b-1)`` fixed, same storage.

The scale is rounded to fp16 *before* the codes are computed, so that the
dequantized weight of the saved checkpoint is exactly ``W_hat``.
"""

from dataclasses import dataclass

import torch

from compress.errors import CompressError


@dataclass
class QuantizedWeight:
    """Codes and group parameters of one ``[out, in]`` weight."""

    q: torch.Tensor  # int32 [out, in], values in [0, 2^bits)
    scales: torch.Tensor  # fp16 [out, in/g]
    zeros: torch.Tensor  # int32 [out, in/g]
    bits: int
    group_size: int

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        g = self.group_size
        z = self.zeros.repeat_interleave(g, dim=1)
        s = self.scales.to(dtype).repeat_interleave(g, dim=1)
        return (self.q - z).to(dtype) * s


def check_divides(name: str, in_features: int, group_size: int) -> None:
    """``group_size`` divides layer ``name``'s ``in_features`` (-1: one group per row)."""
    if group_size == -1:  # one group per row (per-channel), GPTQ/AutoAWQ's convention
        return
    if group_size <= 0 or in_features % group_size:
        raise CompressError(
            f"group size {group_size} does not divide layer '{name}' "
            f"(in_features={in_features}). Pick a group size that divides every quantized "
            f"layer's in_features, group_size=auto (128, else 64, else 32), or -1 (one scale per row)."
        )


def auto_group_size(in_features: list[int]) -> int:
    """128 where it divides every in_features, else the largest of 64 and 32 that does."""
    for g in (128, 64, 32):
        if all(k % g == 0 for k in in_features):
            return g
    raise CompressError(
        f"no group size among 128, 64, 32 divides every quantized layer's in_features "
        f"({sorted(set(in_features))}); set an explicit group size that does."
    )


def _group_view(w: torch.Tensor, group_size: int) -> torch.Tensor:
    out, k = w.shape
    return w.reshape(out, k // group_size, group_size)


def quantize(
    w: torch.Tensor,
    bits: int,
    group_size: int,
    symmetric: bool = False,
    clip_max: torch.Tensor | None = None,
) -> QuantizedWeight:
    """Quantize ``w [out, in]``. ``clip_max [out, in/g]``, if given, bounds |w| first (AWQ clip).

    ``group_size=-1`` is one group per row (per-channel scales).
    """
    if not 2 <= bits <= 8:
        raise CompressError(f"bits must be between 2 and 8, got {bits}")
    out, k = w.shape
    group_size = k if group_size == -1 else group_size
    wg = _group_view(w.float(), group_size)
    if clip_max is not None:
        c = clip_max.float().unsqueeze(-1)
        wg = torch.maximum(torch.minimum(wg, c), -c)
    s, z = group_params(wg, bits, symmetric)
    q = codes(wg, s.unsqueeze(-1), z.unsqueeze(-1), bits)
    return QuantizedWeight(
        q=q.reshape(out, k).to(torch.int32),
        scales=s.half(),
        zeros=z.to(torch.int32),
        bits=bits,
        group_size=group_size,
    )


def group_params(wg: torch.Tensor, bits: int, symmetric: bool = False):
    """``(s, z)``, each ``wg.shape[:-1]``, of the groups along ``wg``'s last axis (the grid of the
    module docstring; ``s`` rounded to fp16, then back to ``wg``'s float dtype)."""
    qmax = 2**bits - 1
    if symmetric:
        s = wg.abs().amax(-1).clamp(min=1e-5) / (2 ** (bits - 1) - 1)
        s = s.half().to(wg.dtype)
        z = torch.full_like(s, 2 ** (bits - 1))
    else:
        hi, lo = wg.amax(-1), wg.amin(-1)
        s = ((hi - lo).clamp(min=1e-5) / qmax).half().to(wg.dtype)
        z = (-torch.round(lo / s)).clamp(0, qmax)
    return s, z


def codes(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int) -> torch.Tensor:
    """``clamp(round(w / s) + z, 0, 2^b - 1)`` (float), ``s`` and ``z`` broadcast against ``w``."""
    return (torch.round(w / s) + z).clamp(0, 2**bits - 1)


def fake_quantize(
    w: torch.Tensor,
    bits: int,
    group_size: int,
    symmetric: bool = False,
    clip_max: torch.Tensor | None = None,
) -> torch.Tensor:
    """``W_hat`` in ``w``'s dtype: quantize then dequantize."""
    return quantize(w, bits, group_size, symmetric, clip_max).dequantize(torch.float32).to(w.dtype)


def check_bits(bits, key: str) -> None:
    """A bit width from 2 to 8."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise CompressError(f"{key}={bits!r}: the bit width is an integer from 2 to 8.")


def check_group_size(group_size, in_features: dict[str, int], key: str) -> None:
    """``auto``, -1 or a power of two that divides every quantized layer's in_features."""

    if group_size in ("auto", None, -1):
        if group_size == "auto" and in_features:
            auto_group_size(list(in_features.values()))
        return
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, int)
        or group_size < 2
        or group_size & (group_size - 1)
    ):
        raise CompressError(
            f"{key}={group_size!r}: the group size is auto (128, else 64, else 32), -1 "
            f"(one scale per output row) or a power of two such as 32, 64 or 128."
        )
    for name, k in in_features.items():
        check_divides(name, k, group_size)
