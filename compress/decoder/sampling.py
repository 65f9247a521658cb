"""Next-token sampling: greedy at temperature 0, else temperature, top-k and top-p.

p = softmax(l / temperature), restricted to the ``top_k`` largest entries, then to the smallest
set of largest entries whose mass reaches ``top_p``, renormalised, and drawn with a seeded
generator.

``check_sampling`` is the one validation of these settings (and of the token count and thread
count that go with them): the decoder CLI calls it with its flag names before loading,
``Sampling`` calls it when built (the Python API), and the server calls it with the request's
field names (``SamplingError.param`` names the field in the error body).
"""

import math
import numbers
from dataclasses import dataclass

import torch

from compress.errors import CompressError

TEMPERATURE_MAX = 2.0  # OpenAI's bound; above it the distribution is almost flat
SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes an unsigned 64-bit seed
THREADS_MAX = 1024
STOPS_MAX = 4  # OpenAI's bound


class SamplingError(CompressError):
    """A sampling setting out of range; ``param`` is the field as the caller names it (the
    server's ``max_tokens``), or the setting's own name when the caller names a flag."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _is_int(v) -> bool:
    """An integer of any kind (numpy's too), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v) -> bool:
    """A finite real number of any kind (numpy's too), not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def check_sampling(
    temperature=0.0,
    top_k=None,
    top_p=None,
    seed=None,
    max_new_tokens=None,
    threads=None,
    stop=None,
    names: dict | None = None,
) -> None:
    """Raise ``SamplingError`` for a setting out of range. ``names`` maps a field name to what
    the user wrote (``{"top_p": "--top-p"}``); the message shows ``NAME VALUE``."""
    names = names or {}

    def refuse(field, value, rule):
        shown = names.get(field, field)
        flag = shown.startswith("-")
        raise SamplingError(
            f"{shown}{' ' if flag else '='}{value!r}: {rule}", field if flag else shown
        )

    if not _is_number(temperature) or not 0 <= temperature <= TEMPERATURE_MAX:
        refuse(
            "temperature",
            temperature,
            f"the temperature is a number from 0 (greedy) to {TEMPERATURE_MAX:g}.",
        )
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        refuse(
            "top_p",
            top_p,
            "top-p is the probability mass kept, a number above 0 and at most 1 (1 keeps "
            "every token).",
        )
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        refuse("top_k", top_k, "top-k is the number of likeliest tokens kept, an integer >= 1.")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= SEED_MAX):
        refuse("seed", seed, "the seed is an integer from 0 to 2**64-1 (18446744073709551615).")
    if max_new_tokens is not None and (not _is_int(max_new_tokens) or max_new_tokens < 1):
        refuse(
            "max_new_tokens",
            max_new_tokens,
            "the number of tokens to generate is an integer >= 1.",
        )
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else list(stop)
        if len(stops) > STOPS_MAX or any(not isinstance(x, str) or not x for x in stops):
            refuse("stop", stop, f"give at most {STOPS_MAX} stop strings, none of them empty.")
    if threads is not None and (not _is_int(threads) or not 1 <= threads <= THREADS_MAX):
        refuse(
            "threads",
            threads,
            f"the CPU thread count is an integer from 1 to {THREADS_MAX} (1 is often fastest "
            f"for batch-1 decoding on a busy machine); leave it out for torch's default.",
        )


@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self):
        check_sampling(self.temperature, self.top_k, self.top_p, self.seed)
        # numpy scalars (np.float32(0.7), np.int64(5)) pass the check; keep Python numbers
        self.temperature = float(self.temperature)
        self.top_k = None if self.top_k is None else int(self.top_k)
        self.top_p = None if self.top_p is None else float(self.top_p)
        self.seed = None if self.seed is None else int(self.seed)


def logits_to_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """``logits [B, V]`` -> probabilities after temperature, top-k and top-p."""
    logits = logits.float() / max(s.temperature, 1e-5)
    if s.top_k is not None and s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if s.top_p is not None and s.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        drop = (
            sorted_p.cumsum(-1) - sorted_p >= s.top_p
        )  # mass before this token already reaches top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """Next token ids ``[B]`` from ``logits [B, V]``."""
    if s.temperature <= 0:  # the same index; ATen's fp32 argmax is faster than its bf16 one
        return (
            logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
        ).argmax(-1)
    probs = logits_to_probs(logits, s)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def seeded(sampling: Sampling) -> torch.Generator | None:
    """The generator of ``sampling``'s draws: seeded from ``sampling.seed``; None without one."""
    return torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None


GREEDY = Sampling()


class Sampler:
    """The next token of every row of a batch, from its logits: how every generation step draws
    (``compress.decoder.step``)::

        Sampler(sampling)          every row with one setting and one generator (seeded from
                                   ``sampling.seed``), drawn together (``generate``)
        Sampler.per_row(rows)      row b with its own ``rows[b] = (sampling, generator)`` (a
                                   server's requests); ``rows[b]`` None: row b draws nothing

    ``sample(logits [B, V]) -> ids [B]`` (-1 for a row that draws nothing): a greedy row takes the
    argmax and uses no generator, any other draws from :func:`logits_to_probs`, which is also
    ``probs(logits)``, the distribution a one-setting sampler draws from (speculative decoding
    verifies drafts against it).
    """

    def __init__(self, sampling: Sampling | None = None, generator: torch.Generator | None = None):
        self.sampling = sampling or Sampling()
        self.generator = generator if generator is not None else seeded(self.sampling)
        self.rows: list | None = None

    @classmethod
    def per_row(cls, rows: list) -> "Sampler":
        sampler = cls()
        sampler.rows = list(rows)
        return sampler

    @property
    def greedy(self) -> bool:
        """Every row takes the argmax."""
        if self.rows is None:
            return self.sampling.temperature <= 0
        return all(r is None or r[0].temperature <= 0 for r in self.rows)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution of a one-setting sampler (:func:`logits_to_probs`) over ``[..., V]``."""
        if self.rows is not None:
            raise CompressError("internal: a per-row sampler has no one distribution.")
        shape = logits.shape
        return logits_to_probs(logits.reshape(-1, shape[-1]), self.sampling).reshape(shape)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """Next token ids ``[B]`` from ``logits [B, V]``."""
        if self.rows is None:
            return sample(logits, self.sampling, self.generator)
        B = logits.shape[0]
        if len(self.rows) != B:
            raise CompressError(f"internal: {len(self.rows)} sampler rows for {B} logit rows.")
        out = torch.full((B,), -1, dtype=torch.long, device=logits.device)
        greedy = [b for b, r in enumerate(self.rows) if r is not None and r[0].temperature <= 0]
        if greedy:  # one argmax for all of them
            rows = logits if len(greedy) == B else logits[greedy]
            out[greedy] = sample(rows, GREEDY, None)
        for b, r in enumerate(self.rows):
            if r is not None and r[0].temperature > 0:
                out[b] = sample(logits[b : b + 1], r[0], r[1])[0]
        return out
