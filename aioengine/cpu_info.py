"""What this processor can do, read once from /proc/cpuinfo (Linux x86; elsewhere empty).

The engine's choices that depend on the CPU (the default dtype, the C kernels' instruction
set) read these, so the start-up log and `/version` can say what they were based on.
"""
from __future__ import annotations

import functools
import platform

# The flags that decide a choice somewhere in the engine (the ones worth logging).
RELEVANT_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
                  "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = platform.machine(), frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model == platform.machine():
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = frozenset(value.split())
    except OSError:
        pass
    return model, flags


def cpu_model() -> str:
    """The processor's model name ("AMD EPYC ..."), or the machine type."""
    return _cpuinfo()[0]


def cpu_flags() -> frozenset[str]:
    """The feature flags of the first processor (/proc/cpuinfo's names)."""
    return _cpuinfo()[1]


def relevant_flags() -> list[str]:
    """The flags among RELEVANT_FLAGS this processor has, in that order."""
    flags = cpu_flags()
    return [f for f in RELEVANT_FLAGS if f in flags]


def has_bf16_compute() -> bool:
    """Native bf16 dot products (AVX512-BF16 or AMX): bf16 GEMMs run ~4x fp32 here, while
    on AVX2-only cores torch's bf16 matmul is ~70x slower than its fp32."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags
