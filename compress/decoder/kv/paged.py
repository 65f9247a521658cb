"""A paged KV cache (PagedAttention, Kwon et al. 2023): one pool of fixed-size blocks for many
sequences, each sequence's tokens found through its block table.

Layout, per layer: K and V pools ``[num_blocks * block_size, Hkv, D]``; token position ``p`` of
a sequence with block table ``t`` lives in slot ``t[p // bs] * bs + p % bs`` (``bs`` = block_size).

A step of the engine (``compress.serve.engine``) runs the ONE model forward on a padded batch
``idx [B, T]``, each row's new tokens right-aligned. Rows sit on a shared virtual timeline, as
left padding does in ``generate``: column ``j`` is virtual slot ``pos[j] = V + j`` and row b's
position 0 is virtual slot ``start[b]``, so the model's position ``pos[j] - start[b]`` is
the token's true position. :meth:`PagedCache.bind` gives the cache the step's slot mapping
(pool slot of every column, -1 for padding), block tables and context lengths, then

    append:  pool[slot[b, j]] = k[b, :, j]                        (padding not written)
    attend:  K_b = pool[table_b]  at virtual slots start[b] + 0 .. len_b - 1
             softmax(q K_b^T * scale + mask) V_b          (``hidden``, ``fused_attention``)

with slots past ``len_b`` masked as the future, and a sliding-window layer's keys at or before
``pos - w`` hidden (``kv/base.py``). The blocks are shared by all layers through one table per
sequence, so a local layer's blocks are not freed when they leave its window: the paged cache's
bytes are not bounded by the window (the contiguous caches' are). Storage is fp16 (``fp16``) or
the compute dtype (``full``, exact), attention computes as the contiguous caches do;
``invariant`` (CPU) computes it instead query by query in a fixed order
(``compress.kernels.paged_attn_cpu``), so a row's attention is the same bits whatever else the
batch holds.
"""

import torch

from compress.decoder.kv.base import Cache, fused_attention, hidden
from compress.errors import CompressError

PAGED_KINDS = ("fp16", "full")


