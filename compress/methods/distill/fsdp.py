"""Fully sharded data parallel training (FSDP2: torch's ``fully_shard``) under ``accelerate launch``.

Launch::

    accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 -m compress.methods.distill.distill ...
    accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 -m compress recipe=minitron_width ...

accelerate 1.15 turns ``--use_fsdp`` (or an accelerate config with ``distributed_type: FSDP``)
into environment variables (``ACCELERATE_USE_FSDP``, ``FSDP_VERSION``,
``FSDP_RESHARD_AFTER_FORWARD``, ``FSDP_OFFLOAD_PARAMS``, ...), but switches its own FSDP mode on
only on accelerator devices: on the CPU its processes form a plain MULTI_CPU (gloo) group. The
trainer therefore reads those variables itself and shards with torch's ``fully_shard`` on the GPU
and the CPU alike; accelerate still launches the processes, joins them and reduces the losses.

Sharding: one FSDP unit per decoder layer and one root for the rest (embeddings, final norm,
head; a tied head stays one parameter). Each parameter becomes a DTensor split along dim 0 over
the N ranks, so rank r holds ~1/N of the weights, gradients and AdamW moments; a unit's full
weights exist only around its forward and backward (all-gather), gradients are reduce-scattered
(averaged) at the last micro-step of an optimizer step (``set_requires_gradient_sync``). The
root keeps its full weights from its forward to its backward (``reshard_after_forward=False``),
so the chunked distillation loss (``distill.kl_chunk``), which applies the head after the
forward, sees the whole head and its gradient is reduce-scattered with the root's. The trainer
shards a copy of the student (the caller's whole model stays where it was meanwhile, as every
rank loaded it); the trained weights are gathered back into it at the end, whole on every rank
as before training. The copy is made on the CPU and each unit moves to the GPU as it is sharded
(``shard``), so no rank ever holds the whole student on its GPU. The teacher is not trained and stays replicated.

Checkpoints: ``torch.distributed.checkpoint`` (DCP) of ``{"model", "optim"}`` from
``get_state_dict``: every rank writes its own shard (``dcp/__<rank>_0.distcp``, with a shared
``dcp/.metadata``), and loading reads each rank's shard back in place, so resuming is exact.

Refused before any work (``check_settings``): ``--fsdp_version 1`` (FSDP1 is deprecated in
torch; FSDP2 is what is implemented and tested), parameter offload (``--fsdp_offload_params``)
and ``distill.compile`` (not tried under FSDP).
"""

import copy
import logging
import os

import torch

from compress.arch.adapters import get_adapter
from compress.errors import CompressError

log = logging.getLogger(__name__)


def _flag(name: str, default: str = "false") -> bool:
    return os.environ.get(name, default).strip().lower() in ("1", "true", "yes")


def requested() -> bool:
    """Whether ``accelerate launch --use_fsdp`` started this process among several."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return _flag("ACCELERATE_USE_FSDP") and world > 1


def check_settings(compile: bool = False) -> None:
    """Refuse an FSDP launch the trainer cannot honour (module docstring); no-op without FSDP."""
    if not requested():
        return
    fix = "Relaunch without it (`accelerate launch --multi_gpu` runs DDP) or drop the setting."
    version = os.environ.get("FSDP_VERSION", "1").strip()
    if version != "2":
        raise CompressError(
            f"`accelerate launch --use_fsdp` asked for FSDP version {version}; compress trains "
            f"with FSDP2 (torch's fully_shard) only. Add `--fsdp_version 2` to the launch "
            f"command (or fsdp_version: 2 in the accelerate config)."
        )
    if _flag("FSDP_OFFLOAD_PARAMS"):
        raise CompressError(
            "`--fsdp_offload_params true`: parameter offload is not supported by compress's "
            f"FSDP trainer. {fix}"
        )
    if compile:
        raise CompressError(f"distill.compile=true is not supported under FSDP. {fix}")


def shard(model, device, activation_checkpointing: bool = False):
    """A copy of ``model`` sharded over the default process group, on ``device`` (docstring).

    The copy is made on the CPU and reaches ``device`` one unit at a time: ``fully_shard`` moves
    the unit's parameters and buffers to its mesh's device, keeps this rank's 1/N slice of each
    and drops the rest when it returns, so a rank never holds more than its shards plus one
    whole unit there (never the whole student). ``model`` itself is moved to the CPU first if it
    is elsewhere (the trainer moves it back with the trained weights)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = torch.device(device)
    if device.type == "cuda":  # the mesh places the shards on the current device
        device = torch.device(
            "cuda", torch.cuda.current_device() if device.index is None else device.index
        )
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    if any(t.device.type != "cpu" for t in (*model.parameters(), *model.buffers())):
        model.cpu()
    work = copy.deepcopy(model)
    work.train()
    if activation_checkpointing:
        work.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reshard = _flag("FSDP_RESHARD_AFTER_FORWARD", "true")
    layers = get_adapter(work.config).decoder_layers(work)
    for layer in layers:  # to the device and sharded, one layer at a time
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    # the root: the rest (embeddings, final norm, head, rotary buffers); its weights are needed at once
    fully_shard(work, mesh=mesh, reshard_after_forward=False)
    astray = [
        n
        for n, t in (*work.named_parameters(), *work.named_buffers())
        if t.device.type != device.type or (device.type != "cpu" and t.device != device)
    ]  # (accelerate names the CPU "cpu:0", tensors report "cpu")
    if astray:  # fully_shard moves what it manages; anything else would run on the wrong device
        raise RuntimeError(f"fsdp: {astray[:3]} not on {device} after sharding")
    if torch.distributed.get_rank() == 0:
        log.info(
            "fsdp: the student sharded over %d processes in %d units",
            torch.distributed.get_world_size(),
            len(layers) + 1,
        )
    return work


def set_sync(model, sync: bool) -> None:
    """Reduce-scatter the gradients in this backward (the last micro-step) or keep accumulating."""
    model.set_requires_gradient_sync(sync)


def gather_into(sharded, model) -> None:
    """The full trained weights of ``sharded`` copied into ``model``, one parameter all-gathered
    at a time (collective: every rank, in the same order)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in sharded.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            params[name].copy_(full)


def save(folder, model, opt) -> None:
    """Every rank's shard of the weights and the optimizer state into ``folder`` (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(folder))


def load(folder, model, opt) -> None:
    """Each rank's shard of a ``save`` read back into the sharded ``model`` and ``opt``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def clip_grad_norm_(model, max_norm: float) -> torch.Tensor:
    """Clip by the global norm: each rank's squared shard norms, all-reduced (DTensor)."""
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
