"""The KVCacheManager's invariants, checked by tests and debug runs (not on the hot path):
each block's ref_cnt equals the number of tables holding it, a table's out-of-window entries
are its leading NULL_BLOCKs, and the blocks offered to the prefix cache carry the request's
own hashes."""
from __future__ import annotations

from typing import TYPE_CHECKING

from aioengine.core.block_pool import NULL_BLOCK, KVCacheBlock

if TYPE_CHECKING:
    from aioengine.core.kv_cache_manager import KVCacheManager


def check_kv_integrity(mgr: KVCacheManager) -> None:
    """Pool invariants, plus: every table entry is a live pool block held once per
    table, and each block's ref_cnt equals the number of tables holding it."""
    pool = mgr.block_pool
    pool.check_integrity()
    refs = [0] * pool.num_blocks
    assert mgr._num_slot_tokens.keys() == mgr.req_to_blocks.keys(), (
        "slot token counts and block tables cover different requests")
    for rid, table in mgr.req_to_blocks.items():
        num_null = mgr._num_null.get(rid, 0)
        assert all(b is NULL_BLOCK for b in table[:num_null]), (
            f"request {rid}: a live block among its first {num_null} (out of window)")
        blocks = table[num_null:]
        ids = [b.block_id for b in blocks]
        assert len(set(ids)) == len(ids), f"request {rid} holds a block twice: {ids}"
        assert mgr._num_slot_tokens[rid] <= len(table) * mgr.block_size, (
            f"request {rid}: {mgr._num_slot_tokens[rid]} tokens in {len(table)} blocks")
        for block in blocks:
            assert pool.owns(block), f"request {rid} holds foreign block {block.block_id}"
            assert block.ref_cnt >= 1, (
                f"request {rid} holds block {block.block_id} with ref_cnt {block.ref_cnt}")
            refs[block.block_id] += 1
        _check_cached_prefix(mgr, rid, table)
    for block in pool.blocks:
        assert block.ref_cnt == refs[block.block_id], (
            f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
            f"{refs[block.block_id]} request(s) hold it")
    for src, dst in mgr._copy_ops:
        assert pool.blocks[dst].ref_cnt >= 1, f"pending copy {src}->{dst} into a free block"

def _check_cached_prefix(mgr: KVCacheManager, rid: str, blocks: list[KVCacheBlock]) -> None:
    num_cached = mgr.num_cached_block.get(rid, 0)
    assert num_cached <= len(blocks), (
        f"request {rid}: {num_cached} cached blocks but only {len(blocks)} held")
    if not num_cached:
        return
    request = mgr._requests[rid]
    assert len(request.block_hashes) >= num_cached, (
        f"request {rid}: {num_cached} cached blocks but {len(request.block_hashes)} hashes")
    for i in range(mgr._num_null.get(rid, 0), num_cached):
        h = blocks[i].block_hash
        assert h is None or h == request.block_hashes[i], (
            f"request {rid}: block {blocks[i].block_id} at index {i} carries a foreign hash")

