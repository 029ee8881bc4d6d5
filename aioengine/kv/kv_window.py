"""Prefix-cache hits under a sliding window W (every layer of a KV cache group windowed).

The queries after a hit of n blocks read only the last W positions, so only the blocks
holding those must be cached: a cached block's chained hash vouches for every token before
it. The blocks before them are NULL_BLOCK in the hit (vLLM's SlidingWindowManager finds its
hits the same way).
"""
from __future__ import annotations

from aioengine.kv.block_pool import NULL_BLOCK, BlockPool, KVCacheBlock


def first_needed_block(num_hit_blocks: int, block_size: int, window: int) -> int:
    """Index of the oldest block a query right after `num_hit_blocks` blocks reads."""
    return max(0, num_hit_blocks * block_size - window + 1) // block_size


def window_hit_lengths(pool: BlockPool, block_hashes: list, block_size: int, window: int,
                       max_blocks: int) -> list[bool]:
    """For n = 0 .. max_blocks: whether every block a hit of n blocks needs is cached.
    One lookup per block; `block_hashes` must cover max_blocks blocks."""
    run = [0] * (max_blocks + 1)  # run[n]: cached blocks in a row ending at block n - 1
    for i, block_hash in enumerate(block_hashes[:max_blocks]):
        cached = pool.get_cached_block(block_hash) is not None
        run[i + 1] = run[i] + 1 if cached else 0
    return [run[n] >= n - first_needed_block(n, block_size, window)
            for n in range(max_blocks + 1)]


def window_hit(pool: BlockPool, block_hashes: list, block_size: int, window: int,
               num_hit_blocks: int) -> list[KVCacheBlock] | None:
    """The hit of the first num_hit_blocks blocks: NULL_BLOCK for those out of the window,
    the cached blocks for the rest; None when one of those is not cached."""
    first = first_needed_block(num_hit_blocks, block_size, window)
    hits = [NULL_BLOCK] * first
    for block_hash in block_hashes[first:num_hit_blocks]:
        block = pool.get_cached_block(block_hash)
        if block is None:
            return None
        hits.append(block)
    return hits
