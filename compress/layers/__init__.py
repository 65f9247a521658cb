"""The layers that hold quantized weights, and which layer each on-disk format loads into.

A checkpoint's ``config.json`` names its format in ``quantization_config["quant_method"]``;
:data:`LAYERS` maps it to the layer that replaces each decoder linear on load:

    "awq"           INT4, AutoAWQ GEMM packing (compress/formats/awq_gemm.py)        -> QuantLinear
    "compress"      any other width, our bit planes (compress/formats/bitplanes.py)  -> QuantLinear
    "bitsandbytes"  bitsandbytes' int8 layout, LLM.int8 forward             -> Int8Linear

Layers know formats (``compress.formats``) and kernels (``compress.kernels``), not methods: nothing
here imports the quantization, pruning or training code.
"""

from torch import nn

from compress.errors import CompressError
from compress.layers.int8_linear import Int8Linear
from compress.layers.quant_linear import QuantLinear, layout_for

__all__ = [
    "LAYERS",
    "Int8Linear",
    "QuantLinear",
    "layout_for",
    "quantized_layer",
]


def _group_quantized(qcfg: dict, linear: nn.Linear, name: str) -> QuantLinear:
    return QuantLinear(
        linear.in_features,
        linear.out_features,
        qcfg["bits"],
        qcfg["group_size"],
        bias=linear.bias is not None,
    )


def _int8(qcfg: dict, linear: nn.Linear, name: str) -> Int8Linear:
    return Int8Linear(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        threshold=qcfg.get("llm_int8_threshold", 6.0),
        name=name,
    )


LAYERS = {"awq": _group_quantized, "compress": _group_quantized, "bitsandbytes": _int8}


def quantized_layer(qcfg: dict, linear: nn.Linear, name: str = "") -> nn.Module:
    """An empty layer of ``linear``'s shape in the format of ``qcfg["quant_method"]``.

    ``name`` (the module's full name) lets a layer name itself in run-time errors.
    """
    method = qcfg.get("quant_method")
    if method not in LAYERS:
        names = [repr(m) for m in LAYERS]
        raise CompressError(
            f"unknown quant_method '{method}' in config.json; compress reads "
            f"{', '.join(names[:-1])} and {names[-1]}."
        )
    return LAYERS[method](qcfg, linear, name)
