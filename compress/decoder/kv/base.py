"""The KV cache interface of the decoder, and the masked attention every kind shares.

    cache.append(layer, k, v, pos)          k, v [B, Hkv, T, D] of the T tokens at cache slots pos [T]
    out = cache.attend(layer, q, pos, start)  q [B, H, Tq, D] of the queries at slots pos [Tq]
                                              -> softmax(q K^T * scale + mask) V  [B, H, Tq, Dv]

``scale`` is 1/sqrt(D) unless given. With ``v_dim`` (latent attention) ``v`` is None and V is
the first ``v_dim`` channels of K, stored once.

``pos`` defaults to the next T slots (append) and to the last Tq slots written (attend).
    cache.length, cache.nbytes(), cache.reset(), cache.rollback(length), cache.settle()

K arrives position-encoded, as the model's attention computes it. Query head ``j`` reads KV
head ``j // (H / Hkv)`` (GQA). The mask hides future slots (``> pos``), per row ``b`` the left
padding (slots ``< start[b]``) and, in a layer with a sliding window ``w`` (``windows[layer]``,
None: global), the slots ``<= pos - w``: the query at p sees p - w < k <= p, as transformers'
sliding window does. Such a layer keeps only what a later query can see: ``w`` tokens plus
``lookahead`` (the most tokens a caller rolls back, minus one: speculative decoding's gamma),
so its bytes are bounded at any length. Scores and softmax run in ``dtype`` (fp32 on the CPU);
the output comes back in ``q``'s dtype.
"""

import torch
import torch.nn.functional as F

from compress.errors import CompressError


def hidden(
    kpos: torch.Tensor, qpos: torch.Tensor, start: torch.Tensor | None, window: int | None = None
) -> torch.Tensor:
    """Mask ``[B|1, Hkv|1, 1, Tq, Lk]``, True where key slot ``kpos [B|1, Hkv|1, Lk]`` is in query
    slot ``qpos [Tq]``'s future, in row b's left padding (``< start[b]``) or, with a sliding
    ``window`` w, at or before ``qpos - w``."""
    k = kpos[:, :, None, None, :]
    m = k > qpos[:, None]
    if window is not None:
        m = m | (k <= qpos[:, None] - window)
    if start is not None:
        m = m | (kpos < start.view(-1, 1, 1))[:, :, None, None, :]
    return m


