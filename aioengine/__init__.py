"""aioengine: a paged, continuously batching LLM engine on one asyncio event loop.

The public names are imported lazily, so `import aioengine.<submodule>` stays cheap.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncEngine": "aioengine.engine.async_engine",
    "LLM": "aioengine.engine.llm",
    "EngineArgs": "aioengine.config",
    "EngineDeadError": "aioengine.errors",
    "InvalidRequestError": "aioengine.errors",
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
