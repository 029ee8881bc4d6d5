"""The runner's side of tree drafts (spec_decode/tree.py): a tree item's rows get their
tree positions and mask, and after verification its accepted path's K/V are moved to the
path's slots.

A tree item is one attention sequence (ScheduledRequest.is_tree: not decode rows) of
1 + N rows, laid out as a prefill chunk would be, so its slots are c .. c + N; only the
positions (c + depth) and the mask (AttentionMetadata.tree_masks) differ.
"""
from __future__ import annotations

import torch
from torch import Tensor

from aioengine.core.scheduler_output import ScheduledRequest
from aioengine.model.attention import AttentionMetadata, to_device
from aioengine.spec_decode.tree import accepted_slot_moves, node_depths, tree_attention_mask


def apply_tree_layout(scheduled: list[ScheduledRequest], item_starts: list[int],
                      meta: AttentionMetadata, positions: Tensor) -> Tensor:
    """Sets the tree items' masks in `meta` and returns `positions` with their rows at
    the root's position + depth (the input when the step has no tree)."""
    if not any(item.is_tree for item in scheduled):
        return positions
    if meta.layer_metas is not None:  # SpeculativeConfig's tree refuses such models
        raise RuntimeError("tree drafts with KV cache groups")
    masks: dict[int, Tensor] = {}
    seq = 0
    positions = positions.clone()
    for i, item in enumerate(scheduled):
        if item.is_tree:
            assert item.spec_tree_parents is not None
            parents = item.spec_tree_parents
            masks[seq] = tree_attention_mask(parents, positions.device)
            root = item.num_computed_tokens
            depths = torch.tensor([0] + node_depths(parents), dtype=positions.dtype)
            start = item_starts[i]
            positions[start:start + len(parents) + 1] = to_device(root + depths,
                                                                   positions.device)
        seq += item.num_new_tokens if item.as_decode_rows else 1
    meta.tree_masks = masks
    return positions


def move_accepted_kv(kv_caches: list[Tensor], item: ScheduledRequest,
                     accepted_nodes: list[int], block_size: int) -> None:
    """Copies the accepted nodes' K/V (in every layer) from their node slots to their
    path positions, so the cache holds exactly the accepted path."""
    moves = accepted_slot_moves(accepted_nodes, item.num_computed_tokens)
    if not moves:
        return
    table = item.block_ids

    def slot(position: int) -> int:
        return table[position // block_size] * block_size + position % block_size

    device = kv_caches[0].device
    src = torch.tensor([slot(s) for s, _ in moves], dtype=torch.long, device=device)
    dst = torch.tensor([slot(d) for _, d in moves], dtype=torch.long, device=device)
    for cache in kv_caches:  # [2, num_blocks, block_size, Hkv, D]
        flat = cache.view(2, -1, *cache.shape[3:])
        flat.index_copy_(1, dst, flat.index_select(1, src))  # all read before any write
