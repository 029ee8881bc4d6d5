"""Per-request block tables on top of the BlockPool: slot allocation, fork with
copy-on-write, and release; prefix-cache lookups through the PrefixCache it holds
(kv_prefix_cache.py).

A request's block table maps logical block i (tokens [i*B, (i+1)*B), B = block_size) to a
physical block. With C = num_computed_tokens and N new tokens scheduled this step:

    tokens   0 ........ C ......... C+N
    blocks   [ full | full | part ][ new | new ]
                             ^ first written block, index C // B: copied first if shared

Blocks wholly before C // B are only read, so they may be shared freely (prefix hits,
forks). Every block at or after C // B receives writes this step and must be private.

With a sliding window W on every layer, a query at position p >= C reads keys p-W+1 .. p
only, so the blocks wholly before C-W+1 are never read again: they go back to the pool
(cached, if full, for other requests' prefix hits) and their table entries become
NULL_BLOCK, which keeps the table's indexing by position (vLLM's SlidingWindowManager).
A request then holds about (W + N) / B blocks, whatever its length.
"""
from __future__ import annotations

from aioengine.kv.block_pool import (DEFAULT_PREFIX_CACHING_HASH_ALGO, NULL_BLOCK,
                                       BlockPool, KVCacheBlock)
from aioengine.kv.kv_integrity import RequestTable, check_kv_integrity
from aioengine.kv.kv_prefix_cache import PrefixCache
from aioengine.kv.kv_usage import count_empty_slots
from aioengine.request import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns the block tables of all requests that hold KV blocks.

    Invariants (checked by `check_integrity`): each block's ref_cnt equals the number of
    request tables holding it; the `prefix_cache.num_cached_block[r]` leading blocks of
    request r have been offered to the prefix cache and carry either no hash or
    `r.block_hashes[i]`.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_algo: str = DEFAULT_PREFIX_CACHING_HASH_ALGO,
                 sliding_window: int | None = None, max_step_tokens: int | None = None,
                 ) -> None:
        """`sliding_window`: every layer attends to the last W positions only, so blocks
        that fall out of it are released; `max_step_tokens` (the most tokens one step
        schedules for a request) then bounds the blocks a request holds
        (num_blocks_needed)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and (sliding_window < 1 or not max_step_tokens):
            raise ValueError("a sliding window needs window >= 1 and max_step_tokens")
        self.sliding_window = sliding_window
        self.max_step_tokens = max_step_tokens or 0
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.prefix_cache = PrefixCache(self.block_pool, block_size, enable_caching,
                                        hash_algo, sliding_window)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._requests: dict[str, Request] = {}
        # How many leading table entries of each request are NULL_BLOCK (out of window).
        self._num_null: dict[str, int] = {}
        # Pending (src_block_id, dst_block_id) copies; must run, in order, before the forward
        # of the step that queued them (a later op may target an earlier op's source).
        self._copy_ops: list[tuple[int, int]] = []
        # Tokens each request's slots hold once the step that last allocated for it has
        # run: num_computed + num_new at that allocation. Feeds the KV-waste measure.
        self._num_slot_tokens: dict[str, int] = {}
        # The step with the most blocks in use (ref_cnt > 0) since the last reset, and how
        # many of their slots held no token then (see observe_peak_usage).
        self.peak_num_blocks = 0
        self.peak_num_empty_slots = 0

    # ---------------------------------------------------------------- queries

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, cached or not: all of them can be allocated."""
        return self.block_pool.get_num_free_blocks()

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests (ref_cnt > 0); free cached blocks are not counted."""
        return self.num_blocks - self.num_free_blocks

    @property
    def waste_at_peak(self) -> float:
        """Share of the slots of the blocks in use at the peak that held no token."""
        if not self.peak_num_blocks:
            return 0.0
        return self.peak_num_empty_slots / (self.peak_num_blocks * self.block_size)

    @property
    def hash_algo(self) -> str:
        return self.prefix_cache.hash_algo

    @property
    def prefix_cache_queries(self) -> int:
        """Tokens looked up in the prefix cache, once per admission."""
        return self.prefix_cache.queries

    @property
    def prefix_cache_hits(self) -> int:
        """Tokens of those found cached."""
        return self.prefix_cache.hits

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache.hit_rate

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The request's longest cached prefix (PrefixCache.get_computed_blocks): pass its
        blocks to allocate_slots."""
        return self.prefix_cache.get_computed_blocks(request)

    def reset_prefix_cache(self) -> bool:
        """Drops every cached hash; False (nothing done) while any block is in use."""
        return self.prefix_cache.reset()

    def num_blocks_needed(self, num_tokens: int) -> int:
        """The most blocks a request of `num_tokens` tokens holds at once: all of them, or
        with a sliding window those a step's queries can read plus the ones it writes."""
        full = _cdiv(num_tokens, self.block_size)
        if self.sliding_window is None:
            return full
        span = self.sliding_window - 1 + self.max_step_tokens
        return min(full, _cdiv(span, self.block_size) + 1)

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (empty if it holds no blocks; 0 for the entries out
        of the window)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The tables of other KV cache groups: none (kv_cache_groups.py has them)."""
        return ()

    def take_copy_ops(self) -> list[tuple[int, int]]:
        """Pending copy-on-write copies (src, dst), in the order they must be applied."""
        ops, self._copy_ops = self._copy_ops, []
        return ops

    # ---------------------------------------------------------------- allocation

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_computed_tokens: int | None = None,
                       ) -> list[KVCacheBlock] | None:
        """Makes room for `num_new_tokens` more tokens after the computed ones (those of
        request.num_computed_tokens plus the prefix hits `new_computed_blocks`).
        `num_computed_tokens` overrides the request's count: a step scheduled ahead
        allocates for what the request will have computed once the step in flight is done
        (with the stale count, blocks that step is writing would look unwritten and a shared
        one would be swapped for an empty copy).

        Returns the blocks newly taken from the pool (copy-on-write replacements first,
        in table order, then appended blocks), or None, with nothing changed, if the pool
        is short. Hits must directly follow the request's existing full blocks.
        """
        plan = self._plan(request, num_new_tokens, new_computed_blocks, num_computed_tokens)
        if plan is None:
            return None
        hits, num_computed, total, num_append, cow, out_of_window = plan
        rid, size = request.request_id, self.block_size
        self._release(rid, out_of_window)

        if new_computed_blocks is not None and self.enable_caching:
            self.prefix_cache.record_lookup(request.num_tokens, len(hits) * size)
        self._requests[rid] = request
        blocks = self.req_to_blocks.setdefault(rid, [])
        num_null = sum(1 for b in hits if b is NULL_BLOCK)  # leading: a window_hit
        if num_null:
            self._num_null[rid] = num_null
        self.block_pool.touch(hits[num_null:])
        blocks.extend(hits)
        new_blocks = self.block_pool.get_new_blocks(len(cow) + num_append)
        self._copy_on_write(blocks, cow, new_blocks[:len(cow)], num_computed)
        blocks.extend(new_blocks[len(cow):])
        self.prefix_cache.cache_full_blocks(request, blocks, total, self._num_null.get(rid, 0))
        self._num_slot_tokens[rid] = total
        self._free_out_of_window(rid, request.num_computed_tokens + len(hits) * size)
        return new_blocks

    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed_blocks: list[KVCacheBlock] | None = None,
                     num_computed_tokens: int | None = None) -> bool:
        """Whether allocate_slots with these arguments would succeed (nothing changed)."""
        return self._plan(request, num_new_tokens, new_computed_blocks,
                          num_computed_tokens) is not None

    def _plan(self, request: Request, num_new_tokens: int,
              new_computed_blocks: list[KVCacheBlock] | None,
              num_computed_tokens: int | None) -> tuple | None:
        """allocate_slots' arithmetic, changing nothing: (hits, num_computed, total,
        num_append, cow indices, out-of-window blocks), or None if the pool is short."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        hits = new_computed_blocks or []
        rid, size = request.request_id, self.block_size
        blocks = self.req_to_blocks.get(rid, [])
        if hits and request.num_computed_tokens != len(blocks) * size:
            raise ValueError(f"request {rid}: prefix hits must follow full blocks, but "
                             f"{request.num_computed_tokens} tokens are computed in "
                             f"{len(blocks)} blocks")
        if num_computed_tokens is None:
            num_computed_tokens = request.num_computed_tokens
        num_computed = num_computed_tokens + len(hits) * size
        total = num_computed + num_new_tokens
        num_append = max(0, _cdiv(total, size) - len(blocks) - len(hits))
        cow = self._shared_written_indices(blocks, num_computed, total)
        # Touching a free cached hit pulls it out of the free queue: it cannot also be
        # handed out as a new block.
        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0 and b is not NULL_BLOCK)
        out_of_window = self._out_of_window(rid, request.num_computed_tokens)
        num_released = sum(1 for b in out_of_window if b.ref_cnt == 1)
        if (len(cow) + num_append
                > self.block_pool.get_num_free_blocks() + num_released - num_free_hits):
            return None
        return hits, num_computed, total, num_append, cow, out_of_window

    def _out_of_window(self, rid: str, num_computed: int) -> list[KVCacheBlock]:
        """The blocks no query at or after position `num_computed` reads (those wholly
        before num_computed - W + 1) that the request still holds. Only its verified count
        may be passed: a step in flight or scheduled ahead has its queries after it."""
        blocks = self.req_to_blocks.get(rid)
        if self.sliding_window is None or not blocks:
            return []
        end = min(max(0, num_computed - self.sliding_window + 1) // self.block_size,
                  len(blocks))
        return blocks[self._num_null.get(rid, 0):end]

    def _release(self, rid: str, dropped: list[KVCacheBlock]) -> None:
        """Frees `dropped` (the request's next out-of-window blocks), last first like
        `free`, and puts NULL_BLOCK in their table entries."""
        if not dropped:
            return
        start = self._num_null.get(rid, 0)
        end = start + len(dropped)
        self.req_to_blocks[rid][start:end] = [NULL_BLOCK] * len(dropped)
        self._num_null[rid] = end
        self.block_pool.free_blocks(reversed(dropped))

    def _free_out_of_window(self, rid: str, num_computed: int) -> None:
        self._release(rid, self._out_of_window(rid, num_computed))

    def _shared_written_indices(self, blocks: list[KVCacheBlock], num_computed: int,
                                total: int) -> list[int]:
        """Indices of existing blocks that receive writes this step while shared."""
        if total <= num_computed:
            return []
        first = num_computed // self.block_size
        end = min(_cdiv(total, self.block_size), len(blocks))
        return [i for i in range(first, end) if blocks[i].ref_cnt > 1]

    def _copy_on_write(self, blocks: list[KVCacheBlock], indices: list[int],
                       fresh: list[KVCacheBlock], num_computed: int) -> None:
        """Swaps each shared block at `indices` for a private fresh one. Only a block that
        already holds computed tokens of this request needs its contents copied; later
        ones hold nothing this request will read before writing it."""
        if not indices:
            return
        released: list[KVCacheBlock] = []
        for i, dst in zip(indices, fresh):
            src = blocks[i]
            if i * self.block_size < num_computed:
                self._copy_ops.append((src.block_id, dst.block_id))
            blocks[i] = dst
            released.append(src)
        # ref_cnt > 1 for each, so none reaches the free queue here. No replaced block was
        # hashed by this request: hashed blocks lie wholly before num_computed.
        self.block_pool.free_blocks(released)

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent (ref_cnt += 1). The child's tokens
        must equal the parent's over the parent's computed tokens; the caller sets
        child.num_computed_tokens (normally to the parent's). The first write by either
        into a shared block copies it (see allocate_slots)."""
        cid, n = child.request_id, parent.num_computed_tokens
        if self.req_to_blocks.get(cid):
            raise ValueError(f"fork: child {cid} already holds blocks")
        if child.all_token_ids[:n] != parent.all_token_ids[:n]:
            raise ValueError(f"fork: child {cid} differs from parent {parent.request_id} "
                             f"within its {n} computed tokens")
        if child.cache_salt != parent.cache_salt:
            raise ValueError("fork: parent and child must have the same cache_salt")
        blocks = self.req_to_blocks.get(parent.request_id, [])
        self.block_pool.touch(b for b in blocks if b is not NULL_BLOCK)
        self.req_to_blocks[cid] = list(blocks)
        if parent.request_id in self._num_null:
            self._num_null[cid] = self._num_null[parent.request_id]
        self._requests[cid] = child
        self._num_slot_tokens[cid] = n
        self.prefix_cache.fork(parent, child, n // self.block_size)

    def free(self, request: Request, discard_cache: bool = False) -> None:
        """Releases the request's blocks in reverse, so its tail blocks (the least
        shareable part of a prefix) are evicted before its head.

        `discard_cache` (a failed forward, or a request freed between allocate_slots and
        its forward) also drops the hashes of blocks that reach ref_cnt 0: their KV may
        never have been written.
        """
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, [])
        self.prefix_cache.free(rid)
        self._requests.pop(rid, None)
        self._num_slot_tokens.pop(rid, None)
        self._num_null.pop(rid, None)
        self.block_pool.free_blocks((b for b in reversed(blocks) if b is not NULL_BLOCK),
                                    discard_cache=discard_cache)
        if self._copy_ops:
            # A copy into a block that is now free would only clobber its next owner.
            dead = {b.block_id for b in blocks if b.ref_cnt == 0}
            self._copy_ops = [op for op in self._copy_ops if op[1] not in dead]

    # ---------------------------------------------------------------- peak usage

    def observe_peak_usage(self) -> None:
        """Called once per step, after scheduling (the only time blocks are taken): when
        more blocks are in use than at any step since the last reset, records how many of
        their slots hold no token (kv_usage.py). Ties keep the first such step."""
        num_used = self.num_used_blocks
        if num_used <= self.peak_num_blocks:
            return
        self.peak_num_blocks = num_used
        self.peak_num_empty_slots = count_empty_slots(
            self.req_to_blocks, self._num_slot_tokens, self.block_size)

    def reset_peak_usage(self) -> None:
        """Starts a new peak measurement (e.g. before a benchmark's timed run)."""
        self.peak_num_blocks = 0
        self.peak_num_empty_slots = 0

    # ---------------------------------------------------------------- checks

    def check_integrity(self) -> None:
        """Pool and table invariants (kv_integrity.py); AssertionError on a violation."""
        check_kv_integrity(self.block_pool, self.block_size, self._request_tables(),
                           self._copy_ops)

    def _request_tables(self) -> list[RequestTable]:
        """One entry per request with a table or a slot count (the two must agree)."""
        cached = self.prefix_cache.num_cached_block
        rids = dict.fromkeys([*self.req_to_blocks, *self._num_slot_tokens])
        return [RequestTable(rid, self._requests.get(rid), self.req_to_blocks.get(rid),
                             self._num_null.get(rid, 0), self._num_slot_tokens.get(rid),
                             cached.get(rid, 0))
                for rid in rids]
