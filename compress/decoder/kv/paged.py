"""A paged KV cache (PagedAttention, Kwon et al. 2023): pools of fixed-size blocks for many
sequences, each sequence's tokens found through its block tables.

The cache slots fall in window groups (:func:`window_groups`): the global slots, and the slots
of each sliding window ``w``. Each group has its own pool of ``num_blocks[g]`` blocks and each
sequence one block table per group (vLLM's hybrid KV-cache manager). Layout, per slot of group
``g``: K and V pools ``[num_blocks[g] * block_size, Hkv, D]``; token position ``p`` of a
sequence with table ``t`` lives in slot ``t[p // bs] * bs + p % bs`` (``bs`` = block_size).
A local group's blocks that every present and future query sees past (all their positions
``<= c - w`` once ``c`` tokens are cached) go back to the pool (``compress.serve.block_manager``),
so a sequence holds at most ``ceil(w / bs) + 1`` blocks of a local group between steps, at any
length: the local slots' bytes are bounded by the window, as the contiguous caches' rings are,
and the pool of a local group can be much smaller than the global one.

A step of the engine (``compress.serve.engine``) runs the ONE model forward on a padded batch
``idx [B, T]``, each row's new tokens right-aligned. Rows sit on a shared virtual timeline, as
left padding does in ``generate``: column ``j`` is virtual slot ``pos[j] = V + j`` and row b's
position 0 is virtual slot ``start[b]``, so the model's position ``pos[j] - start[b]`` is
the token's true position. :meth:`PagedCache.bind` gives the cache the step's layout per group:
the pool slot of every column (-1 for padding), the live part of each row's block table (from
the block holding position ``first[b]``) and the context lengths, then

    append:  pool[slot[b, j]] = k[b, :, j]                        (padding not written)
    attend:  K_b = pool[table_b]  at virtual slots start[b] + first[b] + 0 .. len_b - first[b] - 1
             softmax(q K_b^T * scale + mask) V_b          (``hidden``, ``fused_attention``)

with slots past ``len_b`` masked as the future, and a sliding-window layer's keys at or before
``pos - w`` hidden (``kv/base.py``), so the freed blocks are never needed and the mask is the
contiguous caches'. Storage is fp16 (``fp16``) or the compute dtype (``full``, exact), attention
computes as the contiguous caches do; ``invariant`` (CPU) computes it instead query by query in
a fixed order (``compress.kernels.paged_attn_cpu``), so a row's attention is the same bits
whatever else the batch holds; a sliding-window layer gives the kernel one row per query, its
window's keys in position order (:func:`window_keys`).
"""

import torch

from compress.decoder.kv.base import Cache, fused_attention, hidden
from compress.errors import CompressError
from compress.kernels import native, paged_attn_cpu

PAGED_KINDS = ("fp16", "full")


def window_groups(windows) -> list[int | None]:
    """The distinct sliding windows of the cache slots ``windows``, global (None) first: one
    block pool and one block table per sequence for each."""
    ws = set(windows or [None])
    return ([None] if None in ws else []) + sorted(w for w in ws if w is not None)


def window_keys(gather, lens, first, pos, start, window: int):
    """The fixed-order kernel's input for a sliding-window layer, one row per query ``(b, t)``:
    the pool slots of the keys it sees, in position order, ``[B * T, min(w, L)]``, and their count
    ``[B * T, 1]``. Row b's gather starts at position ``first[b]``; the query at true position
    ``p = pos[t] - start[b]`` sees positions ``max(0, p - w + 1) .. min(p, len_b - 1)``."""
    B, L = gather.shape
    p = pos[None, :] - start[:, None]
    hi = torch.minimum(lens[:, None], p + 1) - first[:, None]
    lo = ((p - window + 1).clamp_min(0) - first[:, None]).clamp_min(0)
    n = (hi - lo).clamp(0, window)
    width = min(window, L)
    idx = (lo[..., None] + torch.arange(width, device=gather.device)).clamp_max(L - 1)
    slots = torch.gather(gather[:, None, :].expand(-1, len(pos), -1), 2, idx)
    return slots.reshape(-1, width).contiguous(), n.reshape(-1, 1).contiguous()


