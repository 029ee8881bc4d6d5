"""KVCacheManager's peak measure: blocks in use at the fullest step and their empty slots
(KV waste at peak), with shared blocks counted once."""
from __future__ import annotations

from aioengine.kv.kv_cache_manager import KVCacheManager

from test_kv_cache_manager import BS, admit, decode, make_request  # tests/unit is on sys.path


def test_waste_at_peak_counts_empty_slots_of_blocks_in_use() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    assert (mgr.peak_num_blocks, mgr.waste_at_peak) == (0, 0.0)
    admit(mgr, make_request("a", list(range(5))))  # 2 blocks: 4 + 1 tokens
    admit(mgr, make_request("b", list(range(100, 108))))  # 2 full blocks
    mgr.observe_peak_usage()
    # 4 blocks = 16 slots hold 13 tokens: 3 empty slots, all in a's last block.
    assert (mgr.num_used_blocks, mgr.peak_num_blocks, mgr.peak_num_empty_slots) == (4, 4, 3)
    assert mgr.waste_at_peak == 3 / 16


def test_waste_at_peak_counts_a_shared_prefix_block_once() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    admit(mgr, make_request("a", list(range(9))))  # 3 blocks: 4 + 4 + 1
    b = make_request("b", list(range(8)) + [50, 51])
    assert admit(mgr, b) == [3]  # hits a's 2 full blocks; 1 own block for 2 tokens
    assert mgr.num_used_blocks == 4
    mgr.observe_peak_usage()
    # 16 slots hold 8 shared + 1 + 2 = 11 tokens (6 blocks and 11 empty slots if the
    # shared blocks were counted per request).
    assert (mgr.peak_num_blocks, mgr.peak_num_empty_slots) == (4, 5)
    assert mgr.waste_at_peak == 5 / 16


def test_waste_at_peak_counts_a_forked_partial_block_once() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    parent = make_request("p", list(range(6)))  # 2 blocks: 4 + 2
    admit(mgr, parent)
    mgr.fork(parent, make_request("c", list(range(6))))
    mgr.check_integrity()
    mgr.observe_peak_usage()
    assert (mgr.peak_num_blocks, mgr.peak_num_empty_slots, mgr.waste_at_peak) == (2, 2, 0.25)


def test_peak_keeps_the_largest_step_until_reset_and_ignores_free_cached_blocks() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(5)))
    admit(mgr, a)
    mgr.observe_peak_usage()
    assert (mgr.peak_num_blocks, mgr.peak_num_empty_slots) == (2, 3)
    # A decode in the same partial block: as many blocks, not a new peak.
    decode(mgr, a, 77)
    mgr.observe_peak_usage()
    assert (mgr.peak_num_blocks, mgr.peak_num_empty_slots) == (2, 3)
    b = make_request("b", list(range(200, 203)))
    admit(mgr, b)
    mgr.observe_peak_usage()  # a: 6 tokens in 2 blocks, b: 3 tokens in 1 block
    assert (mgr.peak_num_blocks, mgr.peak_num_empty_slots) == (3, 3)
    mgr.free(a)
    mgr.free(b)
    assert mgr.block_pool.cached_block_hash_to_block  # a's full block stays cached, free
    mgr.observe_peak_usage()
    assert (mgr.num_used_blocks, mgr.peak_num_blocks) == (0, 3)  # the peak stays
    mgr.reset_peak_usage()
    assert (mgr.peak_num_blocks, mgr.peak_num_empty_slots, mgr.waste_at_peak) == (0, 0, 0.0)
    admit(mgr, make_request("c", list(range(300, 304))))  # one full block
    mgr.observe_peak_usage()
    assert (mgr.peak_num_blocks, mgr.peak_num_empty_slots, mgr.waste_at_peak) == (1, 0, 0.0)
