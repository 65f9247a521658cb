"""The ``compressed-tensors`` format, ``pack-quantized`` (what llm-compressor writes and vLLM and
transformers load natively: ``quant_method: compressed-tensors``).

Per quantized linear ``W [out, in]`` with ``b``-bit codes in groups of ``g`` input channels::

    weight_packed      int32 [out, ceil(in*b/32)]    codes packed along the input dimension
    weight_scale       float [out, in/g]
    weight_zero_point  int32 [ceil(out*b/32), in/g]  packed along the output dimension (asymmetric
                                                     only; symmetric schemes store none)
    weight_shape       int64 [2]                     (out, in)

    W_hat[o, i] = (q[o, i] - z[o, i // g]) * s[o, i // g]

with ``q`` and ``z`` the signed codes in ``[-2^(b-1), 2^(b-1))``. Packing is dense: element
``j`` of a packed row takes bits ``[j*b, j*b + b)`` of the row read as one little-endian bit
string of int32 words (an INT3 code may straddle two words), stored as ``q + 2^(b-1)``. That
stored value is compress's unsigned code (``compress.formats.quantizer``), so a checkpoint is
a repacking of the same codes, and a symmetric scheme's zero point is the constant
``2^(b-1)``.

The ``quantization_config`` names the schemes: ``config_groups`` each hold ``targets``
(``"Linear"``, a module name, or ``"re:<regex>"``) and ``weights`` arguments; ``ignore``
lists the modules left in floating point.
"""

import math
import re

import torch

from compress.errors import CompressError

METHOD = "compressed-tensors"
FORMAT = "pack-quantized"
NAMES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