class PagedCache(Cache):
    """One pool per window group of ``num_blocks`` blocks (an int for every group, or one count
    per group of :func:`window_groups`) of ``block_size`` tokens; bind a step before the
    forward."""

    LATENT = True

    def __init__(
        self,
        layout,
        num_blocks,
        block_size: int,
        dtype,
        device,
        storage: torch.dtype = torch.float16,
        invariant: bool = False,
    ):
        groups = window_groups(layout.windows)
        sizes = [num_blocks] * len(groups) if isinstance(num_blocks, int) else list(num_blocks)
        if len(sizes) != len(groups):
            raise CompressError(
                f"the paged KV cache has {len(groups)} window groups {groups}: give one block "
                f"count for each (got {sizes})."
            )
        super().__init__(layout, 0, max(sizes) * block_size, dtype, device)
        n_kv_heads, head_dim, v_dim = layout.n_kv_heads, layout.head_dim, layout.v_dim
        self.groups, self.group_blocks = groups, sizes
        self.group = [groups.index(w) for w in self.windows]  # each slot's group
        self.num_blocks, self.block_size, self.storage = sum(sizes), block_size, storage
        self.k = [
            torch.zeros(sizes[g] * block_size, n_kv_heads, head_dim, dtype=storage, device=device)
            for g in self.group
        ]
        self.v = (
            [t[..., :v_dim] for t in self.k] if v_dim else [torch.zeros_like(t) for t in self.k]
        )
        self.step = None
        self.invariant = invariant

    def bind(self, slots, tables, lens: torch.Tensor, start: torch.Tensor, first=None) -> None:
        """The step's layout, per window group ``g`` (a tensor instead of a list: one group):
        ``slots[g] [B, T]`` (pool slot per column, -1: padding), ``tables[g] [B, nb]`` (block
        ids of each row's live blocks, padded with 0), ``first[g] [B]`` (the position of each
        row's first live block; None: 0); ``lens [B]`` (tokens in the cache after this step),
        ``start [B]`` (virtual slot of each row's position 0)."""
        if torch.is_tensor(slots):
            slots, tables, first = [slots], [tables], [first]
        first = first or [None] * len(tables)
        dev, bs = self.device, self.block_size
        start, lens = start.to(dev), lens.to(dev)
        self.batch = len(lens)
        self.step = dict(start=start, kpos_lens=lens, groups=[])
        for sl, table, f in zip(slots, tables, first):
            flat = sl.reshape(-1).to(dev)
            keep = (flat >= 0).nonzero().squeeze(-1)
            gather = (table.to(dev)[:, :, None] * bs + torch.arange(bs, device=dev)).reshape(
                len(table), -1
            )
            f = torch.zeros_like(lens) if f is None else f.to(dev)
            j = torch.arange(gather.shape[1], device=dev)
            # a key slot past the row's length gets a virtual slot beyond every query: masked
            kpos = torch.where(
                j < (lens - f)[:, None], (start + f)[:, None] + j, torch.iinfo(torch.long).max
            )
            self.step["groups"].append(
                dict(
                    first=f,
                    keep=keep,
                    dest=flat[keep],
                    gather=gather,
                    flat=gather.reshape(-1),  # every layer's gather index, made once a step
                    kpos=kpos[:, None],
                )
            )

    def append(self, layer, k, v, pos=None):
        if self.step is None:
            raise CompressError(
                "the paged KV cache was used without a step layout: call bind() first."
            )
        s = self.step["groups"][self.group[layer]]
        B, H, T, D = k.shape
        rows = k.transpose(1, 2).reshape(B * T, H, D)[s["keep"]]
        self.k[layer][s["dest"]] = rows.to(self.storage)
        if v is not None:
            self.v[layer][s["dest"]] = (
                v.transpose(1, 2).reshape(B * T, H, -1)[s["keep"]].to(self.storage)
            )

    def attend(self, layer, q, pos=None, start=None):
        step, s = self.step, self.step["groups"][self.group[layer]]
        self.check_queries(q)
        if pos is None:
            raise CompressError("the paged KV cache needs the queries' virtual slots pos.")
        B, L = s["gather"].shape
        sinks = None if self.sinks is None else self.sinks[layer]
        if self.invariant:
            w = self.windows[layer]
            if "hi" not in s:  # the same for every layer of the group in the step
                if w is None:
                    s["hi"] = paged_attn_cpu.visible(step["kpos_lens"], pos, step["start"])
                else:
                    s["hi"] = window_keys(
                        s["gather"], step["kpos_lens"], s["first"], pos, step["start"], w
                    )
            if w is None:
                out = paged_attn_cpu.attention(
                    q, self.k[layer], self.v[layer], s["gather"], s["hi"], self.scale, sinks=sinks
                )
                return out.to(q.dtype)
            slots, n = s["hi"]  # every query its own row of keys
            T, H = q.shape[2], q.shape[1]
            out = paged_attn_cpu.attention(
                q.transpose(1, 2).reshape(B * T, H, 1, -1),
                self.k[layer],
                self.v[layer],
                slots,
                n,
                self.scale,
                sinks=sinks,
            )
            return out.view(B, T, H, -1).transpose(1, 2).to(q.dtype)
        keys = self.k[layer].index_select(0, s["flat"]).view(B, L, self.n_kv_heads, -1)
        values = self.v[layer].index_select(0, s["flat"]).view(B, L, self.n_kv_heads, -1)
        return fused_attention(
            q,
            keys.transpose(1, 2).to(self.dtype),
            values.transpose(1, 2).to(self.dtype),
            hidden(s["kpos"], pos, step["start"], self.windows[layer]),
            self.scale,
            sinks,
        )

    def put(self, tables, source: Cache, length: int) -> None:
        """Store one sequence's K/V of positions ``0 .. length - 1``, computed elsewhere into the
        contiguous cache ``source`` (row 0; ``source.read``), at the pool slots of its block
        tables ``tables[g]`` (one per window group), outside a bound step: KV-Runahead's
        prefill (``compress.serve.runahead``). Global layers only: a windowed group's freed
        blocks hold nothing."""
        bs, p = self.block_size, torch.arange(length)
        for layer in range(self.n_layers):
            if self.windows[layer] is not None:
                raise CompressError(
                    "the paged cache takes whole sequences' K/V into global layers only; this "
                    "model has sliding-window layers."
                )
            table = torch.tensor(tables[self.group[layer]], dtype=torch.long)
            slots = (table[p // bs] * bs + p % bs).to(self.device)
            k, v = source.read(layer, length)
            self.k[layer][slots] = k[0].transpose(0, 1).to(self.storage)
            if not self.v_dim:  # latent attention: V is K's first channels, written with K
                self.v[layer][slots] = v[0].transpose(0, 1).to(self.storage)

    def block_bytes(self, group: int = 0) -> int:
        """Bytes of one block of window group ``group`` over its slots (K and V)."""
        width = self.head_dim if self.v_dim else 2 * self.head_dim
        slots = self.group.count(group)
        return slots * self.block_size * self.n_kv_heads * width * self.k[0].element_size()

    def nbytes(self) -> int:
        return sum(n * self.block_bytes(g) for g, n in enumerate(self.group_blocks))

    def reset(self):
        self.step = None


def new_paged_cache(
    model, num_blocks, block_size: int = 16, kind: str = "fp16", invariant: bool = False
) -> PagedCache:
    """The block pools for the decoder's ``model``: ``num_blocks`` an int for every window group,
    or one count per group of :func:`window_groups` (``model.kv_layout().windows``); ``kind``
    fp16 or full (the compute dtype); ``invariant``: batch-invariant attention (CPU, needs the
    C++ kernels).

    Attention computes in fp32 on the CPU and in the model's dtype on a GPU, as ``new_cache``.
    """
    if kind not in PAGED_KINDS:
        raise CompressError(
            f"the paged KV cache stores K and V as {' or '.join(PAGED_KINDS)}, not "
            f"'{kind}'; paged KIVI and PackKV are not implemented."
        )
    if min([num_blocks] if isinstance(num_blocks, int) else num_blocks) < 1 or block_size < 1:
        raise CompressError(
            f"the paged KV cache needs at least one block of at least one token "
            f"(got {num_blocks} blocks of {block_size})."
        )
    device = model.device
    if invariant:
        if device.type != "cpu" or native.library() is None:
            raise CompressError(
                "batch-invariant serving computes attention with the C++ CPU kernel: serve on "
                "the CPU on a machine where it builds (a C++ compiler and ninja), or without "
                "batch invariance."
            )
    dtype = torch.float32 if device.type == "cpu" else model.dtype
    storage = torch.float16 if kind == "fp16" else dtype
    return PagedCache(model.kv_layout(), num_blocks, block_size, dtype, device, storage, invariant)
