"""A small training loop on accelerate, resumable to the bit.

The same code runs on one CPU, several GPUs (DDP) or under ``accelerate launch``
(``--num_processes 2 --cpu`` runs DDP over gloo). ``train`` takes a
``loss_fn(model, batch) -> scalar`` (distillation, next-token CE, ...).

Data: ``blocks [n, seqlen]`` of token ids. Global sample g of the run is block
``perm_e[g mod n]`` with e = g div n and ``perm_e`` a permutation seeded by
(seed, e), so the order depends on the step alone. Micro-step m of optimizer
step s on process r reads the ``batch_size`` samples starting at::

    g0 = ((s * grad_accum + m) * world + r) * batch_size

so one process with batch 2B sees the same global batch as two with batch B.

Schedule: AdamW, linear warm-up for ``warmup`` x steps, then cosine decay to
``min_lr_ratio`` x lr::

    lr(s) = lr * (s + 1) / W                                       s < W
    lr(s) = lr * (m + (1 - m) * (1 + cos(pi * (s - W) / (S - W))) / 2)   otherwise

Checkpoints (every ``checkpoint_every`` steps, in ``checkpoint_dir``):
``step-NNNNNNNN/`` with ``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``,
``rng-<rank>.pt`` and ``state.json`` (step, losses, fingerprint), written into a
temporary folder and renamed. A run started with the same ``checkpoint_dir``
resumes from the newest one; the data position is the step. Checkpoints of other
settings (``fingerprint``) are refused. Optimizer state is saved by the main
process (DDP keeps it identical on every rank).

FSDP (``accelerate launch --use_fsdp --fsdp_version 2 --num_processes N``): the student is
sharded with torch's ``fully_shard`` (``compress.methods.distill.fsdp``), one unit per decoder layer; a
checkpoint then holds ``dcp/`` (torch.distributed.checkpoint: every rank's shard of the weights
and of the AdamW state) instead of ``model.safetensors`` and ``optimizer.pt``, and resumes to the
bit like the others. Tested on 2 CPU processes over gloo: the loss curve of one process with the
same global batch within 1e-5 relative, resume to the bit (tests/test_distill_fsdp.py).
"""

import contextlib
import json
import logging
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.optim.lr_scheduler import LambdaLR
from tqdm import tqdm

from compress.arch.adapters import get_adapter
from compress.errors import CompressError
from compress.io.checkpoint import guard_safetensors
from compress.io.data import tokenize
from compress.io.run_folder import commit_dir
from compress.methods.distill import fsdp

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    tokens: int  # budget: training stops after ceil(tokens / tokens per step) steps
    seqlen: int = 512
    batch_size: int = 1  # sequences per process and micro-step
    grad_accum: int = 4  # micro-steps per optimizer step
    lr: float = 2e-4
    min_lr_ratio: float = 0.1
    warmup: float = 0.05  # fraction of the steps
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.95)
    grad_clip: float = 1.0  # 0: off
    mixed_precision: str = (
        "auto"  # auto (bf16 where the GPU supports it, else no) | no | bf16 | fp16
    )
    seed: int = 0
    checkpoint_every: int = 0  # optimizer steps; 0: no checkpoints
    checkpoint_dir: str | None = None
    keep_checkpoints: bool = False  # keep checkpoint_dir once training completes
    progress: bool = True
    extra: dict = field(default_factory=dict)  # caller's settings, part of the fingerprint
    tokens_per_step: int | str = 0  # > 0: grad_accum from it; auto: batch from device memory
    minutes: float = 0.0  # > 0: stop after this many minutes of training (the schedule shrinks)
    activation_checkpointing: bool = False  # recompute each layer's activations in backward
    compile: bool = False  # torch.compile the student

    def schedule_keys(self) -> dict:
        """Settings a resumed run must share with the checkpoint."""
        d = asdict(self)
        for k in (
            "checkpoint_every",
            "checkpoint_dir",
            "keep_checkpoints",
            "progress",
            "mixed_precision",
            "tokens_per_step",
            "minutes",
            "activation_checkpointing",
            "compile",
        ):
            d.pop(k)
        d["betas"] = list(d["betas"])
        return d


def make_accelerator(tc: TrainConfig):
    from accelerate import Accelerator

    mp = tc.mixed_precision
    if mp == "auto":
        mp = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    # cpu=True on a machine without CUDA: under `accelerate launch --multi_gpu` (torchrun) the
    # processes then form a MULTI_CPU group over gloo instead of running alone
    return Accelerator(mixed_precision=mp, cpu=not torch.cuda.is_available())


