"""A compressed history behind an fp16 window of the most recent tokens (KIVI, PackKV).

The newest ``residual`` tokens stay in fp16; older ones are compressed by the subclass. KIVI
compresses a 32-token group once it has wholly left the window (K is quantized over the
group's tokens), so up to 31 more tokens wait in fp16. PackKV quantizes each token as it
leaves, so its window holds exactly ``residual`` tokens. A token is never compressed in the
``append`` that brought it, so a prefill attends over exact fp16 keys (as KIVI does), and the
compressed history is always older than every query: the causal mask never cuts through it,
only left padding can.

A layer with a sliding window ``w`` compresses nothing: its fp16 window keeps the ``w - 1 +
lookahead`` newest tokens between steps (plus the tokens of the running append) and drops the
older ones, which no later query can see; its bytes are bounded at any length.

``nbytes()`` counts what is held for the tokens in the cache: codes, every scale, minimum,
bit width, offset and permutation, and the fp16 window.
"""

import torch

from compress.decoder.kv.base import Cache, hidden, masked_softmax, sees_everything
from compress.errors import CompressError


class ResidualCache(Cache):
    """An fp16 window of recent tokens in front of a compressed history.

    Per layer: ``win_k, win_v`` fp16 ``[B, Hkv, w, D]`` hold positions ``ncomp .. length-1``;
    positions ``0 .. ncomp-1`` are compressed (``ncomp`` a multiple of ``block``). Subclasses
    store the history and give its scores ``q K_hat^T``, its mix ``p V_hat`` and its positions
    (and, optionally, its newest tokens dequantized: :meth:`tail`).
    """

    block = 64
    granule = None  # tokens leave the window in multiples of this; None: of ``block``

    def __init__(self, layout, batch, max_len, dtype, device, lookahead=0, residual=128):
        super().__init__(layout, batch, max_len, dtype, device, lookahead)
        if residual < 0:
            raise CompressError(f"KV cache residual={residual} must be >= 0 (tokens kept in fp16).")
        self.residual = residual
        self.cap = max_len // self.block * self.block  # most tokens the history can hold
        self.reset()

    def reset(self):
        self.lens = [0] * self.n_layers
        self.ncomp = [0] * self.n_layers
        self.dropped = [0] * self.n_layers  # sliding-window layers: tokens left behind the window
        self.start = None  # rows' left padding, as last given to attend
        empty = torch.zeros(
            self.batch, self.n_kv_heads, 0, self.head_dim, dtype=torch.float16, device=self.device
        )
        self.win_k, self.win_v = [empty] * self.n_layers, [empty] * self.n_layers
        self.reset_history()

    def append(self, layer, k, v, pos=None):
        T = self.check_append(layer, k, v)
        self.win_k[layer] = torch.cat([self.win_k[layer], k.half()], 2)
        self.win_v[layer] = torch.cat([self.win_v[layer], v.half()], 2)
        self.lens[layer] += T
        if self.windows[layer] is not None:  # what this chunk's first query can still see
            self.drop(layer, T + self.windows[layer] - 1 + self.lookahead)
        else:  # older than this chunk, outside the newest `residual`
            self.evict(layer, max(T, self.residual))

    def drop(self, layer: int, keep: int) -> None:
        """A sliding-window layer: forget the window's oldest tokens, all but the newest ``keep``."""
        n = self.win_k[layer].shape[2] - keep
        if n > 0:
            self.win_k[layer] = self.win_k[layer][:, :, n:].clone()
            self.win_v[layer] = self.win_v[layer][:, :, n:].clone()
            self.dropped[layer] += n

    def settle(self):
        """Compress now, in every layer, what the next append will compress whatever it brings.

        Called after a prefill: the prompt is then compressed in the prefill that brought it,
        not in the first decode step, and the cache ends up exactly as that step would leave it
        (the next append's ``n`` tokens are these, then its own share: both whole granules).
        """
        for layer, w in enumerate(self.windows):
            if w is None:
                self.evict(layer, max(self.residual - 1, 0))
            else:
                self.drop(layer, w - 1 + self.lookahead)

    def evict(self, layer: int, keep: int) -> None:
        """Compress the window's oldest tokens, in whole granules, all but the newest ``keep``."""
        granule = self.granule or self.block
        wk, wv = self.win_k[layer], self.win_v[layer]
        n = max(0, wk.shape[2] - keep) // granule * granule
        if n:
            self.compress(layer, wk[:, :, :n].float(), wv[:, :, :n].float())
            self.ncomp[layer] += n
            self.win_k[layer], self.win_v[layer] = wk[:, :, n:].clone(), wv[:, :, n:].clone()

    def rollback(self, length: int) -> None:
        """Drop the tokens past ``length`` from the fp16 window; they must not be compressed yet.

        Every append leaves at least ``residual`` tokens in the window, so dropping up to
        ``residual`` tokens of the last appends always works (speculative decoding: γ < residual).
        """
        self.check_rollback(length)
        if length < max(self.ncomp):
            raise CompressError(
                f"KV cache rollback to {length} tokens: {max(self.ncomp)} are "
                f"already compressed, and compressed tokens cannot be dropped. Keep"
                f" more tokens in fp16 (--kv-opt residual=N with N > gamma)."
            )
        for layer, w in enumerate(self.windows):
            if w is not None and length - w + 1 < self.dropped[layer]:
                raise CompressError(
                    f"KV cache rollback to {length} tokens: sliding-window layer {layer} has "
                    f"already dropped the tokens before {self.dropped[layer]}, which the next "
                    f"query would see. Build the cache with lookahead >= the speculative gamma."
                )
        for layer, C in enumerate(self.ncomp):
            first = C + self.dropped[layer]
            self.win_k[layer] = self.win_k[layer][:, :, : length - first]
            self.win_v[layer] = self.win_v[layer][:, :, : length - first]
        self.lens = [length] * self.n_layers

    def attend(self, layer, q, pos=None, start=None):
        self.start = start
        q4, tq = self.queries(q)
        C, qpos = self.ncomp[layer], self.slots(layer, tq, pos, after=False)
        wk, wv = self.win_k[layer].to(self.dtype), self.win_v[layer].to(self.dtype)
        tail = self.tail(layer)  # the newest compressed tokens, taken with the window
        if tail is not None:
            wk, wv = torch.cat([tail[0], wk], 2), torch.cat([tail[1], wv], 2)
        H = C - (0 if tail is None else tail[0].shape[2])  # from history_scores / history_mix
        scores = q4 @ wk.transpose(-1, -2)
        if H:
            scores = torch.cat([self.history_scores(layer, q4).to(self.dtype), scores], -1)
        w, first = self.windows[layer], C + self.dropped[layer]
        if sees_everything(qpos, start, self.lens[layer]) and (
            w is None or self.lens[layer] - first <= w
        ):
            p = masked_softmax(scores, None, tq, self.sink_rows(layer, tq))
        else:
            kpos = torch.arange(first, self.lens[layer], device=self.device)[None, None]
            if C:
                hpos = self.history_positions(layer, qpos, start)
                kpos = torch.cat([hpos, kpos.expand(*hpos.shape[:2], -1)], -1)
            p = masked_softmax(scores, hidden(kpos, qpos, start, w), tq, self.sink_rows(layer, tq))
        out = p[..., H:] @ wv
        if H:
            out = out + self.history_mix(layer, p[..., :H].contiguous()).to(self.dtype)
        return self.heads(out, q)

    def tail(self, layer) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(K_hat, V_hat)`` ``[B, Hkv, s, D]`` in ``dtype`` of the newest ``s`` compressed
        positions, which attention multiplies together with the window (one product each) rather
        than through ``history_scores`` / ``history_mix`` (these then cover the first ``C - s``);
        None (the default) when the history covers them all."""
        return None

    def history_positions(self, layer, qpos, start) -> torch.Tensor:
        """Positions ``[B|1, Hkv|1, C]`` of the compressed slots; in order by default."""
        return torch.arange(self.ncomp[layer], device=self.device)[None, None]

    def window_nbytes(self) -> int:
        return sum(w.nbytes for w in self.win_k + self.win_v)
