"""What the engine streams back to callers."""
from __future__ import annotations

import asyncio

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# One position's logprobs: token id -> (logprob, rank). Always holds the chosen token;
# plus the top-k alternatives when asked for.
PositionLogprobs = dict[int, "Logprob"]


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample (index `index` of `n`) of a request, as of the latest step.

    `text`/`token_ids` are the new pieces since the previous output of this sample;
    `cumulative_text`/`cumulative_token_ids` everything so far.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_text: str
    cumulative_token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None  # new positions only
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    error: str | None = None


@dataclass
class RequestOutput:
    """One streamed update of a request: `outputs` holds the samples that advanced."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt: str | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class PoolingOutput:
    """The pooled vector of one prompt (vLLM's name): float32 [hidden_size]."""

    data: torch.Tensor

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()


@dataclass
class PoolingRequestOutput:
    """The one output of a pooling request (AsyncEngine.encode, LLM.embed): `outputs` is
    None when it failed (`error` says why) or was aborted (`finish_reason` "abort")."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput | None
    finished: bool = True
    num_cached_tokens: int = 0
    finish_reason: str = "stop"
    error: str | None = None


def merge_completion(a: CompletionOutput, b: CompletionOutput) -> CompletionOutput:
    """Two consecutive updates of one sample as one (b is the later)."""
    logprobs = None if a.logprobs is None and b.logprobs is None else (
        (a.logprobs or []) + (b.logprobs or []))
    return CompletionOutput(b.index, a.text + b.text, a.token_ids + b.token_ids,
                            b.cumulative_text, b.cumulative_token_ids, logprobs, b.finished,
                            b.finish_reason, b.stop_reason, b.error)


def merge_request_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive updates of one request as one: each sample's new pieces joined, the
    later update's state (finished, metrics, cached tokens) kept."""
    samples: dict[int, CompletionOutput] = {c.index: c for c in a.outputs}
    for c in b.outputs:
        samples[c.index] = merge_completion(samples[c.index], c) if c.index in samples else c
    return RequestOutput(b.request_id, b.prompt_token_ids, list(samples.values()), b.finished,
                         b.prompt, b.prompt_logprobs if b.prompt_logprobs is not None
                         else a.prompt_logprobs, b.num_cached_tokens, b.metrics)


class RequestOutputCollector:
    """One request's outputs waiting for its consumer, merged (vLLM's idea of the same
    name): a consumer that lags gets one update with everything new since it last read,
    so what waits stays O(the request's output) however slowly it reads."""

    def __init__(self) -> None:
        self._pending: RequestOutput | None = None
        self._ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        self._pending = out if self._pending is None else merge_request_outputs(
            self._pending, out)
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        out, self._pending = self._pending, None
        self._ready.clear()
        assert out is not None
        return out
