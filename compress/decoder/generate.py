"""Generation: prefill the prompts, then decode one token at a time into a preallocated KV cache.

    prefill:  l_0 = model(prompt [B, T0])[:, -1]        x_1 = sample(l_0)
    decode:   l_t = model(x_t [B, 1])                     x_{t+1} = sample(l_t)

Each line is one ``compress.decoder.step.step``, the step the serving engine runs too;
``sample`` is the ``Sampler``'s (``compress.decoder.sampling``), greedy at temperature 0. With a
propose/verify policy (speculative decoding) a decode step feeds x_t and the drafts after it and
takes the accepted drafts and one more token.

Prompts of different lengths are left-padded to the longest; row b's tokens start at
slot ``start[b]``, which the cache masks before and the model takes as position 0, so each
row decodes exactly as it would alone.

Cache length: ``max_len`` defaults to the longest prompt + ``max_new_tokens``, capped at the
model's ``max_position_embeddings`` (sliding-window layers attend within their window at any
length: the caches keep what the window reaches). A prompt that does not fit (T0 >= max_len) raises a
``CompressError``; a continuation that would overrun the cache stops at ``max_len`` with a
warning. An empty prompt is an error.
"""

import re
import time
import warnings
from dataclasses import dataclass

import torch

from compress.decoder import step as one_step
from compress.decoder.compiled import StaticDecoder
from compress.decoder.kv import new_cache, static_cache
from compress.decoder.sampling import Sampler, Sampling
from compress.decoder.stopping import Stopping
from compress.errors import CompressError


def peak_memory_reset() -> None:
    """Start a new peak: CUDA's allocator statistics, or the process's peak RSS on Linux."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM
    except OSError:
        pass


def peak_memory() -> int:
    """Peak bytes since :func:`peak_memory_reset`: CUDA allocated if a GPU is used, else peak RSS."""
    if torch.cuda.is_available() and torch.cuda.max_memory_allocated():
        return torch.cuda.max_memory_allocated()
    try:
        with open("/proc/self/status") as f:
            return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) * 1024
    except (OSError, AttributeError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class Result:
    tokens: list[list[int]]  # generated ids per prompt (EOS excluded)
    texts: list[str]  # their text, cut before a stop string ("" without a tokenizer)
    prompt_tokens: int  # tokens prefilled (the padded batch)
    prefill_s: float
    ttft_s: float  # prefill + first sample
    decode_s: float  # every later token
    decode_steps: int
    kv_bytes: int
    kv_tokens: int  # slots the cache holds at the end, all rows

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second of the decode loop (tokens after the first, per row)."""
        return self.decode_steps / self.decode_s if self.decode_steps else float("nan")

    @property
    def kv_bytes_per_token(self) -> float:
        return self.kv_bytes / max(self.kv_tokens, 1)


