"""Drafters for speculative decoding: a second model with its own cache, or the target minus layers.

A drafter proposes up to γ tokens after the sequence ``seq`` (prompt + generated, whose last
token is not yet in the target's cache) and returns them with their probabilities p (None when
greedy). With ``stop_below`` = c > 0 it stops early after a draft d_i whose own probability
p_i(d_i) < c (softmax of the draft's logits when greedy): transformers' assistant confidence
threshold, which spares the draft steps and verification rows that a doubtful token would waste:

    ModelDraft      a smaller or compressed model of the same vocabulary, with its own KV cache;
                    after a round its cache rolls back to the accepted tokens (``sync``)
    LayerSkipDraft  the target itself with layers ``skip`` left out (self-speculative decoding:
                    Draft & Verify, arXiv 2309.08168); one weight copy, and one cache: the kept
                    layers write their K/V into the target's cache at the drafted slots, the
                    skipped layers write nothing, and the target's verification pass rewrites
                    all of them, so the draft reads the target's exact K/V for every accepted token.

A drafter is the propose half of the speculative policy (``Speculation``, in ``generate.py``),
so it drafts inside the round's generation step (``compress.decoder.step``); its forwards are
``step.forward``, the step's own call of a model.

Families: a draft may be of another family than the target (each runs its own architecture
spec); only the token ids must mean the same, so a draft whose vocabulary size or tokenizer is
not the target's is refused (``load_draft``) from its config.json and tokenizer, before its
weights load, naming both sizes.
"""

from pathlib import Path

import torch

from compress.arch.spec import spec_of
from compress.decoder.generate import static_step
from compress.decoder.kv import new_cache
from compress.decoder.model import load
from compress.decoder.sampling import Sampling, logits_to_probs
from compress.decoder.speculative.gamma import check_confidence
from compress.decoder.step import forward
from compress.errors import CompressError
from compress.io.checkpoint import read_config, read_tokenizer


def draw(logits: torch.Tensor, sampling: Sampling, gen) -> tuple[int, torch.Tensor | None]:
    """``(token, probs [V] or None)`` from one position's logits ``[V]``: argmax when greedy."""
    if sampling.temperature <= 0:
        return int(logits.argmax()), None
    probs = logits_to_probs(logits[None], sampling)[0].cpu()
    return int(torch.multinomial(probs, 1, generator=gen)), probs


def confidence(logits: torch.Tensor, token: int, probs: torch.Tensor | None) -> float:
    """The draft's probability of its own token: ``probs[token]``, or softmax(logits)[token]."""
    if probs is not None:
        return float(probs[token])
    z = logits.float()
    return float(1.0 / torch.exp(z - z[token]).sum())


def run_drafts(
    forward,
    first: list[int],
    length: int,
    gamma: int,
    sampling: Sampling,
    gen,
    device,
    stop_below: float = 0.0,
):
    """``(tokens [n <= γ], probs [n, V] or None)``: feed ``first`` at slots ``length...``, then
    each draft in turn, until γ drafts or one whose confidence is below ``stop_below``.

    ``forward(ids [1, T], pos [T]) -> logits [1, T, V]`` runs the draft over its cache.
    """
    tokens, probs, feed = [], [], first
    for i in range(gamma):
        pos = torch.arange(length, length + len(feed), device=device)
        logits = forward(torch.tensor([feed], device=device), pos)[0, -1]
        t, p = draw(logits, sampling, gen)
        length += len(feed)
        tokens.append(t)
        probs.append(p)
        feed = [t]
        if stop_below > 0 and i < gamma - 1 and confidence(logits, t, p) < stop_below:
            break
    return tokens, (None if sampling.temperature <= 0 or not probs else torch.stack(probs))


