"""The uncompressed caches: K and V in fp16 (the baseline), or in any dtype (``full``: exact).

Per layer, one preallocated ``[B, Hkv, max_len, D]`` tensor each for K and V (separate tensors
per layer: inductor writes a slot of one in place, where for a slice of one big tensor it
copied the whole). A ``static`` cache attends over every slot with the mask hiding the unwritten
ones, so every decode step has the same shapes and one compiled graph serves them all
(``compress.decoder.static``); otherwise it attends over the slots written so far.
"""

import torch

from compress.decoder.kv.base import Cache, hidden, masked_softmax, sees_everything
from compress.errors import CompressError


class FP16Cache(Cache):
    storage = torch.float16
    static = False
    # a long prompt attends in blocks of this many queries, each over the keys up to its last
    # query: an 8,000-token prefill in one forward took 102 s against 235 s over [T, T] scores
    # (python -m compress.eval.bench.bench_serve --folder fp32=MODEL --batch --ttft 8000 --chunk 0)
    QUERY_BLOCK = 1024

    OPTIONS = ("v_dim", "scale")

    def __init__(
        self, n_layers, batch, n_kv_heads, head_dim, max_len, dtype, device, v_dim=None, scale=None
    ):
        super().__init__(
            n_layers, batch, n_kv_heads, head_dim, max_len, dtype, device, v_dim, scale
        )
        self.k = [
            torch.zeros(batch, n_kv_heads, max_len, head_dim, dtype=self.storage, device=device)
            for _ in range(n_layers)
        ]
        self.v = (
            [t[..., :v_dim] for t in self.k] if v_dim else [torch.zeros_like(t) for t in self.k]
        )

    def append(self, layer, k, v, pos=None):
        pos = self.slots(layer, k.shape[2], pos, after=True)
        if not torch.compiler.is_compiling():  # a compiled step's caller counts its token
            self.lens[layer] += self.check_append(layer, k, v)
        self.k[layer][:, :, pos] = k.to(self.storage)
        if v is not None:
            self.v[layer][:, :, pos] = v.to(self.storage)

    def attend(self, layer, q, pos=None, start=None):
        tq, block = q.shape[2], self.QUERY_BLOCK
        if tq <= block or self.static:
            return self.heads(self.mix(layer, self.weights(layer, q, pos, start)), q)
        pos, out = self.slots(layer, tq, pos, after=False), []
        for i in range(0, tq, block):  # each block reads the keys up to its last query's slot
            qb, pb = q[:, :, i : i + block], pos[i : i + block]
            out.append(self.heads(self.mix(layer, self.weights(layer, qb, pb, start, upto=pb)), qb))
        return torch.cat(out, dim=2)

    def weights(self, layer, q, pos=None, start=None, upto=None) -> torch.Tensor:
        """The attention weights ``softmax(q K^T * scale + mask)`` ``[B, Hkv, g*Tq, L]`` of
        ``layer`` over the ``L`` slots it attends to (query head j = KV head j // g, row i*Tq + t);
        with ``upto`` (the queries' slots), only the slots up to the last of them."""
        q4, tq = self.queries(q)
        pos = self.slots(layer, tq, pos, after=False)
        L = self.max_len if self.static else self.lens[layer]
        if upto is not None:
            L = min(L, int(upto.max()) + 1)
        scores = q4 @ self.k[layer][:, :, :L].to(self.dtype).transpose(-1, -2)
        if not self.static and sees_everything(pos, start, L):
            return scores.softmax(-1)
        kpos = torch.arange(L, device=q.device)[None, None]
        return masked_softmax(scores, hidden(kpos, pos, start), tq)

    def mix(self, layer, p: torch.Tensor) -> torch.Tensor:
        """``p V`` ``[B, Hkv, g*Tq, Dv]``: weights ``p`` (:meth:`weights`' layout) over ``layer``'s values."""
        return p @ self.v[layer][:, :, : p.shape[-1]].to(self.dtype)

    def nbytes(self) -> int:
        width = self.head_dim if self.v_dim else 2 * self.head_dim
        return sum(self.lens) * self.batch * self.n_kv_heads * width * self.k[0].element_size()

    def reset(self):
        self.lens = [0] * self.n_layers

    def rollback(self, length: int) -> None:
        """Slots are written by position, so forgetting the tokens past ``length`` is a count."""
        self.check_rollback(length)
        self.lens = [length] * self.n_layers


class FullCache(FP16Cache):
    """The fp16 cache's layout and attention, K and V stored in ``dtype``: exact, for equivalence checks."""

    def __init__(
        self, n_layers, batch, n_kv_heads, head_dim, max_len, dtype, device, v_dim=None, scale=None
    ):
        self.storage = dtype
        super().__init__(
            n_layers, batch, n_kv_heads, head_dim, max_len, dtype, device, v_dim, scale
        )


def static_cache(cache: FP16Cache) -> FP16Cache:
    """``cache`` marked static (attend over all ``max_len`` slots), for the compiled decode step."""
    if not isinstance(cache, FP16Cache):
        raise CompressError(
            f"the compiled decode step needs an fp16 or full cache, not {type(cache).__name__}."
        )
    cache.static = True
    return cache
