"""CUDA graphs of decode steps (vLLM's cudagraph capture sizes).

At start-up the runner captures the model's forward of a decode step for each batch size
in `capture_sizes` (inputs in static buffers, attention metadata pointing into them). A
decode step of n requests is padded up to the next captured size and replayed: its ids,
positions, slots, seq lens and block tables are copied into the buffers, and the rows past
n are padding (slot -1: no K/V written; seq len 1 over block 0: a harmless read). Larger
steps, prefill chunks, and anything the graphs cannot hold (the torch attention backend,
which reads host-side lists; LoRA; EAGLE's auxiliary hidden states; layers whose soft-capped
attention loops over requests on the host, `cuda_graph_safe`) run eagerly.

Off CUDA (tests), `capture=False` runs the same padded step eagerly from the same buffers:
everything but the graph itself is exercised on the CPU.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from aioengine.model.attention import AttentionMetadata
from aioengine.model.llama import LlamaForCausalLM

PAD_SLOT_ID = -1


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (vLLM's default pattern), and
    max_num_seqs itself."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 8))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


def padded_size(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_reqs (None: run eagerly)."""
    return next((s for s in sizes if s >= num_reqs), None)


class CUDAGraphRunner:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[Tensor], capture_sizes: list[int],
                 max_model_len: int, block_size: int, device: torch.device,
                 capture: bool = True) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(capture_sizes)
        self.max_model_len = max_model_len
        self.device = device
        self.capture_enabled = capture
        n, width = self.sizes[-1], -(-max_model_len // block_size)
        kw = {"device": device}
        # Static inputs of the largest size; a size's graph reads their leading rows.
        self.input_ids = torch.zeros(n, dtype=torch.long, **kw)
        self.positions = torch.zeros(n, dtype=torch.long, **kw)
        self.slot_mapping = torch.full((n,), PAD_SLOT_ID, dtype=torch.long, **kw)
        self.seq_lens = torch.ones(n, dtype=torch.int32, **kw)
        self.block_tables = torch.zeros((n, width), dtype=torch.int32, **kw)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, **kw)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}
        self.pool = None

    def static_metadata(self, size: int) -> AttentionMetadata:
        """The metadata a graph of `size` rows was captured with: views of the buffers, and
        host-side bounds that hold for any step it replays (max_model_len)."""
        return AttentionMetadata(
            num_actual_tokens=size, num_reqs=size, num_decodes=size,
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size],
            max_query_len=1, max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(size + 1)), seq_lens_cpu=[self.max_model_len] * size,
            max_decode_seq_len=self.max_model_len)

    def _forward(self, size: int) -> Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches,
                          self.static_metadata(size))

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every size, largest first (later graphs share its memory pool). The
        padding rows write nowhere (slot -1), so capturing touches no KV block."""
        if not self.capture_enabled or not self.model.cuda_graph_safe:
            return
        self._load_padding(0)
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up outside the graph: kernels compiled, allocator grown
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[size] = self._forward(size)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def can_run(self, meta: AttentionMetadata) -> bool:
        n = meta.num_reqs
        return (meta.num_decodes == n == meta.num_actual_tokens and n <= self.sizes[-1]
                and meta.block_tables.shape[1] <= self.block_tables.shape[1]
                and not self.model.aux_hidden_state_layers and self.model.cuda_graph_safe
                and meta.layer_metas is None  # captured with one block table
                and meta.tree_masks is None)  # and causal attention

    def _load_padding(self, n: int) -> None:
        self.input_ids[n:].zero_()
        self.positions[n:].zero_()
        self.slot_mapping[n:].fill_(PAD_SLOT_ID)
        self.seq_lens[n:].fill_(1)
        self.block_tables[n:].zero_()

    def load(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> int:
        """Copies a decode step of n requests into the buffers, pads it to the next captured
        size and returns that size (all device-side copies: no sync)."""
        n = meta.num_reqs
        size = padded_size(n, self.sizes)
        assert size is not None
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids[:n], non_blocking=True)
        self.positions[:n].copy_(positions[:n], non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping[:n], non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens[:n], non_blocking=True)
        self.block_tables[:n, width:].zero_()
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self._load_padding(n)
        return size

    def run(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata,
            before_layers: Callable[[], None] | None = None) -> Tensor:
        """The step's final hidden states [n, H], from its graph (or, not capturing, from
        an eager forward over the same padded buffers)."""
        size = self.load(input_ids, positions, meta)
        if before_layers is not None:
            before_layers()
        if size in self.graphs:
            self.graphs[size].replay()
            out = self.outputs[size]
        else:
            out = self._forward(size)
        return out[:meta.num_reqs]
