"""How a step's scheduled items become attention sequences, and each layer's KV cache
group (kv/kv_cache_groups.py) on the runner's side: its block tables, its caches' sizes
and its copy-on-write copies."""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from aioengine.sched.scheduler_output import ScheduledRequest
from aioengine.model.attention import AttentionMetadata, build_attention_metadata


def copy_blocks(kv_caches: list[Tensor], src: list[int], dst: list[int]) -> None:
    """Copies whole blocks src[i] -> dst[i] in every layer (copy-on-write of shared blocks).

    Invariant: no dst is also a src (dst blocks are freshly allocated).
    """
    if len(src) != len(dst):
        raise ValueError("src and dst must have the same length")
    if not src:
        return
    device = kv_caches[0].device
    src_t = torch.tensor(src, dtype=torch.long, device=device)
    dst_t = torch.tensor(dst, dtype=torch.long, device=device)
    for cache in kv_caches:
        cache.index_copy_(1, dst_t, cache.index_select(1, src_t))


def step_layout(scheduled: list[ScheduledRequest],
                ) -> tuple[list[int], list[int], list[list[int]], list[int]]:
    """The attention's query_lens, seq_lens and block tables, one entry per attention
    sequence (an item with drafts, or a small chunk, is one decode row per position, each
    seeing the positions before it: ScheduledRequest.as_decode_rows), and where each item's
    tokens start in the step ([items + 1])."""
    query_lens: list[int] = []
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    starts = [0]
    for s in scheduled:
        n, context = s.num_new_tokens, s.num_computed_tokens
        if s.as_decode_rows:
            query_lens.extend([1] * n)
            seq_lens.extend(range(context + 1, context + n + 1))
            tables.extend([s.block_ids] * n)
        else:
            query_lens.append(n)
            seq_lens.append(context + n)
            tables.append(s.block_ids)
        starts.append(starts[-1] + n)
    return query_lens, seq_lens, tables, starts


def step_tables(scheduled: list[ScheduledRequest],
                table_of: Callable[[ScheduledRequest], list[int]]) -> list[list[int]]:
    """Block tables of another KV cache group, one per attention sequence as step_layout
    lays them out."""
    tables: list[list[int]] = []
    for s in scheduled:
        tables.extend([table_of(s)] * (s.num_new_tokens if s.as_decode_rows else 1))
    return tables


class LayerKVGroups:
    """Which KV cache group each layer's cache belongs to, from the engine's
    `kv_groups` ((layers, num_blocks) per group, group 0 first)."""

    def __init__(self, kv_groups: Sequence[tuple[tuple[int, ...], int]],
                 num_layers: int) -> None:
        groups = [0] * num_layers
        for g, (layers, _) in enumerate(kv_groups):
            for i in layers:
                groups[i] = g
        self.layer_groups = tuple(groups)
        self.num_groups = len(kv_groups)
        # Each layer's number of blocks (make_kv_caches).
        self.layer_blocks = [kv_groups[g][1] for g in groups]

    def copy_blocks(self, kv_caches: list, ops: list[tuple[int, ...]]) -> None:
        """Copy-on-write copies (src, dst, group), each in its group's layers."""
        by_group: dict[int, list[tuple[int, int]]] = {}
        for op in ops:
            by_group.setdefault(op[2] if len(op) > 2 else 0, []).append((op[0], op[1]))
        for g, pairs in by_group.items():
            caches = [c for i, c in enumerate(kv_caches) if self.layer_groups[i] == g]
            copy_blocks(caches, [s for s, _ in pairs], [d for _, d in pairs])

    def layer_metas(self, scheduled: list[ScheduledRequest], query_lens: list[int],
                    seq_lens: list[int], main: AttentionMetadata, block_size: int,
                    device: torch.device) -> tuple[AttentionMetadata, ...]:
        """Each layer's attention metadata: its group's block tables and slots (group 0's
        is `main`), the step's rows as step_layout laid them out."""
        metas = [main]
        for g in range(1, self.num_groups):
            tables = step_tables(scheduled, lambda s, g=g: s.group_block_ids[g - 1])
            metas.append(build_attention_metadata(query_lens, seq_lens, tables,
                                                  block_size, device)[0])
        return tuple(metas[g] for g in self.layer_groups)
