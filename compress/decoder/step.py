"""The one generation step: a forward of the model over each row's new tokens, and the tokens
each row takes from it. Every generation loop runs it: plain generation
(``compress.decoder.generate``: the prefill and every decode step), speculative decoding (each
round is one step with the speculative policy: ``compress.decoder.speculative.generate``) and the
serving engine (``compress.serve.engine``: every step of its continuous batch)::

    drafts = policy.propose(ids, cache, sampler)                   [B, γ] or None
    logits = model([ids | drafts] [B, T (+ γ)], cache, pos, start)   (the last position only
                                                                      when there are no drafts)
    tokens = policy.accept(logits, drafts, sampler, cache)         [B, k]: each row's new tokens

The plain policy (:data:`NEXT_TOKEN`) proposes nothing and draws each row's next token from its
last position with the sampler (``compress.decoder.sampling.Sampler``). Speculative decoding
is a propose/verify policy: propose γ drafts (a draft model, or the target with layers skipped),
verify them in this one forward, keep the accepted ones and one more, and roll the cache back
past the rejected. ``pos`` and ``start`` lay the batch out in the cache as
``Transformer.forward`` takes them: None for the next slots of a contiguous cache without left
padding; the paged cache's steps give both.
"""

import torch

from compress.decoder.sampling import Sampler


def forward(model, cache, ids: torch.Tensor, pos=None, start=None, last=True, skip=()):
    """``model(ids [B, T], cache, ...)`` logits ``[B, T or 1, V]`` (``last``: the last position's
    only); only the keywords that are set are passed, so a compiled decode step, which takes
    ``start`` alone, is called as the model is. ``skip``: layers left out (a self-speculative
    draft)."""
    kw = {}
    if pos is not None:
        kw["pos"] = pos
    if start is not None:
        kw["start"] = start
    if last and ids.shape[1] > 1:
        kw["last"] = True
    if skip:
        kw["skip"] = skip
    return model(ids, cache, **kw)


class NextToken:
    """The plain policy: no drafts; each row's next token drawn from its last position.

    A policy's hooks, as ``generate`` calls them: ``lookahead`` (tokens its cache must roll back
    beyond one), ``static_decode`` (its steps may run the compiled one-token step),
    ``check(cache, kv)`` once the cache is built, ``begin(prompt, first, max_len, n_new)`` after
    the prefill (``first``: the tokens it drew), ``propose`` and ``accept`` in every decode step,
    ``finish(result)`` at the end.
    """

    lookahead = 0
    static_decode = True

    def check(self, cache, kv: str) -> None:
        pass

    def begin(self, prompts, first: torch.Tensor, max_len: int, n_new: int) -> None:
        pass

    def propose(self, ids, cache, sampler: Sampler) -> torch.Tensor | None:
        return None

    def accept(self, logits, drafts, sampler: Sampler, cache) -> torch.Tensor:
        return sampler.sample(logits[:, -1])[:, None]

    def finish(self, result):
        return result


NEXT_TOKEN = NextToken()


def step(
    model, cache, ids: torch.Tensor, sampler: Sampler, pos=None, start=None, policy=NEXT_TOKEN
) -> torch.Tensor:
    """Feed ``ids [B, T]`` (each row's tokens not yet in ``cache``) and take each row's next
    tokens ``[B, k]`` (module docstring; -1 where the sampler draws nothing for a row)."""
    drafts = policy.propose(ids, cache, sampler)
    if drafts is not None:
        ids = torch.cat([ids, drafts.to(ids.device)], 1)
    logits = forward(model, cache, ids, pos, start, last=drafts is None)
    return policy.accept(logits, drafts, sampler, cache)