def _on(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def training_bytes(model, device, sharded: bool = False, world: int = 1) -> int:
    """Bytes the student will add on ``device`` once training runs, beyond what it holds there now:

    - its parameters and buffers not yet on ``device``;
    - for each trainable parameter, its gradient and AdamW's two moments (``exp_avg``,
      ``exp_avg_sq``), each of the parameter's dtype and shape: 3 x its bytes;
    - under DDP (``world`` > 1, not sharded), DDP's gradient buckets, one more copy of the
      gradients;

    under FSDP (``sharded``) all of these are split over ``world`` ranks, and a rank also holds
    unsharded, while they compute, the root unit's parameters (embeddings, final norm, head: kept
    from forward to backward) and two decoder layers' (the one running and the one prefetched),
    each with its gradient before the reduce-scatter (``compress.methods.distill.fsdp``). The teacher is
    on the device already, in the free memory measured."""
    device = torch.device(device)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    moved = [t for t in (*params, *model.buffers()) if not _on(t, device)]
    need = _nbytes(moved) + 3 * _nbytes(trainable)
    if not sharded:
        return need + (_nbytes(trainable) if world > 1 else 0)

    layers = list(get_adapter(model.config).decoder_layers(model))
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    root = _nbytes(p for p in params if id(p) not in in_layers)
    layer = max((_nbytes(layer.parameters()) for layer in layers), default=0)
    return -(-need // world) + 2 * (root + 2 * layer)  # unsharded: parameters and gradients


def plan_batch(tc: TrainConfig, world: int, device, model=None, sharded=False) -> TrainConfig:
    """``tc`` with ``batch_size`` and ``grad_accum`` set from ``tokens_per_step``:

    - 0: as given (today's default);
    - N > 0: ``grad_accum = ceil(N / (seqlen * batch_size * world))``;
    - ``auto``: on CUDA, sequences per micro-step from the memory left once the student, its
      gradients and AdamW state are in place (free memory now, less :func:`training_bytes`;
      refused if that is not positive): activations of about 34 * hidden bytes per token and
      layer in 16-bit (Korthikanti et al. 2022) within half of it; and about 2^19 tokens a step
      (at most 1/64 of the budget). On the CPU, as given.
    """
    import dataclasses

    n = tc.tokens_per_step
    if n in (0, None) or (n == "auto" and torch.device(device).type != "cuda"):
        return tc
    if n == "auto":
        cfg = model.config
        per_seq = tc.seqlen * cfg.num_hidden_layers * cfg.hidden_size * 34
        free, _ = torch.cuda.mem_get_info(device)
        need = training_bytes(model, device, sharded, world)
        if free <= need:
            raise CompressError(
                f"distill.tokens_per_step=auto: the student needs {need / 2**30:.2f} GiB more on "
                f"{device} for its weights, gradients and AdamW state, and {free / 2**30:.2f} GiB "
                f"are free. Shard it over more GPUs (accelerate launch --use_fsdp --fsdp_version 2 "
                f"--num_processes N), free the device, or train a smaller student."
            )
        batch = max(1, min(64, int(0.5 * (free - need) // per_seq)))
        target = max(tc.seqlen * batch * world, min(2**19, tc.tokens // 64))
        accum = max(1, round(target / (tc.seqlen * batch * world)))
        return dataclasses.replace(tc, batch_size=batch, grad_accum=accum)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise CompressError(
            f"distill.tokens_per_step={n!r}: give auto, 0 (batch_size x grad_accum x seqlen) "
            f"or a number of tokens per optimizer step."
        )
    accum = max(1, math.ceil(n / (tc.seqlen * tc.batch_size * world)))
    return dataclasses.replace(tc, grad_accum=accum)


def token_blocks(tokenizer, text: str, seqlen: int) -> torch.Tensor:
    """``[n, seqlen]`` consecutive non-overlapping blocks of the tokenized text."""

    ids = tokenize(tokenizer, text)
    n = ids.numel() // seqlen
    if n == 0:
        raise CompressError(
            f"training text has {ids.numel()} tokens, fewer than one block of {seqlen}; "
            f"lower the sequence length or use a longer text."
        )
    return ids[: n * seqlen].reshape(n, seqlen)


class Sampler:
    """Global sample g -> block index, a seeded permutation per pass over the blocks."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.perms = n, seed, {}

    def __call__(self, g: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(g)
        for i, gi in enumerate(g.tolist()):
            e = gi // self.n
            if e not in self.perms:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + e)
                self.perms[e] = torch.randperm(self.n, generator=gen)
            out[i] = self.perms[e][gi % self.n]
        return out


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


# ---- checkpoints --------------------------------------------------------------------------------


def latest_checkpoint(folder: Path | None) -> Path | None:
    if folder is None or not Path(folder).is_dir():
        return None
    done = sorted(p for p in Path(folder).glob("step-*") if (p / "state.json").is_file())
    return done[-1] if done else None


def _check_fingerprint(found: Path, saved: dict, now: dict) -> None:
    diff = [
        f"{k}: {saved.get(k)!r} in the checkpoint, {now.get(k)!r} now"
        for k in sorted(set(saved) | set(now))
        if saved.get(k) != now.get(k)
    ]
    if diff:
        raise CompressError(
            f"checkpoint '{found}' belongs to another run ({'; '.join(diff[:4])}). Resuming would mix "
            f"two trainings. Remove the folder '{found.parent}' to start over, or set another "
            f"checkpoint folder (distill.checkpoint_dir / --checkpoint-dir)."
        )


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _save(
    acc, folder: Path, step: int, model, opt, sched, meta: dict, keep: int = 1, sharded=False
) -> Path:
    from safetensors.torch import save_model

    final, tmp = folder / f"step-{step:08d}", folder / f".step-{step:08d}.tmp"
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    acc.wait_for_everyone()
    torch.save(_rng_state(), tmp / f"rng-{acc.process_index}.pt")
    if sharded:  # every rank writes its shard of the weights and the optimizer state
        fsdp.save(tmp / "dcp", model, opt)
    elif acc.is_main_process:
        save_model(acc.unwrap_model(model), str(tmp / "model.safetensors"))  # tied tensors once
        torch.save(opt.state_dict(), tmp / "optimizer.pt")
    if acc.is_main_process:
        torch.save(sched.state_dict(), tmp / "scheduler.pt")
        (tmp / "state.json").write_text(json.dumps(meta, indent=1))
    acc.wait_for_everyone()
    if acc.is_main_process:
        commit_dir(tmp, final)
        for old in sorted(folder.glob("step-*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint %s", final)
    acc.wait_for_everyone()
    return final


def _load_weights(found: Path, model) -> None:
    from safetensors.torch import load_model

    with guard_safetensors(found):
        load_model(model, str(found / "model.safetensors"))


def _load_rest(found: Path, acc, model, opt, sched, sharded=False) -> None:
    if sharded:
        fsdp.load(found / "dcp", model, opt)
    else:
        opt.load_state_dict(
            torch.load(found / "optimizer.pt", map_location=acc.device, weights_only=True)
        )
    sched.load_state_dict(torch.load(found / "scheduler.pt", weights_only=True))
    rng = found / f"rng-{acc.process_index}.pt"
    if rng.is_file():
        state = torch.load(rng, weights_only=True)
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


# ---- the loop -----------------------------------------------------------------------------------


def train(
    model, loss_fn, blocks: torch.Tensor, tc: TrainConfig, fingerprint: dict, acc=None
) -> dict:
    """Train ``model`` in place on ``blocks`` for ``tc.tokens`` tokens; returns stats.

    ``loss_fn(model, batch [B, seqlen]) -> scalar`` runs under the accelerator's
    autocast. ``fingerprint`` identifies the run (model, teacher, data, recipe):
    a checkpoint with another fingerprint is refused.
    """
    acc = acc or make_accelerator(tc)
    world, rank = acc.num_processes, acc.process_index
    sharded = fsdp.requested()
    fsdp.check_settings(tc.compile)
    tc = plan_batch(tc, world, acc.device, model, sharded)
    per_step = tc.seqlen * tc.batch_size * tc.grad_accum * world
    steps = math.ceil(tc.tokens / per_step) if tc.tokens > 0 else 0
    stats = {
        "steps": steps,
        "tokens": steps * per_step,
        "tokens_per_step": per_step,
        "batch_size": tc.batch_size,
        "grad_accum": tc.grad_accum,
        "world_size": world,
        "parallel": "fsdp" if sharded else ("ddp" if world > 1 else "none"),
        "losses": [],
    }
    if steps == 0:
        return stats
    if blocks.shape[1] != tc.seqlen:
        raise CompressError(
            f"training blocks have {blocks.shape[1]} tokens, the config says seqlen={tc.seqlen}."
        )
    fp = {
        **fingerprint,
        **tc.schedule_keys(),
        "global_batch": tc.batch_size * world,
        "blocks": int(blocks.shape[0]),
    }
    if sharded:
        fp["sharded"] = "fsdp"  # the checkpoint's layout: dcp/ shards
    folder = Path(tc.checkpoint_dir) if tc.checkpoint_dir else None

    found, start, losses, elapsed = latest_checkpoint(folder), 0, [], 0.0
    if found is not None:
        meta = json.loads((found / "state.json").read_text())
        _check_fingerprint(found, meta["fingerprint"], json.loads(json.dumps(fp)))
        if not sharded:
            _load_weights(found, model)
        start, losses, elapsed = meta["step"], meta["losses"], meta.get("elapsed_s", 0.0)
        log.info("resuming from %s (step %d of %d)", found, start, steps)

    target, model = (
        model,
        (fsdp.shard(model, acc.device, tc.activation_checkpointing) if sharded else model),
    )
    model.train()
    if tc.activation_checkpointing and not sharded:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fused = {"fused": True} if acc.device.type == "cuda" else {}  # one kernel for all params
    opt = torch.optim.AdamW(
        model.parameters(), lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay, **fused
    )
    plan = {"steps": steps}  # minutes: shrunk once the step time is known
    if found is not None and tc.minutes > 0:
        plan["steps"] = min(steps, meta.get("steps", steps))
    warm = max(1, round(tc.warmup * steps)) if tc.warmup > 0 else 0
    sched = LambdaLR(opt, lambda s: lr_factor(s, plan["steps"], warm, tc.min_lr_ratio))
    if not sharded:  # FSDP: sharded above; accelerate's MULTI_CPU prepare would wrap DDP around it
        model, opt = acc.prepare(model, opt)
    if tc.compile:
        model = torch.compile(model)
    if found is not None:
        _load_rest(found, acc, model, opt, sched, sharded)

    sample = Sampler(blocks.shape[0], tc.seed)
    bar = tqdm(
        total=steps,
        initial=start,
        desc="train",
        unit="step",
        disable=not (tc.progress and acc.is_local_main_process),
    )
    t_run = time.time()
    step = start
    while step < plan["steps"]:
        t0 = time.time()
        total = torch.zeros((), device=acc.device)
        for m in range(tc.grad_accum):
            g0 = ((step * tc.grad_accum + m) * world + rank) * tc.batch_size
            batch = blocks[sample(torch.arange(g0, g0 + tc.batch_size))].to(acc.device)
            last = m == tc.grad_accum - 1
            if sharded:
                fsdp.set_sync(model, last)
            sync = contextlib.nullcontext() if last or sharded else acc.no_sync(model)
            with sync:
                with acc.autocast():
                    loss = loss_fn(model, batch)
                acc.backward(loss / tc.grad_accum)
            total += loss.detach().float()
        if tc.grad_clip and sharded:
            fsdp.clip_grad_norm_(model, tc.grad_clip)
        elif tc.grad_clip:
            acc.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss_value = acc.reduce(total / tc.grad_accum, "mean").item()
        losses.append(round(loss_value, 6))
        tok_s = per_step / max(time.time() - t0, 1e-9)
        bar.set_postfix(
            loss=f"{loss_value:.4f}", tok_s=f"{tok_s:.0f}", lr=f"{sched.get_last_lr()[0]:.2e}"
        )
        bar.update(1)
        done = step + 1
        step = done
        if (
            tc.minutes > 0 and done - start == 3
        ):  # the budget in time: fewer steps, same schedule shape
            per = (time.time() - t_run) / 3
            fit = start + 3 + int((tc.minutes * 60 - (time.time() - t_run)) / per)
            fit = int(acc.reduce(torch.tensor(fit, device=acc.device), "min").item())
            if fit < plan["steps"]:
                log.info("distill.minutes=%g: %d steps of %d fit", tc.minutes, fit, plan["steps"])
                plan["steps"] = max(done, fit)
                bar.total = plan["steps"]
        if (
            folder
            and tc.checkpoint_every
            and done % tc.checkpoint_every == 0
            and done < plan["steps"]
        ):
            meta = {
                "step": done,
                "steps": plan["steps"],
                "losses": losses,
                "fingerprint": fp,
                "elapsed_s": round(elapsed + time.time() - t_run, 2),
            }
            _save(acc, folder, done, model, opt, sched, meta, sharded=sharded)
    bar.close()
    run_s = time.time() - t_run
    acc.wait_for_everyone()
    if folder and acc.is_main_process and not tc.keep_checkpoints:
        shutil.rmtree(folder, ignore_errors=True)
    if sharded:  # the trained weights, whole on every rank, into the caller's model
        fsdp.gather_into(model, target)
        del model, opt, sched
        model = target.to(acc.device)
    model = acc.unwrap_model(model)
    model.eval()
    trained = (plan["steps"] - start) * per_step
    stats.update(
        steps=plan["steps"],
        tokens=plan["steps"] * per_step,
        losses=losses,
        resumed_from=start,
        elapsed_s=round(elapsed + run_s, 2),
        tok_s=round(trained / run_s, 1) if run_s > 0 else None,
    )
    return stats
