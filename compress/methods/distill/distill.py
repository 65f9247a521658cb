"""Knowledge distillation of a student (the pruned model) from a teacher (the source).

Losses on the next-token logits of each position t (z_s student, z_t teacher, T temperature)::

    kl  = T^2 * mean_t sum_v p_t(v) (log p_t(v) - log q_t(v))     p = softmax(z_t / T), q = softmax(z_s / T)
    ce  = mean_t -log softmax(z_s)_t(x_{t+1})                      (no teacher)
    mix = alpha * kl + (1 - alpha) * ce

Minitron distils with forward KL on the logits alone (``kl``, T = 1). The loop is
``compress.methods.distill.trainer.train`` (accelerate; resumable checkpoints).

With ``kl_chunk`` = C > 0 (``distill.kl_chunk``; ``auto``: 4096 on CUDA, 0 on the CPU) the
losses are the same sums taken C tokens at a time: both models run up to their final norm,
and each chunk applies the two heads, the softmaxes and the loss under activation
checkpointing (recomputed in the backward pass), so ``[batch, seq, vocab]`` float32 logits of
student and teacher never exist, only ``[C, vocab]`` ones. The teacher runs without gradients,
in bfloat16 under bf16 mixed precision.

As a pipeline stage (``distill``), the keys are ``distill.*``: tokens (0 skips),
data (null: ``data.calib.source``), loss, temperature, alpha, and the TrainConfig
fields (seqlen, batch_size, grad_accum, lr, ...). Checkpoints live beside the run
folder (``.<run>.distill/``) unless ``distill.checkpoint_dir`` says otherwise; the
same command resumes an interrupted run.

Standalone, on one process or several::

    python -m compress.cli.distill --student DIR --teacher DIR --data FILE --out DIR --tokens N
    accelerate launch --multi_gpu --num_processes 2 -m compress.methods.distill.distill --student DIR ...
    accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 -m compress.methods.distill.distill ...

(accelerate 1.15's ``launch --cpu --num_processes 2`` starts one process unless given an MPI
hostfile; ``--multi_gpu`` goes through torchrun, and without CUDA the processes form a
MULTI_CPU group over gloo; ``--use_fsdp --fsdp_version 2`` shards the student, see
``compress.methods.distill.fsdp``.)
"""

import dataclasses
import hashlib
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from compress.arch.adapters import get_adapter
from compress.errors import CompressError
from compress.io.data import check_source, read_text
from compress.io.run_folder import weights_sha256
from compress.io.source import load_model
from compress.methods.distill import fsdp
from compress.methods.distill.trainer import TrainConfig, make_accelerator, token_blocks, train
from compress.methods.prune.prune import param_total

log = logging.getLogger(__name__)

LOSSES = ("kl", "ce", "mix")


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 at least (float64 stays float64)."""
    return t if t.dtype == torch.float64 else t.float()


def kl_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Forward KL(teacher || student) per token, averaged over tokens, times T^2."""
    T = float(temperature)
    log_q = F.log_softmax(_wide(student_logits).flatten(0, -2) / T, dim=-1)
    log_p = F.log_softmax(_wide(teacher_logits).flatten(0, -2) / T, dim=-1)
    return T * T * F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")


