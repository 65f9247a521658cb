"""The serving engine: continuous batching of many requests over one paged KV cache.

    engine = Engine(model, tokenizer, num_blocks=1024)
    seq = engine.add(prompt_ids, Params(max_tokens=64))
    while engine.has_work():
        for event in engine.step(): ...   # sequence, new token or None, text now final

Each step is the decoder's one generation step (``compress.decoder.step``, the step
``generate`` and speculative decoding run) over the sequences the scheduler picked
(``compress.serve.scheduler``), as a padded batch laid out for the paged cache
(``compress.decoder.kv.paged``); a sequence whose tokens are all in the cache after the step
draws its next token from its last position's logits with its own sampling settings and
generator (``Sampler.per_row``). Outputs, EOS and stop strings follow
``compress.decoder.generate``: a greedy request decodes the tokens it decodes alone.

A model with sliding-window layers gets one block pool per window group
(``compress.serve.block_manager``): the global layers' ``num_blocks``, and per window
``local_blocks`` (default :func:`~compress.serve.block_manager.local_pool_blocks`, at most
``num_blocks``), whose blocks return to the pool once they leave the window.

``batch_invariant`` makes that exact, whatever else is served: attention runs query by query in
a fixed order (``compress.kernels.paged_attn_cpu``), and the model should be loaded with the
integer W4A8 linears at every M (``load(..., kernel="w4a8", lean=True)``, then
``w4a8_cpu.use(model, "w4a8", every_m=True)``: per-token int8
activations and int32 sums, the same bits for a row in any batch); :func:`invariant_model`
says whether it is.
"""

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from compress.decoder import step as one_step
from compress.decoder.generate import cache_size, eos_ids_of
from compress.decoder.kv.paged import new_paged_cache, window_groups
from compress.decoder.sampling import Sampler
from compress.decoder.stopping import Stopping
from compress.errors import CompressError
from compress.io.tokenizer import check_ids
from compress.serve.block_manager import BlockManager, local_pool_blocks
from compress.serve.memory import check_pool_memory
from compress.serve.scheduler import Params, Scheduler, Sequence


@dataclass
class Event:
    seq: Sequence
    token: int | None  # the token appended this step (None: a prompt chunk, or EOS)
    text: str  # text that became final this step
    finished: bool


def invariant_model(model) -> bool:
    """Whether every linear of ``model`` is a W4A8 layer at every M (loaded lean with kernel
    w4a8, then ``compress.kernels.w4a8_cpu.use(model, "w4a8", every_m=True)``): the rows of a
    batch then do not change each other's bits in the matmuls."""
    linears = [
        m
        for m in model.modules()
        if isinstance(m, nn.Linear) or hasattr(m, "group_size") or hasattr(m, "SCB")
    ]
    return bool(linears) and all(
        getattr(m, "cache", {}).get("lean") == "w4a8" and getattr(m, "kernel_every_m", False)
        for m in linears
    )


