"""On-disk formats of quantized layers, and the layers that hold them.

A checkpoint's ``config.json`` names its format in ``quantization_config["quant_method"]``;
:data:`LAYERS` maps it to the layer that replaces each decoder linear on load:

    "awq"           INT4, AutoAWQ GEMM packing (compress/kernels/awq_gemm.py)        -> QuantLinear
    "compress"      any other width, our bit planes (compress/kernels/bitplanes.py)  -> QuantLinear
    "bitsandbytes"  bitsandbytes' int8 layout, LLM.int8 forward             -> Int8Linear

This package knows formats, not methods: it imports nothing from the quantization,
pruning or training code, and it reads the bit layouts from the kernels (``compress.kernels``, a leaf).
"""

from torch import nn

from compress.errors import CompressError
from compress.formats.int8_linear import Int8Linear
from compress.formats.quant_linear import QuantLinear, layout_for
from compress.kernels.awq_gemm import AWQ_ORDER, pack_awq, unpack_awq
from compress.kernels.bitplanes import pack_planes, plane_widths, unpack_planes

__all__ = [
    "AWQ_ORDER",
    "LAYERS",
    "Int8Linear",
    "QuantLinear",
    "layout_for",
    "pack_awq",
    "pack_planes",
    "plane_widths",
    "quantized_layer",
    "unpack_awq",
    "unpack_planes",
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
