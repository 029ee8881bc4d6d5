"""Executors of a model's decoder layers: who runs the layers of one step.

    LayerwiseExecutor      every step: the layers' own forward, op by op, with the model's
                           device ops and attention backend (the reference)
    FusedCpuDecodeExecutor decode steps on the CPU (decode rows, speculative verification
                           rows and trees): every layer and the final norm in one C call
                           (`cpu_decode.llama_decode`)

The model asks the fused executor first, per step; it runs the step only when it
`supports` it, and it supports only what it declares: the layer features in
`SUPPORTED_FEATURES` (anything else a LayerSpec uses declines the whole model, see
layer_spec.py), float32 activations on the CPU, the torch attention backend with its C
kernel, and the step's shape. Everything else runs layerwise: fail closed. The model
records which executor ran (`LlamaForCausalLM.last_executor`) for the step profile.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor, nn

from aioengine.kernels import cpu_decode
from aioengine.model.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from aioengine.model.layer_spec import LayerSpec, smallest_window, unsupported

if TYPE_CHECKING:
    from aioengine.model.arch import ModelArchConfig
    from aioengine.model.ops import TorchOps
    from aioengine.model.rotary import RopeStep, RotaryEmbedding

# The fused call reads panel-packed weights only (the any-M GEMM of kernels/cpu/gemm.h,
# which reads each weight once per step whatever the rows; the row-major gemv that once
# bounded it at 8 tokens is retired): it takes decode steps of any size, this bounds only its
# scratch (a few MB).
FUSED_DECODE_MAX_TOKENS = 1024


class DecoderModel(Protocol):
    """What an executor reads of its model (LlamaForCausalLM, llama.py, which builds its
    executors: naming the parts keeps this module from importing the model's)."""

    arch: ModelArchConfig
    ops: TorchOps
    layer_specs: tuple[LayerSpec, ...]
    layers: nn.ModuleList  # LlamaDecoderLayer per LayerSpec
    norm: Tensor
    rotary: RotaryEmbedding
    attn_backend: AttentionBackend
    lora_source: cpu_decode.LoRADecodeSource | None
    aux_hidden_state_layers: tuple[int, ...]

    def layer_ropes(self, positions: Tensor) -> list[RopeStep | None]: ...


class LayerwiseExecutor:
    """The layers one by one (any step, any device, any feature the layer code has)."""

    name = "layerwise"

    def __init__(self, model: DecoderModel) -> None:
        self.model = model

    def run(self, x: Tensor, positions: Tensor, kv_caches: list[Tensor],
            meta: AttentionMetadata, aux: Tensor | None) -> Tensor:
        """x: the embeddings [T, H] -> the final-normed hidden states; fills aux (the
        residual stream into each of model.aux_hidden_state_layers) when given."""
        model = self.model
        aux_layers, h = model.aux_hidden_state_layers, model.arch.hidden_size
        ropes = model.layer_ropes(positions)
        residual: Tensor | None = None
        for i, (layer, kv_cache, rope) in enumerate(zip(model.layers, kv_caches, ropes)):
            if aux is not None and i in aux_layers:
                # What the layer's input norm sees: x + residual (vLLM's hidden + residual).
                stream = x if residual is None else x + residual
                for j, listed in enumerate(aux_layers):
                    if listed == i:
                        aux[:, j * h:(j + 1) * h] = stream
            x, residual = layer(x, residual, rope, kv_cache, meta.for_layer(i),
                                model.attn_backend)
        eps = model.arch.rms_norm_eps
        if residual is None:  # no layers
            return model.ops.rms_norm(x, model.norm, eps)
        return model.ops.fused_add_rms_norm(x, residual, model.norm, eps)[0]


class FusedCpuDecodeExecutor:
    """All decoder layers of a small decode step in one C call (kernels/cpu/llama_decode.c),
    over the same weight objects as the layers."""

    name = "fused_cpu_decode"
    # The LayerSpec options the C kernel implements (layer_spec.LayerSpec.features()).
    # "sliding_window" only in steps whose every sequence fits in the window (the kernel
    # attends to the whole context): then the window masks nothing.
    SUPPORTED_FEATURES = frozenset({"qk_norm", "attention_bias", "sliding_window"})

    def __init__(self, model: DecoderModel) -> None:
        self.model = model
        # Off (tests, the runner's A/B): every step runs layerwise.
        self.enabled = True
        # The features of the model's layers the kernel lacks: non-empty declines every step.
        self.declined = unsupported(model.layer_specs, self.SUPPORTED_FEATURES)
        self.max_seq_len = smallest_window(model.layer_specs)  # None: any length
        # (the KV caches' data pointers, the typed layer table llama_decode reads) for the
        # last kv_caches seen: built once, the weights being updated in place. Whatever
        # replaces a parameter tensor (rather than copying into it) must call reset().
        self._table: tuple[tuple[int, ...], cpu_decode.DecodeLayerTable] | None = None

    def reset(self) -> None:
        self._table = None

    def supports(self, x: Tensor, meta: AttentionMetadata) -> bool:
        """The step is decode rows only (or trees of the C attention's rows beside them)
        and small, on the CPU in float32, with the torch attention backend and its C
        kernel, on layers with only SUPPORTED_FEATURES, no sequence longer than the
        smallest sliding window."""
        num_tokens = x.shape[0]
        backend = self.model.attn_backend
        return (self.enabled and not self.declined and bool(self.model.layers)
                and 0 < num_tokens <= self.max_tokens()
                and meta.num_actual_tokens == num_tokens and self._rows_supported(meta)
                and (self.max_seq_len is None or meta.max_seq_len <= self.max_seq_len)
                and meta.layer_metas is None  # one block table for every layer
                and type(backend) is TorchAttentionBackend and backend.use_cpu_kernel
                and x.device.type == "cpu" and x.dtype == torch.float32)

    @staticmethod
    def _rows_supported(meta: AttentionMetadata) -> bool:
        """Every sequence of the step is a decode row, or a tree verification item whose
        rows the C attention takes (AttentionMetadata.tree_kernel: each node row its own
        table ending in scratch blocks, worker/spec_tree.py); a tree the runner left to the
        torch masks (tree_kernel None) declines the step."""
        if meta.tree_masks is None:
            return meta.num_decodes == meta.num_reqs == meta.num_actual_tokens
        if meta.tree_kernel is None:
            return False
        qsl = meta.query_start_loc_cpu
        return all(qsl[i + 1] - qsl[i] == 1 or i in meta.tree_masks
                   for i in range(meta.num_reqs))

    def max_tokens(self) -> int:
        """The largest decode step it takes: any size with packed weights (or a GGUF's
        blocks); none (0) with weights left unpacked (no kernels, fp16), which the kernel
        does not read."""
        layers = self.model.layers
        qkv = layers[0].qkv_proj if layers else None
        packed = qkv is not None and (getattr(qkv, "is_packed", False)
                                      or getattr(qkv, "blocks", None) is not None)
        return FUSED_DECODE_MAX_TOKENS if packed else 0

    def run(self, x: Tensor, positions: Tensor, kv_caches: list[Tensor],
            meta: AttentionMetadata, aux: Tensor | None, aux_index: Tensor | None) -> bool:
        """The layers and the final norm on x in place; False, having done nothing, where
        the kernel is not built or the caches are not in its layout."""
        table = self._layer_table(kv_caches)
        if table is None:
            return False
        model, arch = self.model, self.model.arch
        lora = model.lora_source
        _, num_blocks, block_size, _, _ = kv_caches[0].shape
        tables, seq_lens, tree_copies = meta.block_tables, meta.seq_lens, None
        tree = meta.tree_kernel
        if tree is not None:  # one table per row, the node rows' scratch slots filled
            tables, seq_lens = tree.row_tables(), tree.row_seq_lens
            tree_copies = (tree.src_slots, tree.dst_slots)
        return cpu_decode.llama_decode(
            x, table, model.norm, num_heads=arch.num_attention_heads,
            num_kv_heads=arch.num_key_value_heads, head_dim=arch.head_dim,
            intermediate_size=arch.intermediate_size, eps=arch.rms_norm_eps,
            scale=model.layer_specs[0].scale, positions=positions, cos=model.rotary.cos,
            sin=model.rotary.sin, slot_mapping=meta.slot_mapping,
            block_tables=tables, seq_lens=seq_lens, num_blocks=num_blocks,
            block_size=block_size,
            aux=aux, aux_layers=aux_index, lora=None if lora is None else lora.decode_args(),
            tree_copies=tree_copies)

    def _layer_table(self, kv_caches: list[Tensor]) -> cpu_decode.DecodeLayerTable | None:
        key = tuple(c.data_ptr() for c in kv_caches)
        if self._table is None or self._table[0] != key:
            model, arch = self.model, self.model.arch
            kv_shape = (arch.num_key_value_heads, arch.head_dim)
            if (len(kv_caches) != len(model.layers) or len({c.shape for c in kv_caches}) != 1
                    or kv_caches[0].dim() != 5 or kv_caches[0].shape[-2:] != kv_shape):
                return None
            # Each projection in its own format, or parts of several (a GGUF's blocks:
            # cpu_decode.decode_projection); one it cannot read declines the table.
            table = cpu_decode.decode_layer_table([
                {"input_norm": layer.input_layernorm,
                 "qkv": cpu_decode.decode_projection(layer.qkv_proj),
                 "qkv_bias": layer.qkv_proj.bias, "q_norm": layer.q_norm,
                 "k_norm": layer.k_norm, "o": cpu_decode.decode_projection(layer.o_proj),
                 "post_norm": layer.post_attention_layernorm,
                 "gate_up": cpu_decode.decode_projection(layer.gate_up_proj),
                 "down": cpu_decode.decode_projection(layer.down_proj), "kv_cache": cache}
                for layer, cache in zip(model.layers, kv_caches)])
            if table is None:
                return None
            self._table = (key, table)
        return self._table[1]
