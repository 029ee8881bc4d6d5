"""The KV cache's size: on a GPU from a profiling run (vLLM's --gpu-memory-utilization), on
the CPU a fixed space (vLLM's VLLM_CPU_KVCACHE_SPACE)."""
from __future__ import annotations

import logging
import os

import torch

from aioengine import envs
from aioengine.config import ConfigError, EngineArgs, gpu_kv_cache_budget
from aioengine.model.loader import LoadedModel
from aioengine.worker.model_runner import ModelRunner

logger = logging.getLogger("aioengine")


def profile_gpu_kv_cache_memory(loaded: LoadedModel, args: EngineArgs, max_model_len: int,
                                kv_cache_dtype: torch.dtype, device: torch.device) -> int:
    """The largest step (ModelRunner.warm_up) on a throw-away KV cache just big enough for
    it, then --gpu-memory-utilization of the device minus the peak torch memory (without
    that cache) and the memory outside torch (gpu_kv_cache_budget). Bytes."""
    bs, tokens = args.block_size, args.max_num_batched_tokens
    blocks = tokens // bs + -(-tokens // max_model_len) + 1
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    runner = ModelRunner(loaded, blocks, bs, device, kv_cache_dtype)
    runner.warm_up(tokens, max_model_len)
    torch.cuda.synchronize(device)
    kv_bytes = sum(c.numel() * c.element_size() for c in runner.kv_caches)
    peak = torch.cuda.max_memory_allocated(device) - kv_bytes
    del runner
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    memory = gpu_kv_cache_budget(total, args.gpu_memory_utilization, peak, non_torch)
    logger.info("GPU memory: %.2f GiB total, profiling peak %.2f GiB, %.2f GiB outside torch: "
                "%.2f GiB for the KV cache (--gpu-memory-utilization %.2f)", total / 2**30,
                peak / 2**30, non_torch / 2**30, memory / 2**30, args.gpu_memory_utilization)
    return memory


# The CPU's KV space in GiB, like vLLM's VLLM_CPU_KVCACHE_SPACE (whose default is 4 GiB).
CPU_KVCACHE_SPACE_ENV = "AIOENGINE_CPU_KVCACHE_SPACE"
# 2 GiB: 2,900 blocks of 16 tokens (46k tokens) of SmolLM2-135M in float32, 1.4x the most
# any benchmark in docs/benchmarks.md held at once (2,107 blocks, prefix caching off); two
# cores decode far fewer sequences than that holds. vLLM's 4 GiB is sized for 7B models.
DEFAULT_CPU_KVCACHE_SPACE_GIB = 2.0


def cpu_kv_cache_memory() -> int:
    """Bytes of the KV cache off CUDA: $AIOENGINE_CPU_KVCACHE_SPACE GiB (default
    DEFAULT_CPU_KVCACHE_SPACE_GIB), at most a quarter of the memory available now.
    EngineCore also caps the blocks at what max_num_seqs requests of max_model_len tokens
    can use; --kv-cache-memory / --num-kv-blocks override all of it. The pages are
    reserved, not touched: they become resident as requests write K/V (make_kv_caches)."""
    raw = envs.AIOENGINE_CPU_KVCACHE_SPACE
    try:
        gib = DEFAULT_CPU_KVCACHE_SPACE_GIB if raw in (None, "") else float(raw)
    except ValueError:
        gib = -1.0
    if not 0 < gib < float("inf"):
        raise ConfigError(f"{CPU_KVCACHE_SPACE_ENV} must be a positive number of GiB, "
                          f"got {raw!r}")
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        available = 8 << 30
    return int(min(gib * 2**30, available // 4))
