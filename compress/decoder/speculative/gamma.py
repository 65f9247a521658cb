"""Which draft and how many draft tokens γ each speculative round uses.

A schedule answers ``next() -> (draft, γ)`` before a round and hears ``update(γ, accepted,
seconds)`` after it (the drafts the target accepted, and the round's wall time); ``reset()``
starts each generation afresh (the adaptive ones learn per prompt):

    Fixed     one draft, one γ
    AutoGamma transformers' candidate-length heuristic (assisted generation's "heuristic"
              schedule): γ starts at 5, +2 after a round whose drafts were all accepted, else −1,
              never below 1
    (``compress.decoder.speculative.bandit``: a bandit over ordered (draft, γ) arms)
"""

from compress.errors import CompressError


def check_gamma(gamma) -> None:
    if gamma == "auto":
        return
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise CompressError(
            f"gamma={gamma!r}: the number of draft tokens per round must be an "
            f"integer >= 1, or 'auto' (transformers' heuristic)."
        )


def check_confidence(stop_below) -> None:
    if (
        isinstance(stop_below, bool)
        or not isinstance(stop_below, (int, float))
        or not (0.0 <= stop_below < 1.0)
    ):
        raise CompressError(
            f"draft confidence {stop_below!r}: give a probability in [0, 1) under which a "
            f"round stops drafting (0 drafts all gamma tokens)."
        )


class Fixed:
    def __init__(self, draft, gamma: int):
        check_gamma(gamma)
        self.draft, self.gamma = draft, gamma

    def next(self):
        return self.draft, self.gamma

    def drafts(self) -> list:
        return [self.draft]

    def reset(self) -> None:
        pass

    def update(self, gamma: int, accepted: int, seconds: float) -> None:
        pass

    def largest_gamma(self) -> int:
        return self.gamma


class AutoGamma(Fixed):
    START, UP, DOWN, MAX = 5, 2, 1, 32  # MAX: bounds the rollback a compressed cache must allow

    def __init__(self, draft):
        super().__init__(draft, self.START)

    def reset(self) -> None:
        self.gamma = self.START

    def update(self, gamma: int, accepted: int, seconds: float) -> None:
        if accepted == gamma:
            self.gamma = min(self.gamma + self.UP, self.MAX)
        else:
            self.gamma = max(1, self.gamma - self.DOWN)

    def largest_gamma(self) -> int:
        return self.MAX


def schedule_for(draft, gamma) -> Fixed:
    """A :class:`Fixed` schedule, or :class:`AutoGamma` for ``gamma="auto"``."""
    check_gamma(gamma)
    return AutoGamma(draft) if gamma == "auto" else Fixed(draft, gamma)
