"""Greedy exactness up to ties: two greedy decodings of one model may part where its top-2
logits are equal to rounding, and only there."""

import torch

from compress.decoder.kv import new_cache

TIE = 1e-4


def first_divergence_is_tie(target, ids, ref, other) -> bool:
    """Whether the target's top-2 logit gap is below ``TIE`` where ``other`` first leaves
    ``ref``."""
    i = next(i for i, (a, b) in enumerate(zip(ref, other)) if a != b)
    seq = ids + ref[:i]
    with torch.no_grad():
        cache = new_cache(target, "full", 1, len(seq))
        logits = target(torch.tensor([seq]), cache, last=True)[0, -1]
    top = logits.double().topk(2).values
    return bool(top[0] - top[1] < TIE)
