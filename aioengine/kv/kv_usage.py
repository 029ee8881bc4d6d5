"""The KV-waste measure: how many slots of the blocks in use hold no token."""
from __future__ import annotations

from aioengine.kv.block_pool import KVCacheBlock


def count_empty_slots(req_to_blocks: dict[str, list[KVCacheBlock]],
                      num_slot_tokens: dict[str, int], block_size: int) -> int:
    """Empty slots over every request's blocks, `num_slot_tokens[r]` being the tokens
    request r's slots hold.

    Only a request's blocks from index num_tokens // block_size on can have empty slots
    (normally just its last, partial block), so this is O(requests holding blocks). A
    partial block shared by forks is counted once; shared full blocks (prefix hits, forks)
    never have empty slots.
    """
    filled: dict[int, int] = {}  # block_id -> tokens it holds, for blocks not full
    for rid, blocks in req_to_blocks.items():
        num_tokens = num_slot_tokens[rid]
        for i in range(num_tokens // block_size, len(blocks)):
            block_id = blocks[i].block_id
            filled[block_id] = max(filled.get(block_id, 0),
                                   max(0, num_tokens - i * block_size))
    return sum(block_size - n for n in filled.values())
