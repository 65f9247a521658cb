"""Which RoPE frequency pairs of each KV head keep their rotation (MHA2MLA's partial RoPE).

A head of dim D has D/2 pairs in transformers' half-split layout: pair j is dims (j, j + D/2),
rotated by frequency ``theta^(-2j/D)`` (j = 0 the highest). Keeping p pairs per KV head:

``2norm``: per layer and KV head g, score pair j on calibration text by
    s_g(j) = mean_t ||k_{g,j}(t)|| * sum_{h in group g} mean_t ||q_{h,j}(t)||
    and keep the p highest (the norms are taken before RoPE, which does not change them);
``uniform``: pairs (i * D/2) // p, i < p; ``high``: pairs 0..p-1; ``low``: the last p.
"""

import torch

from compress.arch.spec import spec_of
from compress.errors import CompressError
from compress.methods.attn.calib import attention_inputs

METHODS = ("2norm", "uniform", "high", "low")


def check_pairs(config, pairs: int, method: str) -> None:
    half = spec_of(config).head_dim // 2
    if not 1 <= pairs <= half:
        raise CompressError(
            f"mla.rope_pairs={pairs}: a head of dim {2 * half} has {half} RoPE "
            f"frequency pairs; use 1..{half}."
        )
    if method not in METHODS:
        raise CompressError(f"mla.rope_select={method!r}: use one of {', '.join(METHODS)}.")


def pair_norms(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[heads, D/2]`` summed over tokens: the norm of each pair of ``x [tokens, heads * D]``."""
    x = x.double().view(x.shape[0], heads, 2, -1)
    return x.norm(dim=2).sum(0)


class PairNorms:
    """A visitor for ``attention_inputs``: ``scores()`` gives the ``[layers, G, D/2]`` 2-norm
    scores of every layer's KV heads."""

    def __init__(self, model):
        spec = spec_of(model.config)
        self.H, self.G = spec.n_heads, spec.n_kv_heads
        self.adapter = spec.adapter
        self.layers = self.adapter.decoder_layers(model)
        half = spec.head_dim // 2
        self.q = torch.zeros(len(self.layers), self.H, half, dtype=torch.float64)
        self.k = torch.zeros(len(self.layers), self.G, half, dtype=torch.float64)
        self.count = 0

    def __call__(self, i, x):
        self.q[i] += pair_norms(self.adapter.linear(self.layers[i], "q")(x), self.H)
        self.k[i] += pair_norms(self.adapter.linear(self.layers[i], "k")(x), self.G)
        if i == 0:
            self.count += x.shape[0]

    def scores(self) -> torch.Tensor:
        q, k = self.q / self.count, self.k / self.count
        return k * q.view(q.shape[0], self.G, self.H // self.G, -1).sum(2)


def qk_pair_scores(model, tokens: torch.Tensor) -> torch.Tensor:
    """``[layers, G, D/2]`` 2-norm scores of every layer's KV heads on ``tokens``."""
    norms = PairNorms(model)
    attention_inputs(model, tokens, norms)
    return norms.scores()


def select_pairs(config, pairs: int, method: str, scores: torch.Tensor | None = None):
    """``[layers, G, pairs]`` pair indices (ascending) each KV head keeps rotating."""
    spec = spec_of(config)
    half, layers, G = spec.head_dim // 2, spec.n_layers, spec.n_kv_heads
    if method == "2norm":
        index = scores.topk(pairs, dim=-1).indices
    else:
        fixed = {
            "uniform": (torch.arange(pairs) * half) // pairs,
            "high": torch.arange(pairs),
            "low": torch.arange(half - pairs, half),
        }[method]
        index = fixed.expand(layers, G, pairs)
    return index.sort(dim=-1).values.contiguous()
