"""Round-to-nearest (RTN): quantize every decoder linear group-wise, no calibration.

Every family alike (``adapter.linears``: q/k/v/o and gate/up/down of each layer): norms, per-head
q/k norms (Qwen3, Gemma 3), biases, the embedding and the head keep their float weights, so
Gemma's (1 + w) norms, embedding scale and tied 262k-row head are untouched (``quant.lm_head``
quantizes the head at load instead). Group size ``auto`` is the largest of 128, 64, 32 dividing
every in_features (Gemma 3 270M: 640, 1024 and 2048 take 128)."""

from torch import nn

from compress.arch.adapters import get_adapter, layer_in_features, set_module
from compress.errors import CompressError
from compress.formats import compressed_tensors as ct
from compress.formats.quantizer import (
    auto_group_size,
    check_bits,
    check_divides,
    check_group_size,
    quantize,
)
from compress.io.offload import check_fits, layer_on
from compress.layers import QuantLinear, layout_for
from compress.layers.experts import unfuse_experts


def check_width(c, key: str, hf_config=None) -> None:
    """``KEY.bits`` from 2 to 8 and ``KEY.group_size`` that divides every quantized layer's
    in_features (read from ``hf_config`` when the model's config.json is at hand)."""
    check_bits(c.bits, f"{key}.bits")
    in_features = layer_in_features(hf_config) if hf_config is not None else {}
    check_group_size(c.group_size, in_features, f"{key}.group_size")
    if hf_config is not None:
        adapter = get_adapter(hf_config)
        word = 8 if layout_for(c.bits) == "awq" else 32  # output channels a packed word holds
        for path, (out, k) in adapter.linear_shapes(hf_config).items():
            if out % word:
                raise CompressError(
                    f"layer '{adapter.layers}.N.{path}' [{out}x{k}] has {out} output channels; "
                    f"compress packs {c.bits}-bit codes {word} output channels to a word, so it "
                    f"quantizes layers whose output count is a multiple of {word} only."
                )


def check(cfg, hf_config=None) -> None:
    """Refuse ``rtn.*`` and ``quant.format`` before the model loads."""
    check_width(cfg.rtn, "rtn", hf_config)
    stored_format(cfg)


def resolve_group_size(model: nn.Module, group_size) -> int:
    """``auto`` -> 128, 64 or 32 (the largest dividing every quantized in_features); -1 -> one group
    per row (per-channel scales, as GPTQ and AutoAWQ spell it); else validated."""
    linears = get_adapter(model.config).all_linears(model)
    if group_size in (None, "auto"):
        return auto_group_size([m.in_features for m in linears.values()])
    group_size = int(group_size)
    for name, m in linears.items():
        check_divides(f"{name} [{m.out_features}x{m.in_features}]", m.in_features, group_size)
    return group_size


FORMATS = ("compressed-tensors", "autoawq")


def stored_format(cfg) -> str:
    """``quant.format``: compressed-tensors (default) or autoawq."""
    fmt = (cfg.get("quant") or {}).get("format") or FORMATS[0]
    if fmt not in FORMATS:
        raise CompressError(
            f"quant.format={fmt!r}: the saved format is compressed-tensors (pack-quantized, "
            f"which vLLM and transformers load natively) or autoawq (AutoAWQ's GEMM layout at "
            f"INT4, compress's bit planes at other widths)."
        )
    return fmt


def quantization_config(
    bits: int, group_size: int, symmetric: bool = False, fmt: str = FORMATS[0], ignore=None
) -> dict:
    """config.json's ``quantization_config`` for a group-quantized checkpoint in format ``fmt``
    (:data:`FORMATS`); compressed-tensors' ``ignore`` lists the linears left in floating point
    (default: the head)."""
    if fmt == "compressed-tensors":
        return ct.quantization_config(bits, group_size, symmetric, ignore or ("lm_head",))
    if layout_for(bits) == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    return {
        "quant_method": "compress",
        "bits": bits,
        "group_size": group_size,
        "zero_point": not symmetric,
        "layout": "bitplanes",
    }


def pack_model(
    model: nn.Module, bits: int, group_size: int, symmetric: bool = False, clip=None, device=None
) -> nn.Module:
    """Replace every decoder linear by a ``QuantLinear`` holding its RTN codes, one decoder layer
    at a time on ``device`` (``compress.io.offload.layer_on``; None: where the layers are).

    ``clip`` maps a full module name to a ``[out, in/g]`` max |w| (AWQ's clip search).
    """
    clip = clip or {}
    adapter = get_adapter(model.config)
    for i in range(len(adapter.decoder_layers(model))):
        with layer_on(model, i, device, write=True) as layer:
            for path, lin in adapter.named_linears(layer).items():
                name = f"{adapter.layers}.{i}.{path}"
                qw = quantize(lin.weight.data, bits, group_size, symmetric, clip.get(name))
                set_module(layer, path, QuantLinear.from_quantized(qw, lin.bias))
    return model


def float_linears(model: nn.Module) -> list[str]:
    """The names of ``model``'s linears left in floating point (the head; in a mixture of
    experts also the shared expert's gate)."""
    return [name for name, m in model.named_modules() if type(m) is nn.Linear]


def rtn(model: nn.Module, ctx) -> nn.Module:
    """Stage: RTN with ``ctx.cfg.rtn`` = {bits, group_size, symmetric}. A mixture of experts is
    quantized expert by expert (``compress.layers.experts.unfuse_experts``); its routers stay
    in the source precision."""
    q = ctx.cfg.rtn
    unfuse_experts(model, get_adapter(model.config))
    g = resolve_group_size(model, q.group_size)
    device = getattr(ctx, "device", None)
    check_fits(model, device or "cpu", 0, "rtn")
    model = pack_model(model, q.bits, g, q.get("symmetric", False), device=device)
    fmt = stored_format(ctx.cfg)
    ignore = float_linears(model)
    ctx.quantization_config = quantization_config(q.bits, g, q.get("symmetric", False), fmt, ignore)
    ctx.record["group_size"] = g
    ctx.record["bits"] = q.bits
    return model
