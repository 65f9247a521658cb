"""Speculative decoding (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, 2302.01318).

One round, with x the newest token (in neither cache yet) at slot L::

    draft:   d_i ~ p_i = P_draft(. | ..., x, d_1..d_{i-1})                      i = 1..γ
    target:  q_0..q_γ  from ONE forward of [x, d_1..d_γ] at slots L..L+γ
             (q_{i-1} is the target's distribution for the slot of d_i)
    accept d_i while u_i < min(1, q_{i-1}(d_i) / p_i(d_i)),  u_i ~ U(0, 1)
    first rejection at i:  the next token ~ norm(max(q_{i-1} − p_i, 0));  all accepted: ~ q_γ

so every emitted token is distributed as the target's own; greedy (temperature 0) accepts while
d_i = argmax q_{i-1} and then takes argmax q_n, the target's greedy output. Temperature, top-k
and top-p shape both p and q (``sampling.logits_to_probs``). After n accepted drafts both
caches roll back to L + n + 1 tokens (``cache.rollback``); a draft model whose drafts were all
accepted feeds d_γ together with the next token in its next round (gpt-fast instead runs d_γ
through the draft at once: the same cache, one forward more). Expected tokens per target pass
for acceptance rate α: (1 − α^(γ+1)) / (1 − α).

A compressed target cache (KIVI, PackKV) rolls back within its fp16 window; its verification
pass appends γ+1 tokens at once, so tokens leave the window up to γ steps earlier than in
plain decoding: the output is exact for the cache's state, not token-identical to plain
decoding with the same compressed cache.
"""

import time
from dataclasses import dataclass

import torch

from compress.decoder.generate import Result, generate, sync
from compress.decoder.model import Transformer
from compress.decoder.sampling import Sampler, Sampling
from compress.decoder.speculative.drafts import ModelDraft, check_draft
from compress.decoder.speculative.gamma import schedule_for
from compress.errors import CompressError


def verify(
    drafts: torch.Tensor, p: torch.Tensor | None, q: torch.Tensor, sampling: Sampling, gen=None
):
    """The acceptance rule over R independent rows: ``(accepted n [R], next token [R])``.

    ``drafts [R, γ]``; ``p [R, γ, V]`` the draft's probabilities (None when greedy);
    ``q [R, γ+1, V]`` the target's probabilities (logits when greedy). A row's output is
    ``drafts[:n] + [next]``.
    """
    R, g = drafts.shape
    if sampling.temperature <= 0:
        best = q.argmax(-1)  # [R, γ+1]
        n = (drafts == best[:, :g]).long().cumprod(1).sum(1)
        return n, best.gather(1, n[:, None])[:, 0]
    pd = p.gather(2, drafts[..., None])[..., 0]  # p_i(d_i)  [R, γ]
    qd = q[:, :g].gather(2, drafts[..., None])[..., 0]  # q_{i-1}(d_i)
    u = torch.rand(R, g, generator=gen, dtype=q.dtype)
    n = (u * pd < qd).long().cumprod(1).sum(1)  # u < q/p, p > 0
    V, at = q.shape[-1], n[:, None, None].expand(-1, 1, q.shape[-1])
    qn = q.gather(1, at)[:, 0]
    pn = torch.cat([p, torch.zeros(R, 1, V, dtype=p.dtype)], 1).gather(1, at)[:, 0]  # 0: none left
    resid = (qn - pn).clamp(min=0)
    mass = resid.sum(-1, keepdim=True)
    dist = torch.where(mass > 0, resid / mass.clamp(min=1e-30), qn)  # p = q to rounding: q itself
    return n, torch.multinomial(dist, 1, generator=gen)[:, 0]


