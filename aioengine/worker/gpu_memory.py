"""The KV cache's size: on a GPU from a profiling run (vLLM's --gpu-memory-utilization), on
the CPU from the model's KV bytes per token and the memory available once its weights are
loaded (or a fixed space: vLLM's VLLM_CPU_KVCACHE_SPACE)."""
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


# The CPU's KV space in GiB, like vLLM's VLLM_CPU_KVCACHE_SPACE: an explicit size.
CPU_KVCACHE_SPACE_ENV = "AIOENGINE_CPU_KVCACHE_SPACE"
# Without it the space is sized to the model and the machine: at most this share of the
# memory available once the weights are loaded (the rest for activations, the tokenizer,
# other processes), at most CPU_KV_CAP_GIB, and no more than max_num_seqs requests of
# max_model_len tokens can use. The pages are reserved, not touched: they become resident
# as requests write K/V (make_kv_caches), so a large pool costs address space until used.
CPU_KV_AVAILABLE_FRACTION = 0.5
CPU_KV_CAP_GIB = 16.0
_MEMINFO = "/proc/meminfo"


def mem_available() -> int:
    """Bytes the kernel says can be allocated now without swapping (/proc/meminfo's
    MemAvailable: free memory plus reclaimable page cache); elsewhere free pages."""
    try:
        with open(_MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


def _explicit_cpu_kv_space() -> int | None:
    """$AIOENGINE_CPU_KVCACHE_SPACE in bytes; None when unset; ConfigError when not a
    positive number of GiB."""
    raw = envs.AIOENGINE_CPU_KVCACHE_SPACE
    if raw in (None, ""):
        return None
    try:
        gib = float(raw)
    except ValueError:
        gib = -1.0
    if not 0 < gib < float("inf"):
        raise ConfigError(f"{CPU_KVCACHE_SPACE_ENV} must be a positive number of GiB, "
                          f"got {raw!r}")
    return int(gib * 2**30)


def cpu_kv_cache_memory(bytes_per_token: int, wanted_tokens: int) -> tuple[int, str]:
    """(bytes of the KV cache off CUDA, how they were chosen): $AIOENGINE_CPU_KVCACHE_SPACE
    GiB when set; else the least of CPU_KV_AVAILABLE_FRACTION of MemAvailable (read now:
    call it after the weights are loaded), CPU_KV_CAP_GIB, and `wanted_tokens` (what
    max_num_seqs requests of max_model_len use) of `bytes_per_token` (layers x K and V x
    kv_heads x head_dim x the cache dtype's bytes). --kv-cache-memory / --num-kv-blocks
    override all of it (EngineCore)."""
    explicit = _explicit_cpu_kv_space()
    if explicit is not None:
        return explicit, f"{CPU_KVCACHE_SPACE_ENV}={envs.AIOENGINE_CPU_KVCACHE_SPACE} GiB"
    available = mem_available()
    limits = {"of MemAvailable": int(available * CPU_KV_AVAILABLE_FRACTION),
              "cap": int(CPU_KV_CAP_GIB * 2**30),
              "max_num_seqs x max_model_len": wanted_tokens * bytes_per_token}
    reason = min(limits, key=limits.__getitem__)
    return limits[reason], (f"MemAvailable {available / 2**30:.1f} GiB, the least of "
                            f"{CPU_KV_AVAILABLE_FRACTION:.0%} of it, the {CPU_KV_CAP_GIB:g} "
                            f"GiB cap and what max_num_seqs x max_model_len use: {reason}")
