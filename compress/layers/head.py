"""A quantized output head: ``lm_head`` group-quantized when a run folder is loaded.

The head of a small model is its largest single read per token (SmolLM2's tied 49,152 x 576
embedding: 56.6 MB in bfloat16, as much as all its int4 projections together). ``quant.lm_head``
(recipes) and ``--head`` (``python -m compress.decoder``) replace it, at load time, by a
``QuantLinear`` of the same group-wise asymmetric codes as the decoder layers
(``compress.formats.quantizer``)::

    s = (max - min) / (2^b - 1)   (fp16)    z = clamp(round(-min / s), 0, 2^b - 1)
    q = clamp(round(W / s) + z, 0, 2^b - 1)           W_hat = (q - z) * s

per ``group_size`` consecutive input channels of a row, b = 8 (``int8``) or 4 (``int4``), so it
runs through the same kernels (``compress.kernels.quant_matmul``: ATen's int4pack on bfloat16
CPU inputs, one call for int4 and two for int8; the K-packed planes for float32; Triton on
CUDA). A tied head is untied first: only the head's copy is quantized, the embedding lookup
stays exact. int8 is these weight-only group-wise codes rather than LLM.int8's per-row int8
GEMM (``compress.kernels.int8_matmul``), which would also round the activations to int8 per
token and has no group scales.

The saved checkpoint is not changed: the head is stored as the source's (AutoAWQ's format has
no quantized head, and transformers and vLLM load the folder as it is). The run's choice is
recorded in ``manifest.json`` (``recipe.quant.lm_head``); the pipeline's evaluation and decode
measurement and ``python -m compress.decoder`` quantize at load, so ppl, KL and tok/s in
``report.json`` are those of the quantized head, and quantizing is deterministic from the stored
weight.
"""

import json
from pathlib import Path

from torch import nn

from compress.errors import CompressError
from compress.formats.quantizer import auto_group_size, quantize
from compress.layers import QuantLinear, group_params

HEAD_BITS = {"none": None, "int8": 8, "int4": 4}


def check_head(kind, key: str = "quant.lm_head") -> None:
    """Refuse a head setting other than none, int8 or int4."""
    if kind not in HEAD_BITS:
        raise CompressError(
            f"{key}={kind!r}: the output head is kept as stored (none) or group-quantized at "
            f"load time to int8 or int4; use one of {', '.join(HEAD_BITS)}."
        )


def recorded_head(folder) -> str:
    """The head quantization a run folder's ``manifest.json`` records (``recipe.quant.lm_head``),
    ``"none"`` for folders without one."""
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        return "none"
    try:
        recipe = json.loads(path.read_text()).get("recipe") or {}
    except (json.JSONDecodeError, AttributeError):
        return "none"
    kind = (recipe.get("quant") or {}).get("lm_head") or "none"
    check_head(kind, f"manifest.json of '{folder}': recipe.quant.lm_head")
    return kind


def head_group_size(in_features: int, qcfg: dict | None) -> int:
    """The run's group size when it divides the head's input (``quantization_config``), else
    ``auto``'s: 128, else 64, else 32."""

    g = (group_params(qcfg) or (None, None))[1]
    if isinstance(g, int) and g > 0 and in_features % g == 0:
        return g
    return auto_group_size([in_features])


def quantize_head(model: nn.Module, kind: str, qcfg: dict | None = None) -> nn.Module:
    """Replace ``model.lm_head`` (an ``nn.Linear``) by its group-quantized ``QuantLinear``
    (``kind`` int8 or int4; ``none`` leaves it); returns the head now in place."""

    check_head(kind)
    if HEAD_BITS[kind] is None:
        return getattr(model, "lm_head", None)
    head = model.lm_head
    if not isinstance(head, nn.Linear):
        raise CompressError(
            f"the output head is a {type(head).__name__}, not a float linear layer, so it "
            f"cannot be quantized again; load the folder with the head as stored (none)."
        )
    if head.out_features % 32:
        raise CompressError(
            f"the output head has {head.out_features} rows (the vocabulary), not a multiple of "
            f"32, so its codes do not fill whole packed words; load with the head as stored "
            f"(none)."
        )
    g = head_group_size(head.in_features, qcfg)
    qw = quantize(head.weight.detach(), HEAD_BITS[kind], g)
    layer = QuantLinear.from_quantized(qw, head.bias).to(head.weight.device)
    if getattr(model, "config", None) is not None and hasattr(model.config, "tie_word_embeddings"):
        model.config.tie_word_embeddings = False  # the embedding keeps the stored weight
    model.lm_head = layer
    return layer
