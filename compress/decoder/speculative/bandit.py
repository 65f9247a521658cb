"""Choosing the self-speculative draft configuration per prompt, while generating: two bandits.

Arms are configurations (skip set s, γ) on a grid ordered by the number of skipped layers and
by γ. A round on arm k emits X_k tokens (accepted drafts + 1) and costs c_k seconds, pre-measured
(``layer_skip.layer_costs``: c_k = γ (c_0 + kept c_layer) + c_0 + L c_layer), so its throughput
is μ_k = E[X_k] / c_k, and X_k ∈ [1, γ+1] bounds the noise.

    Unimodal   SP2EC-style: throughput is taken as unimodal on the grid, so a local search with
               confidence bounds suffices (OSUB, Combes & Proutière 2014): the leader is the arm
               with the best empirical μ; every (|N|+1)-th time an arm leads it is played, else
               the arm of N(leader) ∪ {leader} with the largest
               μ̂_k + (γ_k + 1)/c_k · sqrt(2 ln l / n_k)  (l: rounds the leader has led).
               Known costs: only E[X_k] is learned, not the wall time.
    UCB1       the plain baseline over all arms: reward = X / measured round seconds, scaled by the
               largest seen, index r̂_k + sqrt(2 ln t / n_k).
"""

import math

from compress.decoder.speculative.drafts import LayerSkipDraft
from compress.decoder.speculative.layer_skip import layer_costs, unified_skip
from compress.errors import CompressError


class Bandit:
    """Shared bookkeeping: arms ``[(draft, gamma, cost)]`` on a ``rows x cols`` grid, row-major."""

    def __init__(self, arms: list[tuple], cols: int):
        if not arms or len(arms) % cols:
            raise CompressError(
                "a bandit needs a full grid of draft configurations (skip sets x gammas)."
            )
        self.arms, self.cols = arms, cols
        self.reset()

    def reset(self) -> None:
        """Forget what was learnt: each prompt is a new bandit problem."""
        self.n = [0] * len(self.arms)
        self.total = [0.0] * len(self.arms)
        self.t, self.current = 0, None
        self.history = []  # arm index per round

    def drafts(self) -> list:
        return list({id(a[0]): a[0] for a in self.arms}.values())

    def largest_gamma(self) -> int:
        return max(a[1] for a in self.arms)

    def next(self):
        self.current = self.choose()
        self.history.append(self.current)
        draft, gamma, _ = self.arms[self.current]
        return draft, gamma

    def update(self, gamma: int, accepted: int, seconds: float) -> None:
        k = self.current
        self.t += 1
        self.n[k] += 1
        self.total[k] += self.reward(k, accepted + 1, seconds)

    def mean(self, k: int) -> float:
        return self.total[k] / self.n[k] if self.n[k] else -math.inf

    def favourite(self) -> int:
        """The arm played most often: the bandit's choice for this prompt."""
        return max(range(len(self.arms)), key=lambda k: self.n[k])


class Unimodal(Bandit):
    """OSUB-style local search on the grid, with the pre-measured costs (module docstring)."""

    def __init__(self, arms: list[tuple], cols: int):
        super().__init__(arms, cols)
        rows = len(arms) // cols
        self.start = (rows // 2) * cols + cols // 2  # the middle of the grid leads until measured

    def reset(self) -> None:
        super().reset()
        self.led = [0] * len(self.arms)

    def reward(self, k: int, tokens: int, seconds: float) -> float:
        return tokens / self.arms[k][2]

    def neighbours(self, k: int) -> list[int]:
        r, c, rows = divmod(k, self.cols) + (len(self.arms) // self.cols,)
        out = [
            (r + dr) * self.cols + c + dc
            for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1))
            if 0 <= r + dr < rows and 0 <= c + dc < self.cols
        ]
        return out

    def choose(self) -> int:
        played = [k for k in range(len(self.arms)) if self.n[k]]
        lead = max(played, key=self.mean) if played else self.start
        self.led[lead] += 1
        near = [lead] + self.neighbours(lead)
        if (self.led[lead] - 1) % len(near) == 0 and self.n[lead]:
            return lead
        log_l = math.log(max(self.led[lead], 2))

        def index(k):
            if not self.n[k]:
                return math.inf
            _, gamma, cost = self.arms[k]
            return self.mean(k) + (gamma + 1) / cost * math.sqrt(2 * log_l / self.n[k])

        return max(near, key=index)


class UCB1(Bandit):
    """UCB1 (Auer et al. 2002) over every arm; rewards from measured wall time."""

    def reset(self) -> None:
        super().reset()
        self.scale = 0.0

    def reward(self, k: int, tokens: int, seconds: float) -> float:
        r = tokens / max(seconds, 1e-9)
        self.scale = max(self.scale, r)
        return r

    def choose(self) -> int:
        for k in range(len(self.arms)):
            if not self.n[k]:
                return k
        scale = self.scale or 1.0
        return max(
            range(len(self.arms)),
            key=lambda k: self.mean(k) / scale + math.sqrt(2 * math.log(self.t) / self.n[k]),
        )


BANDITS = {"bandit": Unimodal, "ucb1": UCB1}


def default_skip_counts(n_layers: int) -> list[int]:
    """Skip 10% to 50% of the middle layers (distinct counts): SmolLM2-135M's greedy agreement
    falls to 0 beyond about a third (``python -m compress.decoder.speculative.layer_skip RUN``)."""
    return sorted({max(1, round(f * (n_layers - 2))) for f in (0.1, 0.2, 0.3, 0.4, 0.5)})


def self_bandit(model, kind: str, skip_counts=None, gammas=(1, 2, 3, 4, 6), costs=None):
    """A bandit of ``kind`` (:data:`BANDITS`) over the unified skip sets of ``skip_counts`` x
    ``gammas``; ``costs``: ``layer_costs(model)`` if measured already."""

    if kind not in BANDITS:
        raise CompressError(f"--adapt {kind}: use one of {sorted(BANDITS)}.")
    L = model.spec.n_layers
    if L < 3:
        raise CompressError(f"self-speculative drafts skip middle layers; this model has only {L}.")
    c0, cl = costs or layer_costs(model)
    arms = []
    for n in skip_counts or default_skip_counts(L):
        draft = LayerSkipDraft(model, unified_skip(L, n))
        for g in gammas:
            arms.append((draft, g, g * (c0 + (L - n) * cl) + c0 + L * cl))
    return BANDITS[kind](arms, len(gammas))
