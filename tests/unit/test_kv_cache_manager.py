"""KVCacheManager: exact block tables, prefix hits, eviction order, fork + copy-on-write.

Every test calls check_integrity() after each operation. test_kv_cache_property.py drives
random workloads against a simulation of the KV contents.
"""
from __future__ import annotations

import pytest

from aioengine.kv.block_pool import hash_block_tokens
from aioengine.kv.kv_cache_manager import KVCacheManager
from aioengine.request import Request
from aioengine.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], salt: tuple | None = None) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(tokens),
                   sampling_params=SamplingParams(), cache_salt=salt)


def admit(mgr: KVCacheManager, req: Request, num_new: int | None = None) -> list[int]:
    """Prefix lookup + allocation + "forward" of `num_new` tokens (default: all)."""
    hits, num_hit = mgr.get_computed_blocks(req)
    num_new = req.num_tokens - num_hit if num_new is None else num_new
    new = mgr.allocate_slots(req, num_new, hits)
    assert new is not None
    req.num_computed_tokens = num_hit + num_new
    mgr.check_integrity()
    return [b.block_id for b in new]


def decode(mgr: KVCacheManager, req: Request, token: int) -> list[int] | None:
    req.append_output_token_ids([token])
    new = mgr.allocate_slots(req, 1)
    if new is not None:
        req.num_computed_tokens += 1
    mgr.check_integrity()
    return None if new is None else [b.block_id for b in new]


def free_ids(mgr: KVCacheManager) -> list[int]:
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def snapshot(mgr: KVCacheManager, req: Request) -> tuple:
    pool = mgr.block_pool
    return (free_ids(mgr), [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            {h: b.block_id for h, b in pool.cached_block_hash_to_block.items()},
            {rid: [b.block_id for b in bl] for rid, bl in mgr.req_to_blocks.items()},
            dict(mgr.prefix_cache.num_cached_block), list(mgr._copy_ops),
            list(req.block_hashes), req.num_computed_tokens)


def test_allocate_hashes_full_blocks_as_they_fill() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_request("a", list(range(10)))
    assert mgr.get_computed_blocks(req) == ([], 0)
    assert admit(mgr, req) == [0, 1, 2]
    assert mgr.get_block_ids("a") == [0, 1, 2]
    h0 = hash_block_tokens(None, [0, 1, 2, 3], None)
    h1 = hash_block_tokens(h0, [4, 5, 6, 7], None)
    assert req.block_hashes == [h0, h1]
    blocks = mgr.block_pool.blocks
    assert [blocks[i].block_hash for i in range(3)] == [h0, h1, None]
    assert decode(mgr, req, 10) == []  # 11 tokens fit in 3 blocks
    assert decode(mgr, req, 11) == []
    assert blocks[2].block_hash == hash_block_tokens(h1, [8, 9, 10, 11], None)
    assert decode(mgr, req, 12) == [3]
    assert mgr.get_block_ids("a") == [0, 1, 2, 3]
    assert free_ids(mgr) == [4, 5, 6, 7, 8, 9]


def test_chunked_prefill_hashes_only_computed_full_blocks() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_request("a", list(range(10)))
    assert admit(mgr, req, 6) == [0, 1]
    assert mgr.block_pool.blocks[1].block_hash is None and mgr.prefix_cache.num_cached_block["a"] == 1
    assert mgr.allocate_slots(req, 4) is not None
    assert mgr.get_block_ids("a") == [0, 1, 2]
    assert mgr.block_pool.blocks[1].block_hash == req.block_hashes[1]
    mgr.check_integrity()


def test_free_releases_in_reverse_to_the_tail() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=BS)
    a, b = make_request("a", list(range(10))), make_request("b", [7] * 5)
    assert admit(mgr, a) == [0, 1, 2]
    assert admit(mgr, b) == [3, 4]
    mgr.free(a)
    mgr.check_integrity()
    assert free_ids(mgr) == [5, 2, 1, 0] and mgr.get_block_ids("a") == []
    mgr.free(b)
    mgr.check_integrity()
    assert free_ids(mgr) == [5, 2, 1, 0, 4, 3]


