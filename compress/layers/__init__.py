"""The layers that hold quantized weights, and which layer each on-disk format loads into.

A checkpoint's ``config.json`` names its format in ``quantization_config["quant_method"]``;
:data:`LAYERS` maps it to the layer that replaces each decoder linear on load:

    "awq"           INT4, AutoAWQ GEMM packing (compress/formats/awq_gemm.py)        -> QuantLinear
    "compress"      any other width, our bit planes (compress/formats/bitplanes.py)  -> QuantLinear
    "compressed-tensors"  pack-quantized (compress/formats/compressed_tensors.py)    -> QuantLinear
                    (repacked on load and save: compress/layers/codec.py)
    "bitsandbytes"  bitsandbytes' int8 layout, LLM.int8 forward             -> Int8Linear

Layers know formats (``compress.formats``) and kernels (``compress.kernels``), not methods: nothing
here imports the quantization, pruning or training code.
"""

from torch import nn

from compress.errors import CompressError
from compress.formats import compressed_tensors as ct
from compress.layers.int8_linear import Int8Linear
from compress.layers.quant_linear import QuantLinear, layout_for

__all__ = [
    "GROUP_QUANTIZED",
    "LAYERS",
    "Int8Linear",
    "QuantLinear",
    "group_params",
    "layout_for",
    "quantized_layer",
]


def _quant_linear(linear: nn.Linear, bits: int, group_size: int) -> QuantLinear:
    bias = linear.bias is not None
    return QuantLinear(linear.in_features, linear.out_features, bits, group_size, bias=bias)


def _group_quantized(qcfg: dict, linear: nn.Linear, name: str) -> QuantLinear:
    return _quant_linear(linear, qcfg["bits"], qcfg["group_size"])


def _compressed_tensors(qcfg: dict, linear: nn.Linear, name: str) -> QuantLinear | None:
    got = ct.scheme(qcfg, name)
    if got is None:  # ignored, or no scheme targets it
        return None
    return _quant_linear(linear, got[0], got[1])


def _int8(qcfg: dict, linear: nn.Linear, name: str) -> Int8Linear:
    return Int8Linear(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        threshold=qcfg.get("llm_int8_threshold", 6.0),
        name=name,
    )


LAYERS = {
    "awq": _group_quantized,
    "compress": _group_quantized,
    ct.METHOD: _compressed_tensors,
    "bitsandbytes": _int8,
}
GROUP_QUANTIZED = ("awq", "compress", ct.METHOD)  # the formats that load as QuantLinear


def group_params(qcfg: dict | None) -> tuple[int, int] | None:
    """``(bits, group_size)`` of a group-quantized ``quantization_config`` (compressed-tensors:
    its first scheme), else None."""
    qcfg = qcfg or {}
    method = qcfg.get("quant_method")
    if method in ("awq", "compress"):
        return qcfg.get("bits"), qcfg.get("group_size")
    if method == ct.METHOD:
        for group in (qcfg.get("config_groups") or {}).values():
            w = group.get("weights") or {}
            return w.get("num_bits"), w.get("group_size")
    return None


def quantized_layer(qcfg: dict, linear: nn.Linear, name: str = "") -> nn.Module | None:
    """An empty layer of ``linear``'s shape in the format of ``qcfg["quant_method"]`` (None: the
    format leaves it in floating point).

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
