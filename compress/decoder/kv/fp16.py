"""The uncompressed caches: K and V in fp16 (the baseline), or in any dtype (``full``: exact).

Per layer, one preallocated ``[B, Hkv, max_len, D]`` tensor each for K and V (separate tensors
per layer: inductor writes a slot of one in place, where for a slice of one big tensor it
copied the whole). A ``static`` cache attends over every slot with the mask hiding the unwritten
ones, so every decode step has the same shapes and one compiled graph serves them all
(``compress.decoder.compiled``); otherwise it attends over the slots written so far.

A layer with a sliding window ``w`` keeps a ring of ``cap = w + lookahead`` slots when that is
less than ``max_len``: position p lives in slot ``p % cap``, and after the newest position n the
slot j holds ``n - ((n - j) mod cap)`` (negative: never written). Appending T tokens overwrites
what the first of them may still see when ``T + w - 1 > cap`` (a long prefill): then the ring as
it was and the chunk are kept aside until the layer's next append, and the chunk's queries
attend over both (:meth:`FP16Cache.attend_chunk`). Rolling back r tokens needs
``r <= lookahead + 1``: what the ring overwrote is then outside every later query's window.
"""

import torch

from compress.decoder.kv.base import Cache, hidden, masked_softmax, sees_everything
from compress.errors import CompressError
from compress.kernels.paged_attn_cpu import cache_attention, takes_cache