def left_pad(
    prompts: list[list[int]], pad_id: int, device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(ids [B, T0], start [B] or None)`` with each prompt right-aligned."""
    T0 = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T0), pad_id, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T0 - len(p) :] = torch.tensor(p, dtype=torch.long)
    start = torch.tensor([T0 - len(p) for p in prompts], dtype=torch.long, device=device)
    return ids.to(device), (start if start.any() else None)


def eos_ids_of(model, tokenizer) -> set[int]:
    ids = set(model.spec.eos_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def cache_size(model, prompt_len: int, max_new_tokens: int, max_len: int | None) -> int:
    """The cache length for a prompt, per the module docstring's rule."""
    limit = model.spec.max_positions or 1 << 30
    max_len = min(max_len or prompt_len + max_new_tokens, limit)
    if prompt_len >= max_len:
        raise CompressError(
            f"the prompt has {prompt_len} tokens, but the KV cache holds {max_len} (the model's "
            f"max_position_embeddings is {limit}). Shorten the prompt or raise --max-len."
        )
    if prompt_len + max_new_tokens > max_len:
        warnings.warn(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"cache ({max_len}); generation stops after {max_len - prompt_len} tokens."
        )
    return max_len


@torch.no_grad()
def generate(
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
    on_prefill=None,
    *,
    policy=None,
) -> Result:
    """Continue each prompt (token ids) by up to ``max_new_tokens``; stop on EOS or a stop string.

    ``on_text(row, text)`` receives text as it becomes final; ``on_prefill()`` is called between
    the prefill and the decode loop, untimed (benchmarks reset their peak-memory mark there).
    ``compile`` decodes with the static-shape compiled step (``compress.decoder.compiled``; fp16
    or full cache only), whose cache is rounded up to a multiple of ``STATIC_BUCKET`` tokens so
    that calls share a graph. ``policy``: what each decode step proposes and accepts
    (``compress.decoder.step``; default one token per row; speculative decoding passes its
    propose/verify policy). The prefill and every decode step are ``step.step``; ``prefill_s``
    includes drawing the first token.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise CompressError("a prompt is empty; give at least one token of text to continue.")
    if stop and tokenizer is None:
        raise CompressError("stop strings need a tokenizer, and this run folder has none.")
    policy = policy or one_step.NEXT_TOKEN
    sampler = Sampler(sampling or Sampling())
    device = model.device
    pad = (
        tokenizer.pad_token_id
        if tokenizer is not None and tokenizer.pad_token_id is not None
        else 0
    )
    ids, start = left_pad(prompts, pad, device)
    B, T0 = ids.shape
    max_len = cache_size(model, T0, max_new_tokens, max_len)
    n_new = min(max_new_tokens, max_len - T0)
    if compile and policy.static_decode:
        decoder, cache = static_step(model, kv, kv_opts, B, max_len)
    else:
        decoder = model
        cache = new_cache(model, kv, B, max_len, lookahead=policy.lookahead, **(kv_opts or {}))
    policy.check(cache, kv)
    eos = () if ignore_eos else eos_ids_of(model, tokenizer)
    rows = [Stopping(n_new, eos, tokenizer, stop) for _ in range(B)]

    def take(new: torch.Tensor):
        for b, tokens in enumerate(new.tolist()):
            for t in tokens:
                _, text = rows[b].feed(t)
                if on_text and text:
                    on_text(b, text)

    t0 = time.perf_counter()
    x = one_step.step(model, cache, ids, sampler, start=start)
    cache.settle()  # a compressed cache compresses the prompt now, as part of the prefill
    policy.begin(prompts, x, max_len, n_new)
    sync(device)
    t1 = time.perf_counter()
    take(x)
    if on_prefill is not None:
        on_prefill()
    t2 = time.perf_counter()
    steps = 0
    while not all(r.done for r in rows):  # a row is done at n_new tokens at the latest
        x = one_step.step(decoder, cache, x[:, -1:], sampler, start=start, policy=policy)
        take(x)
        steps += 1
    t3 = time.perf_counter()
    tokens, texts = [r.tokens for r in rows], [r.text for r in rows]
    return policy.finish(
        Result(
            tokens,
            texts,
            B * T0,
            t1 - t0,
            t2 - t0,
            t3 - t2,
            steps,
            cache.nbytes(),
            B * cache.length,
        )
    )


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


STATIC_BUCKET = 256  # the compiled step's cache length is a multiple of this


def static_step(model, kv: str, kv_opts: dict | None, batch: int, max_len: int, lookahead: int = 0):
    """``(step, cache)`` for compiled decoding: a :class:`StaticDecoder` kept on the model per batch size."""

    if kv not in ("fp16", "full") or kv_opts:
        raise CompressError(
            f"compiled decoding (--compile) keeps an uncompressed cache: use --kv fp16 or full "
            f"without options, not --kv {kv}{' with options' if kv_opts else ''}."
        )
    steps = model.__dict__.setdefault(
        "static_steps", {}
    )  # a plain dict: not registered as a submodule
    if batch not in steps:
        steps[batch] = StaticDecoder(model, batch)
    limit = model.spec.max_positions or 1 << 30
    size = min(-(-max_len // STATIC_BUCKET) * STATIC_BUCKET, max(limit, max_len))
    return steps[batch], static_cache(new_cache(model, kv, batch, size, lookahead=lookahead))
