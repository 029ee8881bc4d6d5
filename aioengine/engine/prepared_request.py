"""The prepared request: the engine's input after admission.

Admission (engine/admission.py) makes one from a prompt and its params; the front ends
(AsyncEngine, LLM, the server) hold it between admission and queueing; EngineCore queues
it as it is. It names nothing of the engine, so each of them can import it."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from aioengine.lora.request import LoRARequest
from aioengine.pooling_params import PoolingParams
from aioengine.sampling_params import SamplingParams


@dataclass
class PreparedRequest:
    """A request the engine has admitted, once: its prompt rendered and validated, its
    adapter resolved (`lora_request` is the registered one, with its lora_int_id), its
    grammar compiled (front ends' prepare) and `sampling_params` the engine's own copy
    with max_tokens and the stop token set resolved. `generate` queues it as it is."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt_text: str | None = None
    lora_request: LoRARequest | None = None
    # A pooling request (prefill only, AsyncEngine.encode / LLM.embed): how its hidden
    # states are pooled; `sampling_params` is then a placeholder nothing samples with.
    pooling_params: PoolingParams | None = None
    # For its trace (aioengine/tracing.py; read only when tracing is on): the caller's W3C
    # trace-context headers (traceparent, tracestate), the GenAI operation it is ("chat",
    # "text_completion"), when preparing began and its grammar compile ran
    # (time.monotonic(): the request span starts at `received_time`).
    trace_headers: Mapping[str, str] | None = None
    operation: str = "text_completion"
    received_time: float | None = None
    grammar_compile: tuple[float, float] | None = None