def pack(q: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """Unsigned codes ``q`` (values in ``[0, 2^bits)``) packed densely into int32 along ``dim``."""
    q = q.to(torch.int64)
    if dim == 0:
        return pack(q.t(), bits).t().contiguous()
    rows, n = q.shape
    words = math.ceil(n * bits / 32)
    pos = torch.arange(n, device=q.device) * bits
    word, shift = pos // 32, pos % 32
    out = torch.zeros(rows, words + 1, dtype=torch.int64, device=q.device)
    out.index_add_(1, word, q << shift)  # low part (the bits of one code never overlap another's)
    out.index_add_(1, word + 1, q >> (32 - shift))  # the part that straddles into the next word
    out = out[:, :words] & 0xFFFFFFFF
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def unpack(packed: torch.Tensor, bits: int, n: int, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`pack`: the ``n`` unsigned codes along ``dim`` (int32)."""
    if dim == 0:
        return unpack(packed.t(), bits, n).t().contiguous()
    words = packed.to(torch.int64) & 0xFFFFFFFF
    words = torch.cat([words, torch.zeros_like(words[:, :1])], 1)  # the straddle of the last code
    pos = torch.arange(n, device=packed.device) * bits
    word, shift = pos // 32, pos % 32
    both = words[:, word] | (words[:, word + 1] << 32)
    return ((both >> shift) & ((1 << bits) - 1)).to(torch.int32)


def weights_args(bits: int, group_size: int, symmetric: bool = False) -> dict:
    """A scheme's ``weights`` arguments (compressed-tensors' ``QuantizationArgs``); group size -1
    is the ``channel`` strategy (one scale per output row)."""
    return {
        "num_bits": bits,
        "type": "int",
        "symmetric": symmetric,
        "group_size": None if group_size == -1 else group_size,
        "strategy": "channel" if group_size == -1 else "group",
        "dynamic": False,
        "actorder": None,
        "block_structure": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }


def quantization_config(
    bits: int, group_size: int, symmetric: bool = False, ignore=("lm_head",)
) -> dict:
    """config.json's ``quantization_config`` for W{bits}A16 group quantization, as llm-compressor
    writes it (act_order's static groups need no ``g_idx``, so ``actorder`` is null).

    An asymmetric scheme also says ``"dequantize": true``, which transformers reads as
    ``CompressedTensorsConfig(dequantize=True)``: its compressed path cannot take packed zero
    points (llm-compressor issue 1618), so it dequantizes at load; vLLM ignores the key."""
    return {
        "quant_method": METHOD,
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights_args(bits, group_size, symmetric),
                "input_activations": None,
                "output_activations": None,
                "format": FORMAT,
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "global_compression_ratio": None,
        **({} if symmetric else {"dequantize": True}),
    }


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def scheme(qcfg: dict, name: str) -> tuple[int, int, bool] | None:
    """``(bits, group_size, symmetric)`` of linear ``name`` under ``qcfg``, or None when it stays
    in floating point (ignored, or no group targets it). ``group_size`` -1: one group per row."""
    fmt = qcfg.get("format")
    if fmt != FORMAT:
        raise CompressError(
            f"quantization_config format '{fmt}': compress reads the compressed-tensors format "
            f"'{FORMAT}' (integer weights, 16-bit activations) only. Re-export the checkpoint "
            f"as W4A16 or W8A16 pack-quantized."
        )
    if any(_matches(p, name) for p in qcfg.get("ignore") or []):
        return None
    for group in (qcfg.get("config_groups") or {}).values():
        if not any(t == "Linear" or _matches(t, name) for t in group.get("targets") or []):
            continue
        w = group.get("weights") or {}
        if group.get("input_activations") or w.get("type", "int") != "int":
            raise CompressError(
                f"layer '{name}': compressed-tensors scheme {w} quantizes activations or "
                f"uses float weights; compress reads integer weight-only schemes (W4A16, W8A16)."
            )
        strategy, g = w.get("strategy"), w.get("group_size")
        if strategy == "channel":
            g = -1
        elif strategy != "group" or not isinstance(g, int) or g <= 0:
            raise CompressError(
                f"layer '{name}': compressed-tensors weight strategy '{strategy}' (group size "
                f"{g}); compress reads 'group' and 'channel' strategies."
            )
        bits = w.get("num_bits")
        if not isinstance(bits, int) or not 2 <= bits <= 8:
            raise CompressError(f"layer '{name}': num_bits {bits!r}; compress reads 2 to 8 bits.")
        return bits, g, bool(w.get("symmetric", True))
    return None


def encode(q, zeros, scales, bits: int, symmetric: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of one layer from unsigned codes ``q [out, in]``, ``zeros`` and ``scales``
    ``[out, in/g]``."""
    out = {
        "weight_packed": pack(q, bits, 1),
        "weight_scale": scales,
        "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64),
    }
    if not symmetric:
        out["weight_zero_point"] = pack(zeros, bits, 0)
    return out


def shapes(out: int, k: int, bits: int, group_size: int, symmetric: bool = False) -> dict:
    """``{name: shape}`` of one layer's tensors (``group_size`` -1: one group per row)."""
    groups = 1 if group_size == -1 else k // group_size
    got = {
        "weight_packed": (out, math.ceil(k * bits / 32)),
        "weight_scale": (out, groups),
        "weight_shape": (2,),
    }
    if not symmetric:
        got["weight_zero_point"] = (math.ceil(out * bits / 32), groups)
    return got


def decode(tensors: dict, bits: int, symmetric: bool = False):
    """``(q [out, in], zeros [out, in/g], scales [out, in/g])`` of one layer's tensors (local
    names), the codes unsigned."""
    out, k = (int(v) for v in tensors["weight_shape"].tolist())
    scales = tensors["weight_scale"]
    q = unpack(tensors["weight_packed"], bits, k, 1)
    if symmetric:
        zeros = torch.full(scales.shape, 2 ** (bits - 1), dtype=torch.int32)
    else:
        zeros = unpack(tensors["weight_zero_point"], bits, out, 0)
    return q, zeros, scales


def dequantize(tensors: dict, bits: int, group_size: int, symmetric: bool, dtype=torch.float32):
    """The float weight ``(q - z) s`` [out, in] of one layer's tensors (local names)."""
    q, zeros, scales = decode(tensors, bits, symmetric)
    g = q.shape[1] if group_size == -1 else group_size
    z, s = zeros.repeat_interleave(g, dim=1), scales.to(dtype).repeat_interleave(g, dim=1)
    return (q - z).to(dtype) * s