@dataclass
class SpecResult(Result):
    rounds: int = 0  # target verification passes after the prefill
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # of those, accepted

    @property
    def acceptance(self) -> float:
        """α: the fraction of draft tokens the target accepted."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def tokens_per_pass(self) -> float:
        """Tokens emitted per target pass in the decode loop (1 without speculation)."""
        return self.decode_steps / self.rounds if self.rounds else float("nan")


def as_schedule(target, draft, gamma=5):
    """A schedule from ``draft``: a loaded model (a :class:`ModelDraft` of it, checked against the
    target's vocabulary), a drafter (``compress.decoder.speculative.drafts``) or a schedule as it is."""

    if hasattr(draft, "next"):
        return draft
    if isinstance(draft, Transformer):
        check_draft(target, draft)
        draft = ModelDraft(draft)
    if not hasattr(draft, "propose"):
        raise CompressError(
            f"draft={type(draft).__name__}: pass a loaded model "
            f"(compress.decoder.model.load), a drafter or a schedule."
        )
    return schedule_for(draft, gamma)


class Speculation:
    """Speculative decoding as the generation step's propose/verify policy
    (``compress.decoder.step``), batch 1; one step is one round of the module docstring::

        propose:  draft, γ = schedule.next();  d_1..d_γ = draft.propose(seq)   (γ capped so the
                  round cannot pass the token budget)
        forward:  the target over [x, d_1..d_γ] at slots L..L+γ (the step's one forward)
        accept:   n, next = verify(...);  seq += d_1..d_n, next;  roll back to L + n + 1

    A draft that writes into the target's cache (layer skip) drafts there and the cache rolls back
    to L before the target rewrites those slots.
    """

    static_decode = False  # a round feeds γ + 1 tokens; the drafts may run compiled

    def __init__(self, schedule):
        self.schedule = schedule
        self.lookahead = schedule.largest_gamma()  # windowed layers keep what a rollback restores
        self.rounds = self.drafted = self.accepted = 0

    def check(self, cache, kv: str) -> None:
        residual = getattr(cache, "residual", None)
        if residual is not None and residual <= self.lookahead:
            raise CompressError(
                f"the {kv} cache keeps {residual} tokens in fp16, and rolling back a "
                f"rejected draft of up to {self.lookahead} tokens needs "
                f"more: raise --kv-opt residual or lower --gamma."
            )

    def begin(self, prompts, first: torch.Tensor, max_len: int, n_new: int) -> None:
        """After the target's prefill: the draft models prefill the prompt."""
        self.seq, self.T0, self.n_new = list(prompts[0]) + first[0].tolist(), len(prompts[0]), n_new
        for draft in self.schedule.drafts():
            draft.lookahead = self.lookahead
            draft.prefill(list(prompts[0]), max_len)

    def propose(self, ids, cache, sampler: Sampler) -> torch.Tensor:
        self.r0 = time.perf_counter()
        draft, gamma = self.schedule.next()
        gamma = min(gamma, self.n_new - (len(self.seq) - self.T0) - 1)
        L = len(self.seq) - 1  # the slot of the newest token, x
        tokens, p = (
            draft.propose(self.seq, gamma, sampler.sampling, sampler.generator, cache)
            if gamma
            else ([], None)
        )
        if draft.shares_cache:
            cache.rollback(L)  # the target rewrites the drafted slots
        self.round = draft, tokens, p, L
        return torch.tensor([tokens], dtype=torch.long)

    def accept(self, logits, drafts, sampler: Sampler, cache) -> torch.Tensor:
        draft, tokens, p, L = self.round
        gamma, logits = len(tokens), logits[0]
        if not sampler.greedy:
            q = sampler.probs(logits).cpu()
            p = p[None] if gamma else torch.zeros(1, 0, q.shape[-1])
        else:
            q = logits.cpu()
        n, nxt = verify(
            torch.tensor([tokens], dtype=torch.long),
            p,
            q[None],
            sampler.sampling,
            sampler.generator,
        )
        n = int(n[0])
        new = tokens[:n] + [int(nxt[0])]
        self.seq += new
        cache.rollback(L + n + 1)
        draft.sync(self.seq)
        self.rounds, self.drafted, self.accepted = (
            self.rounds + 1,
            self.drafted + gamma,
            self.accepted + n,
        )
        sync(logits.device)
        if gamma:
            self.schedule.update(gamma, n, time.perf_counter() - self.r0)
        return torch.tensor([new], device=logits.device)

    def finish(self, result: Result) -> "SpecResult":
        fields = vars(result) | dict(decode_steps=max(len(result.tokens[0]) - 1, 0))
        return SpecResult(
            **fields, rounds=self.rounds, drafted=self.drafted, accepted=self.accepted
        )


@torch.no_grad()
def speculative_generate(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    tokenizer=None,
    sampling: Sampling | None = None,
    kv: str = "fp16",
    kv_opts: dict | None = None,
    max_len: int | None = None,
    stop: tuple[str, ...] = (),
    on_text=None,
    compile: bool = False,
    ignore_eos: bool = False,
    *,
    draft,
    gamma=5,
) -> SpecResult:
    """Continue one prompt with ``model`` verifying the drafts of ``draft`` (see
    :func:`as_schedule`), ``gamma`` per round (an int >= 1, or ``"auto"``:
    ``compress.decoder.speculative.gamma.AutoGamma``): ``generate`` with the
    :class:`Speculation` policy.

    The other arguments are :func:`compress.decoder.generate.generate`'s (batch 1); ``compile``
    runs the draft models' decode steps compiled (``ModelDraft.compile``), the target eager.
    ``prefill_s`` includes the draft models' prefill of the prompt.
    """
    schedule = as_schedule(model, draft, gamma)
    schedule.reset()
    if compile:
        for d in schedule.drafts():
            if d.shares_cache:
                raise CompressError(
                    "a self-speculative draft runs the target's eager forward with "
                    "layers skipped: decode without compile."
                )
            d.compile = True
    if len(prompts) != 1:
        raise CompressError(
            f"speculative decoding runs one prompt at a time (batch 1); got "
            f"{len(prompts)}. Call it once per prompt, or decode without a draft."
        )
    return generate(
        model,
        prompts,
        max_new_tokens,
        tokenizer,
        sampling,
        kv,
        kv_opts,
        max_len,
        stop,
        on_text,
        ignore_eos=ignore_eos,
        policy=Speculation(schedule),
    )
