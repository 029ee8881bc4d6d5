"""Frozen configuration of one engine, and EngineArgs that builds it."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch

from aioengine import cpu_info

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


class ConfigError(ValueError):
    """An engine setting is invalid."""


QUANTIZATIONS = ("int8", "w8a8", "gguf")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")


def auto_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """What dtype="auto" means here, and why: bf16 on CUDA; on the CPU bf16 where the cores
    have native bf16 dot products (AVX512-BF16 or AMX), else float32 (on AVX2-only cores
    torch's bf16 matmul is ~70x slower than its fp32)."""
    if device.type == "cuda":
        return torch.bfloat16, "CUDA"
    flags = cpu_info.relevant_flags()
    shown = " ".join(flags) or "none"
    if cpu_info.has_bf16_compute():
        return torch.bfloat16, f"CPU has native bf16 dot products (flags: {shown})"
    return torch.float32, f"CPU has no native bf16 dot products (flags: {shown})"


def parse_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """The model's weight dtype; "auto" as `auto_dtype` decides."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ConfigError(f"unsupported dtype {dtype}; supported: {sorted(set(_DTYPES))}")
        return dtype
    if dtype == "auto":
        return auto_dtype(device)[0]
    if dtype not in _DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r}; supported: auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" or "priority" (lower value first, then arrival)
    # Speculative decoding: drafts per request per step (0 = off), and the batch size above
    # which a step verifies none (None = no limit).
    num_speculative_tokens: int = 0
    spec_disable_by_batch_size: int | None = None
    # Slots allocated past each step's tokens for a draft head's chain (EAGLE: k).
    num_lookahead_tokens: int = 0
    # Multi-LoRA: distinct adapters one step may hold (0 = LoRA off).
    max_loras: int = 0


@dataclass(frozen=True)
class EngineArgs:
    """Flat user-facing settings, vLLM's names. `model=None` is the bundled SmolLM2."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    # Quantization computed at load from any checkpoint: "int8" (weight-only, per output
    # channel scales) or "w8a8" (the same weights, activations quantized per token: integer
    # matmuls); "gguf" keeps a GGUF's own Q4_1 projection blocks; None keeps the weights in
    # `dtype`.
    quantization: str | None = None
    # "auto": float32 on the CPU (activations are float32 there), the model dtype on CUDA.
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    # Structured output: append grammar-forced tokens without sampling them one by one.
    structured_jump_forward: bool = True
    # AsyncEngine: schedule a decode step while the one before it runs, so the worker goes
    # straight on to it (Scheduler.schedule_ahead). The synchronous LLM never does.
    async_scheduling: bool = True
    # vLLM's speculative_config (a dict or its JSON text), validated by
    # aioengine.spec_decode.SpeculativeConfig.parse; None = no speculative decoding.
    speculative_config: dict | str | None = None
    # Multi-LoRA (vLLM's names): adapters per step, their largest rank, adapters kept
    # loaded in CPU memory (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)  # type: ignore[arg-type]

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            return torch.device(self.device)
        except RuntimeError as e:
            raise ConfigError(f"bad device {self.device!r}: {e}") from e

    def validate(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ConfigError(f"block_size must be a power of two <= 128, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {list(QUANTIZATIONS)} or None, "
                              f"got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_memory is not None and self.num_kv_blocks is not None:
            raise ConfigError("set kv_cache_memory or num_kv_blocks, not both")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ConfigError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras} "
                              f"and {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                              f"({self.max_loras})")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ConfigError(f"kv_cache_memory must be >= 1 byte, got {self.kv_cache_memory}")


def default_kv_cache_memory(device: torch.device) -> int:
    """A quarter of available host memory on CPU (capped at 4 GiB); 80% of free GPU memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 8 << 30
    return int(min(avail // 4, 4 << 30))
