"""The KVCacheManager's invariants, checked by tests and debug runs (not on the hot path):
each block's ref_cnt equals the number of tables holding it, a table's out-of-window entries
are its leading NULL_BLOCKs, and the blocks offered to the prefix cache carry the request's
own hashes.

The manager hands its state over as RequestTables (one per request it knows of), so this
module reads no private attribute of the manager and does not import it."""
from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from aioengine.kv.block_pool import NULL_BLOCK, BlockPool, KVCacheBlock
from aioengine.request import Request


class RequestTable(NamedTuple):
    """What the manager holds for one request; None where it holds no such entry."""

    request_id: str
    request: Request | None
    blocks: list[KVCacheBlock] | None  # the block table, NULL_BLOCK out of the window
    num_null: int  # leading NULL_BLOCK entries
    num_slot_tokens: int | None  # tokens its slots hold once its last allocation has run
    num_cached: int  # leading blocks offered to the prefix cache


def check_kv_integrity(pool: BlockPool, block_size: int, tables: Iterable[RequestTable],
                       copy_ops: Iterable[tuple[int, int]]) -> None:
    """Pool invariants, plus: every table entry is a live pool block held once per
    table, each block's ref_cnt equals the number of tables holding it, and no pending
    copy targets a free block."""
    pool.check_integrity()
    refs = [0] * pool.num_blocks
    for table in tables:
        rid, blocks = table.request_id, table.blocks
        assert blocks is not None and table.num_slot_tokens is not None, (
            "slot token counts and block tables cover different requests")
        assert all(b is NULL_BLOCK for b in blocks[:table.num_null]), (
            f"request {rid}: a live block among its first {table.num_null} (out of window)")
        held = blocks[table.num_null:]
        ids = [b.block_id for b in held]
        assert len(set(ids)) == len(ids), f"request {rid} holds a block twice: {ids}"
        assert table.num_slot_tokens <= len(blocks) * block_size, (
            f"request {rid}: {table.num_slot_tokens} tokens in {len(blocks)} blocks")
        for block in held:
            assert pool.owns(block), f"request {rid} holds foreign block {block.block_id}"
            assert block.ref_cnt >= 1, (
                f"request {rid} holds block {block.block_id} with ref_cnt {block.ref_cnt}")
            refs[block.block_id] += 1
        _check_cached_prefix(table, blocks)
    for block in pool.blocks:
        assert block.ref_cnt == refs[block.block_id], (
            f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
            f"{refs[block.block_id]} request(s) hold it")
    for src, dst in copy_ops:
        assert pool.blocks[dst].ref_cnt >= 1, f"pending copy {src}->{dst} into a free block"


def _check_cached_prefix(table: RequestTable, blocks: list[KVCacheBlock]) -> None:
    rid, num_cached, request = table.request_id, table.num_cached, table.request
    assert num_cached <= len(blocks), (
        f"request {rid}: {num_cached} cached blocks but only {len(blocks)} held")
    if not num_cached:
        return
    assert request is not None, f"request {rid}: cached blocks but no request"
    assert len(request.block_hashes) >= num_cached, (
        f"request {rid}: {num_cached} cached blocks but {len(request.block_hashes)} hashes")
    for i in range(table.num_null, num_cached):
        h = blocks[i].block_hash
        assert h is None or h == request.block_hashes[i], (
            f"request {rid}: block {blocks[i].block_id} at index {i} carries a foreign hash")