def ce_loss(student_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(_wide(student_logits).flatten(0, -2), targets.flatten())


def _normed_hidden(model, batch: torch.Tensor) -> torch.Tensor:
    """The final norm's output ``[B, seq, hidden]`` (the head's input); the head itself runs on
    the last position only (``logits_to_keep=1``)."""

    inner = getattr(model, "module", model)  # DDP's wrapped model
    inner = getattr(inner, "_orig_mod", inner)  # torch.compile's
    seen = {}
    norm = inner.get_submodule(get_adapter(inner.config).final_norm)
    handle = norm.register_forward_hook(lambda _m, _a, out: seen.__setitem__("h", out))
    try:
        model(batch, use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    return seen["h"]


def _head(model) -> torch.nn.Module:

    inner = getattr(model, "module", model)
    inner = getattr(inner, "_orig_mod", inner)
    return inner.get_submodule(get_adapter(inner.config).lm_head)


def _chunk_loss(hs, ht, w_s, w_t, targets, kind: str, T: float, alpha: float):
    """Sum over the chunk's tokens of the loss (see the module docstring)."""
    zs = _wide(hs @ w_s.t())
    total = zs.new_zeros(())
    if kind != "ce":
        log_q = F.log_softmax(zs / T, dim=-1)
        with torch.no_grad():
            log_p = F.log_softmax(_wide(ht @ w_t.t()) / T, dim=-1)
        kl = T * T * (log_p.exp() * (log_p - log_q)).sum()
        total = kl if kind == "kl" else alpha * kl
    if kind != "kl":
        ce = F.cross_entropy(zs, targets, reduction="sum")
        total = total + (ce if kind == "ce" else (1 - alpha) * ce)
    return total


def chunked_loss(student, teacher, batch, kind: str, T: float, alpha: float, chunk: int):
    """The loss of ``distill_loss`` taken ``chunk`` tokens at a time (module docstring)."""
    from torch.utils.checkpoint import checkpoint

    hs = _normed_hidden(student, batch)[:, :-1].flatten(0, 1)
    ht = None
    if kind != "ce":
        with torch.no_grad():
            ht = _normed_hidden(teacher, batch)[:, :-1].flatten(0, 1)
    targets = batch[:, 1:].flatten()
    w_s = _head(student).weight
    w_t = _head(teacher).weight if teacher is not None else None
    total = _wide(hs.new_zeros(()))
    for a in range(0, hs.shape[0], chunk):
        b = a + chunk
        total = total + checkpoint(
            _chunk_loss,
            hs[a:b],
            ht[a:b] if ht is not None else None,
            w_s,
            w_t,
            targets[a:b],
            kind,
            T,
            alpha,
            use_reentrant=False,
        )
    return total / hs.shape[0]


def plain_head(model) -> bool:
    """Whether the logits are the head of the final norm's output alone (no soft-capping, no
    bias), as ``chunked_loss`` computes them."""
    head = _head(model)
    return (
        getattr(model.config, "final_logit_softcapping", None) is None
        and isinstance(head, torch.nn.Linear)
        and head.bias is None
    )


def distill_loss(
    teacher, kind: str = "kl", temperature: float = 1.0, alpha: float = 0.5, chunk: int = 0
):
    """``loss_fn(student, batch)`` for the trainer: ``kind`` in kl | ce | mix; ``chunk`` > 0
    takes the loss that many tokens at a time (``chunked_loss``)."""
    if kind not in LOSSES:
        raise CompressError(f"distill.loss={kind!r}: use one of {', '.join(LOSSES)}.")
    if not 0.0 <= alpha <= 1.0:
        raise CompressError(
            f"distill.alpha={alpha} must lie in [0, 1] (the weight of the KL term)."
        )

    def loss_fn(student, batch):
        if chunk > 0:
            return chunked_loss(student, teacher, batch, kind, float(temperature), alpha, chunk)
        logits = student(batch, use_cache=False).logits[:, :-1]
        if kind == "ce":
            return ce_loss(logits, batch[:, 1:])
        with torch.no_grad():
            teacher_logits = teacher(batch, use_cache=False).logits[:, :-1]
        kl = kl_loss(logits, teacher_logits, temperature)
        return kl if kind == "kl" else alpha * kl + (1 - alpha) * ce_loss(logits, batch[:, 1:])

    return loss_fn


def check_vocab(student, teacher) -> None:
    vs, vt = student.config.vocab_size, teacher.config.vocab_size
    if vs != vt:
        raise CompressError(
            f"teacher and student have different vocabularies ({vt} and {vs} tokens): logit distillation "
            f"compares distributions over the same tokens. Distil from the model the student was pruned "
            f"from, or use distill.loss=ce (no teacher)."
        )


def run_distill(
    student,
    teacher,
    blocks: torch.Tensor,
    tc: TrainConfig,
    kind: str,
    temperature: float,
    alpha: float,
    fingerprint: dict,
    kl_chunk="auto",
) -> dict:
    """Distil ``student`` in place; returns the trainer's stats. ``kl_chunk``: see the module
    docstring."""
    fsdp.check_settings(tc.compile)
    if teacher is not None:
        check_vocab(student, teacher)
    if any(p.dtype != torch.float32 for p in student.parameters() if p.is_floating_point()):
        student.float()  # float32 master weights (a 16-bit source loads 16-bit: model.dtype=auto)
    acc = make_accelerator(tc)
    if teacher is not None:
        teacher.to(acc.device).eval().requires_grad_(False)
        if acc.mixed_precision == "bf16":
            teacher.to(torch.bfloat16)  # no gradients, no optimizer state: 16-bit is enough
    chunk = resolve_chunk(kl_chunk, acc.device)
    if chunk and not (plain_head(student) and (teacher is None or plain_head(teacher))):
        log.info("distill.kl_chunk: the head is not a plain linear; the loss takes whole logits")
        chunk = 0
    fp = {
        **fingerprint,
        "loss": kind,
        "temperature": float(temperature),
        "alpha": float(alpha) if kind == "mix" else None,
    }
    loss = distill_loss(teacher, kind, temperature, alpha, chunk)
    return train(student, loss, blocks, tc, fp, acc)


def resolve_chunk(value, device) -> int:
    """``distill.kl_chunk``: auto (4096 tokens on CUDA, 0 = whole logits on the CPU) or a count."""
    if value in (None, "auto"):
        return 4096 if torch.device(device).type == "cuda" else 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CompressError(
            f"distill.kl_chunk={value!r}: give auto, 0 (whole logits) or a number of tokens "
            f"such as 4096."
        )
    return value


def train_config(d, seed: int = 0, **over) -> TrainConfig:
    """A TrainConfig from a mapping (``distill.*``); unknown keys are ignored."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    kw = {k: v for k, v in dict(d).items() if k in names and v is not None}
    kw.setdefault("seed", seed)
    kw.update(over)
    if "betas" in kw:
        kw["betas"] = tuple(kw["betas"])
    return TrainConfig(**kw)


def curve(losses: list, points: int = 20) -> list:
    """``points`` (step, mean loss) pairs summarising a loss curve."""
    if not losses:
        return []
    n = len(losses)
    edges = [round(i * n / points) for i in range(points + 1)]
    return [
        [edges[i + 1], round(sum(losses[edges[i] : edges[i + 1]]) / (edges[i + 1] - edges[i]), 4)]
        for i in range(points)
        if edges[i + 1] > edges[i]
    ]


SAMPLER_SEED_MAX = (2**64 - 1) // 1_000_004  # the trainer seeds pass e with seed * 1_000_003 + e


def check(cfg, hf_config=None) -> None:
    """Refuse, before the model loads, ``distill.*`` settings the stage would skip on, replace
    or fail on only after the stages before it (0 tokens skips distillation)."""
    d = cfg.distill
    if d.get("data"):
        check_source(d.data, role="distill")
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        fsdp.check_settings(bool(d.get("compile", False)))
    rules = (
        ("tokens", 0, "the training budget in tokens; 0 skips distillation"),
        ("seqlen", 2, "tokens per training sequence"),
        ("batch_size", 1, "sequences per process and micro-step"),
        ("grad_accum", 1, "micro-steps per optimizer step"),
        ("checkpoint_every", 0, "optimizer steps between checkpoints; 0: none"),
    )
    for key, low, what in rules:
        v = d.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise CompressError(
                f"distill.{key}={v!r}: distill.{key} takes an integer >= {low} ({what})."
            )
    if d.get("loss", "kl") not in LOSSES:
        raise CompressError(f"distill.loss={d.loss!r}: use one of {', '.join(LOSSES)}.")
    resolve_chunk(d.get("kl_chunk", "auto"), "cpu")
    if d.tokens and int(cfg.seed) > SAMPLER_SEED_MAX:
        raise CompressError(
            f"seed={cfg.seed}: the distill stage seeds each pass over its text with "
            f"seed x 1,000,003 + pass, a 64-bit number; use a seed up to {SAMPLER_SEED_MAX}."
        )


def distill(model, ctx):
    """Pipeline stage: distil the model (student) from ``model.path`` (teacher) on ``distill.data``."""

    cfg, d = ctx.cfg, ctx.cfg.distill
    kind = d.get("loss", "kl")
    tc = train_config(d, seed=int(cfg.seed))
    ctx.record["params"] = param_total(model)
    if tc.tokens <= 0:
        ctx.record["distill_tokens"] = 0
        return model
    if tc.checkpoint_dir is None and ctx.run_dir is not None:
        run_dir = Path(ctx.run_dir)
        tc.checkpoint_dir = str(run_dir.parent / f".{run_dir.name}.distill")
    teacher = None
    if kind != "ce":
        m = cfg.model
        teacher = load_model(m.path, m.dtype, m.trust_remote_code)[0]
    source = d.get("data") or cfg.data.calib.source
    text = read_text(source, role="calib" if not d.get("data") else "distill")
    blocks = token_blocks(ctx.tokenizer, text, tc.seqlen)
    fingerprint = {
        "recipe": cfg.name,
        "model": str(cfg.model.path),
        "student": weights_sha256(model),
        "teacher": weights_sha256(teacher) if teacher is not None else None,
        "data": hashlib.sha256(text.encode()).hexdigest(),
    }
    stats = run_distill(
        model,
        teacher,
        blocks,
        tc,
        kind,
        d.get("temperature", 1.0),
        d.get("alpha", 0.5),
        fingerprint,
        d.get("kl_chunk", "auto"),
    )
    del teacher
    losses = stats["losses"]
    ctx.record.update(
        distill_tokens=stats["tokens"],
        distill={
            "loss": kind,
            "steps": stats["steps"],
            "tokens_per_step": stats["tokens_per_step"],
            "parallel": stats["parallel"],
            "tok_s": stats.get("tok_s"),
            "elapsed_s": stats.get("elapsed_s"),
            "resumed_from": stats.get("resumed_from"),
            "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None,
            "curve": curve(losses),
            "data": str(source),
            "blocks": int(blocks.shape[0]),
        },
    )
    return model
