"""Tree attention for the C kernel, which has no mask (speculative tree drafts: the
runner's worker/spec_tree.py builds it, TorchAttentionBackend and the fused decode
executor run it)."""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class TreeKernelRows:
    """The C kernel's rows for a step with tree masks (AttentionMetadata.tree_kernel)."""

    block_tables: Tensor  # [N + V, W] int32: the step's tables, then the node rows' own
    row_to_req: Tensor  # [T] int32: each row's table
    row_seq_lens: Tensor  # [T] int32
    src_slots: Tensor  # [S] int64: slots copied, in each layer before it attends, ...
    dst_slots: Tensor  # [S] int64: ... into the node rows' scratch blocks

    def fill_scratch(self, kv_cache: Tensor) -> None:
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
        flat.index_copy_(1, self.dst_slots, flat.index_select(1, self.src_slots))

    def row_tables(self) -> Tensor:
        """[T, W] int32: each row's block table (the fused decode kernel's one per row)."""
        return self.block_tables.index_select(0, self.row_to_req.long())
