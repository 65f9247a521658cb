"""How the kernels see a ``QuantLinear``: its bit planes, and the inputs they accept.

Every packed weight is a list of bit planes, low bits first (the layouts are
``compress.formats.awq_gemm`` and ``compress.formats.bitplanes``)::

    "awq"      (INT4): one 4-bit plane, qweight [in, out/8], nibbles in AWQ_ORDER
    "compress" (other): plane w{p} per p in plane_widths(bits), widest (low bits) first,
                        qweight_w{p} [in, out*p/32], 32/p consecutive columns per int32

and ``W_hat[o, i] = (q[i, o] - z[i // g, o]) * s[i // g, o]`` with ``s = scales [in/g, out]``.
"""

import torch

from compress.errors import CompressError
from compress.formats.bitplanes import plane_widths

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def planes(layer) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """``(p, qweight, qzeros)`` for each bit plane of ``layer``, low bits first."""
    if layer.format == "awq":
        return [(4, layer.qweight, layer.qzeros)]
    return [
        (p, getattr(layer, f"qweight_w{p}"), getattr(layer, f"qzeros_w{p}"))
        for p in plane_widths(layer.bits)
    ]


def stamp(layer) -> tuple:
    """Identity of a layer's tensors: forms prepared from them are rebuilt when it changes."""
    return tuple((t.data_ptr(), t._version) for t in layer._buffers.values() if t is not None)


def cached(layer, key, build):
    """``build()``, kept in ``layer.cache[key]`` until the layer's tensors change."""
    current = stamp(layer)
    hit = layer.cache.get(key)
    if hit is None or hit[0] != current:
        hit = layer.cache[key] = (current, build())
    return hit[1]


def recache(layer, key, value, buffers: dict | None = None) -> None:
    """Keep ``value`` (a form built elsewhere: a view into several layers' stacked forms) as
    ``layer.cache[key]``, after replacing the layer's ``buffers`` (name -> an equal tensor, a view
    into the same stack); what was prepared from the layer's tensors stays current."""
    old = stamp(layer)
    layer._buffers.update(buffers or {})
    new = stamp(layer)
    for k, hit in layer.cache.items():
        if isinstance(hit, tuple) and hit == old:  # a check of the current tensors
            layer.cache[k] = new
        elif isinstance(hit, tuple) and len(hit) == 2 and hit[0] == old:  # a current form
            layer.cache[k] = (new, hit[1])
    layer.cache[key] = (new, value)


def _where(layer) -> str:
    return (
        f"quantized layer [{layer.in_features} -> {layer.out_features}], {layer.bits}-bit, "
        f"group size {layer.group_size}"
    )


def check_layer(layer) -> None:
    """Raise ``CompressError`` unless the packed tensors of ``layer`` fit the kernels."""
    k, n, g = layer.in_features, layer.out_features, layer.group_size
    where = _where(layer)
    if g <= 0 or k % g:
        raise CompressError(
            f"{where}: in_features {k} is not a multiple of the group size "
            f"{g}; re-quantize with a group size that divides {k} (e.g. 128, 64 "
            f"or 32)."
        )
    pack = 8 if layer.format == "awq" else 32
    if n % pack:
        raise CompressError(
            f"{where}: out_features {n} is not a multiple of {pack}, the "
            f"columns per packed int32 word of the '{layer.format}' format; pad "
            f"the layer or leave it unquantized."
        )
    if layer.scales.shape != (k // g, n) or not layer.scales.is_floating_point():
        raise CompressError(
            f"{where}: scales have shape {tuple(layer.scales.shape)} and dtype "
            f"{layer.scales.dtype}, expected a float tensor [{k // g}, {n}]; the "
            f"checkpoint is corrupt."
        )
    for p, qw, qz in planes(layer):
        for name, t, rows in (("qweight", qw, k), ("qzeros", qz, k // g)):
            shape = (rows, n * p // 32)
            if t.dtype != torch.int32 or t.shape != shape or t.device != layer.scales.device:
                raise CompressError(
                    f"{where}: {p}-bit plane of {name} has shape "
                    f"{tuple(t.shape)}, dtype {t.dtype} and device {t.device}, "
                    f"expected int32 [{rows}, {n * p // 32}] on "
                    f"{layer.scales.device}; the checkpoint is corrupt."
                )


def check_inputs(x: torch.Tensor, layer) -> None:
    """Raise ``CompressError`` unless ``x [M, in]`` and ``layer`` fit the kernels (the layer once
    per change)."""
    if x.dim() != 2 or x.shape[1] != layer.in_features:
        raise CompressError(
            f"{_where(layer)}: input of shape {tuple(x.shape)} is not "
            f"[M, {layer.in_features}]; flatten the leading dimensions to "
            f"[M, in_features] first."
        )
    if x.dtype not in FLOAT_DTYPES:
        raise CompressError(
            f"{_where(layer)}: input dtype {x.dtype} is not supported; "
            f"cast it to float16, bfloat16 or float32."
        )
    if layer.scales.device != x.device:
        raise CompressError(
            f"{_where(layer)}: input is on {x.device} but the packed weight is "
            f"on {layer.scales.device}; move the model and its inputs to the same "
            f"device."
        )
    current = stamp(layer)
    if layer.cache.get("checked") != current:
        check_layer(layer)
        layer.cache["checked"] = current
