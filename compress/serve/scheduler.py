"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Every step the scheduler admits and retires sequences (iteration-level batching, Orca/vLLM),
prefill first: a step either feeds prompt chunks (sequences still prefilling, then waiting
ones while seats and the step's token budget last, the budget bounding the padded batch
``rows x width``; a prompt longer than the budget is prefilled in chunks over several steps),
or, when there is no prompt work, one token of every decoding sequence. When a decoding
sequence needs a block and none is free, the newest running sequence is preempted: its blocks
are released and it returns to the head of the queue, to be recomputed from its tokens (prompt
+ generated) later, through the prefix cache where its blocks survive.
"""

from collections import deque
from dataclasses import dataclass, field

import torch

from compress.decoder.sampling import Sampling
from compress.decoder.stopping import Stopping
from compress.errors import CompressError
from compress.serve.block_manager import BlockManager


@dataclass
class Params:
    max_tokens: int = 16
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


class Sequence:
    """One request: ``tokens`` (prompt + generated), ``computed`` of them in the KV cache."""

    def __init__(self, seq_id, prompt: list[int], params: Params, stopping: Stopping | None = None):
        self.id, self.tokens, self.n_prompt, self.params = seq_id, list(prompt), len(prompt), params
        self.block_tables: list[list[int | None]] = []  # one per window group
        self.block_hashes: list[bytes] = []
        self.computed = 0
        self.stopping = stopping or Stopping(params.max_tokens)  # EOS, stop strings, text
        seed = params.sampling.seed
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.finish_reason: str | None = None

    @property
    def output(self) -> list[int]:
        return self.tokens[self.n_prompt :]

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache; 1 while decoding."""
        return len(self.tokens) - self.computed


class Scheduler:
    def __init__(self, blocks: BlockManager, max_seqs: int = 32, max_step_tokens: int = 512):
        if max_seqs < 1 or max_step_tokens < 1:
            raise CompressError(
                f"the scheduler needs at least one sequence and one token a step "
                f"(got max_seqs={max_seqs}, max_step_tokens={max_step_tokens})."
            )
        self.blocks, self.max_seqs, self.max_step_tokens = blocks, max_seqs, max_step_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def fits(self, n_prompt: int, max_tokens: int) -> None:
        """Raise unless a request could ever run: all its K/V (the last token is not fed) fit
        in each pool (a local group's pool: its window and a step's chunk)."""
        bm = self.blocks
        need = bm.needs(n_prompt + max_tokens - 1, self.max_step_tokens)
        for n, pool in zip(need, bm.pools):
            if n > pool.num_blocks:
                what = f"the {pool.window}-token window's pool" if pool.window else "the pool"
                raise CompressError(
                    f"a request of {n_prompt} prompt tokens and up to {max_tokens} new "
                    f"ones needs {n} KV blocks, and {what} has "
                    f"{pool.num_blocks}: shorten it or give more blocks."
                )

    def add(self, seq: Sequence) -> None:
        self.fits(len(seq.tokens), seq.params.max_tokens)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def retire(self, seq: Sequence) -> None:
        """Drop ``seq`` (finished or aborted) wherever it is, releasing its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def admit_whole(self, min_tokens: int) -> Sequence | None:
        """Admit the head of the queue with blocks for all its tokens, if it has ``min_tokens`` or
        more and they fit (for a prefill run outside the step: ``compress.serve.runahead``)."""
        if not self.waiting or len(self.running) >= self.max_seqs:
            return None
        seq = self.waiting[0]
        if len(seq.tokens) < min_tokens or not self.blocks.can_grow(seq, len(seq.tokens)):
            return None
        self.blocks.grow(seq, len(seq.tokens))
        self.running.append(self.waiting.popleft())
        return seq

    def schedule(self) -> list[tuple[Sequence, int]]:
        """``[(sequence, tokens to feed)]`` for the next step; empty when there is no work."""
        for _ in range(len(self.running) + 2):
            batch = self._prefill() or self._decode()
            if batch or not self.has_work():
                return batch
            if self.running:  # only prefills that cannot grow: make room for the oldest
                self.preempt(self.running[-1])
        raise CompressError("internal: the scheduler found no step to run.")

    def _prefill(self) -> list[tuple[Sequence, int]]:
        """Prompt chunks for one step. The step runs a padded ``[rows, width]`` batch, so the
        budget ``max_step_tokens`` bounds ``rows * width``, not the sum of the chunks: a row
        joins with a chunk of at most ``max_step_tokens // rows`` tokens, and none joins once
        the step is as wide as that allows."""
        bm, batch, width = self.blocks, [], 0

        def chunk(seq) -> int:  # this row's tokens, 0 when it does not fit the step
            cap = self.max_step_tokens // (len(batch) + 1)
            return min(seq.pending, cap) if cap >= width else 0

        for seq in self.running:
            if seq.pending > 1 and (n := chunk(seq)):
                if bm.can_grow(seq, seq.computed + n):
                    bm.grow(seq, seq.computed + n)
                    batch.append((seq, n))
                    width = max(width, n)
        while self.waiting and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            bm.match_prefix(seq)
            n = chunk(seq)
            if not n or not bm.can_grow(seq, seq.computed + n):
                bm.release(seq)
                break
            bm.hit_tokens += seq.computed
            bm.grow(seq, seq.computed + n)
            self.running.append(self.waiting.popleft())
            batch.append((seq, n))
            width = max(width, n)
        return batch

    def _decode(self) -> list[tuple[Sequence, int]]:
        batch = []
        for seq in list(self.running):
            if seq not in self.running or seq.pending != 1:
                continue
            while not self.blocks.can_grow(seq, seq.computed + 1):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                self.blocks.grow(seq, seq.computed + 1)
                batch.append((seq, 1))
        return batch
