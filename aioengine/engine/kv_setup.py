"""The engine's KV cache manager: one KVCacheManager (every layer alike: full attention, or
a window on every layer), or one per KV cache group where the model mixes full-attention
and sliding-window layers (kv/kv_cache_groups.py), with each group's number of blocks.

Fail closed: groups only where the attention backend implements sliding windows and no
EAGLE head reads the target's block tables (it attends with full attention over group 0's
table alone); otherwise one manager keeps every block of every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

from aioengine.config import ConfigError, EngineArgs
from aioengine.kv.kv_cache_groups import (GroupedKVCacheManager, KVCacheGroupSpec,
                                            kv_cache_group_specs)
from aioengine.kv.kv_cache_manager import KVCacheManager
from aioengine.model.layer_spec import LayerSpec, uniform_window


@dataclass(frozen=True)
class KVCacheLayout:
    """The manager's construction: its groups (one: no grouping) and blocks per group."""

    groups: tuple[KVCacheGroupSpec, ...]
    num_blocks: tuple[int, ...]

    @property
    def grouped(self) -> bool:
        return len(self.groups) > 1

    def runner_groups(self) -> tuple[tuple[tuple[int, ...], int], ...]:
        """ModelRunner's kv_groups: each group's layers and blocks (empty: one group)."""
        if not self.grouped:
            return ()
        return tuple((g.layers, n) for g, n in zip(self.groups, self.num_blocks))


def kv_cache_layout(specs: tuple[LayerSpec, ...], args: EngineArgs, max_model_len: int,
                    num_blocks: int, windows_supported: bool, eagle: bool) -> KVCacheLayout:
    """`num_blocks`: what one pool for every layer would hold (the engine's sizing rule).
    With groups the same bytes are shared out: each windowed group gets what max_num_seqs
    requests at its window's bound use (at most num_blocks), group 0 the rest, counted in
    blocks of its own layers."""
    groups = kv_cache_group_specs(specs)
    if len(groups) < 2 or groups[0].sliding_window is not None or eagle or not windows_supported:
        window = None if eagle else uniform_window(specs)
        return KVCacheLayout((KVCacheGroupSpec(tuple(s.layer_idx for s in specs), window),),
                             (num_blocks,))
    num_layers = len(specs)
    budget = num_blocks * num_layers  # in layer-blocks
    counts = [0]
    for group in groups[1:]:
        probe = KVCacheManager(1, args.block_size, sliding_window=group.sliding_window,
                               max_step_tokens=args.max_num_batched_tokens)
        n = min(num_blocks, args.max_num_seqs * probe.num_blocks_needed(max_model_len))
        counts.append(n)
        budget -= n * len(group.layers)
    full = len(groups[0].layers)
    if args.num_kv_blocks is not None:
        counts[0] = num_blocks
    else:
        usable = args.max_num_seqs * -(-max_model_len // args.block_size)
        counts[0] = min(budget // full, usable)
    if counts[0] < 1:
        raise ConfigError("the KV cache memory holds no block for the full-attention layers "
                          "once the sliding-window layers have theirs")
    return KVCacheLayout(groups, tuple(counts))


def make_kv_cache_manager(layout: KVCacheLayout, args: EngineArgs,
                          ) -> KVCacheManager | GroupedKVCacheManager:
    managers = [KVCacheManager(n, args.block_size, enable_caching=args.enable_prefix_caching,
                               hash_algo=args.prefix_caching_hash_algo,
                               sliding_window=group.sliding_window,
                               max_step_tokens=args.max_num_batched_tokens)
                for group, n in zip(layout.groups, layout.num_blocks)]
    if not layout.grouped:
        return managers[0]
    return GroupedKVCacheManager(layout.groups, managers)


def peak_layer_blocks(layout: KVCacheLayout,
                      manager: KVCacheManager | GroupedKVCacheManager) -> int:
    """Blocks in use at each group's peak times that group's layers: the KV memory the
    peak held, in one layer's blocks (each group's peak may fall in a different step)."""
    managers = manager.managers if isinstance(manager, GroupedKVCacheManager) else (manager,)
    return sum(m.peak_num_blocks * len(g.layers) for g, m in zip(layout.groups, managers))
