"""Engine-side state of one sequence being generated."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable

from aioengine.pooling_params import PoolingParams, PoolingState
from aioengine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from aioengine.kv.block_pool import BlockHash
    from aioengine.lora.request import LoRARequest


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """One sequence. With `n > 1` each sample is its own Request (`sample_index` i of the
    parent `parent_id`); samples after the first are forked from the first once its
    prompt is computed, sharing its KV blocks by reference count.

    Invariant: `num_computed_tokens <= num_tokens`; the scheduler's job is to make every
    running request's `num_computed_tokens` catch up with `num_tokens`.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    # Extra keys mixed into every block hash (e.g. a LoRA adapter id); None = base model.
    cache_salt: tuple | None = None
    parent_id: str | None = None
    sample_index: int = 0

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache at first scheduling (-1 = not yet looked up).
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # time.monotonic(), for queue-time metrics
    # Full-block hashes of all_token_ids, extended by the KV cache manager as blocks fill.
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Samples still to be forked from this one when its prompt is done (n > 1).
    pending_forks: list[Request] = field(default_factory=list)
    stop_reason: int | str | None = None
    error: str | None = None
    # The sampler's torch.Generator for a seeded request; it lives as long as the request so
    # that preemption and batch composition never change the random stream.
    generator: torch.Generator | None = None
    # The features' per-sample state: feature name -> what its EngineFeature.admit gave
    # (aioengine.engine.features; a feature that does not apply has no entry). Each
    # sample has its own; only the feature's own folder reads its entry (typed).
    feature_state: dict[str, object] = field(default_factory=dict)
    # The adapter it runs with (as registered: its lora_int_id is unique to one load);
    # None = the base model.
    lora_request: LoRARequest | None = None
    # Draft tokens proposed after the last step (speculative decoding), verified in the
    # next one; never part of all_token_ids (nor of any block hash) until accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    # With tree drafts (spec_decode/tree.py), each draft's parent (-1: the root); None: a chain.
    spec_tree_parents: list[int] | None = None
    # The proposer method that drafted spec_token_ids ("": the config's one method).
    spec_method: str = ""
    # Whether every feature lets it be drafted as a tree (EngineFeature.allows_tree_drafts,
    # decided at admission); else its drafts are a chain.
    allows_tree_drafts: bool = True
    # Which finished requests' outputs may draft for it (EngineFeature.draft_pool, decided
    # at admission): requests with equal pools share what a proposer learned across them.
    draft_pool: tuple[tuple[str, Hashable], ...] = ()
    # A pooling (prefill-only) request: no token is sampled; it ends once its prompt is
    # computed, with the pooled vector of its final hidden states (pooling_params.py).
    pooling_params: PoolingParams | None = None
    pooling_state: PoolingState | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.pooling_params is not None:
            self.pooling_state = PoolingState(self.pooling_params)

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def reads_cached_prefix(self) -> bool:
        """Whether the prefix cache may skip prompt positions: not when every position's
        output is wanted (prompt_logprobs, mean/cls pooling)."""
        if self.pooling_params is not None:
            return self.pooling_params.reads_cached_prefix
        return self.sampling_params.prompt_logprobs is None

    @property
    def lora_id(self) -> int:
        """The adapter's lora_int_id; 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
