"""The two caches of IAM attention mapping (Zhao, Li and Zhao, ACL 2025, arXiv 2507.11953).

    RecordingCache  the small model's cache: an uncompressed cache that also keeps the attention
                    weights P_s[l] = softmax(q K^T / sqrt(D) + mask) of the layers in ``keep``
                    for the step that is running
    MappedCache     the large model's cache: unmapped layers use ``inner`` (any kind); a mapped
                    layer l stores V only and attends as  y_h = P_s[m(l)][head(l, h)] V_g(h)

A mapped layer's V lives in an fp16 cache in its latent layout (V stored once, in K's place,
``v_dim = head_dim``), so it costs ``Hkv * D * 2`` bytes per token against ``2 Hkv D 2``.
Both models see the same tokens at the same slots, so the small model's weights already carry
the causal and left-padding masks the large layer needs. They are not ``--kv`` kinds: the pair's
model builds them (``compress.methods.iam.decode.IAMModel.make_cache``).
"""

import torch

from compress.decoder.kv.base import Cache, KVLayout
from compress.decoder.kv.fp16 import FP16Cache
from compress.errors import CompressError


class RecordingCache(FP16Cache):
    """An fp16 cache (``exact``: K/V in ``dtype``, as ``full``) whose ``attend`` keeps the weights
    of the ``keep`` layers for the running step (``probs``: layer -> ``([B, Hkv, g*Tq, L], Tq)``)."""

    def __init__(
        self, layout: KVLayout, batch, max_len, dtype, device, keep=(), exact: bool = False
    ):
        if exact:
            self.storage = dtype
        super().__init__(layout, batch, max_len, dtype, device)
        self.keep, self.probs = set(keep), {}

    def attend(self, layer, q, pos=None, start=None):
        p = self.weights(layer, q, pos, start)
        if layer in self.keep:
            self.probs[layer] = (p, q.shape[2])
        return self.heads(self.mix(layer, p), q)

    def heads_of(self, layer: int) -> torch.Tensor:
        """The kept weights of ``layer`` per query head: ``[B, H, Tq, L]``."""
        if layer not in self.probs:
            raise CompressError(
                f"IAM: the small model's layer {layer} has not attended in this step; run the "
                f"small model on the same tokens before the large one."
            )
        p, tq = self.probs[layer]
        B, G, M, L = p.shape
        return p.view(B, G * (M // tq), tq, L)


class MappedCache(Cache):
    """The large model's cache under IAM (see the module docstring).

    ``mapped``: large layer -> small layer; ``heads``: large layer -> LongTensor [H] of the small
    model's query heads its heads read; ``source``: the small model's :class:`RecordingCache`.
    """

    def __init__(self, inner: Cache, values: FP16Cache, mapped: dict, heads: dict, source):
        self.inner, self.values, self.source = inner, values, source
        self.mapped, self.heads_map = dict(mapped), dict(heads)
        self.slot = {layer: i for i, layer in enumerate(sorted(self.mapped))}
        self.layout, self.windows = inner.layout, inner.windows
        self.n_layers, self.batch, self.max_len = inner.n_layers, inner.batch, inner.max_len
        self.n_kv_heads, self.head_dim, self.dtype = inner.n_kv_heads, inner.head_dim, inner.dtype
        self.device, self.lens = inner.device, [0] * inner.n_layers

    def append(self, layer, k, v, pos=None):
        if layer in self.mapped:
            if k is not None:
                raise CompressError(f"IAM: large layer {layer} is mapped and stores no K.")
            self.values.append(self.slot[layer], v, None, pos)
        else:
            self.inner.append(layer, k, v, pos)
        self.lens[layer] += v.shape[2]

    def attend(self, layer, q, pos=None, start=None):
        if layer not in self.mapped:
            return self.inner.attend(layer, q, pos, start)
        p = self.source.heads_of(self.mapped[layer])[:, self.heads_map[layer]]  # [B, H, Tq, L]
        B, H, Tq, L = p.shape
        g = H // self.n_kv_heads
        out = self.values.mix(self.slot[layer], p.reshape(B, self.n_kv_heads, g * Tq, L))
        return out.reshape(B, H, Tq, -1)

    def nbytes(self) -> int:
        return self.inner.nbytes() + self.values.nbytes()

    def reset(self):
        self.inner.reset()
        self.values.reset()
        self.lens = [0] * self.n_layers
