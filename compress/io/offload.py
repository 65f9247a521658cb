"""Sequential onloading (as llm-compressor does it): the decoder layers wait on the host or on
disk, and one layer at a time moves to the device with its calibration inputs.

Two kinds of model go through the same loop, ``with layer_on(model, i, device) as layer``:

- an in-memory model: layer i moves to ``device`` and back to the host afterwards (nothing
  moves when ``device`` is the CPU);
- a *disk-backed* model (``make_lazy``): its decoder layers are empty (meta) tensors. ``layer_on``
  reads layer i's tensors from the safetensors files (memory-mapped, that layer only) into
  the compute dtype, float32 (a 16-bit source widens exactly); with ``write=True`` it then
  writes what the method made of the layer (its quantized form) to a spill folder, and the
  layer is emptied again. The peak holds one layer, not the model.

Outside the decoder layers a disk-backed model holds its tensors in memory: the embedding and
the output head in the stored dtype, memory-mapped (a bfloat16 source keeps them 16-bit; the
head is applied ``vocab_chunk`` rows at a time, widened to float32, by :func:`head_log_probs`;
both are checked for NaN/inf where used, so a lookup reads only the rows it needs), the small
ones (norms) in float32. Every tensor of a layer is checked when the layer is read.

:func:`final_hidden` runs token windows through every layer in turn (``capture_inputs``, then
the layers, then the final norm); :func:`head_log_probs` turns hidden states into log-probs a
chunk of tokens at a time, so ``[tokens, vocab]`` float32 logits exist for a chunk only.
"""

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from compress.arch.adapters import Adapter, get_adapter
from compress.errors import CompressError
from compress.io.shards import Entry, read, write_file

log = logging.getLogger(__name__)
_ATTR = "_compress_disk"


@dataclass
class DiskLayers:
    """Where a disk-backed model's decoder layers are: ``files`` maps each tensor's name to the
    safetensors file with its current value (the source's, then the spill folder's)."""

    files: dict
    spill: Path | None = None  # where ``layer_on(..., write=True)`` writes a layer
    dtype: torch.dtype = torch.float32  # the layers' compute dtype
    codec: object = None  # a ``compress.layers.codec.Codec`` when quantized layers are stored
    # under other names (compressed-tensors); None: every tensor under its own name

    def read(self, names) -> dict:
        """The tensors ``names`` (the model's names): stored ones as they are, a coded layer's
        buffers repacked from its stored tensors."""
        plain, layers = [], {}
        for n in names:
            prefix = None if n in self.files or self.codec is None else self.codec.owner(n)
            (plain if prefix is None else layers.setdefault(prefix, [])).append(n)
        stored = {p: self.codec.disk_names(p) for p in layers}
        out = read(self.files, plain + [n for names in stored.values() for n in names])
        for prefix, wanted in layers.items():
            buffers = self.codec.decode(prefix, {n: out.pop(n) for n in stored[prefix]})
            out.update({n: buffers[n] for n in wanted})
        return out


def disk(model: nn.Module) -> DiskLayers | None:
    """The model's ``DiskLayers`` when it is disk-backed, else None."""
    return model.__dict__.get(_ATTR)


def is_lazy(model) -> bool:
    return isinstance(model, nn.Module) and disk(model) is not None


