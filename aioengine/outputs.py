"""What the engine streams back to callers."""
from __future__ import annotations

from dataclasses import dataclass, field

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
