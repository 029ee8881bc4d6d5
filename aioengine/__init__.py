"""aioengine: a paged, continuously batching LLM engine on one asyncio event loop.

The public names are imported lazily, so `import aioengine.<submodule>` stays cheap.
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import Any

__version__ = "0.1.0"

# How long torch's idle OpenMP threads spin before sleeping, read by libgomp once, when torch
# is first imported (so only if aioengine comes first; a value already set wins). libgomp's
# default (300k spins) lets the threads fall asleep in the gaps between a decode step's
# small ops and between steps, and each wake-up is a futex round trip: 10M cut one request's
# time per output token by ~13% on 2 cores (docs/benchmarks.md). Idle threads give the core
# back after ~0.3 s of spinning.
if "torch" not in sys.modules:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000000")

# oneDNN keeps every matmul primitive it creates in two caches of 1,024 entries each (its
# own, and ideep's LRU above it), one entry per (shape, op), each holding JIT code and
# scratch. Every distinct step size (tokens in a prefill chunk, requests in a decode) makes
# new entries for each projection, about 2.6 MiB per step size with the bundled model: a
# server's memory grew ~13 MiB/min under mixed traffic and would have plateaued only some
# gigabytes later. 64 entries each bound that to a few hundred MiB at no measured cost
# (docs/benchmarks.md, "Soak"). Both are read at the first matmul; a value already set wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
os.environ.setdefault("LRU_CACHE_CAPACITY", "64")

_EXPORTS = {
    "AsyncEngine": "aioengine.engine.async_engine",
    "LLM": "aioengine.engine.llm",
    "EngineArgs": "aioengine.config",
    "EngineDeadError": "aioengine.errors",
    "InvalidRequestError": "aioengine.errors",
    "NotFoundError": "aioengine.errors",
    "LoRARequest": "aioengine.lora.request",
    "CompletionOutput": "aioengine.outputs",
    "Logprob": "aioengine.outputs",
    "RequestOutput": "aioengine.outputs",
    "SamplingParams": "aioengine.sampling_params",
    "SamplingParamsError": "aioengine.sampling_params",
    "StructuredOutputs": "aioengine.sampling_params",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'aioengine' has no attribute {name!r}")
