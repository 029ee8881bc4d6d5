"""What the dtype settings mean on this machine: the weights' dtype ("auto" by the CPU's
flags or CUDA, `auto_dtype`; names as vLLM takes them, `parse_dtype`) and the KV cache's
(`auto_kv_cache_dtype`). aioengine.config re-exports them beside EngineArgs."""
from __future__ import annotations

import torch

from aioengine import cpu_info
from aioengine.errors import ConfigError

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


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


def auto_kv_cache_dtype(weight_dtype: torch.dtype, compute: torch.dtype,
                        quantization: str | None, device: torch.device) -> torch.dtype:
    """What kv_cache_dtype="auto" means: on the CPU bf16 where the weights are bf16 (not
    quantized), as vLLM's CPU build keeps K/V in the model's dtype (the C attention widens
    each element exactly as it reads it: half the bytes of float32); elsewhere the
    activations' dtype (`compute`)."""
    if device.type == "cpu" and quantization is None and weight_dtype == torch.bfloat16:
        return torch.bfloat16
    return compute


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