def test_prefix_hits_cover_full_blocks_but_never_the_last_token() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(12)))
    admit(mgr, a)
    mgr.free(a)
    blocks = mgr.block_pool.blocks
    cases = {12: 8, 13: 12, 9: 8, 8: 4, 5: 4, 4: 0, 1: 0}
    for n, expected in cases.items():
        req = make_request(f"r{n}", list(range(n)))
        hits, num_hit = mgr.get_computed_blocks(req)
        assert num_hit == expected, n
        assert hits == blocks[:expected // BS]
    # A different token inside block 1 breaks the chain there.
    hits, num_hit = mgr.get_computed_blocks(make_request("x", [0, 1, 2, 3, 4, 99, 6, 7, 8]))
    assert (hits, num_hit) == ([blocks[0]], 4)
    # A different salt (LoRA adapter, ...) is a separate cache.
    salted = make_request("s", list(range(12)), salt=("lora", 1))
    assert mgr.get_computed_blocks(salted) == ([], 0)
    assert free_ids(mgr) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]  # lookups change nothing
    mgr.check_integrity()


def test_hit_on_free_cached_blocks_takes_them_out_of_the_free_queue() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(10)))
    admit(mgr, a)
    mgr.free(a)
    assert free_ids(mgr) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    b = make_request("b", list(range(10)))
    assert admit(mgr, b) == [3]
    assert b.num_computed_tokens == 10
    assert mgr.get_block_ids("b") == [0, 1, 3]
    assert free_ids(mgr) == [4, 5, 6, 7, 8, 9, 2]
    # The hit blocks are shared with the next identical request.
    c = make_request("c", list(range(10)))
    assert admit(mgr, c) == [4]
    assert mgr.get_block_ids("c") == [0, 1, 4]
    assert [mgr.block_pool.blocks[i].ref_cnt for i in (0, 1, 3, 4)] == [2, 2, 1, 1]


def test_cached_blocks_are_evicted_tail_first() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(12)))
    admit(mgr, a)
    mgr.free(a)
    assert free_ids(mgr) == [3, 4, 5, 2, 1, 0]
    b = make_request("b", [50] * 17)
    assert admit(mgr, b, 16) == [3, 4, 5, 2]  # evicts a's last block first
    hits, num_hit = mgr.get_computed_blocks(make_request("a2", list(range(12))))
    assert num_hit == 8 and [h.block_id for h in hits] == [0, 1]
    new = mgr.allocate_slots(b, 1)  # b's 5th block: evicts a's block 1
    assert new is not None and [blk.block_id for blk in new] == [1]
    mgr.check_integrity()
    hits, num_hit = mgr.get_computed_blocks(make_request("a3", list(range(12))))
    assert num_hit == 4 and [h.block_id for h in hits] == [0]
    assert len(mgr.block_pool.cached_block_hash_to_block) == 5  # a's block 0 + b's 4


def test_allocate_failure_changes_nothing() -> None:
    mgr = KVCacheManager(num_blocks=5, block_size=BS)
    a = make_request("a", list(range(8)))
    admit(mgr, a)
    mgr.free(a)  # blocks 0, 1 free but cached
    c = make_request("c", [9] * 8)
    assert admit(mgr, c) == [2, 3]
    assert free_ids(mgr) == [4, 1, 0]
    # b hits blocks 0, 1 and needs 2 more. Three blocks are free, but touching the two
    # hits takes them out of the queue, leaving one.
    b = make_request("b", list(range(16)))
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8
    before = snapshot(mgr, b)
    assert mgr.allocate_slots(b, 8, hits) is None
    assert snapshot(mgr, b) == before
    mgr.check_integrity()
    # With one block fewer needed, it fits exactly.
    b2 = make_request("b2", list(range(12)))
    assert admit(mgr, b2) == [4]
    assert mgr.get_block_ids("b2") == [0, 1, 4] and free_ids(mgr) == []
    # A running request that needs a new block fails cleanly too.
    before = snapshot(mgr, c)
    c.append_output_token_ids([9])
    assert mgr.allocate_slots(c, 1) is None
    c.all_token_ids.pop()
    c.output_token_ids.pop()
    assert snapshot(mgr, c) == before
    mgr.check_integrity()


