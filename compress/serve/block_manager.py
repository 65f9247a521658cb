"""Block allocation for the paged KV cache, with prefix caching (nano-vllm's BlockManager) and
one pool per window group (vLLM's hybrid KV-cache manager).

The KV cache slots of a model fall in groups by sliding window (``kv/paged.py``:
:func:`~compress.decoder.kv.paged.window_groups`): the global slots, and the slots of each
window size ``w``. Each group has its own pool of blocks and each sequence one block table per
group (``seq.block_tables[g]``). A global group's table keeps every block. A local group's
block ``i`` holds positions ``i*bs .. (i+1)*bs - 1``; once the sequence has ``c`` tokens in the
cache its next query is at position ``c`` and every later query after it, and they see only
keys ``> c - w``, so the block is dead as soon as ``(i+1)*bs - 1 <= c - w``: its entry becomes
None and the block goes back to the pool. The live blocks of a local table then cover the last
``w - 1`` positions plus the tokens of the step,

    live blocks of a local group <= ceil(w / bs) + 1           (a decode step; at rest)

whatever the sequence's length, while a global table grows with it.

Every block has a reference count. A full block whose K/V has been computed is registered
under the chained hash of its tokens,

    h_0 = H(tokens[0:bs])        h_i = H(h_{i-1} || tokens[i*bs:(i+1)*bs])

so ``h_i`` names the whole prefix up to the block's end (K/V of a token depend on its prefix
only), the same name in every group. A new sequence whose prompt starts with ``k`` registered
blocks shares them (reference count + 1) and skips computing those tokens; it needs blocks
``0 .. k-1`` of each global group and, of a local group, only those still live at ``k*bs``
tokens (the longest ``k`` for which every group has them). A block whose count drops to 0
returns to its pool's free list with its hash kept, so a later prompt can still hit it until
the block is handed out again (free blocks are reused oldest first).
"""

import hashlib
from collections import deque

from compress.errors import CompressError


def chain_hash(prev: bytes, tokens: list[int]) -> bytes:
    """``H(prev || tokens)``: BLAKE2b-128 of the previous block's hash and the token ids."""
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(b"".join(t.to_bytes(8, "little", signed=True) for t in tokens))
    return h.digest()


