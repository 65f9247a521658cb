"""Next-token sampling: greedy at temperature 0, else temperature, top-k and top-p.

p = softmax(l / temperature), restricted to the ``top_k`` largest entries, then to the smallest
set of largest entries whose mass reaches ``top_p``, renormalised, and drawn with a seeded
generator.
"""

from dataclasses import dataclass

import torch


@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None


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
    if s.temperature <= 0:
        return logits.argmax(-1)
    probs = logits_to_probs(logits, s)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)
