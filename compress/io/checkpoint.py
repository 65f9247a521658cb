"""The checkpoint inside a run folder: write it, and load it back for evaluation.

A run folder holds an HF-format checkpoint::

    config.json        the model config + "quantization_config" (absent for fp)
    model.safetensors  every tensor of model.state_dict(); a tied lm_head is omitted. Above
                       ``shards.MAX_SHARD_BYTES``, ``model-0000i-of-0000N.safetensors`` shards
                       and ``model.safetensors.index.json``, as ``save_pretrained`` writes them
                       (``compress.io.shards``: written one tensor at a time)
    tokenizer files    as tokenizer.save_pretrained writes them

``quantization_config["quant_method"]`` says which layer replaces the decoder's
linears on load (``compress.layers.LAYERS``): "compressed-tensors" (pack-quantized, repacked
to the kernels' layout on load), "awq" (INT4, AutoAWQ GEMM) and "compress" (other widths) load
as ``QuantLinear``; "bitsandbytes" as ``Int8Linear``.
Layers whose names contain an entry of ``modules_to_not_convert`` (bitsandbytes:
``llm_int8_skip_modules``) stay ``nn.Linear``.
In a quantized checkpoint, every tensor outside the quantized layers (embedding, norms,
unquantized linears) is saved in float16, as AutoAWQ saves them, or in the source's dtype
when that is 16-bit (bfloat16 stays bfloat16); config.json's ``dtype`` says which. A tensor
beyond float16's range sends them all to bfloat16 instead. Loading for evaluation widens
them to float32 exactly, so the figures are those of the saved file.
"""

import contextlib
import json
import logging
from pathlib import Path

import torch
from torch import nn

import compress.formats.attention  # noqa: F401  (registers the converted attentions' model types)
from compress.arch.adapters import get_adapter, set_module
from compress.arch.hf_config import config_from_dict, read_config_json
from compress.arch.spec import spec_of
from compress.errors import CompressError
from compress.io.manifest import check_loadable
from compress.io.memory import release_freed_memory
from compress.io.offload import disk, empty_model, make_lazy
from compress.io.shards import (
    MAX_SHARD_BYTES,
    WEIGHTS,  # noqa: F401  (the single-file name, re-exported)
    Entry,
    tensor_files,
    weight_files,
    write_sharded,
)
from compress.io.shards import header as read_header
from compress.io.tokenizer import load_tokenizer
from compress.layers import quantized_layer
from compress.layers.codec import codec_for
from compress.layers.experts import unfuse_experts

log = logging.getLogger(__name__)


