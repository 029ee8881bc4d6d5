"""BlockPool and FreeKVCacheBlockQueue: exact block ids, queue orders and eviction."""
from __future__ import annotations

import pytest

from aioengine.kv.block_pool import (BlockPool, FreeKVCacheBlockQueue, KVCacheBlock,
                                       hash_block_tokens)


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_hash_block_tokens_chains_over_prefix_and_extra_keys() -> None:
    h0 = hash_block_tokens(None, [1, 2], None)
    assert h0 == hash_block_tokens(None, (1, 2), None)
    assert h0 != hash_block_tokens(None, [2, 1], None)
    assert h0 != hash_block_tokens(None, [1, 2], ("lora", 1))
    # Same tokens in the second block, different first block: different hash.
    assert hash_block_tokens(h0, [3, 4], None) != hash_block_tokens(
        hash_block_tokens(None, [9, 9], None), [3, 4], None)
    assert hash_block_tokens(h0, [3, 4], None) == hash_block_tokens(h0, [3, 4], None)


def test_free_queue_operations() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4, 5] and q.num_free_blocks == 6
    assert q.popleft() is blocks[0]
    assert ids(q.popleft_n(2)) == [1, 2]
    q.remove(blocks[4])  # from the middle
    assert ids(q.get_all_free_blocks()) == [3, 5] and q.num_free_blocks == 2
    assert blocks[4].prev_free_block is None and blocks[4].next_free_block is None
    q.append(blocks[1])
    q.append_n([blocks[4], blocks[0]])
    assert ids(q.get_all_free_blocks()) == [3, 5, 1, 4, 0] and q.num_free_blocks == 5
    q.remove(blocks[3])  # the head
    q.remove(blocks[0])  # the tail
    assert ids(q.get_all_free_blocks()) == [5, 1, 4]
    q.check_integrity()


def test_free_queue_rejects_misuse_without_changing() -> None:
    blocks = [KVCacheBlock(i) for i in range(3)]
    q = FreeKVCacheBlockQueue(blocks[:2])
    with pytest.raises(ValueError, match="cannot pop 3"):
        q.popleft_n(3)
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[2])
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[0])
    assert ids(q.get_all_free_blocks()) == [0, 1]
    q.popleft_n(2)
    with pytest.raises(ValueError, match="no free blocks"):
        q.popleft()
    assert q.get_all_free_blocks() == [] and q.num_free_blocks == 0
    q.check_integrity()


def test_allocation_pops_from_head_with_ref_cnt_one() -> None:
    pool = BlockPool(8, enable_caching=True)
    a = pool.get_new_blocks(3)
    b = pool.get_new_blocks(2)
    assert ids(a) == [0, 1, 2] and ids(b) == [3, 4]
    assert all(blk.ref_cnt == 1 for blk in a + b)
    assert free_ids(pool) == [5, 6, 7] and pool.get_num_free_blocks() == 3
    pool.check_integrity()
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert free_ids(pool) == [5, 6, 7]  # the failed request took nothing
    pool.check_integrity()


def test_free_appends_to_tail_in_given_order() -> None:
    pool = BlockPool(8, enable_caching=True)
    a = pool.get_new_blocks(3)
    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [3, 4, 5, 6, 7, 2, 1, 0]
    pool.check_integrity()
    # Reallocation takes the untouched blocks first, then the freed ones in freed order.
    assert ids(pool.get_new_blocks(6)) == [3, 4, 5, 6, 7, 2]
    pool.check_integrity()


def test_touch_and_shared_free() -> None:
    pool = BlockPool(4, enable_caching=True)
    blk = pool.get_new_blocks(1)[0]
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and free_ids(pool) == [1, 2, 3]
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and free_ids(pool) == [1, 2, 3, 0]
    pool.check_integrity()
    with pytest.raises(ValueError, match="double free of block 0"):
        pool.free_blocks([blk])
    pool.check_integrity()