class ModelDraft:
    """A draft model with its own KV cache (``kv``, default fp16), prefilled with the prompt;
    ``compile``: its decode steps run ``compress.decoder.compiled``'s compiled step (CPU);
    ``stop_below``: the confidence under which a round's drafting stops."""

    shares_cache = False
    lookahead = 0  # tokens its cache must be able to roll back beyond one (the largest gamma)

    def __init__(
        self,
        model,
        kv: str = "fp16",
        kv_opts: dict | None = None,
        compile: bool = False,
        stop_below: float = 0.0,
    ):
        check_confidence(stop_below)
        self.model, self.kv, self.kv_opts, self.cache = model, kv, kv_opts or {}, None
        self.compile, self.step, self.stop_below = compile, None, stop_below

    def prefill(self, ids: list[int], max_len: int) -> None:

        if self.compile:
            self.step, self.cache = static_step(
                self.model, self.kv, self.kv_opts, 1, max_len, self.lookahead
            )
        else:
            self.cache = new_cache(
                self.model, self.kv, 1, max_len, lookahead=self.lookahead, **self.kv_opts
            )
        if len(ids) > 1:  # the last prompt token is fed with the first draft
            forward(self.model, self.cache, torch.tensor([ids[:-1]], device=self.model.device))

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if self.step is None:
            return forward(self.model, self.cache, ids, pos)
        for t in ids[0].tolist():  # the compiled step takes one token at a time, as a fresh [1, 1]
            logits = self.step(torch.tensor([[t]], device=ids.device), self.cache)
        return logits

    def propose(self, seq: list[int], gamma: int, sampling: Sampling, gen, target_cache=None):
        L, device = self.cache.length, self.model.device
        return run_drafts(self.forward, seq[L:], L, gamma, sampling, gen, device, self.stop_below)

    def sync(self, seq: list[int]) -> None:
        """Keep the tokens of ``seq`` the cache holds (all but the newest at most)."""
        self.cache.rollback(min(self.cache.length, len(seq) - 1))


class LayerSkipDraft:
    """The target with layers ``skip`` left out, drafting into the target's own cache."""

    shares_cache = True

    def __init__(self, model, skip, stop_below: float = 0.0):
        check_confidence(stop_below)
        n = model.spec.n_layers
        self.model, self.skip = model, frozenset(int(i) for i in skip)
        self.stop_below = stop_below
        if not self.skip or min(self.skip) < 0 or max(self.skip) >= n or len(self.skip) >= n:
            raise CompressError(
                f"skip layers {sorted(self.skip)}: give at least one and fewer "
                f"than all of the target's {n} layers (indices 0..{n - 1})."
            )
        attns = [b.self_attn for b in model.model.layers]
        for i in self.skip:  # cross-layer attention: a skipped writer leaves readers without K/V
            if attns[i].writes_kv and any(
                a.kv_slot == attns[i].kv_slot and j not in self.skip for j, a in enumerate(attns)
            ):
                raise CompressError(
                    f"layer {i} writes the K/V that other kept layers read "
                    f"(cross-layer attention); skip its whole group or none of it."
                )

    def prefill(self, ids: list[int], max_len: int) -> None:
        pass

    def propose(self, seq: list[int], gamma: int, sampling: Sampling, gen, target_cache=None):
        L, device = len(seq) - 1, self.model.device

        def skipping(ids, pos):
            return forward(self.model, target_cache, ids, pos, skip=self.skip)

        return run_drafts(skipping, seq[L:], L, gamma, sampling, gen, device, self.stop_below)

    def sync(self, seq: list[int]) -> None:
        pass


def check_vocab(target_size: int, draft_size: int) -> None:
    if target_size != draft_size:
        raise CompressError(
            f"the draft's vocabulary has {draft_size} tokens and the target's "
            f"{target_size}: speculative decoding needs the same tokenizer. Use a "
            f"draft compressed from the same source model (or of the same family)."
        )


def check_draft(target, draft) -> None:
    """Refuse a draft whose vocabulary size is not the target's (ids would mean other tokens)."""
    check_vocab(target.model.embed_tokens.num_embeddings, draft.model.embed_tokens.num_embeddings)
    check_vocab(target.spec.vocab_size, draft.spec.vocab_size)


def load_draft(folder, target, tokenizer=None, **load_kwargs):
    """Load the draft model folder ``folder`` (``model.load`` keywords), checked against
    ``target``."""

    folder = Path(folder)
    if not folder.is_dir() or not (folder / "config.json").is_file():
        raise CompressError(
            f"draft '{folder}' is not a model folder (no config.json). Pass a run "
            f"folder a recipe wrote (outputs/...), an HF folder with the target's "
            f"tokenizer, or 'self' for self-speculative decoding."
        )
    config, _ = read_config(folder)
    check_vocab(target.spec.vocab_size, spec_of(config).vocab_size)  # before loading the weights
    draft_tok = read_tokenizer(folder)
    if (
        tokenizer is not None
        and draft_tok is not None
        and tokenizer.get_vocab() != draft_tok.get_vocab()
    ):
        raise CompressError(
            f"the draft's tokenizer ('{folder}') differs from the target's (same "
            f"size, other tokens): speculative decoding needs the same tokenizer. "
            f"Use a draft of the same model family."
        )
    draft, _ = load(folder, **load_kwargs)
    check_draft(target, draft)
    return draft
