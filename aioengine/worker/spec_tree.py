"""The runner's side of tree drafts (spec_decode/tree.py): a tree item's rows get their
tree positions and mask, and after verification its accepted path's K/V are moved to the
path's slots.

A tree item is one attention sequence (ScheduledRequest.is_tree: not decode rows) of
1 + N rows, laid out as a prefill chunk would be, so its slots are c .. c + N; only the
positions (c + depth) and the mask (AttentionMetadata.tree_masks) differ.

For the C attention kernel (no masks) each node row at depth d gets a block table of its
own, the request's up to the block holding position c + 1, then scratch blocks (past the
block pool's, never handed out) into which each layer copies the context's tail and the
row's path before attending:

    request's table   [ b0 .. b_k-1 | b_k: c-3 c-2 c-1 c  n0 n1 n2 ... ]   (node slots)
    node n2's table   [ b0 .. b_k-1 | s:   c-3 c-2 c-1 c  n0 n2 ]          (path a -> n2)

so the row attends over positions 0 .. c + d exactly as a chain's (or a plain decode's)
row there: the kernel splits at fixed absolute positions, the bits are the same.
"""
from __future__ import annotations

import torch
from torch import Tensor

from aioengine.sched.scheduler_output import ScheduledRequest
from aioengine.model.attention import AttentionMetadata, kernel_rows_plan, to_device
from aioengine.model.tree_attention import TreeKernelRows
from aioengine.spec_decode.tree import (TreeConfig, accepted_slot_moves, node_depths,
                                        node_index_paths, tree_attention_mask)

# Tree requests per step whose rows the C kernel attends for (scratch blocks are kept for
# them: the draft head's default disable_by_batch_size); a step with more takes the torch
# path (still exact in distribution, not bit for bit the kernel's).
TREE_KERNEL_MAX_REQUESTS = 8


def num_tree_scratch_blocks(tree: TreeConfig | None, block_size: int) -> int:
    """Scratch blocks the runner keeps past the block pool's for the C kernel's tree rows:
    per node row, the context's tail (< one block) and its path (up to depth)."""
    if tree is None:
        return 0
    per_row = -(-(block_size - 1 + tree.depth) // block_size)
    return TREE_KERNEL_MAX_REQUESTS * tree.num_nodes * per_row


def apply_tree_layout(scheduled: list[ScheduledRequest], item_starts: list[int],
                      meta: AttentionMetadata, positions: Tensor,
                      scratch_blocks: list[int], block_size: int) -> Tensor:
    """Sets the tree items' masks (and, where the scratch blocks suffice, the C kernel's
    rows) in `meta` and returns `positions` with their rows at the root's position +
    depth (the input when the step has no tree)."""
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
    meta.tree_kernel = _tree_kernel_rows(scheduled, item_starts, meta, scratch_blocks,
                                         block_size)
    return positions


def _tree_kernel_rows(scheduled: list[ScheduledRequest], item_starts: list[int],
                      meta: AttentionMetadata, scratch_blocks: list[int], block_size: int,
                      ) -> TreeKernelRows | None:
    """The C kernel's rows for the step (see the module docstring); None when the
    scratch blocks do not suffice."""
    row_to_req, row_seq_lens = (t.clone() for t in kernel_rows_plan(meta))
    tables: list[list[int]] = []
    src: list[int] = []
    dst: list[int] = []
    free = list(reversed(scratch_blocks))
    first_table = meta.num_reqs
    bs = block_size
    for i, item in enumerate(scheduled):
        if not item.is_tree:
            continue
        assert item.spec_tree_parents is not None
        c, table = item.num_computed_tokens, item.block_ids
        b0 = (c + 1) // bs
        for node, path in enumerate(node_index_paths(item.spec_tree_parents)):
            length = c + 1 + len(path)
            count = -(-(length - b0 * bs) // bs)
            if len(free) < count:
                return None
            blocks = [free.pop() for _ in range(count)]
            sources = list(range(b0 * bs, c + 1)) + [c + 1 + n for n in path]
            for p, source in enumerate(sources):
                src.append(table[source // bs] * bs + source % bs)
                dst.append(blocks[p // bs] * bs + p % bs)
            row = item_starts[i] + 1 + node
            row_to_req[row] = first_table + len(tables)
            row_seq_lens[row] = length
            tables.append(table[:b0] + blocks)
    width = meta.block_tables.shape[1]
    extra = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    device = meta.block_tables.device
    return TreeKernelRows(
        block_tables=torch.cat((meta.block_tables.cpu(), extra)).contiguous(),
        row_to_req=row_to_req.contiguous(), row_seq_lens=row_seq_lens.contiguous(),
        src_slots=torch.tensor(src, dtype=torch.long, device=device),
        dst_slots=torch.tensor(dst, dtype=torch.long, device=device))



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
