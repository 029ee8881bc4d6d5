"""An EAGLE-3 head's layer through the fused C decode kernel (kernels/cpu/llama_decode.c,
its `eagle_*` inputs): the two input norms, the layer and the final norm in one call per
draft step, where the torch path makes ~20 (issue 32).

Every row is laid out as a decode row (its own position, seq_len = position + 1, its
request's block table): the kernel writes every row's K/V before any row attends, so a
catch-up chunk is the same causal attention as the torch path's prefill. Tree drafting's
rows (eagle_tree.py) come with tables of their own (AttentionMetadata.tree_kernel), whose
scratch slots the kernel fills after the K/V write. The projections
run the same packed GEMM and attention the same fixed-position parts as the torch path,
so the two give the same bits (tests/model/test_eagle_fused.py). Fail closed: anything
else (EAGLE-1, another device or dtype, q/k norms, weights left unpacked, no kernel
library) returns None and the caller runs the torch path.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from aioengine.kernels import cpu_decode
from aioengine.model.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend

if TYPE_CHECKING:
    from aioengine.model.arch import ModelArchConfig
    from aioengine.model.decoder_layer import LlamaDecoderLayer
    from aioengine.model.rotary import RotaryEmbedding


class FusedHead(Protocol):
    """What the fused step reads of its head (an EagleHead, eagle.py, which builds its
    fused step: naming the parts keeps this module from importing the head's)."""

    method: str
    arch: ModelArchConfig
    device: torch.device
    dtype: torch.dtype
    eps: float
    layer: LlamaDecoderLayer
    attn_backend: AttentionBackend
    rotary: RotaryEmbedding
    hidden_norm: Tensor | None
    norm: Tensor | None
    norm_before_residual: bool


class FusedEagleStep:
    def __init__(self, head: FusedHead) -> None:
        self.head = head
        layer = head.layer
        backend = head.attn_backend
        self.enabled = (head.method == "eagle3" and head.device.type == "cpu"
                        and head.dtype == torch.float32 and layer.input_layernorm is not None
                        and head.hidden_norm is not None and head.norm is not None
                        and layer.q_norm is None and layer.spec.sliding_window is None
                        and type(backend) is TorchAttentionBackend and backend.use_cpu_kernel)
        self.packed = bool(getattr(layer.qkv_proj, "is_packed", False))
        self._table: tuple[int, cpu_decode.DecodeLayerTable | None] | None = None

    def _layer_table(self, kv_cache: Tensor) -> cpu_decode.DecodeLayerTable | None:
        if self._table is None or self._table[0] != kv_cache.data_ptr():
            layer = self.head.layer
            qkv, o, gate_up, down = layer.projections()
            proj = cpu_decode.decode_projection
            table = cpu_decode.decode_layer_table([{
                "input_norm": layer.input_layernorm, "qkv": proj(qkv), "qkv_bias": qkv.bias,
                "q_norm": None, "k_norm": None, "o": proj(o),
                "post_norm": layer.post_attention_layernorm, "gate_up": proj(gate_up),
                "down": proj(down), "kv_cache": kv_cache}])
            self._table = (kv_cache.data_ptr(), table)
        return self._table[1]

    def run(self, emb: Tensor, hidden: Tensor, positions: Tensor, kv_cache: Tensor,
            meta: AttentionMetadata) -> tuple[Tensor, Tensor] | None:
        """emb [T, H] (the tokens' embeddings), hidden [T, H] (fc applied): the head's
        (logits_hidden, next_hidden), writing the rows' K/V; None, having done nothing,
        where the kernel does not apply."""
        t = emb.shape[0]
        tree = meta.tree_kernel  # tree rows: each its own table (eagle_tree.py)
        if not (self.enabled and self.packed and t > 0
                and (meta.tree_masks is None or tree is not None)  # no masks in the kernel
                and emb.dtype == hidden.dtype == torch.float32 and kv_cache.dim() == 5):
            return None
        table = self._layer_table(kv_cache)
        if table is None:
            return None
        head, layer = self.head, self.head.layer
        if tree is None:
            starts = meta.query_start_loc_cpu
            query_lens = torch.tensor([b - a for a, b in zip(starts, starts[1:])])
            tables = meta.block_tables.repeat_interleave(query_lens, dim=0).contiguous()
            seq_lens, copies = (positions + 1).to(torch.int32), None
        else:
            tables, seq_lens = tree.row_tables(), tree.row_seq_lens
            copies = (tree.src_slots, tree.dst_slots)
        x = emb.contiguous().clone()
        next_hidden = hidden.contiguous().clone()
        _, num_blocks, block_size, _, _ = kv_cache.shape
        arch = head.arch
        ran = cpu_decode.llama_decode(
            x, table, head.norm, num_heads=arch.num_attention_heads,
            num_kv_heads=arch.num_key_value_heads, head_dim=arch.head_dim,
            intermediate_size=arch.intermediate_size, eps=head.eps, scale=layer.scale,
            positions=positions.contiguous(), cos=head.rotary.cos, sin=head.rotary.sin,
            slot_mapping=meta.slot_mapping, block_tables=tables, seq_lens=seq_lens,
            num_blocks=num_blocks, block_size=block_size,
            eagle=cpu_decode.EagleDecodeArgs(next_hidden, head.hidden_norm,
                                             head.norm_before_residual),
            tree_copies=copies)
        return (x, next_hidden) if ran else None
