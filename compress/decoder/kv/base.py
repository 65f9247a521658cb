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

Attention sinks (gpt-oss, the layout's ``sinks``): query head h's softmax has one more logit
``z_h``, a key whose value is 0, so ``out = sum_j exp(s_j) V_j / (exp(z_h) + sum_j exp(s_j))``;
every kind applies them (:func:`masked_softmax`, :func:`fused_attention`, the kernels).

Every kind is built from one :class:`KVLayout` (the model's ``kv_layout()``: what it stores per
token) and its own options: ``Kind(layout, batch, max_len, dtype, device, lookahead=0, ...)``.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from compress.errors import CompressError


@dataclass(frozen=True)
class KVLayout:
    """What a KV cache holds per token, read off the model (``Transformer.kv_layout()``)::

        n_layers    cache slots (CLA: one per group of layers that share K/V)
        n_kv_heads  KV heads per slot (latent attention: 1)
        head_dim    width D of one stored key
        v_dim       None: V of its own, D wide; d: V is K's first d channels, stored once (MLA)
        scale       the softmax scale of q K^T; None: D**-0.5
        windows     each slot's sliding window in tokens (None: global); None: every slot global
        sinks       None, or fp32 [n_layers, H]: each slot's attention-sink logit per query head

    Every cache kind takes it whole, with its own options besides.
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    v_dim: int | None = None
    scale: float | None = None
    windows: tuple[int | None, ...] | None = None
    sinks: torch.Tensor | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.windows is not None:
            object.__setattr__(self, "windows", tuple(self.windows))
        ws = self.slot_windows()
        if len(ws) != self.n_layers or any(w is not None and w < 1 for w in ws):
            raise CompressError(
                f"KV cache windows={list(self.windows)}: give one sliding window (a positive "
                f"number of tokens, or None for a global layer) per cache slot ({self.n_layers})."
            )

    def slot_windows(self) -> list[int | None]:
        """Each slot's sliding window (None: global), one per slot."""
        return list(self.windows) if self.windows is not None else [None] * self.n_layers

    @property
    def windowed(self) -> bool:
        """Some slot attends within a sliding window."""
        return any(w is not None for w in self.slot_windows())


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


def masked_softmax(
    scores: torch.Tensor, mask: torch.Tensor | None, tq: int, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Softmax over keys of ``scores [B, Hkv, g*Tq, Lk]`` with ``mask`` from :func:`hidden`
    (None: nothing hidden) and ``sinks`` (:meth:`Cache.sink_rows`: one more logit per row).

    A query whose keys are all hidden (a padding query) gets finite weights, not NaN.
    """
    B, H, M, L = scores.shape
    s = scores
    if mask is not None:
        s = s.view(B, H, M // tq, tq, L).masked_fill(mask, torch.finfo(s.dtype).min)
        s = s.view(B, H, M, L)
    if sinks is None:
        return s.softmax(-1)
    s = torch.cat([s, sinks.to(s.dtype).expand(B, H, M, 1)], -1)
    return s.softmax(-1)[..., :L]


def fused_attention(q, keys, values, mask, scale: float, sinks=None) -> torch.Tensor:
    """``softmax(q K^T * scale + mask) V`` through torch's fused ``scaled_dot_product_attention``
    in the keys' dtype: ``q [B, H, Tq, D]``, ``keys``/``values [B, Hkv, L, D]`` (query head ``j``
    reads KV head ``j // (H / Hkv)``), ``mask`` from :func:`hidden` with one KV-head row. A query
    whose keys are all hidden (padding) attends to all of them, so its output stays finite.

    ``python eval/bench/bench_serve.py`` measures it against the gather-then-
    ``masked_softmax`` form (same fp32 math, fewer copies of the gathered keys). With ``sinks``
    (``[H]``), which torch's fused attention does not take, it is that form.
    """
    if sinks is not None:
        B, H, Tq, D = q.shape
        Hkv = keys.shape[1]
        q4 = (q.to(keys.dtype) * scale).reshape(B, Hkv, -1, D)
        rows = sinks.view(Hkv, H // Hkv, 1).expand(-1, -1, Tq).reshape(1, Hkv, -1, 1)
        p = masked_softmax(q4 @ keys.transpose(-1, -2), mask, Tq, rows)
        return (p @ values).reshape(B, H, Tq, -1).to(q.dtype)
    allowed = ~mask[:, 0, 0]  # [B|1, Tq, L]
    allowed = (allowed | ~allowed.any(-1, keepdim=True))[:, None]
    out = F.scaled_dot_product_attention(
        q.to(keys.dtype), keys, values, attn_mask=allowed, scale=scale, enable_gqa=True
    )
    return out.to(q.dtype)


class Cache:
    """Shape checks, GQA query layout and lengths, shared by every kind."""

    OPTIONS: tuple = ()  # keyword options of the kind, for make_cache's check
    LATENT = False  # stores a layout with v_dim (V = K's first channels: latent attention)

    @classmethod
    def check_layout(cls, layout: KVLayout) -> None:
        """Refuse a layout this kind cannot store (before any allocation or option check)."""
        if layout.v_dim and not cls.LATENT:
            raise CompressError(
                f"this model's latent (MLA) attention caches one key per token whose first "
                f"channels are also the value; the {cls.__name__} does not store that yet: "
                f"use --kv fp16 or full."
            )

    def __init__(
        self,
        layout: KVLayout,
        batch: int,
        max_len: int,
        dtype: torch.dtype,
        device,
        lookahead: int = 0,
    ):
        self.check_layout(layout)
        if lookahead < 0:
            raise CompressError(f"KV cache lookahead={lookahead} must be >= 0.")
        self.layout, self.lookahead = layout, lookahead
        self.n_layers, self.n_kv_heads, self.head_dim = (
            layout.n_layers,
            layout.n_kv_heads,
            layout.head_dim,
        )
        self.windows = layout.slot_windows()
        self.batch, self.max_len, self.dtype, self.device = batch, max_len, dtype, device
        # latent attention: V is K's first v_dim channels, not stored apart
        self.v_dim = layout.v_dim
        self.scale = layout.head_dim**-0.5 if layout.scale is None else layout.scale
        self.sinks = None if layout.sinks is None else layout.sinks.to(device, torch.float32)
        self.lens = [0] * layout.n_layers

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

    def mark(self, length: int) -> None:
        """Count ``length`` tokens in every layer, leaving the slots as they are: after the
        compiled step wrote slot ``length - 1`` (its graph does not count), or to read a full
        cache as of its first ``length`` tokens (layer skip's agreement)."""
        self.lens = [length] * self.n_layers

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

    def sink_rows(self, layer: int, tq: int) -> torch.Tensor | None:
        """``layer``'s sink logits in :meth:`queries`' row order, ``[1, Hkv, g*Tq, 1]`` (row
        i*Tq + t of KV head j is query head j*g + i), or None without sinks."""
        if self.sinks is None:
            return None
        z = self.sinks[layer].to(self.dtype)
        return z.view(self.n_kv_heads, -1, 1).expand(-1, -1, tq).reshape(1, self.n_kv_heads, -1, 1)

    def heads(self, out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, g*Tq, Dv]`` -> ``[B, H, Tq, Dv]`` in ``q``'s dtype."""
        return out.reshape(*q.shape[:3], -1).to(q.dtype)