class Engine:
    def __init__(
        self,
        model,
        tokenizer=None,
        num_blocks: int = 1024,
        block_size: int = 16,
        max_seqs: int = 32,
        max_step_tokens: int = 512,
        kv: str = "fp16",
        prefix_caching: bool = True,
        runahead=None,
        runahead_min_tokens: int = 256,
        batch_invariant: bool = False,
        local_blocks: int | None = None,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.runahead, self.runahead_min_tokens = runahead, runahead_min_tokens
        if batch_invariant and not invariant_model(model):
            raise CompressError(
                "batch-invariant serving needs every linear of the model to compute a row the "
                "same in any batch: a group-quantized folder loaded with kernel w4a8 and lean, "
                "the kernel at every M (python -m compress.serve RUN --batch-invariant), "
                "including the output head (--head int8 or int4)."
            )
        windows = window_groups(model.kv_layout().windows)
        sizes = [
            num_blocks
            if w is None
            else local_blocks
            or min(num_blocks, local_pool_blocks(w, block_size, max_seqs, max_step_tokens))
            for w in windows
        ]
        check_pool_memory(model, windows, sizes, block_size, kv)  # before allocating
        self.cache = new_paged_cache(model, sizes, block_size, kv, batch_invariant)
        self.blocks = BlockManager(sizes, block_size, prefix_caching, windows)
        self.scheduler = Scheduler(self.blocks, max_seqs, max_step_tokens)
        self.eos = eos_ids_of(model, tokenizer)
        self.pad = (
            tokenizer.pad_token_id
            if tokenizer is not None and tokenizer.pad_token_id is not None
            else 0
        )
        self.max_len = model.spec.max_positions or 1 << 30
        self.device = model.device
        self.ids = itertools.count()
        self.generated = 0  # tokens sampled, all requests
        self.steps = 0
        self.runahead_prefills = 0

    def check(self, prompt: list[int], params: Params) -> None:
        """Raise ``CompressError`` for a request this engine cannot serve (before queuing it; reads
        no state that steps change, so another thread may call it)."""
        if not prompt:
            raise CompressError("a prompt is empty; give at least one token of text to continue.")
        check_ids(prompt, self.model.spec.vocab_size)  # shared with the decoder CLI
        if params.max_tokens < 1:
            raise CompressError(f"max_tokens must be at least 1 (got {params.max_tokens}).")
        if params.stop and self.tokenizer is None:
            raise CompressError("stop strings need a tokenizer, and this run folder has none.")
        if len(prompt) + params.max_tokens > self.max_len:
            raise CompressError(
                f"the prompt has {len(prompt)} tokens and max_tokens is {params.max_tokens}; "
                f"together they exceed the model's context of {self.max_len} tokens. "
                f"Shorten the prompt or lower max_tokens."
            )
        cache_size(self.model, len(prompt), params.max_tokens, None)  # the context check
        self.scheduler.fits(len(prompt), params.max_tokens)

    def add(self, prompt: list[int], params: Params | None = None, seq_id=None) -> Sequence:
        params = params or Params()
        self.check(prompt, params)
        eos = () if params.ignore_eos else self.eos
        stopping = Stopping(params.max_tokens, eos, self.tokenizer, params.stop)
        seq = Sequence(next(self.ids) if seq_id is None else seq_id, prompt, params, stopping)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Drop ``seq`` and free its blocks (a client that went away)."""
        seq.finish_reason = seq.finish_reason or "abort"
        self.scheduler.retire(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def layout(self, batch: list[tuple[Sequence, int]]):
        """``(idx [B, T], pos [T])`` of the step, the cache bound to its slots (module docstring of
        ``kv/paged.py``: new tokens right-aligned on a shared virtual timeline)."""
        B, T, bs = len(batch), max(n for _, n in batch), self.blocks.block_size
        V = max(0, max(s.computed + n for s, n in batch) - T)
        idx = torch.full((B, T), self.pad, dtype=torch.long)
        start, lens = torch.empty(B, dtype=torch.long), torch.empty(B, dtype=torch.long)
        for b, (s, n) in enumerate(batch):
            c = s.computed
            idx[b, T - n :] = torch.tensor(s.tokens[c : c + n])
            start[b], lens[b] = V + T - n - c, c + n
        all_slots, all_tables, all_first = [], [], []
        for g in range(len(self.blocks.pools)):  # each window group: the live blocks
            live = []
            for s, _ in batch:
                t = s.block_tables[g]
                dead = next((i for i, x in enumerate(t) if x is not None), len(t))
                live.append((dead, t[dead:]))
            slots = torch.full((B, T), -1, dtype=torch.long)
            tables = torch.zeros(B, max(len(t) for _, t in live), dtype=torch.long)
            first = torch.empty(B, dtype=torch.long)
            for b, ((s, n), (dead, t)) in enumerate(zip(batch, live)):
                table = torch.tensor(t, dtype=torch.long)
                tables[b, : len(table)] = table
                p = torch.arange(s.computed, s.computed + n) - dead * bs
                slots[b, T - n :] = table[p // bs] * bs + p % bs
                first[b] = dead * bs
            all_slots.append(slots)
            all_tables.append(tables)
            all_first.append(first)
        self.cache.bind(all_slots, all_tables, lens, start, all_first)
        return (
            idx.to(self.device),
            torch.arange(V, V + T, device=self.device),
            start.to(self.device),
        )

    @torch.no_grad()
    def step(self) -> list[Event]:
        """Run one scheduled step; finished sequences are retired and their blocks freed."""
        if self.runahead is not None and (
            seq := self.scheduler.admit_whole(self.runahead_min_tokens)
        ):
            return [self.prefill_runahead(seq)]
        batch = self.scheduler.schedule()
        if not batch:
            return []
        idx, pos, start = self.layout(batch)
        sampler = Sampler.per_row(  # a row still prefilling its prompt draws nothing
            [None if s.computed + n < len(s.tokens) else self.draws(s) for s, n in batch]
        )
        tokens = one_step.step(self.model, self.cache, idx, sampler, pos=pos, start=start)
        tokens = tokens[:, 0].tolist()
        self.steps += 1
        events = []
        for b, (seq, n) in enumerate(batch):
            seq.computed += n
            self.blocks.register(seq)
            if seq.pending:
                events.append(Event(seq, None, "", False))  # a prompt chunk
                continue
            events.append(self.take(seq, tokens[b]))
        return events

    @staticmethod
    def draws(seq: Sequence) -> tuple:
        """``seq``'s row of a per-row sampler: its sampling settings and its generator."""
        return seq.params.sampling, seq.generator

    def prefill_runahead(self, seq: Sequence) -> Event:
        """Prefill all of ``seq`` over the KV-Runahead ranks, copy its K/V into its blocks and
        sample its next token."""
        logits, full = self.runahead.prefill(seq.tokens)
        self.cache.put(seq.block_tables, full, len(seq.tokens))
        seq.computed = len(seq.tokens)
        self.blocks.register(seq)
        self.steps += 1
        self.runahead_prefills += 1
        token = Sampler.per_row([self.draws(seq)]).sample(logits[None])
        return self.take(seq, int(token[0]))

    def take(self, seq: Sequence, token: int) -> Event:
        """Append ``token`` to ``seq`` unless it is EOS; finish on EOS, a stop string or
        max_tokens (``compress.decoder.stopping``)."""
        self.generated += 1
        kept, text = seq.stopping.feed(token)
        if kept:
            seq.tokens.append(token)
        else:
            token = None
        if seq.stopping.done:
            seq.finish_reason = seq.stopping.finish_reason
            self.scheduler.retire(seq)
        return Event(seq, token, text, seq.finish_reason is not None)

    def generate(self, prompts: list[list[int]], params: Params | None = None) -> list[Sequence]:
        """Serve ``prompts`` to completion (offline); the finished sequences in prompt order."""
        seqs = [self.add(p, params) for p in prompts]
        while self.has_work():
            self.step()
        return seqs

    def kv_bytes(self, seq: Sequence) -> int:
        """Bytes of K/V ``seq`` holds now: its blocks in each window group's pool times the
        group's bytes per block (``PagedCache.block_bytes``)."""
        return sum(n * self.cache.block_bytes(g) for g, n in enumerate(self.blocks.held(seq)))

    def stats(self) -> dict:
        """Queue length, running sequences, block counts, prefix-cache hits, preemptions."""
        sch, bm = self.scheduler, self.blocks
        return dict(
            waiting=len(sch.waiting),
            running=len(sch.running),
            free_blocks=bm.num_free,
            total_blocks=bm.num_blocks,
            pools=[dict(window=p.window, free=len(p.free), total=p.num_blocks) for p in bm.pools],
            block_size=bm.block_size,
            prefix_hit_tokens=bm.hit_tokens,
            preemptions=sch.preemptions,
            generated_tokens=self.generated,
            steps=self.steps,
            runahead_prefills=self.runahead_prefills,
        )
