"""The one registry of environment variables aioengine reads.

Each entry is read when accessed (`envs.AIOENGINE_LOG_LEVEL`), so tests can set them.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

environment_variables: dict[str, Callable[[], Any]] = {
    # Logging level of the `aioengine` logger.
    "AIOENGINE_LOG_LEVEL": lambda: os.getenv("AIOENGINE_LOG_LEVEL", "INFO").upper(),
    # Threads torch uses for intra-op parallelism on CPU (default: all cores).
    "AIOENGINE_CPU_THREADS": lambda: int(os.getenv("AIOENGINE_CPU_THREADS", "0")),
    # API key `aioengine serve` requires when --api-key is not given (like VLLM_API_KEY).
    "AIOENGINE_API_KEY": lambda: os.getenv("AIOENGINE_API_KEY") or None,
    # 0 turns off the C kernels of aioengine.kernels.cpu (compiled on first use) and keeps
    # the plain torch paths.
    "AIOENGINE_CPU_KERNELS": lambda: os.getenv("AIOENGINE_CPU_KERNELS", "1") != "0",
    # Forces one build of the C kernels (amx, avx512_bf16, avx512, avx2, baseline) instead of
    # the best this CPU runs; one it cannot run is an error.
    "AIOENGINE_CPU_ISA": lambda: os.getenv("AIOENGINE_CPU_ISA") or None,
    # The bf16 GEMM on AMX tiles: auto (on in the amx build when the kernel grants the tile
    # state), 0 (the build's AVX-512 kernels), 1 (tiles, refused to 0 where unavailable)
    # or emulate (AMX's arithmetic in software, in any build: for tests).
    "AIOENGINE_AMX": lambda: (os.getenv("AIOENGINE_AMX") or "auto").lower(),
    # Path of the default model, overriding the bundled SmolLM2-135M-Instruct GGUF.
    "AIOENGINE_DEFAULT_MODEL": lambda: os.getenv("AIOENGINE_DEFAULT_MODEL") or None,
    # Seconds between AsyncEngine's periodic stats log lines (vLLM's
    # VLLM_LOG_STATS_INTERVAL); 0 turns them off.
    "AIOENGINE_LOG_STATS_INTERVAL":
        lambda: float(os.getenv("AIOENGINE_LOG_STATS_INTERVAL", "10")),
    # 1 adds POST /debug/faults to `aioengine serve` (in-process fault injection for tests
    # and soak runs: aioengine/engine/faults.py). Never on a server others use.
    "AIOENGINE_FAULT_INJECTION": lambda: os.getenv("AIOENGINE_FAULT_INJECTION", "0") == "1",
    # GiB of KV cache off CUDA when neither --kv-cache-memory nor --num-kv-blocks is given
    # (vLLM's VLLM_CPU_KVCACHE_SPACE; default 2, at most a quarter of free memory:
    # worker/gpu_memory.cpu_kv_cache_memory validates it).
    "AIOENGINE_CPU_KVCACHE_SPACE": lambda: os.getenv("AIOENGINE_CPU_KVCACHE_SPACE") or None,
    # 1: every page of the KV caches written at start-up (as vLLM's and llama.cpp's are),
    # not left for the kernel to zero on first touch (model/hugepages.zeros). A fresh page
    # can cost ~3 ms a huge page in a VM (the host backs it then): a step whose requests
    # first reach a new 2 MB of every layer's cache stalls ~100 ms. Start-up pays ~1.3 s a
    # GiB of KV there instead; `bench spec` turns it on for its own engines.
    "AIOENGINE_CPU_KV_PREFAULT": lambda: os.getenv("AIOENGINE_CPU_KV_PREFAULT", "0") == "1",
    # The start-up cache's root (model/weight_cache.py: parsed GGUFs, tokenizers; bench's
    # HF exports), default user_cache_dir(): see cache_root().
    "AIOENGINE_CACHE_DIR": lambda: os.getenv("AIOENGINE_CACHE_DIR") or None,
}


def user_cache_dir() -> Path:
    """$XDG_CACHE_HOME/aioengine, else ~/.cache/aioengine: the user's cache of aioengine."""
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "aioengine"


def cache_root() -> Path:
    """$AIOENGINE_CACHE_DIR, else user_cache_dir(): where what a start computes from a model
    file (and bench's exports of it) is kept."""
    explicit = environment_variables["AIOENGINE_CACHE_DIR"]()
    return Path(explicit).expanduser() if explicit else user_cache_dir()


def kernel_cache_dir() -> Path:
    """user_cache_dir()/kernels: the compiled C kernels. Not under cache_root(): a build
    depends only on the sources, flags and compiler, so a fresh $AIOENGINE_CACHE_DIR (a
    cold-start measurement, a test's own cache) reuses the builds rather than compiling
    them again."""
    return user_cache_dir() / "kernels"


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