def test_fork_copy_on_write_makes_n_minus_1_copies() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    parent = make_request("p", list(range(6)))
    admit(mgr, parent)
    children = [make_request(f"c{i}", list(range(6))) for i in range(2)]
    for child in children:
        mgr.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        mgr.check_integrity()
        assert mgr.get_block_ids(child.request_id) == [0, 1]
    blocks = mgr.block_pool.blocks
    assert (blocks[0].ref_cnt, blocks[1].ref_cnt) == (3, 3)
    assert children[0].block_hashes == parent.block_hashes
    assert decode(mgr, parent, 100) == [2]  # block 1 is shared and half full: copy
    assert mgr.get_block_ids("p") == [0, 2] and blocks[1].ref_cnt == 2
    assert decode(mgr, children[0], 101) == [3]
    assert mgr.get_block_ids("c0") == [0, 3] and blocks[1].ref_cnt == 1
    assert decode(mgr, children[1], 102) == []  # the last sharer writes in place
    assert mgr.get_block_ids("c1") == [0, 1]
    assert mgr.take_copy_ops() == [(1, 2), (1, 3)]
    assert mgr.take_copy_ops() == []
    # Later writes are private: no more copies. Block 0 stays shared by all three.
    assert decode(mgr, parent, 103) == [] and mgr.take_copy_ops() == []
    assert blocks[0].ref_cnt == 3
    # Each sample's now-full block 1 is hashed from its own tokens.
    assert blocks[2].block_hash == parent.block_hashes[1]
    assert parent.block_hashes[1] == hash_block_tokens(
        parent.block_hashes[0], [4, 5, 100, 103], None)
    for req in [parent] + children:
        mgr.free(req)
        mgr.check_integrity()
    assert all(b.ref_cnt == 0 for b in blocks) and mgr.usage == 0.0


def test_fork_copies_nothing_when_no_shared_block_holds_computed_tokens() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    # At a block boundary the first new token opens a new block for each sample.
    parent, child = make_request("p", list(range(8))), make_request("c", list(range(8)))
    admit(mgr, parent)
    mgr.fork(parent, child)
    child.num_computed_tokens = 8
    assert decode(mgr, parent, 1) == [2] and decode(mgr, child, 2) == [3]
    assert mgr.get_block_ids("p") == [0, 1, 2] and mgr.get_block_ids("c") == [0, 1, 3]
    # 4 known + 2 speculative tokens: block 5 is allocated but holds nothing computed, and
    # only block 4 (full of known tokens) is hashed. The child replaces it without a copy.
    parent, child = make_request("p2", [7] * 4), make_request("c2", [7] * 4)
    assert [b.block_id for b in mgr.allocate_slots(parent, 6)] == [4, 5]
    assert len(parent.block_hashes) == 1 and mgr.block_pool.blocks[5].block_hash is None
    parent.num_computed_tokens = 4  # both speculative tokens rejected
    mgr.fork(parent, child)
    child.num_computed_tokens = 4
    assert decode(mgr, child, 9) == [6]
    assert mgr.get_block_ids("c2") == [4, 6] and mgr.block_pool.blocks[5].ref_cnt == 1
    assert mgr.take_copy_ops() == []


def test_copy_on_write_failure_changes_nothing_and_free_drops_pending_copies() -> None:
    mgr = KVCacheManager(num_blocks=3, block_size=BS)
    parent, child = make_request("p", list(range(6))), make_request("c", list(range(6)))
    filler = make_request("f", [9])
    admit(mgr, parent)
    admit(mgr, filler)
    mgr.fork(parent, child)
    child.num_computed_tokens = 6
    parent.append_output_token_ids([1])
    before = snapshot(mgr, parent)
    assert mgr.allocate_slots(parent, 1) is None  # the copy needs a block: none is free
    assert snapshot(mgr, parent) == before
    mgr.check_integrity()
    mgr.free(filler)
    assert [b.block_id for b in mgr.allocate_slots(parent, 1)] == [2]
    # The parent is freed before its forward (an abort): its pending copy goes with it.
    mgr.free(parent, discard_cache=True)
    mgr.check_integrity()
    assert mgr.take_copy_ops() == []
    # Now the child owns block 1 alone and writes in place.
    child.append_output_token_ids([2])
    assert mgr.allocate_slots(child, 1) == [] and mgr.take_copy_ops() == []
    mgr.check_integrity()


def test_fork_rejects_a_child_that_differs_in_the_computed_prefix() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    parent = make_request("p", list(range(6)))
    admit(mgr, parent)
    with pytest.raises(ValueError, match="differs"):
        mgr.fork(parent, make_request("c", [0, 1, 2, 3, 4, 9]))
    with pytest.raises(ValueError, match="cache_salt"):
        mgr.fork(parent, make_request("c", list(range(6)), salt=("x",)))
    mgr.check_integrity()


def test_discard_cache_drops_hashes_of_released_blocks() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(10)))
    admit(mgr, a)
    b = make_request("b", list(range(10)))
    admit(mgr, b)  # shares blocks 0, 1 with a
    mgr.free(b, discard_cache=True)  # 0, 1 are still held by a: they stay cached
    mgr.check_integrity()
    assert mgr.get_computed_blocks(make_request("x", list(range(10))))[1] == 8
    mgr.free(a, discard_cache=True)
    mgr.check_integrity()
    assert mgr.get_computed_blocks(make_request("y", list(range(10)))) == ([], 0)
    assert mgr.block_pool.cached_block_hash_to_block == {}
    assert free_ids(mgr) == [4, 5, 6, 7, 8, 9, 3, 2, 1, 0]


def test_usage_and_prefix_cache_stats() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    assert mgr.num_blocks == 8 and mgr.num_blocks_needed(9) == 3 and mgr.num_blocks_needed(8) == 2
    a = make_request("a", list(range(10)))
    admit(mgr, a)
    assert mgr.usage == 3 / 8 and mgr.num_free_blocks == 5
    mgr.free(a)
    assert mgr.usage == 0.0 and mgr.num_free_blocks == 8
    admit(mgr, make_request("b", list(range(10))))  # 8 of 10 tokens hit
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (20, 8)
    assert mgr.prefix_cache_hit_rate == 0.4
    assert mgr.usage == 3 / 8


def test_caching_disabled() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    a = make_request("a", list(range(10)))
    assert admit(mgr, a) == [0, 1, 2]
    assert a.block_hashes == [] and mgr.block_pool.cached_block_hash_to_block == {}
    mgr.free(a)
    b = make_request("b", list(range(10)))
    assert mgr.get_computed_blocks(b) == ([], 0)
    assert mgr.prefix_cache_queries == 0 and mgr.prefix_cache_hit_rate == 0.0
    assert admit(mgr, b) == [3, 4, 5]


def test_reset_prefix_cache() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(10)))
    admit(mgr, a)
    assert not mgr.reset_prefix_cache()
    mgr.free(a)
    assert mgr.reset_prefix_cache()
    assert mgr.get_computed_blocks(make_request("b", list(range(10)))) == ([], 0)
    mgr.check_integrity()


def test_check_integrity_catches_a_ref_count_leak() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    admit(mgr, make_request("a", list(range(6))))
    mgr.block_pool.touch([mgr.block_pool.blocks[0]])  # a reference no request holds
    with pytest.raises(AssertionError, match="block 0 has ref_cnt 2 but 1 request"):
        mgr.check_integrity()


def test_check_integrity_catches_a_slot_count_without_a_table() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    admit(mgr, make_request("a", list(range(6))))
    mgr._num_slot_tokens["ghost"] = 3  # the manager's state handed over to kv_integrity
    with pytest.raises(AssertionError, match="cover different requests"):
        mgr.check_integrity()