def test_cached_blocks_are_evicted_lru_from_the_head() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    for i, blk in enumerate(blocks):
        assert pool.cache_full_block(blk, 100 + i)
    pool.free_blocks([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert free_ids(pool) == [2, 0, 3, 1]
    assert pool.get_cached_block(100) is blocks[0]  # free but still cached
    pool.check_integrity()
    assert ids(pool.get_new_blocks(2)) == [2, 0]
    assert blocks[2].block_hash is None and blocks[0].block_hash is None
    assert pool.get_cached_block(102) is None and pool.get_cached_block(100) is None
    assert pool.get_cached_block(103) is blocks[3] and pool.get_cached_block(101) is blocks[1]
    assert sorted(pool.cached_block_hash_to_block) == [101, 103]
    pool.check_integrity()


def test_touch_on_free_cached_block_removes_it_from_the_queue() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_block(blocks[1], 7)
    pool.free_blocks(blocks)
    assert free_ids(pool) == [0, 1, 2, 3]
    hit = pool.get_cached_block(7)
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and free_ids(pool) == [0, 2, 3]
    pool.check_integrity()
    # The hit cannot be evicted any more: new blocks skip it and it keeps its hash.
    assert ids(pool.get_new_blocks(3)) == [0, 2, 3]
    assert pool.get_cached_block(7) is hit
    pool.check_integrity()


def test_cache_full_block_keeps_the_existing_block_for_a_duplicate_hash() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b, _ = pool.get_new_blocks(3)
    assert pool.cache_full_block(a, 5)
    assert not pool.cache_full_block(b, 5)
    assert b.block_hash is None and pool.get_cached_block(5) is a
    assert pool.cache_full_block(a, 5)  # idempotent
    pool.free_blocks([a, b])
    assert pool.get_cached_block(5) is a
    pool.check_integrity()


def test_caching_disabled_never_hashes() -> None:
    pool = BlockPool(2, enable_caching=False)
    blk = pool.get_new_blocks(1)[0]
    assert not pool.cache_full_block(blk, 5)
    assert blk.block_hash is None and pool.get_cached_block(5) is None
    pool.check_integrity()


def test_free_with_discard_cache_drops_hashes_of_released_blocks_only() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b, _ = pool.get_new_blocks(3)
    pool.cache_full_block(a, 1)
    pool.cache_full_block(b, 2)
    pool.touch([b])  # b is shared: it survives the free with its hash
    pool.free_blocks([b, a], discard_cache=True)
    assert a.block_hash is None and pool.get_cached_block(1) is None
    assert pool.get_cached_block(2) is b and b.ref_cnt == 1
    assert free_ids(pool) == [0]
    pool.check_integrity()


def test_usage() -> None:
    pool = BlockPool(4, enable_caching=True)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(3)
    assert pool.get_usage() == 0.75
    pool.cache_full_block(blocks[0], 1)
    pool.free_blocks(blocks[:1])
    assert pool.get_usage() == 0.5  # a free cached block counts as free


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use() -> None:
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 1)
    pool.cache_full_block(b, 2)
    pool.free_blocks([a])
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(1) is a
    pool.free_blocks([b])
    assert pool.reset_prefix_cache()
    assert pool.cached_block_hash_to_block == {} and a.block_hash is None and b.block_hash is None
    assert free_ids(pool) == [0, 1]
    pool.check_integrity()


@pytest.mark.parametrize("corrupt, message", [
    (lambda pool: setattr(pool.blocks[0], "ref_cnt", 1), "ref_cnt 1 but is in the free queue"),
    (lambda pool: setattr(pool.blocks[3], "ref_cnt", 0), "ref_cnt 0 but is not in the free queue"),
    (lambda pool: setattr(pool.blocks[3], "ref_cnt", -1), "ref_cnt -1"),
    (lambda pool: setattr(pool.blocks[1], "block_hash", 99), "does not point back"),
    (lambda pool: pool.cached_block_hash_to_block.__setitem__(42, pool.blocks[2]), "entry 42"),
    (lambda pool: setattr(pool.free_block_queue, "num_free_blocks", 1), "num_free_blocks=1"),
    (lambda pool: setattr(pool.blocks[2], "prev_free_block", pool.blocks[0]), "links disagree"),
])
def test_check_integrity_names_the_broken_invariant(corrupt, message) -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_block(blocks[2], 7)
    pool.free_blocks(blocks[:3])  # queue: 0, 1, 2 (cached); block 3 in use
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()
