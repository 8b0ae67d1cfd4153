"""Block manager: allocation, freeing, ref counts, chained hashes, prefix hits, LRU eviction, rollback."""
from __future__ import annotations

from apiary.cloud.engine.block_manager import ROOT_HASH, BlockManager, chain_hash
from tests.cloud.engine.helpers import make_seq


def computed(bm: BlockManager, seq, n: int) -> None:
    """Pretend the model ran ``n`` more tokens of ``seq`` (allocate, advance, register full blocks)."""
    bm.append(seq, n)
    seq.num_computed_tokens += n
    bm.commit(seq)


def test_allocate_on_demand_and_free() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(10)
    bm.admit(seq, [], 5)  # first chunk: 5 tokens -> 2 blocks
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    seq.num_computed_tokens += 5
    assert bm.append_cost(seq, 3) == 0 and bm.append_cost(seq, 4) == 1
    computed(bm, seq, 5)  # 10 tokens -> 3 blocks
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_hashes_are_chained_with_the_parent() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9]), make_seq([9, 9, 9, 9, 5, 6, 7, 8, 9])
    for s in (a, b):
        bm.admit(s, [], 0)
        computed(bm, s, 9)
    h0 = chain_hash(ROOT_HASH, (1, 2, 3, 4))
    assert a.block_hashes[:2] == [h0, chain_hash(h0, (5, 6, 7, 8))]
    # Same second block contents after a different first block: a different hash.
    assert a.block_hashes[1] != b.block_hashes[1]
    assert a.num_hashed_blocks == 2  # the partial third block is not cached


def test_prefix_hit_shares_blocks_and_counts_references() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(14)))
    bm.admit(a, [], 0)
    computed(bm, a, 14)
    b = make_seq(list(range(12)) + [99, 98, 97])
    hit = bm.cached_prefix(b)
    assert hit == a.block_table[:3]
    assert bm.admit_cost(b, hit, 3) == 1  # shared blocks are in use: only the tail block is new
    bm.admit(b, hit, 3)
    assert b.num_computed_tokens == 12 and [bm.blocks[x].ref_count for x in hit] == [2, 2, 2]
    bm.free(a)
    assert [bm.blocks[x].ref_count for x in hit] == [1, 1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 16 and len(bm.evictable) == 3


def test_full_prompt_hit_still_computes_the_last_token() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(list(range(8)))
    bm.admit(a, [], 0)
    computed(bm, a, 8)
    bm.free(a)
    b = make_seq(list(range(8)))
    assert len(bm.cached_prefix(b)) == 1  # the second block holds the last prompt token: recompute it


def test_hit_on_free_cached_blocks_revives_them_before_allocating() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_seq(list(range(8)))
    bm.admit(a, [], 0)
    computed(bm, a, 8)
    bm.free(a)  # both blocks now free but cached
    b = make_seq(list(range(8)) + [50])
    hit = bm.cached_prefix(b)
    assert len(hit) == 2 and bm.admit_cost(b, hit, 1) == 3
    bm.admit(b, hit, 1)  # allocation must not evict b's own prefix
    assert b.block_table[:2] == hit and bm.num_free_blocks == 0


def test_lru_eviction_order() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    seqs = [make_seq([10 * i, 10 * i + 1, 10 * i + 2]) for i in range(2)]
    for s in seqs:
        bm.admit(s, [], 0)
        computed(bm, s, 3)
    first_block_of = {s.request_id: s.block_table[0] for s in seqs}
    bm.free(seqs[0])
    bm.free(seqs[1])
    # Two uncached blocks (partial tails) are handed out before any cached block is evicted.
    taker = make_seq(list(range(100, 104)))
    bm.admit(taker, [], 4)
    assert len(bm.evictable) == 2
    # Next allocation evicts the least recently used cached block: seqs[0]'s.
    more = make_seq(list(range(200, 202)))
    bm.admit(more, [], 2)
    assert more.block_table == [first_block_of[seqs[0].request_id]]
    assert bm.cached_prefix(make_seq([0, 1, 2])) == []  # its hash is gone
    assert bm.cached_prefix(make_seq([10, 11, 12])) == [first_block_of[seqs[1].request_id]]


def test_reuse_refreshes_lru_position() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = make_seq([1, 2, 3]), make_seq([4, 5, 6])
    for s in (a, b):
        bm.admit(s, [], 0)
        computed(bm, s, 3)
    block_a, block_b = a.block_table[0], b.block_table[0]
    bm.free(a)
    bm.free(b)
    assert list(bm.evictable) == [block_a, block_b]  # a's block is the least recently used
    again = make_seq([1, 2, 9])
    bm.admit(again, bm.cached_prefix(again), 1)
    assert again.block_table[0] == block_a
    bm.free(again)
    assert list(bm.evictable) == [block_b, block_a]  # reuse made a's block the most recent
    taker = make_seq(list(range(20, 28)))
    bm.admit(taker, [], 8)  # four blocks: the two uncached ones, then b's (now LRU), then a's
    assert taker.block_table[2:] == [block_b, block_a]


def test_disabled_prefix_cache_never_shares() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_seq(list(range(9)))
    bm.admit(a, [], 0)
    computed(bm, a, 9)
    assert bm.cached_prefix(make_seq(list(range(9)))) == []
    bm.free(a)
    assert len(bm.evictable) == 0 and bm.num_free_blocks == 8


def test_duplicate_content_registered_once() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(list(range(5))), make_seq(list(range(5)))
    for s in (a, b):  # computed concurrently: neither could hit the other
        bm.admit(s, [], 5)
    for s in (a, b):
        s.num_computed_tokens = 5
        bm.commit(s)
    h = a.block_hashes[0]
    assert bm.cached[h] == a.block_table[0]
    bm.free(b)  # b's duplicate block is not the registered one: it goes back uncached
    assert b.block_hashes[0] == h and len(bm.evictable) == 0
    bm.free(a)
    assert list(bm.evictable) == [bm.cached[h]]


def test_truncate_rolls_back_blocks_and_cache_entries() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(11)))
    bm.admit(seq, [], 0)
    computed(bm, seq, 11)
    assert seq.num_hashed_blocks == 2 and len(seq.block_table) == 3
    third = seq.block_table[2]
    bm.truncate(seq, 6)  # keep 6 tokens: 2 blocks, the second no longer full
    assert len(seq.block_table) == 2 and seq.num_computed_tokens == 6 and seq.num_hashed_blocks == 1
    assert bm.blocks[third].ref_count == 0 and bm.blocks[seq.block_table[1]].hash is None
    assert len(bm.cached) == 1
    assert bm.num_free_blocks == 6
