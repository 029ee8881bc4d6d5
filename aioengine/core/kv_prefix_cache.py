"""The prefix-cache half of the KVCacheManager: block hashes, the longest cached prefix of
a request (with a sliding window, kv_window.py's hits), offering full blocks to the cache,
and the hit counters.

A request's block i carries hash(hash of block i-1, its tokens, the request's cache salt),
computed once (`Request.block_hashes` only grows: the tokens of a full block never change).
A block is offered to the cache (`BlockPool.cache_full_block`) once all its tokens are
computed, and found by its hash until evicted.
"""
from __future__ import annotations

from aioengine.core import kv_window
from aioengine.core.block_pool import BlockHasher, BlockPool, KVCacheBlock
from aioengine.request import Request


class PrefixCacheMixin:
    """KVCacheManager's prefix caching, on the manager's state (set in its __init__)."""

    block_size: int
    enable_caching: bool
    sliding_window: int | None
    block_pool: BlockPool
    hash_block_tokens: BlockHasher
    # How many leading blocks of each request have been passed to cache_full_block.
    num_cached_block: dict[str, int]
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    _num_null: dict[str, int]  # leading NULL_BLOCK entries (out of the window) per request

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached full-block prefix of `request.all_token_ids`.

        At most num_tokens - 1 tokens may hit: the last token is always recomputed because
        sampling needs its logits. Ref counts are untouched; pass the blocks to
        `allocate_slots`, which takes the references and counts the lookup in the
        prefix-cache stats once it succeeds.
        """
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = max(request.num_tokens - 1, 0) // self.block_size
        self._ensure_block_hashes(request, max_hit_blocks)
        if self.sliding_window is not None:
            valid = self.window_hit_lengths(request, max_hit_blocks)
            n = max(i for i, ok in enumerate(valid) if ok)
            return self.window_hit(request, n) or [], n * self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break  # the chain is broken: no later block can be a valid hit
            hits.append(block)
        return hits, len(hits) * self.block_size

    def window_hit_lengths(self, request: Request, max_blocks: int) -> list[bool]:
        """With a sliding window, for n = 0 .. max_blocks: whether a hit of n blocks has
        every block it needs cached (kv_window.py)."""
        assert self.sliding_window is not None, "window_hit_lengths needs a sliding window"
        self._ensure_block_hashes(request, max_blocks)
        return kv_window.window_hit_lengths(self.block_pool, request.block_hashes,
                                            self.block_size, self.sliding_window, max_blocks)

    def window_hit(self, request: Request, num_hit_blocks: int) -> list[KVCacheBlock] | None:
        """With a sliding window, the hit of `request`'s first num_hit_blocks blocks, with
        NULL_BLOCK for those out of the window; None when a needed one is not cached."""
        assert self.sliding_window is not None, "window_hit needs a sliding window"
        self._ensure_block_hashes(request, num_hit_blocks)
        return kv_window.window_hit(self.block_pool, request.block_hashes, self.block_size,
                                    self.sliding_window, num_hit_blocks)

    def reset_prefix_cache(self) -> bool:
        """Drops every cached hash; False (nothing done) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    def _ensure_block_hashes(self, request: Request, num_blocks: int) -> None:
        """Extends request.block_hashes to cover its first `num_blocks` full blocks.
        Hashes depend only on tokens and salt, so computed ones never go stale."""
        hashes, size = request.block_hashes, self.block_size
        assert num_blocks * size <= request.num_tokens, "hashing a block that is not full"
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_blocks):
            parent = self.hash_block_tokens(
                parent, request.all_token_ids[i * size:(i + 1) * size], request.cache_salt)
            hashes.append(parent)

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                           num_tokens: int) -> None:
        """Offers to the cache every block full of known tokens once `num_tokens` tokens
        are computed. Speculative tokens beyond all_token_ids are never hashed."""
        if not self.enable_caching:
            return
        rid = request.request_id
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_block.get(rid, 0)
        if num_full <= start:
            return
        self._ensure_block_hashes(request, num_full)
        for i in range(max(start, self._num_null.get(rid, 0)), num_full):
            self.block_pool.cache_full_block(blocks[i], request.block_hashes[i])
        self.num_cached_block[rid] = num_full