def sees_everything(qpos: torch.Tensor, start: torch.Tensor | None, length: int) -> bool:
    """True for one CPU query at the newest slot of ``length`` without padding: the mask of
    :func:`hidden` is all False, so attention can skip building and applying it (a decode
    step; on a GPU the check would synchronize, so it is never taken there)."""
    return (
        start is None
        and qpos.numel() == 1
        and qpos.device.type == "cpu"
        and int(qpos.reshape(())) >= length - 1
    )


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor, tq: int) -> torch.Tensor:
    """Softmax over keys of ``scores [B, Hkv, g*Tq, Lk]`` with ``mask`` from :func:`hidden`.

    A query whose keys are all hidden (a padding query) gets finite weights, not NaN.
    """
    B, H, M, L = scores.shape
    s = scores.view(B, H, M // tq, tq, L).masked_fill(mask, torch.finfo(scores.dtype).min)
    return s.softmax(-1).view(B, H, M, L)


def fused_attention(q, keys, values, mask, scale: float) -> torch.Tensor:
    """``softmax(q K^T * scale + mask) V`` through torch's fused ``scaled_dot_product_attention``
    in the keys' dtype: ``q [B, H, Tq, D]``, ``keys``/``values [B, Hkv, L, D]`` (query head ``j``
    reads KV head ``j // (H / Hkv)``), ``mask`` from :func:`hidden` with one KV-head row. A query
    whose keys are all hidden (padding) attends to all of them, so its output stays finite.

    ``python eval/bench/bench_serve.py`` measures it against the gather-then-
    ``masked_softmax`` form (same fp32 math, fewer copies of the gathered keys).
    """
    allowed = ~mask[:, 0, 0]  # [B|1, Tq, L]
    allowed = (allowed | ~allowed.any(-1, keepdim=True))[:, None]
    out = F.scaled_dot_product_attention(
        q.to(keys.dtype), keys, values, attn_mask=allowed, scale=scale, enable_gqa=True
    )
    return out.to(q.dtype)


class Cache:
    """Shape checks, GQA query layout and lengths, shared by every kind."""

    OPTIONS: tuple = ()  # keyword options of the kind, for make_cache's check

    def __init__(
        self,
        n_layers,
        batch,
        n_kv_heads,
        head_dim,
        max_len,
        dtype,
        device,
        v_dim=None,
        scale=None,
        windows=None,
        lookahead=0,
    ):
        self.windows = list(windows) if windows is not None else [None] * n_layers
        if len(self.windows) != n_layers or any(w is not None and w < 1 for w in self.windows):
            raise CompressError(
                f"KV cache windows={windows}: give one sliding window (a positive number of "
                f"tokens, or None for a global layer) per cache slot ({n_layers})."
            )
        if lookahead < 0:
            raise CompressError(f"KV cache lookahead={lookahead} must be >= 0.")
        self.lookahead = lookahead
        self.n_layers, self.batch, self.n_kv_heads, self.head_dim = (
            n_layers,
            batch,
            n_kv_heads,
            head_dim,
        )
        self.max_len, self.dtype, self.device = max_len, dtype, device
        self.v_dim = v_dim  # latent attention: V is K's first v_dim channels, not stored apart
        self.scale = head_dim**-0.5 if scale is None else scale
        self.lens = [0] * n_layers

    @property
    def length(self) -> int:
        """Tokens held; the last layer's count, so it is the step's start while a step runs."""
        return self.lens[-1]

    def rollback(self, length: int) -> None:
        """Forget every token at slot ``length`` or later (speculative decoding's rejections)."""
        raise CompressError(
            f"the {type(self).__name__} cannot drop tokens it holds, which "
            f"speculative decoding needs after a rejected draft; use --kv fp16, "
            f"full, kivi or packkv."
        )

    def settle(self) -> None:
        """After a prefill: do now the work the next append would do anyway (compressed caches
        compress the prompt here); a no-op for the uncompressed caches."""

    def check_rollback(self, length: int) -> None:
        if not 0 <= length <= min(self.lens):
            raise CompressError(
                f"KV cache rollback to {length} tokens: every layer must hold at "
                f"least that many (they hold {sorted(set(self.lens))})."
            )

    def check_append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        want = (self.batch, self.n_kv_heads, k.shape[2], self.head_dim)
        if (
            k.dim() != 4
            or tuple(k.shape) != want
            or (v is not None and k.shape != v.shape)
            or (v is None) != bool(self.v_dim)
        ):
            raise CompressError(
                f"KV cache append: k {tuple(k.shape)} and v {tuple(v.shape)} must both be "
                f"[batch, kv_heads, T, head_dim] = {want}; build the cache with the "
                f"model's batch, num_key_value_heads and head_dim."
            )
        if self.lens[layer] + k.shape[2] > self.max_len:
            raise CompressError(
                f"KV cache full: layer {layer} holds {self.lens[layer]} tokens and "
                f"{k.shape[2]} more exceed max_len={self.max_len}. Create the cache "
                f"with a larger max_len (prompt + new tokens)."
            )
        return k.shape[2]

    def slots(self, layer: int, t: int, pos: torch.Tensor | None, after: bool) -> torch.Tensor:
        """``pos``, or the ``t`` slots after (append) or up to (attend) what ``layer`` holds."""
        if pos is not None:
            return pos
        end = self.lens[layer] + t if after else self.lens[layer]
        return torch.arange(end - t, end, device=self.device)

    def check_queries(self, q: torch.Tensor) -> torch.Tensor:
        """``q`` if it is ``[batch, H (a multiple of Hkv), Tq, head_dim]``, else a clear error."""
        B, H, Tq, D = q.shape
        if B != self.batch or D != self.head_dim or H % self.n_kv_heads:
            raise CompressError(
                f"KV cache attend: q {tuple(q.shape)} must be [batch={self.batch}, "
                f"heads (a multiple of kv_heads={self.n_kv_heads}), Tq, {self.head_dim}]."
            )
        return q

    def queries(self, q: torch.Tensor):
        """``q [B, H, Tq, D]`` -> ``(q/sqrt(D) [B, Hkv, g*Tq, D], Tq)`` for this layer."""
        B, H, Tq, D = self.check_queries(q).shape
        return (q.to(self.dtype) * self.scale).reshape(B, self.n_kv_heads, -1, D), Tq

    def heads(self, out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, g*Tq, Dv]`` -> ``[B, H, Tq, Dv]`` in ``q``'s dtype."""
        return out.reshape(*q.shape[:3], -1).to(q.dtype)
