"""What one step hands out and gets back: the scheduler's SchedulerOutput (a snapshot of
each scheduled request's share), the runner's ModelRunnerOutput, and the EngineCoreOutputs
that update_from_output turns them into for the output processor."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aioengine.outputs import PositionLogprobs
from aioengine.request import Request

if TYPE_CHECKING:
    import torch

    from aioengine.structured.bitmask import GrammarBitmask

# The input id of a token scheduled ahead (async scheduling): the runner replaces it with
# the token the previous step sampled for that request.
PLACEHOLDER_TOKEN_ID = -1


# Prompt chunks of up to this many tokens are laid out as decode rows (as_decode_rows): a
# long prompt's late chunks (sched/chunking.py: 1-8 tokens past ~1,000 positions) then run in
# the fused executor, ~8 ms of fixed cost a step against ~15 for the layer path. The bits
# are the same either way: one attention function, one GEMM order.
DECODE_ROWS_CHUNK = 8


@dataclass
class ScheduledRequest:
    """A snapshot of one request's share of a step, so the forward (which runs off the
    event loop) never reads request state the loop may change meanwhile."""

    request: Request
    num_computed_tokens: int  # before this step
    token_ids: list[int]  # the tokens computed this step
    block_ids: list[int]
    # Rows to sample: 0 for a prompt chunk that does not reach the end, 1 normally, and
    # 1 + pending forks when the first sample of an n > 1 request finishes its prompt.
    num_samples: int
    # Prompt positions whose next-token logprobs are wanted (prompt_logprobs).
    want_prompt_logprobs: bool = False
    # Speculative decoding: the draft tokens verified this step, the last len() entries of
    # token_ids. The runner computes each of the 1 + len() positions as its own row and
    # samples all of them (spec_decode's rejection sampler).
    spec_token_ids: list[int] = field(default_factory=list)
    # Tree drafts (spec_decode/tree.py): each draft's parent, -1 the root; None: a chain.
    # A tree is one attention sequence of 1 + drafts rows with a tree mask, not decode rows.
    spec_tree_parents: list[int] | None = None
    # The tables of KV cache groups 1 .. n-1 (kv_cache_groups.py), block_ids being group
    # 0's: empty unless the model mixes full and sliding-window layers.
    group_block_ids: tuple[list[int], ...] = ()

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_tree(self) -> bool:
        """Verifies tree drafts: its rows attend through a tree mask."""
        return self.spec_tree_parents is not None and bool(self.spec_token_ids)

    @property
    def is_decode(self) -> bool:
        """One token, one plus chain drafts, or a chunk of at most DECODE_ROWS_CHUNK
        tokens: every row attends as a decode row."""
        if self.is_tree:
            return False
        return len(self.token_ids) <= DECODE_ROWS_CHUNK or bool(self.spec_token_ids)

    @property
    def as_decode_rows(self) -> bool:
        """More than one token, each computed as its own decode row (its own position and
        seq_len, the request's block table): drafts to verify, or a small prompt chunk
        (fair prefill's chunks late in a long prompt), so the step can stay a decode step
        that the fused CPU executor takes whole."""
        return len(self.token_ids) > 1 and self.is_decode

    @property
    def num_logits_rows(self) -> int:
        """Rows of logits the runner samples for this item, in order (the grammar bitmask
        has the same rows): one per verified position with drafts, else num_samples."""
        return len(self.spec_token_ids) + 1 if self.spec_token_ids else self.num_samples


@dataclass
class ModelRunnerOutput:
    # request_id -> the tokens sampled from its last row: 1, or 1 + pending forks; with
    # drafts, the accepted drafts then one token sampled after them (1 .. 1 + drafts).
    sampled_token_ids: dict[str, list[int]]
    # request_id -> logprobs of each sampled token (aligned with sampled_token_ids).
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    # request_id -> logprobs of the prompt tokens this chunk predicts (positions 1.. of the prompt).
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    # Seconds the worker spent in "prepare", "forward", "sample" and "propose" (timeline).
    timings: dict[str, float] = field(default_factory=dict)
    # Who ran the decoder layers: the model's executor (model/executors.py) or "cuda_graph".
    executor: str = ""
    # Speculative decoding: request_id -> drafts proposed for the step after this one,
    # assuming every token in sampled_token_ids is kept (else update_from_output drops them).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Tree drafts: request_id -> each draft's parent (-1: the root); absent for a chain.
    spec_tree_parents: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> the method that drafted its spec_token_ids, where the proposer chooses
    # among several (spec_decode/auto.py); absent: the config's method.
    spec_methods: dict[str, str] = field(default_factory=dict)
    # The accepted tree nodes of a verified tree (spec_decode/tree.py), root to leaf.
    accepted_tree_nodes: dict[str, list[int]] = field(default_factory=dict)
    # Pooling requests: request_id -> this chunk's share of the pooled vector (float32,
    # pooling_params.chunk_share; absent when the chunk holds nothing the pooling reads).
    pooler_output: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """What one step did to one sample: the detokenizer and streams take it from here."""

    request: Request
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs] | None = None
    # A pooling request that finished: its pooled vector (float32, [hidden_size]).
    pooled: torch.Tensor | None = None

    @property
    def finished(self) -> bool:
        return self.request.is_finished


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # single-token (decode) requests first
    total_num_scheduled_tokens: int
    # (src, dst) block copies, or (src, dst, group) with KV cache groups.
    blocks_to_copy: list[tuple[int, ...]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # The step's grammar bitmask, attached by the structured-output feature's prepare_step
    # after scheduling when a sampled row is constrained; filled while the forward runs,
    # applied by the runner before sampling.
    grammar_bitmask: GrammarBitmask | None = None
    step_id: int = 0  # the scheduler's count of steps handed out
    # Async scheduling: set on a step scheduled ahead, while step `follows_step` ran. Each
    # of its requests computes one token, whose id (PLACEHOLDER_TOKEN_ID here) is the one
    # that step samples for it.
    follows_step: int | None = None
    # Speculative decoding: whether the runner proposes drafts after this step (off for
    # batches above the configured disable_by_batch_size).
    propose_drafts: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