@contextlib.contextmanager
def guard_safetensors(where):
    """Turn safetensors' parse errors into a CompressError naming the folder."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as e:
        raise CompressError(
            f"the safetensors file in '{where}' is corrupt or truncated ({e}). Re-run the recipe "
            f"that wrote it, or download the checkpoint again."
        ) from None


def quantized_modules(model: nn.Module) -> list[str]:
    """Names of the decoder linears a quantized layer has replaced (no longer ``nn.Linear``)."""
    return [
        name
        for name, m in get_adapter(model.config).all_linears(model).items()
        if not isinstance(m, nn.Linear)
    ]


def _unquantized(model: nn.Module, sd: dict) -> list[str]:
    """Floating tensors of ``sd`` outside the quantized layers (whose scales keep their format's
    dtype)."""
    prefixes = tuple(f"{name}." for name in quantized_modules(model))
    return [k for k, v in sd.items() if v.is_floating_point() and not k.startswith(prefixes)]


def _value(model: nn.Module, sd: dict, name: str) -> torch.Tensor:
    """``sd[name]``, read from disk when a disk-backed model holds it there."""
    t = sd[name]
    return disk(model).read([name])[name] if t.device.type == "meta" else t


def unquantized_dtype(model: nn.Module, source_dtype=None) -> torch.dtype:
    """The dtype of a quantized checkpoint's unquantized tensors: the source's when it is 16-bit,
    else float16 (AutoAWQ's), or bfloat16 when some tensor does not fit float16's range."""
    if str(source_dtype).removeprefix("torch.") in ("float16", "bfloat16"):
        return getattr(torch, str(source_dtype).removeprefix("torch."))
    sd = model.state_dict()
    limit = torch.finfo(torch.float16).max
    for name in _unquantized(model, sd):
        if sd[name].numel() and _value(model, sd, name).abs().max() > limit:
            log.warning(
                "tensor '%s' exceeds float16's range: unquantized tensors saved in bfloat16", name
            )
            return torch.bfloat16
    return torch.float16


def state_dict_for_save(model: nn.Module, dtype=None) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint holds; with ``dtype``, those outside quantized layers cast to it."""
    sd = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    cast = set(_unquantized(model, sd)) if dtype is not None else set()
    return {
        k: (v.detach().to(dtype) if k in cast else v.detach()).contiguous() for k, v in sd.items()
    }


def save_entries(model: nn.Module, dtype=None, qcfg: dict | None = None) -> list[Entry]:
    """The tensors a checkpoint holds, as ``state_dict_for_save`` makes them, to be read one at
    a time (a disk-backed model's layers from their files); a compressed-tensors ``qcfg``
    stores the quantized layers in its names (``compress.layers.codec``)."""
    sd = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    cast = set(_unquantized(model, sd)) if dtype is not None else set()
    codec = codec_for(model, qcfg, dtype or model.dtype)
    out, coded = [], set()
    for k, v in sd.items():
        if codec is not None and (prefix := codec.owner(k)) is not None:
            if prefix not in coded:
                coded.add(prefix)
                value = lambda name: _value(model, sd, name).detach()
                for name, (shape, dt, read_one) in codec.encode(prefix, value).items():
                    out.append(Entry(name, shape, dt, read_one))
            continue
        target = dtype if k in cast else v.dtype
        out.append(
            Entry(
                k, tuple(v.shape), target, lambda k=k, t=target: _value(model, sd, k).detach().to(t)
            )
        )
    return out


def save_checkpoint(
    model: nn.Module,
    tokenizer,
    folder: Path,
    quantization_config: dict | None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """Write config.json, the safetensors file(s) and the tokenizer into ``folder``.

    ``dtype``: the unquantized tensors' dtype on disk (``unquantized_dtype``); None keeps the
    model's. Weights beyond ``max_shard_bytes`` go into shards with an index
    (``compress.io.shards.write_sharded``), written one tensor at a time.
    """
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config.to_diff_dict()
    config.pop("quantization_config", None)
    if quantization_config:
        config["quantization_config"] = quantization_config
    if dtype is not None:  # "torch_dtype" for readers older than transformers 5
        config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    write_sharded(folder, save_entries(model, dtype, quantization_config), max_shard_bytes)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def build_model(config, qcfg: dict | None) -> nn.Module:
    """An HF model of ``config`` (random weights) with its linears swapped for quantized layers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if qcfg:  # quantized experts are stored one per expert, as the methods quantize them
        unfuse_experts(model, get_adapter(config))
    swap_quantized(model, config, qcfg)
    return model


def swap_quantized(model: nn.Module, config, qcfg: dict | None) -> None:
    """Replace ``model``'s decoder linears by empty quantized layers, as ``qcfg`` says (none if None)."""
    if qcfg:
        skip = qcfg.get("modules_to_not_convert") or qcfg.get("llm_int8_skip_modules") or []
        for name, lin in get_adapter(config).all_linears(model).items():
            if not any(s in name for s in skip):
                if (layer := quantized_layer(qcfg, lin, name)) is not None:
                    set_module(model, name, layer)


def read_tensors(folder: Path, model: nn.Module | None = None, qcfg: dict | None = None):
    """Every tensor of a folder's safetensors file(s) (shards through their index), under
    ``model``'s names: in a quantized folder for our decoder, its family's MLP aliases applied
    (``Adapter.ours``: Mixtral's ``block_sparse_moe``; float folders get them with the experts'
    fusing, ``compress.decoder.experts``), and the quantized layers' own names where ``qcfg``
    stores them otherwise (compressed-tensors, ``compress.layers.codec``)."""
    from safetensors.torch import load_file

    with guard_safetensors(folder):
        files = weight_files(folder)
    if not files:
        raise CompressError(
            f"run folder '{folder}' has no *.safetensors file; the run did not finish "
            f"or the folder is not a checkpoint."
        )
    ours = qcfg and model is not None and hasattr(model, "spec")  # quantized: our decoder's names
    codec = codec_for(model, qcfg) if model is not None else None
    out, done = {}, set()
    with guard_safetensors(folder):
        for f in files:  # a shard's coded layers decoded as soon as they are whole
            got = load_file(str(f))
            out.update({model.spec.adapter.ours(n): t for n, t in got.items()} if ours else got)
            del got
            if codec is not None:
                codec.decode_all(out, complete=True, done=done)
                release_freed_memory()
    return codec.decode_all(out, done=done) if codec is not None else out


def load_state(model: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Copy ``tensors`` into ``model``, checking names, shapes and dtypes against it; each is
    popped from ``tensors`` as it is copied."""
    expected = model.state_dict()
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, ref in expected.items():
        if name not in tensors:
            if tied and name == "lm_head.weight":
                continue
            raise CompressError(
                f"'{where}' lacks tensor '{name}' (expected shape {tuple(ref.shape)}); "
                f"the checkpoint does not match its config.json."
            )
        t = tensors[name]
        if t.shape != ref.shape:
            raise CompressError(
                f"tensor '{name}' in '{where}' has shape {tuple(t.shape)}, but the config "
                f"expects {tuple(ref.shape)}; the checkpoint does not match its config.json."
            )
        if t.is_floating_point() != ref.is_floating_point():
            raise CompressError(
                f"tensor '{name}' in '{where}' has dtype {t.dtype}, expected {ref.dtype}."
            )
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise CompressError(
            f"'{where}' has tensors the config does not use, e.g. '{extra[0]}'; "
            f"the checkpoint does not match its config.json."
        )
    # each tensor dropped once copied: the dict and the model are never both whole in memory
    with torch.no_grad():
        for name, ref in expected.items():
            if name in tensors:
                ref.copy_(tensors.pop(name))
    if tied:
        model.tie_weights()


def read_config(folder: Path) -> tuple[object, dict | None]:
    """``(HF config, quantization_config or None)`` of a run folder or HF folder of a supported
    family (``compress.arch.adapters``)."""
    if not (folder / "config.json").is_file():
        raise CompressError(
            f"'{folder}' has no config.json: it is not a run folder or HF checkpoint. "
            f"Pass the folder a recipe wrote (outputs/...)."
        )

    raw = read_config_json(folder)
    qcfg = raw.pop("quantization_config", None)
    config = config_from_dict(raw, folder)
    spec_of(config)  # refuses what the decoder cannot run, before any weight is read
    return config, qcfg


def read_tokenizer(folder: Path):
    """The folder's tokenizer (``compress.io.tokenizer.load_tokenizer``: files that do not parse are
    a CompressError), or None when it has no ``tokenizer_config.json``."""

    return load_tokenizer(folder) if (folder / "tokenizer_config.json").exists() else None


def check_finite(model: nn.Module, where: str) -> None:
    """Refuse NaN or inf in any parameter or buffer, naming the tensor."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.device.type == "meta":  # a disk-backed layer: checked when read (offload.layer_on)
            continue
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise CompressError(
                f"tensor '{name}' of {where} contains NaN or inf values. The checkpoint is "
                f"damaged or was saved from a diverged run; re-export or re-download it."
            )


def load_run(folder, verify: bool = True) -> tuple[nn.Module, object]:
    """Load a run folder (or any HF folder of the Llama family) as ``(model, tokenizer)``.

    ``verify`` checks the folder against its manifest first (``manifest.check_loadable``: an
    unfinished or edited run folder is refused); ``verify=False`` loads it as it is."""
    folder = Path(folder)
    if verify:
        check_loadable(folder)
    config, qcfg = read_config(folder)
    model = build_model(config, qcfg)
    load_state(model, read_tensors(folder, model, qcfg), str(folder))
    model.eval()
    check_finite(model, f"run folder '{folder}'")
    return model, read_tokenizer(folder)


def open_lazy(folder: Path, qcfg: dict | None = None, config=None, spill: Path | None = None):
    """A disk-backed model of an HF or run folder (``compress.io.offload``): the decoder layers are
    read from its safetensors one at a time, widened to float32 as ``load_run`` widens them."""
    folder = Path(folder)
    if config is None:
        config, qcfg = read_config(folder)
    with guard_safetensors(folder):
        files = tensor_files(folder)
        if not files:
            raise CompressError(
                f"'{folder}' has no *.safetensors file; the run did not finish or the folder "
                f"is not a checkpoint."
            )
        model = empty_model(config)
        if qcfg:
            with torch.device("meta"):
                swap_quantized(model, config, qcfg)
        codec = codec_for(model, qcfg)
        _check_shapes(model, files, str(folder), codec)
        return make_lazy(model, files, str(folder), spill, codec)


def _check_shapes(model: nn.Module, files: dict, where: str, codec=None) -> None:
    """Names and shapes of a folder's tensors (headers only) against the model built from its
    config, as ``load_state`` checks them."""
    headers = {}
    for f in set(files.values()):
        headers.update(read_header(f))
    if codec is not None:
        headers = codec.headers(headers)
    expected = model.state_dict()
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, ref in expected.items():
        if name not in headers:
            if tied and name == "lm_head.weight":
                continue
            raise CompressError(
                f"'{where}' lacks tensor '{name}' (expected shape {tuple(ref.shape)}); "
                f"the checkpoint does not match its config.json."
            )
        if headers[name][0] != tuple(ref.shape):
            raise CompressError(
                f"tensor '{name}' in '{where}' has shape {headers[name][0]}, but the config "
                f"expects {tuple(ref.shape)}; the checkpoint does not match its config.json."
            )
    extra = sorted(set(headers) - set(expected))
    if extra:
        raise CompressError(
            f"'{where}' has tensors the config does not use, e.g. '{extra[0]}'; "
            f"the checkpoint does not match its config.json."
        )
