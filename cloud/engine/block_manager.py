"""Paged KV-cache bookkeeping: a fixed pool of blocks, per-sequence block tables, ref counts, prefix cache.

A full block is named by a hash chained with its parent's hash, so equal hashes mean equal
token prefixes (the stored token ids are compared too, so a hash collision can never serve
wrong K/V). Freed blocks that hold a cached prefix stay readable until the pool needs them and
are evicted least-recently-used; blocks that hold nothing reusable are handed out first.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from apiary.cloud.engine.sequence import Sequence

ROOT_HASH = 0x5EED  # parent hash of a sequence's first block


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and its K/V computed
    token_ids: tuple[int, ...] = ()


def chain_hash(parent: int, token_ids: tuple[int, ...]) -> int:
    """Content hash of a full block given its parent's hash (tuple hashing of ints is stable across runs)."""
    return hash((parent, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_uncached: deque[int] = deque(range(num_blocks))  # hold nothing reusable
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free but cached; least recently used first
        self.cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_uncached) + len(self.evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------ prefix cache

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The first ``num_blocks`` chained hashes of ``seq``'s full blocks, computed once and kept."""
        hashes, bs, tokens = seq.block_hashes, self.block_size, seq.token_ids
        for i in range(len(hashes), num_blocks):
            hashes.append(chain_hash(hashes[-1] if hashes else ROOT_HASH, tuple(tokens[i * bs:(i + 1) * bs])))
        return hashes

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq``; at least one token is left to compute."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hit: list[int] = []
        bs = self.block_size
        for i, h in enumerate(self._hashes(seq, max_blocks)):
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                break
            hit.append(block_id)
        return hit

    def commit(self, seq: Sequence) -> None:
        """Register the blocks ``seq`` has just filled (K/V computed) so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_hashed_blocks:
            return
        hashes, bs = self._hashes(seq, num_full), self.block_size
        for i in range(seq.num_hashed_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash, block.token_ids = hashes[i], tuple(seq.token_ids[i * bs:(i + 1) * bs])
                self.cached.setdefault(block.hash, block.block_id)
        seq.num_hashed_blocks = num_full

    def reset_prefix_cache(self, running: list[Sequence]) -> None:
        """Forget every cached prefix (e.g. after a weight swap); blocks in use stay with their sequences."""
        for block_id in self.evictable:
            self.free_uncached.append(block_id)
        self.evictable.clear()
        self.cached.clear()
        for block in self.blocks:
            block.hash, block.token_ids = None, ()
        for seq in running:
            seq.num_hashed_blocks = 0  # their full blocks are registered again at the next commit

    # ------------------------------------------------------------ allocation

    def _allocate_block(self) -> int:
        if self.free_uncached:
            block_id = self.free_uncached.popleft()
        else:
            block_id, _ = self.evictable.popitem(last=False)  # evict the least recently used cached block
            block = self.blocks[block_id]
            del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        self.blocks[block_id].ref_count = 1
        return block_id

    def admit_cost(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> int:
        """Free-pool blocks that admitting ``seq`` with prefix ``cached`` and ``num_new_tokens`` would take."""
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        fresh = self.blocks_for(seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens) - len(cached)
        return revived + fresh

    def admit(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> None:
        """Attach the cached prefix (ref counts up) and allocate blocks for ``num_new_tokens`` more tokens."""
        assert not seq.block_table, "admit() starts from an empty block table"
        for block_id in cached:  # revive before allocating, so allocation cannot evict our own prefix
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.evictable[block_id]
            block.ref_count += 1
        seq.block_table = list(cached)
        seq.num_hashed_blocks = len(cached)
        seq.num_computed_tokens += len(cached) * self.block_size
        self.append(seq, num_new_tokens)

    def append_cost(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the block table so tokens up to ``num_computed_tokens + num_new_tokens`` have slots."""
        for _ in range(self.append_cost(seq, num_new_tokens)):
            seq.block_table.append(self._allocate_block())

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count:
            return
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            self.evictable[block_id] = None  # most recently used end
        else:
            block.hash, block.token_ids = None, ()
            self.free_uncached.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Drop all of ``seq``'s blocks; tail blocks first, so they are evicted before shared heads."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Roll ``seq``'s cache back to its first ``num_tokens`` tokens (e.g. rejected speculative tokens).

        Blocks past the new end are freed; a kept block that is no longer full leaves the prefix cache.
        The caller trims ``seq.token_ids`` itself if the tokens themselves are rolled back.
        """
        keep = self.blocks_for(num_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]
        num_full = num_tokens // self.block_size
        for i in range(num_full, min(seq.num_hashed_blocks, keep)):
            block = self.blocks[seq.block_table[i]]
            assert block.ref_count == 1, "cannot roll back into a block shared with another sequence"
            if self.cached.get(block.hash) == block.block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        seq.num_hashed_blocks = min(seq.num_hashed_blocks, num_full)
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)
        del seq.block_hashes[seq.num_tokens // self.block_size:]
