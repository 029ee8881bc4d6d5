"""KV cache groups: models whose layers mix full attention and sliding windows (Gemma 2/3,
Qwen2 with `max_window_layers`) keep one block table per group of layers with the same
attention (vLLM's hybrid KV cache manager), so the windowed layers hold only the blocks
their window still sees, whatever the sequence's length.

Each group is a KVCacheManager over its own block pool; its layers' KV tensors have that
pool's number of blocks. Group 0 is the full-attention layers' (it has the most blocks and
bounds what a request may hold, so admission, `num_blocks` and the usage stats are its);
the windowed groups are sized for max_num_seqs requests at their window's bound
(KVCacheManager.num_blocks_needed). A step allocates in every group or in none.

Prefix caching: a hit is the longest prefix group 0 has cached whose last blocks (those
its window reads) every windowed group still has; the windowed groups' earlier blocks may
long be evicted (vLLM's sliding-window cache hit, searched from the right).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aioengine.kv.block_pool import KVCacheBlock
from aioengine.kv.kv_cache_manager import KVCacheManager
from aioengine.request import Request

if TYPE_CHECKING:
    from aioengine.model.layer_spec import LayerSpec


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """The layers of one group and their attention window (None: full attention)."""

    layers: tuple[int, ...]
    sliding_window: int | None


def kv_cache_group_specs(specs: Sequence[LayerSpec]) -> tuple[KVCacheGroupSpec, ...]:
    """One group per distinct window, full attention first; a single group when every
    layer attends alike (then one KVCacheManager does it all)."""
    windows = sorted({s.sliding_window for s in specs}, key=lambda w: (w is not None, w or 0))
    return tuple(KVCacheGroupSpec(tuple(s.layer_idx for s in specs if s.sliding_window == w), w)
                 for w in windows)


class GroupedKVCacheManager:
    """The KVCacheManager interface the scheduler and the engine use, over one manager per
    KV cache group. Tables, hits and copy-on-write copies are per group; the scheduler sees
    group 0's table in ScheduledRequest.block_ids and the others in group_block_ids."""

    def __init__(self, groups: Sequence[KVCacheGroupSpec],
                 managers: Sequence[KVCacheManager]) -> None:
        if len(groups) != len(managers) or len(groups) < 2:
            raise ValueError("a grouped KV cache needs two or more groups, one manager each")
        if groups[0].sliding_window is not None:
            raise ValueError("group 0 must be the full-attention layers'")
        self.groups = tuple(groups)
        self.managers = tuple(managers)
        self.main = managers[0]
        self.block_size = self.main.block_size
        self.enable_caching = self.main.enable_caching
        self.hash_algo = self.main.hash_algo
        # Full-attention layers read every position: a step's attention is not bounded.
        self.sliding_window: int | None = None

    # ---- group 0's figures: it bounds what a request may hold --------------------------

    @property
    def num_blocks(self) -> int:
        return self.main.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.main.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.main.num_used_blocks

    @property
    def usage(self) -> float:
        """The fullest group's share of blocks in use."""
        return max(m.usage for m in self.managers)

    def __getattr__(self, name: str) -> Any:
        # Prefix-cache and peak counters (prefix_cache_hits, peak_num_blocks, ...): group 0's.
        if name in _MAIN_STATS:
            return getattr(self.main, name)
        raise AttributeError(name)

    def num_blocks_needed(self, num_tokens: int) -> int:
        return self.main.num_blocks_needed(num_tokens)

    # ---- tables -------------------------------------------------------------------------

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.main.get_block_ids(request_id)

    def get_group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The tables of groups 1 .. n-1 (group 0's is get_block_ids)."""
        return tuple(m.get_block_ids(request_id) for m in self.managers[1:])

    def take_copy_ops(self) -> list[tuple[int, int, int]]:
        """Pending copy-on-write copies as (src, dst, group), in order per group."""
        return [(src, dst, g) for g, m in enumerate(self.managers)
                for src, dst in m.take_copy_ops()]

    # ---- prefix cache and allocation ------------------------------------------------------

    def get_computed_blocks(self, request: Request,
                            ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest prefix group 0 has cached whose last blocks every windowed group has
        too (the ones its window reads: PrefixCache.window_hit): its blocks per group,
        its tokens."""
        full = self.main.get_computed_blocks(request)[0]
        valid = [m.prefix_cache.window_hit_lengths(request, len(full))
                 for m in self.managers[1:]]
        n = max(i for i in range(len(full) + 1) if all(v[i] for v in valid))
        if n == 0:
            return tuple([] for _ in self.managers), 0
        others = [m.prefix_cache.window_hit(request, n) for m in self.managers[1:]]
        return (full[:n], *others), n * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: tuple[list[KVCacheBlock], ...] | None = None,
                       num_computed_tokens: int | None = None) -> list[KVCacheBlock] | None:
        """KVCacheManager.allocate_slots in every group, or in none (None, nothing changed,
        when some group is short). Returns group 0's new blocks."""
        hits = new_computed_blocks or (None,) * len(self.managers)
        if not all(m.can_allocate(request, num_new_tokens, h, num_computed_tokens)
                   for m, h in zip(self.managers, hits)):
            return None
        new = [m.allocate_slots(request, num_new_tokens, h, num_computed_tokens)
               for m, h in zip(self.managers, hits)]
        assert all(blocks is not None for blocks in new), "a group ran short after its check"
        return new[0]

    def fork(self, parent: Request, child: Request) -> None:
        for m in self.managers:
            m.fork(parent, child)

    def free(self, request: Request, discard_cache: bool = False) -> None:
        for m in self.managers:
            m.free(request, discard_cache)

    def reset_prefix_cache(self) -> bool:
        if any(m.num_used_blocks for m in self.managers):
            return False
        return all([m.reset_prefix_cache() for m in self.managers])

    def observe_peak_usage(self) -> None:
        for m in self.managers:
            m.observe_peak_usage()

    def reset_peak_usage(self) -> None:
        for m in self.managers:
            m.reset_peak_usage()

    def check_integrity(self) -> None:
        for m in self.managers:
            m.check_integrity()


_MAIN_STATS = frozenset({"prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate",
                         "peak_num_blocks", "peak_num_empty_slots", "waste_at_peak",
                         "max_step_tokens"})
