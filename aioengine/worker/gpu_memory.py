"""The KV cache's size on a GPU, from a profiling run (vLLM's --gpu-memory-utilization)."""
from __future__ import annotations

import logging

import torch

from aioengine.config import EngineArgs, gpu_kv_cache_budget
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