def local_pool_blocks(window: int, block_size: int, max_seqs: int, max_step_tokens: int) -> int:
    """Blocks a local group of window ``window`` can ever hold at once: each of ``max_seqs``
    sequences ``ceil(w/bs) + 2`` (its window, a partial block, a step's first block), plus the
    blocks of a step's ``max_step_tokens`` new tokens."""
    return max_seqs * (-(-window // block_size) + 2) + -(-max_step_tokens // block_size)


class BlockPool:
    """One group's ``num_blocks`` blocks: reference counts, registered hashes, free list."""

    def __init__(self, num_blocks: int, window: int | None):
        self.num_blocks, self.window = num_blocks, window
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.free: deque[int] = deque(range(num_blocks))

    def take(self, block: int | None = None) -> int:
        """A free block (the oldest, or ``block``), its stale hash forgotten unless it is a hit."""
        if block is None:
            block = self.free.popleft()
            old = self.hash_of[block]
            if old is not None and self.by_hash.get(old) == block:
                del self.by_hash[old]
            self.hash_of[block] = None
        else:
            self.free.remove(block)
        self.ref[block] = 1
        return block

    def share(self, block: int) -> int:
        """One more reference to a registered ``block`` (taken from the free list if unheld)."""
        if self.ref[block] == 0:
            return self.take(block)
        self.ref[block] += 1
        return block

    def drop(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free.append(block)


class BlockManager:
    """Blocks of ``block_size`` tokens in one pool per window group: ``windows`` (one per group,
    None: global; default one global group) and ``num_blocks`` (an int for every group, or one
    count per group). Sequences hold ``block_tables`` (block ids per group, None where a local
    block was freed) and ``block_hashes`` (the chained hashes of their registered full
    blocks)."""

    def __init__(
        self,
        num_blocks,
        block_size: int,
        prefix_caching: bool = True,
        windows: list[int | None] | None = None,
    ):
        windows = list(windows) if windows is not None else [None]
        sizes = [num_blocks] * len(windows) if isinstance(num_blocks, int) else list(num_blocks)
        if len(sizes) != len(windows) or min(sizes) < 1 or block_size < 1:
            raise CompressError(
                f"the block manager needs at least one block of at least one token in each of "
                f"its {len(windows)} pools (got {sizes} blocks of {block_size})."
            )
        self.block_size, self.prefix_caching, self.windows = block_size, prefix_caching, windows
        self.pools = [BlockPool(n, w) for n, w in zip(sizes, windows)]
        self.hit_tokens = 0  # prompt tokens served from the prefix cache

    @property
    def num_blocks(self) -> int:
        return sum(p.num_blocks for p in self.pools)

    @property
    def num_free(self) -> int:
        return sum(len(p.free) for p in self.pools)

    @property
    def ref(self) -> list[int]:
        """Every block's reference count, pool after pool."""
        return [r for p in self.pools for r in p.ref]

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def dead(self, window: int | None, computed: int) -> int:
        """How many leading blocks a group of ``window`` no longer needs at ``computed`` tokens."""
        if window is None:
            return 0
        return max(0, (computed - window + 1) // self.block_size)

    def needs(self, n_tokens: int, chunk: int) -> list[int]:
        """Each pool's blocks a sequence of ``n_tokens`` needs at once, fed ``chunk`` tokens a
        step at most: all of them in a global group; ``w - 1`` positions and a chunk in a
        local group."""
        whole = self.blocks_for(n_tokens)
        return [
            whole if w is None else min(whole, self.blocks_for(w - 1 + chunk) + 1)
            for w in self.windows
        ]

    def held(self, seq) -> list[int]:
        """The blocks ``seq`` holds in each pool."""
        return [sum(b is not None for b in t) for t in self.tables(seq)]

    def tables(self, seq) -> list[list]:
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.pools]
        return seq.block_tables

    def match_prefix(self, seq) -> None:
        """Share the registered blocks ``seq``'s tokens start with (an empty table only). The last
        token is never served from the cache: the step needs its logits."""
        tables = self.tables(seq)
        if any(tables):
            raise CompressError("internal: prefix matching needs a sequence without blocks.")
        if not self.prefix_caching:
            return
        prev, bs, hashes = b"", self.block_size, []
        for i in range((len(seq.tokens) - 1) // bs):
            prev = chain_hash(prev, seq.tokens[i * bs : (i + 1) * bs])
            hashes.append(prev)
        k = len(hashes)
        for pool in self.pools:  # a global group needs every block up to k
            if pool.window is None:
                k = next((i for i, h in enumerate(hashes[:k]) if h not in pool.by_hash), k)

        def live(k):  # every local group holds the blocks still live at k blocks
            return all(
                h in p.by_hash
                for p in self.pools
                if p.window is not None
                for h in hashes[self.dead(p.window, k * bs) : k]
            )

        while k and not live(k):
            k -= 1
        for pool, table in zip(self.pools, tables):
            first = self.dead(pool.window, k * bs)
            table += [None] * first + [pool.share(pool.by_hash[h]) for h in hashes[first:k]]
        seq.block_hashes = hashes[:k]
        seq.computed = k * bs

    def trim(self, seq) -> None:
        """Free the local blocks no query of ``seq`` can see any more (module docstring)."""
        for pool, table in zip(self.pools, self.tables(seq)):
            for i in range(min(self.dead(pool.window, seq.computed), len(table))):
                if table[i] is not None:
                    pool.drop(table[i])
                    table[i] = None

    def can_grow(self, seq, n_tokens: int) -> bool:
        self.trim(seq)
        need = self.blocks_for(n_tokens)
        return all(need - len(t) <= len(p.free) for p, t in zip(self.pools, self.tables(seq)))

    def grow(self, seq, n_tokens: int) -> None:
        """Give ``seq`` blocks for its first ``n_tokens`` positions (check :meth:`can_grow`)."""
        self.trim(seq)
        need = self.blocks_for(n_tokens)
        for pool, table in zip(self.pools, self.tables(seq)):
            while len(table) < need:
                table.append(pool.take())

    def register(self, seq) -> None:
        """Register ``seq``'s full blocks whose K/V is computed (``seq.computed`` tokens), then
        free its dead local blocks."""
        if self.prefix_caching:
            bs, tables = self.block_size, self.tables(seq)
            for i in range(len(seq.block_hashes), seq.computed // bs):
                prev = seq.block_hashes[-1] if seq.block_hashes else b""
                h = chain_hash(prev, seq.tokens[i * bs : (i + 1) * bs])
                for pool, table in zip(self.pools, tables):
                    block = table[i]
                    # else another sequence computed the same prefix already
                    if block is not None and h not in pool.by_hash:
                        pool.by_hash[h] = block
                        pool.hash_of[block] = h
                seq.block_hashes.append(h)
        self.trim(seq)

    def release(self, seq) -> None:
        """Drop ``seq``'s references; blocks no one holds return to the free list."""
        for pool, table in zip(self.pools, self.tables(seq)):
            for block in reversed(table):
                if block is not None:
                    pool.drop(block)
        seq.block_tables, seq.block_hashes, seq.computed = [], [], 0