def empty_model(config, dtype=torch.float32) -> nn.Module:
    """An HF model of ``config`` whose parameters are meta tensors (its buffers, e.g. position
    frequencies, real)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _set(module: nn.Module, name: str, t: torch.Tensor) -> None:
    if name in module._parameters:
        module._parameters[name] = nn.Parameter(t, requires_grad=False)
    else:
        module._buffers[name] = t


def layer_buffers_ok(model: nn.Module) -> bool:
    """A layer can be emptied and read back only when all its state is in its state_dict."""
    layers = get_adapter(model.config).decoder_layers(model)
    return not any(m._non_persistent_buffers_set for layer in layers for m in layer.modules())


def make_lazy(
    model: nn.Module, files: dict, where: str, spill: Path | None = None, codec=None
) -> nn.Module:
    """Fill the non-layer tensors of ``model`` (from ``empty_model``) from ``files``
    (``{name: safetensors file}``) and mark its decoder layers disk-backed (``codec``: see
    :class:`DiskLayers`)."""
    adapter = get_adapter(model.config)
    keep = (adapter.embed, adapter.lm_head)  # stored dtype
    layers = adapter.layers + "."
    wanted = {}
    for name, module in model.named_modules():
        if name == adapter.layers or name.startswith(layers):
            continue
        own = list(module._parameters.items()) + [
            (k, b)
            for k, b in module._buffers.items()
            if k not in module._non_persistent_buffers_set
        ]
        for pname, t in own:
            if t is not None and t.device.type == "meta":
                wanted[f"{name}.{pname}" if name else pname] = (module, pname, name in keep)
    tied = getattr(model.config, "tie_word_embeddings", False)
    head = f"{adapter.lm_head}.weight"
    missing = [n for n in wanted if n not in files and not (tied and n == head)]
    if missing:
        raise CompressError(
            f"'{where}' lacks tensor '{missing[0]}'; the checkpoint does not match its config.json."
        )
    d = DiskLayers(files=dict(files), spill=spill, codec=codec)
    tensors = d.read([n for n in wanted if n in files])
    for n, t in tensors.items():
        module, pname, stored = wanted[n]
        if t.is_floating_point() and not stored:  # the embedding and head: checked when used
            t = t.float()
            _check_finite(t, n)
        _set(module, pname, t)
    _retie(model)
    model.__dict__[_ATTR] = d
    model.eval().requires_grad_(False)
    return model


def resident_to(model: nn.Module, device) -> nn.Module:
    """``model.to(device)``; a disk-backed model moves only what it holds in memory (the
    tensors outside its decoder layers)."""
    if not is_lazy(model):
        return model.to(device)
    for _, module, k, t in _resident(model, buffers=True):
        _set(module, k, t.to(device))
    return _retie(model)


def _resident(model: nn.Module, buffers: bool = False):
    """``(full name, module, name, tensor)`` of every tensor ``model`` holds outside its decoder
    layers (parameters, and buffers if asked)."""
    layers = get_adapter(model.config).layers
    for name, module in model.named_modules():
        if name == layers or name.startswith(layers + "."):
            continue
        own = list(module._parameters.items()) + (list(module._buffers.items()) if buffers else [])
        for k, t in own:
            if t is not None and t.device.type != "meta":
                yield (f"{name}.{k}" if name else k), module, k, t


def _retie(model: nn.Module) -> nn.Module:
    """A tied head points at the embedding again (after either was replaced)."""
    if getattr(model.config, "tie_word_embeddings", False):
        adapter = get_adapter(model.config)
        model.get_submodule(adapter.lm_head).weight = model.get_submodule(adapter.embed).weight
    return model


def share_unchanged(model: nn.Module, source: nn.Module) -> list[str]:
    """Point the tensors ``model`` holds outside its decoder layers at ``source``'s where they are
    equal (same name, shape, dtype and values): a recipe that keeps the embedding and head as
    stored then has them mapped once in the evaluation, not twice (the check reads both once,
    before the evaluation's own peak). Both models disk-backed; returns the names shared."""
    theirs = {full: t for full, _, _, t in _resident(source)}
    shared = []
    for full, module, k, t in list(_resident(model)):
        other = theirs.get(full)
        if other is None or other is t:
            continue
        if t.shape == other.shape and t.dtype == other.dtype and torch.equal(t, other):
            _set(module, k, other.data)
            shared.append(full)
    _retie(model)
    return shared


def host_device(layer: nn.Module) -> torch.device:
    return next(iter(layer.state_dict().values())).device


@contextlib.contextmanager
def layer_on(model: nn.Module, i: int, device, write: bool = False):
    """Decoder layer ``i`` on ``device`` for the ``with`` block (see the module docstring);
    ``device=None`` leaves an in-memory layer where it is.

    ``write``: the block changed the layer (a method quantized it); a disk-backed model writes
    the layer to its spill folder before emptying it, so later reads see the change.
    """
    adapter = get_adapter(model.config)
    layer = adapter.decoder_layers(model)[i]
    d = disk(model)
    if device is None:  # where the layer is; a disk-backed one on the CPU
        device = "cpu" if d is not None else host_device(layer)
    device = torch.device(device)
    if d is None:
        home = host_device(layer)
        layer.to(device)
        try:
            yield layer
        finally:
            layer.to(home)
        return
    prefix = f"{adapter.layers}.{i}."
    names = list(layer.state_dict())
    tensors = d.read([prefix + k for k in names])
    layer.to_empty(device=device)
    with torch.no_grad():
        for k, ref in layer.state_dict().items():
            t = tensors.pop(prefix + k)
            _check_finite(t, prefix + k)
            ref.copy_(t)
    del tensors
    try:
        yield layer
        if write:
            if d.spill is None:
                raise CompressError("a disk-backed model needs a spill folder to change its layers")
            d.spill.mkdir(parents=True, exist_ok=True)
            path = d.spill / f"layer-{i:05d}.safetensors"
            state = {k: v.detach() for k, v in layer.state_dict().items()}
            write_file(
                path,
                [
                    Entry(prefix + k, tuple(v.shape), v.dtype, lambda v=v: v)
                    for k, v in state.items()
                ],
            )
            d.files = {k: f for k, f in d.files.items() if not k.startswith(prefix)}
            d.files.update({prefix + k: path for k in state})
            del state
    finally:
        layer.to("meta")
        for m in layer.modules():  # forms the kernels derived from the tensors (QuantLinear.cache)
            if isinstance(getattr(m, "cache", None), dict):
                m.cache.clear()


def _check_finite(t: torch.Tensor, name: str) -> None:
    if t.is_floating_point() and not torch.isfinite(t).all():
        raise CompressError(
            f"tensor '{name}' contains NaN or inf values. The checkpoint is damaged or was "
            f"saved from a diverged run; re-export or re-download it."
        )


def _to(obj, device):
    """Tensors inside ``obj`` (tuples, lists, dicts) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


class _Stop(Exception):
    pass


class _Recorder(nn.Module):
    """Stands in for decoder layer ``i``: records the keyword arguments the model passes it and
    hands its input on (the last one stops the forward before the head)."""

    def __init__(self, seen: list, i: int, last: bool):
        super().__init__()
        self.seen, self.i, self.last = seen, i, last

    def forward(self, hidden_states, *args, **kwargs):
        self.seen[self.i] = {**kwargs, "use_cache": False}
        if self.last:
            raise _Stop
        return hidden_states


def _forward_to_layers(model: nn.Module, adapter: Adapter, chunk: torch.Tensor) -> None:
    """The model's forward on ``chunk`` until a hook stops it; a disk-backed model embeds in the
    stored dtype and widens to its compute dtype before the layers."""
    d = disk(model)
    try:
        if d is None:
            model(chunk, use_cache=False)
        else:
            embed = model.get_submodule(adapter.embed)
            x = embed(chunk.to(embed.weight.device)).to(d.dtype)
            _check_finite(x, f"{adapter.embed}.weight (rows of the tokens used)")
            model(inputs_embeds=x, use_cache=False)
    except _Stop:
        pass


@torch.no_grad()
def layer_kwargs(
    model: nn.Module, adapter: Adapter, tokens: torch.Tensor, device=None
) -> list[dict]:
    """The keyword arguments each decoder layer receives (its attention mask and position encoding),
    from one forward of the first sample with every layer replaced by a recorder (no layer's
    weights are read), on ``device`` (default: where the model made them).

    Layers differ where the spec's layers do: a sliding-window layer gets a banded mask, and
    Gemma 3's local and global layers get different position-encoding tables; a single-sample mask and table
    broadcast over any batch of samples."""
    layers = adapter.decoder_layers(model)
    originals, seen = list(layers), [None] * len(layers)
    for i in range(len(layers)):
        layers[i] = _Recorder(seen, i, last=i == len(layers) - 1)
    try:
        _forward_to_layers(model, adapter, tokens[:1])
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer
    return seen if device is None else [_to(k, device) for k in seen]


@torch.no_grad()
def capture_inputs(
    model: nn.Module, adapter: Adapter, tokens: torch.Tensor, batch: int, device=None
):
    """``(x, per_layer)``: the hidden states entering decoder layer 0 for every sample, and each
    layer's keyword arguments (:func:`layer_kwargs`), on ``device`` (default: where the model is)."""
    first = adapter.decoder_layers(model)[0]
    seen = []

    def hook(_module, args, kwargs):
        seen.append(args[0] if args else kwargs["hidden_states"])
        raise _Stop

    handle = first.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for chunk in tokens.split(batch):
            _forward_to_layers(model, adapter, chunk)
    finally:
        handle.remove()
    x = torch.cat(seen)
    return (x if device is None else x.to(device)), layer_kwargs(model, adapter, tokens, device)


@torch.no_grad()
def final_hidden(
    model: nn.Module, tokens: torch.Tensor, device="cpu", batch: int = 1
) -> torch.Tensor:
    """``[n, seq, hidden]`` float32 outputs of the final norm for ``tokens [n, seq]``, every
    layer onloaded in turn (on the CPU)."""
    adapter = get_adapter(model.config)
    x, per_layer = capture_inputs(model, adapter, tokens, batch, device)
    for i in range(len(adapter.decoder_layers(model))):
        with layer_on(model, i, device) as layer:
            x = torch.cat([layer(c, **per_layer[i]) for c in x.split(batch)])
    norm = model.get_submodule(adapter.final_norm)
    home = host_device(norm)
    norm.to(device)
    try:
        return norm(x).float().cpu()
    finally:
        norm.to(home)


def head_log_probs(model: nn.Module, h: torch.Tensor, vocab_chunk: int = 16384) -> torch.Tensor:
    """``log_softmax(head(h))`` in float32 for ``h [t, hidden]``, on ``h``'s device; a linear
    head is widened ``vocab_chunk`` rows at a time (never a float32 copy of the whole head), and
    a final softcap c (``final_logit_softcapping``) makes the logits ``c * tanh(logits / c)``.
    The head's weight is scanned for NaN/inf only when the logits are not finite: a scan of every
    chunk made Gemma 3 270M's disk-backed evaluation windows about 40% slower (BENCHMARKS.md)."""
    name = get_adapter(model.config).lm_head
    head = model.get_submodule(name)
    if isinstance(head, nn.Linear):
        w, b = head.weight, head.bias
        logits = torch.cat(
            [h @ w[v : v + vocab_chunk].to(h.device, torch.float32).t()
             for v in range(0, w.shape[0], vocab_chunk)],
            dim=1,
        )  # fmt: skip
        if b is not None:
            logits += b.to(h.device, torch.float32)
        if not torch.isfinite(logits).all():
            _check_finite(w, f"{name}.weight")
    else:
        logits = head(h).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return torch.log_softmax(logits, dim=-1)


def layer_bytes(model: nn.Module, i: int = 0, itemsize: int = 4) -> int:
    """Bytes of decoder layer ``i``'s tensors in the compute dtype (meta tensors count too)."""
    layer = get_adapter(model.config).decoder_layers(model)[i]
    return sum(
        t.numel() * (itemsize if t.is_floating_point() else t.element_size())
        for t in layer.state_dict().values()
    )


def calibration_bytes(config, tokens: int) -> int:
    """Float32 activations one layer's calibration holds for ``tokens`` tokens: the layer's input
    and output, the inputs of q, o and gate (hidden-wide) and of down (intermediate-wide)."""
    return tokens * 4 * (5 * config.hidden_size + config.intermediate_size)


def check_fits(model: nn.Module, device, activation_bytes: int, what: str) -> None:
    """Refuse, before any work, a CUDA device whose free memory cannot hold one decoder layer in
    float32 plus ``activation_bytes`` of its inputs."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    need = layer_bytes(model) + activation_bytes
    free, _total = torch.cuda.mem_get_info(device)
    if need > free:
        raise CompressError(
            f"{what} on {device}: one decoder layer needs {size(layer_bytes(model))} in float32 "
            f"plus about {size(activation_bytes)} of calibration activations, but the device "
            f"has {size(free)} free. Lower calib.samples (or calib.seqlen), free the GPU, or "
            f"set device=cpu."
        )


def size(n: int) -> str:
    """Bytes for a person: GiB from 1 GiB up, else MiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
