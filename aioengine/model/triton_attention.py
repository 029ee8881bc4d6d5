"""The Triton attention backend (the GPU path) and the choice of backend.

`TritonAttentionBackend.forward` is two launches per layer: reshape_and_cache, then
unified_attention over the whole step (decodes and prefill chunks together), from the
metadata's device tensors; the split-KV choice reads only host-side fields
(num_decodes, num_reqs, max_decode_seq_len), so a step never waits on the device.
The kernels (aioengine.kernels.triton) are imported on first construction: `triton.jit`
reads TRITON_INTERPRET when they are defined, and on the CPU only the interpreter runs them.
"""
from __future__ import annotations

import os
from types import ModuleType

import torch
from torch import Tensor

from aioengine.config import ConfigError
from aioengine.model.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend


def _interpreting() -> bool:
    # Triton's own switch (not one of aioengine's variables, hence not in envs.py).
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _load_kernels(device: torch.device) -> ModuleType:
    from aioengine.kernels import triton as kernels
    from triton.runtime.interpreter import InterpretedFunction

    interpreted = isinstance(kernels.attention._unified_attention_kernel, InterpretedFunction)
    if device.type != "cuda" and not interpreted:
        raise ConfigError(
            f"attention_backend='triton' on {device.type} runs only under Triton's interpreter: "
            "set TRITON_INTERPRET=1 before aioengine.kernels.triton is imported (tests only: "
            "slow), or use attention_backend='torch'")
    return kernels


class TritonAttentionBackend(AttentionBackend):
    """Paged attention by Triton kernels: one unified launch for prefill chunks and decodes,
    split-KV for decode-only steps of few sequences with long contexts.

    num_kv_segments: force the split (1 = never, > 1 = always, that many segments);
    None = `split_kv_segments`' heuristic over the device's SM count."""

    def __init__(self, device: torch.device, num_kv_segments: int | None = None) -> None:
        self.kernels = _load_kernels(device)
        self.num_kv_segments = num_kv_segments
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 1)

    def segments(self, meta: AttentionMetadata, num_kv_heads: int) -> int:
        if self.num_kv_segments is not None:
            return self.num_kv_segments
        max_query_len = 1 if meta.num_decodes == meta.num_reqs else meta.max_query_len
        return self.kernels.split_kv_segments(meta.num_reqs, num_kv_heads, max_query_len,
                                              meta.max_decode_seq_len, self.num_sms)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor,
                meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None) -> Tensor:
        # Not in SUPPORTED_FEATURES: the model caps max_model_len at its window instead,
        # within which full attention is the windowed one.
        num_tokens = meta.num_actual_tokens
        # Every K/V of the step lands before any row attends (a request may read blocks
        # another request wrote in this very step).
        self.kernels.reshape_and_cache(k[:num_tokens], v[:num_tokens], kv_cache,
                                       meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return self.kernels.unified_attention(
            q, kv_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
            num_segments=self.segments(meta, kv_cache.shape[3]))


def select_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """EngineArgs.attention_backend -> the backend: "auto" = triton on CUDA, torch
    elsewhere; "triton" on the CPU needs TRITON_INTERPRET=1 (ConfigError otherwise)."""
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend()
    if name not in ("auto", "triton"):
        raise ConfigError(f"unknown attention_backend {name!r}")
    if device.type != "cuda" and not _interpreting():
        raise ConfigError(
            f"attention_backend='triton' needs a CUDA device; on {device.type} it runs only "
            "under Triton's interpreter (TRITON_INTERPRET=1, tests only: slow)")
    return TritonAttentionBackend(device)