class PagedCache(Cache):
    """A pool of ``num_blocks`` blocks of ``block_size`` tokens; bind a step before the forward."""

    def __init__(
        self,
        n_layers,
        num_blocks,
        block_size,
        n_kv_heads,
        head_dim,
        dtype,
        device,
        storage: torch.dtype = torch.float16,
        v_dim=None,
        scale=None,
        windows=None,
        invariant: bool = False,
    ):
        super().__init__(
            n_layers,
            0,
            n_kv_heads,
            head_dim,
            num_blocks * block_size,
            dtype,
            device,
            v_dim,
            scale,
            windows,
        )
        self.num_blocks, self.block_size, self.storage = num_blocks, block_size, storage
        slots = num_blocks * block_size
        self.k = [
            torch.zeros(slots, n_kv_heads, head_dim, dtype=storage, device=device)
            for _ in range(n_layers)
        ]
        self.v = (
            [t[..., :v_dim] for t in self.k] if v_dim else [torch.zeros_like(t) for t in self.k]
        )
        self.step = None
        self.invariant = invariant

    def bind(
        self, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, start: torch.Tensor
    ) -> None:
        """The step's layout: ``slots [B, T]`` (pool slot per column, -1: padding), ``tables
        [B, nb]`` (block ids, padded with 0), ``lens [B]`` (tokens in the cache after this step),
        ``start [B]`` (virtual slot of each row's position 0)."""
        dev, bs = self.device, self.block_size
        flat = slots.reshape(-1).to(dev)
        keep = (flat >= 0).nonzero().squeeze(-1)
        gather = (tables.to(dev)[:, :, None] * bs + torch.arange(bs, device=dev)).reshape(
            len(tables), -1
        )
        j = torch.arange(gather.shape[1], device=dev)
        start, lens = start.to(dev), lens.to(dev)
        # a key slot past the row's length gets a virtual slot beyond every query: masked as future
        kpos = torch.where(j < lens[:, None], start[:, None] + j, torch.iinfo(torch.long).max)
        self.batch = len(tables)
        self.step = dict(
            keep=keep,
            dest=flat[keep],
            gather=gather,
            flat=gather.reshape(-1),  # every layer's gather index, made once a step
            kpos=kpos[:, None],
            kpos_lens=lens,
            start=start,
        )

    def append(self, layer, k, v, pos=None):
        s = self.step
        if s is None:
            raise CompressError(
                "the paged KV cache was used without a step layout: call bind() first."
            )
        B, H, T, D = k.shape
        rows = k.transpose(1, 2).reshape(B * T, H, D)[s["keep"]]
        self.k[layer][s["dest"]] = rows.to(self.storage)
        if v is not None:
            self.v[layer][s["dest"]] = (
                v.transpose(1, 2).reshape(B * T, H, -1)[s["keep"]].to(self.storage)
            )

    def attend(self, layer, q, pos=None, start=None):
        s = self.step
        self.check_queries(q)
        if pos is None:
            raise CompressError("the paged KV cache needs the queries' virtual slots pos.")
        B, L = s["gather"].shape
        if self.invariant:
            from compress.kernels import paged_attn_cpu

            if "hi" not in s:  # the same for every layer of the step
                s["hi"] = paged_attn_cpu.visible(s["kpos_lens"], pos, s["start"])
            out = paged_attn_cpu.attention(
                q, self.k[layer], self.v[layer], s["gather"], s["hi"], self.scale
            )
            return out.to(q.dtype)
        keys = self.k[layer].index_select(0, s["flat"]).view(B, L, self.n_kv_heads, -1)
        values = self.v[layer].index_select(0, s["flat"]).view(B, L, self.n_kv_heads, -1)
        return fused_attention(
            q,
            keys.transpose(1, 2).to(self.dtype),
            values.transpose(1, 2).to(self.dtype),
            hidden(s["kpos"], pos, s["start"], self.windows[layer]),
            self.scale,
        )

    def block_bytes(self) -> int:
        """Bytes of one block over all layers (K and V)."""
        width = self.head_dim if self.v_dim else 2 * self.head_dim
        return self.n_layers * self.block_size * self.n_kv_heads * width * self.k[0].element_size()

    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes()

    def reset(self):
        self.step = None


def new_paged_cache(
    model, num_blocks: int, block_size: int = 16, kind: str = "fp16", invariant: bool = False
) -> PagedCache:
    """A block pool for the decoder's ``model``; ``kind`` fp16 or full (the compute dtype);
    ``invariant``: batch-invariant attention (CPU, needs the C++ kernels).

    Attention computes in fp32 on the CPU and in the model's dtype on a GPU, as ``new_cache``.
    """
    if kind not in PAGED_KINDS:
        raise CompressError(
            f"the paged KV cache stores K and V as {' or '.join(PAGED_KINDS)}, not "
            f"'{kind}'; paged KIVI and PackKV are not implemented."
        )
    if num_blocks < 1 or block_size < 1:
        raise CompressError(
            f"the paged KV cache needs at least one block of at least one token "
            f"(got {num_blocks} blocks of {block_size})."
        )
    device = model.device
    if invariant:
        from compress.kernels import native

        if device.type != "cpu" or native.library() is None:
            raise CompressError(
                "batch-invariant serving computes attention with the C++ CPU kernel: serve on "
                "the CPU on a machine where it builds (a C++ compiler and ninja), or without "
                "batch invariance."
            )
    dtype = torch.float32 if device.type == "cpu" else model.dtype
    layout = model.kv_layout()
    if invariant and any(w is not None for w in layout.get("windows") or ()):
        raise CompressError(
            "batch-invariant serving's fixed-order attention reads every key up to the query; "
            "this model has sliding-window layers, which it does not mask: serve it without "
            "batch invariance."
        )
    storage = torch.float16 if kind == "fp16" else dtype
    return PagedCache(
        layout["n_layers"],
        num_blocks,
        block_size,
        layout["n_kv_heads"],
        layout["head_dim"],
        dtype,
        device,
        storage,
        layout["v_dim"],
        layout["scale"],
        layout.get("windows"),
        invariant,
    )
