"""The prefix cache of one KVCacheManager: block hashes, the longest cached prefix of a
request (with a sliding window, kv_window.py's hits), offering full blocks to the cache,
and the hit counters.

The hash -> block map itself is the BlockPool's (it evicts a block's hash when it reuses
the block); this object is the request side of it, held by the manager
(`KVCacheManager.prefix_cache`), as vLLM's manager holds its coordinator's cache lookups.

A request's block i carries hash(hash of block i-1, its tokens, the request's cache salt),
computed once (`Request.block_hashes` only grows: the tokens of a full block never change).
A block is offered to the cache (`BlockPool.cache_full_block`) once all its tokens are
computed, and found by its hash until evicted.
"""
from __future__ import annotations

from aioengine.kv import kv_window
from aioengine.kv.block_pool import BlockPool, KVCacheBlock, get_block_hasher
from aioengine.request import Request


class PrefixCache:
    """Finds a request's cached prefix and offers its full blocks to the pool's cache.

    Invariant: `num_cached_block[r]` leading blocks of request r's table have been offered
    (or are out of the window); the manager calls `fork` and `free` as tables change.
    """

    def __init__(self, block_pool: BlockPool, block_size: int, enable_caching: bool,
                 hash_algo: str, sliding_window: int | None) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        # --prefix-caching-hash-algo; held here, not global, so engines in one process
        # may differ. Raises ValueError for an unknown name.
        self.hash_algo = hash_algo
        self.hash_block_tokens = get_block_hasher(hash_algo)
        # How many leading blocks of each request have been passed to cache_full_block.
        self.num_cached_block: dict[str, int] = {}
        self.queries = 0  # tokens looked up
        self.hits = 0  # tokens found

    @property
    def hit_rate(self) -> float:
        if not self.queries:
            return 0.0
        return self.hits / self.queries

    def record_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Counts one admission's lookup (by the manager, once its allocation succeeds: a
        request that keeps waiting for blocks is looked up every step but queried once)."""
        self.queries += num_queried_tokens
        self.hits += num_hit_tokens

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached full-block prefix of `request.all_token_ids`.

        At most num_tokens - 1 tokens may hit: the last token is always recomputed because
        sampling needs its logits. Ref counts are untouched; pass the blocks to
        `KVCacheManager.allocate_slots`, which takes the references and counts the lookup
        once it succeeds.
        """
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = max(request.num_tokens - 1, 0) // self.block_size
        self.ensure_block_hashes(request, max_hit_blocks)
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
        self.ensure_block_hashes(request, max_blocks)
        return kv_window.window_hit_lengths(self.block_pool, request.block_hashes,
                                            self.block_size, self.sliding_window, max_blocks)

    def window_hit(self, request: Request, num_hit_blocks: int) -> list[KVCacheBlock] | None:
        """With a sliding window, the hit of `request`'s first num_hit_blocks blocks, with
        NULL_BLOCK for those out of the window; None when a needed one is not cached."""
        assert self.sliding_window is not None, "window_hit needs a sliding window"
        self.ensure_block_hashes(request, num_hit_blocks)
        return kv_window.window_hit(self.block_pool, request.block_hashes, self.block_size,
                                    self.sliding_window, num_hit_blocks)

    def reset(self) -> bool:
        """Drops every cached hash; False (nothing done) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    def ensure_block_hashes(self, request: Request, num_blocks: int) -> None:
        """Extends request.block_hashes to cover its first `num_blocks` full blocks.
        Hashes depend only on tokens and salt, so computed ones never go stale."""
        hashes, size = request.block_hashes, self.block_size
        assert num_blocks * size <= request.num_tokens, "hashing a block that is not full"
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_blocks):
            parent = self.hash_block_tokens(
                parent, request.all_token_ids[i * size:(i + 1) * size], request.cache_salt)
            hashes.append(parent)

    def cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                          num_tokens: int, num_null: int) -> None:
        """Offers to the cache every block of `blocks` (the request's table, whose first
        `num_null` entries are out of the window) full of known tokens once `num_tokens`
        tokens are computed. Speculative tokens beyond all_token_ids are never hashed."""
        if not self.enable_caching:
            return
        rid = request.request_id
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_block.get(rid, 0)
        if num_full <= start:
            return
        self.ensure_block_hashes(request, num_full)
        for i in range(max(start, num_null), num_full):
            self.block_pool.cache_full_block(blocks[i], request.block_hashes[i])
        self.num_cached_block[rid] = num_full

    def fork(self, parent: Request, child: Request, num_shared_full: int) -> None:
        """The child shares the parent's first `num_shared_full` full blocks: their hashes,
        and the parent's offers among them, hold for the child too."""
        if len(child.block_hashes) < num_shared_full:
            child.block_hashes[:] = parent.block_hashes[:num_shared_full]
        self.num_cached_block[child.request_id] = min(
            self.num_cached_block.get(parent.request_id, 0), num_shared_full)

    def free(self, request_id: str) -> None:
        self.num_cached_block.pop(request_id, None)
