"""Block allocation for the paged KV cache, with prefix caching (nano-vllm's BlockManager).

Every block has a reference count. A full block whose K/V has been computed is registered
under the chained hash of its tokens,

    h_0 = H(tokens[0:bs])        h_i = H(h_{i-1} || tokens[i*bs:(i+1)*bs])

so ``h_i`` names the whole prefix up to the block's end (K/V of a token depend on its prefix
only). A new sequence whose prompt starts with registered blocks shares them (reference count
+ 1) and skips computing those tokens. A block whose count drops to 0 returns to the free list
with its hash kept, so a later prompt can still hit it until the block is handed out again
(free blocks are reused oldest first).
"""

import hashlib
from collections import deque

from compress.errors import CompressError


def chain_hash(prev: bytes, tokens: list[int]) -> bytes:
    """``H(prev || tokens)``: BLAKE2b-128 of the previous block's hash and the token ids."""
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(b"".join(t.to_bytes(8, "little", signed=True) for t in tokens))
    return h.digest()


class BlockManager:
    """``num_blocks`` blocks of ``block_size`` tokens. Sequences hold ``block_table`` (block ids)
    and ``block_hashes`` (the chained hashes of their registered full blocks)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.num_blocks, self.block_size, self.prefix_caching = (
            num_blocks,
            block_size,
            prefix_caching,
        )
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.free: deque[int] = deque(range(num_blocks))
        self.hit_tokens = 0  # prompt tokens served from the prefix cache

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def _take(self, block: int | None = None) -> int:
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

    def match_prefix(self, seq) -> None:
        """Share the registered blocks ``seq``'s tokens start with (an empty table only). The last
        token is never served from the cache: the step needs its logits."""
        if seq.block_table:
            raise CompressError("internal: prefix matching needs a sequence without blocks.")
        if not self.prefix_caching:
            return
        prev, bs = b"", self.block_size
        for i in range((len(seq.tokens) - 1) // bs):
            h = chain_hash(prev, seq.tokens[i * bs : (i + 1) * bs])
            block = self.by_hash.get(h)
            if block is None:
                break
            if self.ref[block] == 0:
                self._take(block)
            else:
                self.ref[block] += 1
            seq.block_table.append(block)
            seq.block_hashes.append(h)
            prev = h
        seq.computed = len(seq.block_table) * bs

    def can_grow(self, seq, n_tokens: int) -> bool:
        return self.blocks_for(n_tokens) - len(seq.block_table) <= len(self.free)

    def grow(self, seq, n_tokens: int) -> None:
        """Give ``seq`` blocks for its first ``n_tokens`` positions (check :meth:`can_grow`)."""
        while len(seq.block_table) < self.blocks_for(n_tokens):
            seq.block_table.append(self._take())

    def register(self, seq) -> None:
        """Register ``seq``'s full blocks whose K/V is computed (``seq.computed`` tokens)."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.computed // bs):
            prev = seq.block_hashes[-1] if seq.block_hashes else b""
            h = chain_hash(prev, seq.tokens[i * bs : (i + 1) * bs])
            block = seq.block_table[i]
            if h not in self.by_hash:  # else another sequence computed the same prefix already
                self.by_hash[h] = block
                self.hash_of[block] = h
            seq.block_hashes.append(h)

    def release(self, seq) -> None:
        """Drop ``seq``'s references; blocks no one holds return to the free list."""
        for block in reversed(seq.block_table):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free.append(block)
        seq.block_table, seq.block_hashes, seq.computed = [], [], 0