class FP16Cache(Cache):
    storage = torch.float16
    static = False
    read_as_stored = ()  # static layers whose decode attention reads K/V as stored (C++)
    # a long prompt attends in blocks of this many queries, each over the keys up to its last
    # query, instead of over [T, T] scores (faster at 8,000 tokens: BENCHMARKS.md)
    QUERY_BLOCK = 1024

    OPTIONS = ()
    LATENT = True

    def __init__(self, layout, batch, max_len, dtype, device, lookahead=0):
        super().__init__(layout, batch, max_len, dtype, device, lookahead)
        n_kv_heads, head_dim, v_dim = layout.n_kv_heads, layout.head_dim, layout.v_dim
        self.cap = [max_len if w is None else min(max_len, w + lookahead) for w in self.windows]
        self.k = [
            torch.zeros(batch, n_kv_heads, c, head_dim, dtype=self.storage, device=device)
            for c in self.cap
        ]
        self.v = (
            [t[..., :v_dim] for t in self.k] if v_dim else [torch.zeros_like(t) for t in self.k]
        )
        self.pending = {}  # ring layer -> (ring K, V and positions before a long chunk, the chunk)

    def ring(self, layer: int) -> bool:
        """True if ``layer`` keeps a ring of its sliding window's slots (see the module docstring)."""
        return self.cap[layer] < self.max_len

    def chunk_pending(self, layer: int) -> bool:
        """True while ``layer``'s last append was a long chunk (eager; a compiled step, whose
        appends do not count, never sees one)."""
        if torch.compiler.is_compiling() or layer not in self.pending:
            return False
        return self.pending[layer][-1] == self.lens[layer]

    def ring_positions(self, layer: int, newest) -> torch.Tensor:
        """Positions ``[1, 1, cap]`` held by ``layer``'s ring slots after position ``newest`` (an int
        or a 0-d tensor) was written; slots never written get a position past every query."""
        cap = self.cap[layer]
        j = torch.arange(cap, device=self.device)
        kpos = newest - torch.remainder(newest - j, cap)
        return torch.where(kpos < 0, torch.iinfo(torch.long).max, kpos)[None, None]

    def append(self, layer, k, v, pos=None):
        T = k.shape[2]
        pos = self.slots(layer, T, pos, after=True)
        compiling = torch.compiler.is_compiling()
        if not compiling:  # a compiled step's caller counts its token
            self.lens[layer] += self.check_append(layer, k, v)
        if not self.ring(layer):
            self.k[layer][:, :, pos] = k.to(self.storage)
            if v is not None:
                self.v[layer][:, :, pos] = v.to(self.storage)
            return
        cap, w = self.cap[layer], self.windows[layer]
        if not compiling:
            self.pending.pop(layer, None)
            if T + w - 1 > cap:  # the chunk overwrites keys its first queries see: keep them aside
                before = self.ring_positions(layer, self.lens[layer] - T - 1)
                kept = self.k[layer].clone(), None if v is None else self.v[layer].clone()
                self.pending[layer] = (*kept, before, k.to(self.storage), v, pos, self.lens[layer])
        keep = slice(max(T - cap, 0), T)
        slot = torch.remainder(pos[keep], cap)
        self.k[layer][:, :, slot] = k[:, :, keep].to(self.storage)
        if v is not None:
            self.v[layer][:, :, slot] = v[:, :, keep].to(self.storage)

    def attend(self, layer, q, pos=None, start=None):
        tq, block = q.shape[2], self.QUERY_BLOCK
        if self.chunk_pending(layer):
            return self.attend_chunk(layer, q, pos, start)
        if self.ring(layer):
            return self.attend_ring(layer, q, pos, start)
        if self.static and tq == 1 and layer in self.read_as_stored:
            return self.attend_static(layer, q, pos, start)
        if self.windows[layer] is not None and not self.static:
            return self.attend_window(layer, q, pos, start)
        if tq <= block or self.static:
            return self.heads(self.mix(layer, self.weights(layer, q, pos, start)), q)
        pos, out = self.slots(layer, tq, pos, after=False), []
        for i in range(0, tq, block):  # each block reads the keys up to its last query's slot
            qb, pb = q[:, :, i : i + block], pos[i : i + block]
            out.append(self.heads(self.mix(layer, self.weights(layer, qb, pb, start, upto=pb)), qb))
        return torch.cat(out, dim=2)

    def attend_static(self, layer, q, pos=None, start=None):
        """One query per row of the static cache (the compiled decode step) over the slots it
        sees, ``max(start, pos - w + 1) .. pos``, read as stored (``paged_attn_cpu``'s C++
        kernel): the masked path's product without its fp32 copy of every slot."""
        pos = self.slots(layer, 1, pos, after=False)
        B = q.shape[0]
        hi = (pos.view(1, 1) + 1).expand(B, 1)
        lo = torch.zeros_like(hi) if start is None else start.view(B, 1).to(hi.dtype)
        if self.windows[layer] is not None:
            lo = torch.maximum(lo, hi - self.windows[layer])
        lo = torch.minimum(lo, hi)
        sinks = None if self.sinks is None else self.sinks[layer]
        out = cache_attention(q, self.k[layer], self.v[layer], lo, hi, self.scale, sinks)
        return out.to(q.dtype)

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
        w = self.windows[layer]
        sinks = self.sink_rows(layer, tq)
        if not self.static and w is None and sees_everything(pos, start, L):
            return masked_softmax(scores, None, tq, sinks)
        kpos = torch.arange(L, device=q.device)[None, None]
        return masked_softmax(scores, hidden(kpos, pos, start, w), tq, sinks)

    def attend_over(self, layer, q, keys, values, kpos, pos, start, window) -> torch.Tensor:
        """Attention of ``q`` at slots ``pos`` over ``keys``/``values [B, Hkv, L, D]`` (storage
        dtype) at positions ``kpos [1|B, 1|Hkv, L]``, masked with ``window``."""
        q4, tq = self.queries(q)
        scores = q4 @ keys.to(self.dtype).transpose(-1, -2)
        p = masked_softmax(scores, hidden(kpos, pos, start, window), tq, self.sink_rows(layer, tq))
        return self.heads(p @ values.to(self.dtype), q)

    def attend_ring(self, layer, q, pos=None, start=None):
        """A ring layer: every slot, at the positions :meth:`ring_positions` gives."""
        pos = self.slots(layer, q.shape[2], pos, after=False)
        kpos = self.ring_positions(layer, pos.max())
        return self.attend_over(
            layer, q, self.k[layer], self.v[layer], kpos, pos, start, self.windows[layer]
        )

    def attend_window(self, layer, q, pos=None, start=None):
        """A windowed layer without a ring: the written slots that the queries' windows reach,
        query-blocked like a long prompt of a global layer."""
        tq, w, L = q.shape[2], self.windows[layer], self.lens[layer]
        pos, out = self.slots(layer, tq, pos, after=False), []
        for i in range(0, tq, self.QUERY_BLOCK):  # queries are the newest tq slots
            qb, pb = q[:, :, i : i + self.QUERY_BLOCK], pos[i : i + self.QUERY_BLOCK]
            lo, hi = max(0, L - tq + i - w + 1), min(L, L - tq + i + qb.shape[2])
            kpos = torch.arange(lo, hi, device=q.device)[None, None]
            ks, vs = self.k[layer][:, :, lo:hi], self.v[layer][:, :, lo:hi]
            out.append(self.attend_over(layer, qb, ks, vs, kpos, pb, start, w))
        return torch.cat(out, dim=2)

    def attend_chunk(self, layer, q, pos=None, start=None):
        """A ring layer's queries of a long chunk: over the ring as it was before the chunk and
        the chunk itself, query-blocked (each block reads the chunk's keys its windows reach)."""
        ring_k, ring_v, ring_pos, k, v, cpos, _ = self.pending[layer]
        tq, w, T = q.shape[2], self.windows[layer], k.shape[2]
        pos, out = self.slots(layer, tq, pos, after=False), []
        if ring_v is None:  # latent attention: V is K's first channels
            ring_v, v = ring_k[..., : self.v_dim], k[..., : self.v_dim]
        for i in range(0, tq, self.QUERY_BLOCK):  # queries are the chunk's last tq tokens
            qb, pb = q[:, :, i : i + self.QUERY_BLOCK], pos[i : i + self.QUERY_BLOCK]
            first = T - tq + i
            lo, hi = max(0, first - w + 1), first + qb.shape[2]
            keys = torch.cat([ring_k, k[:, :, lo:hi].to(self.storage)], 2)
            values = torch.cat([ring_v, v[:, :, lo:hi].to(self.storage)], 2)
            kpos = torch.cat([ring_pos, cpos[lo:hi][None, None]], -1)
            out.append(self.attend_over(layer, qb, keys, values, kpos, pb, start, w))
        return torch.cat(out, dim=2)

    def mix(self, layer, p: torch.Tensor) -> torch.Tensor:
        """``p V`` ``[B, Hkv, g*Tq, Dv]``: weights ``p`` (:meth:`weights`' layout) over ``layer``'s values."""
        return p @ self.v[layer][:, :, : p.shape[-1]].to(self.dtype)

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer``'s positions ``0 .. length - 1``, ``[B, Hkv, length, D]`` each, as
        stored (V: K's first ``v_dim`` channels with latent attention); a layer that keeps every
        position (not a ring)."""
        if self.ring(layer) or not 0 <= length <= self.lens[layer]:
            raise CompressError(
                f"KV cache read of {length} positions of layer {layer}: it holds "
                f"{self.lens[layer]}{' in a ring of its window' if self.ring(layer) else ''}."
            )
        return self.k[layer][:, :, :length], self.v[layer][:, :, :length]

    def nbytes(self) -> int:
        """Bytes of the K/V held: a ring layer holds at most its ``cap`` tokens."""
        width = self.head_dim if self.v_dim else 2 * self.head_dim
        held = sum(min(n, c) for n, c in zip(self.lens, self.cap))
        return held * self.batch * self.n_kv_heads * width * self.k[0].element_size()

    def reset(self):
        self.lens = [0] * self.n_layers
        self.pending = {}

    def rollback(self, length: int) -> None:
        """Slots are written by position, so forgetting the tokens past ``length`` is a count;
        a ring layer can forget at most ``lookahead + 1`` (see the module docstring)."""
        self.check_rollback(length)
        for layer, n in enumerate(self.lens):
            if self.ring(layer) and n - length > self.lookahead + 1:
                raise CompressError(
                    f"KV cache rollback of {n - length} tokens: sliding-window layer {layer} "
                    f"keeps {self.cap[layer]} slots (window {self.windows[layer]} + lookahead "
                    f"{self.lookahead}), so it can drop at most {self.lookahead + 1}. Build the "
                    f"cache with lookahead >= the speculative gamma."
                )
        self.lens = [length] * self.n_layers
        self.pending = {}


class FullCache(FP16Cache):
    """The fp16 cache's layout and attention, K and V stored in ``dtype``: exact, for equivalence checks."""

    def __init__(self, layout, batch, max_len, dtype, device, lookahead=0):
        self.storage = dtype
        super().__init__(layout, batch, max_len, dtype, device, lookahead)


def static_cache(cache: FP16Cache) -> FP16Cache:
    """``cache`` marked static (attend over all ``max_len`` slots), for the compiled decode step."""
    if not isinstance(cache, FP16Cache):
        raise CompressError(
            f"the compiled decode step needs an fp16 or full cache, not {type(cache).__name__}."
        )
    cache.static = True
    # decided here, not while a compiled step traces attend (the check may build the operators)
    cache.read_as_stored = frozenset(
        i for i in range(cache.n_layers) if takes_cache(cache.k[i], cache.v[i])
    )
    return cache
