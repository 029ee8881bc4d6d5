"""Sampling: logits of the rows that sample this step -> tokens and logprobs."""
from __future__ import annotations

from aioengine.sample.metadata import (
    CANDIDATE_SIZES,
    SamplingMetadata,
    SamplingRow,
    SparseLogitEdit,
    is_plain_greedy,
    make_generator,
    min_tokens_stop_ids,
)
from aioengine.sample.ops import greedy_tokens
from aioengine.sample.sampler import (
    Sampler,
    SamplerOutput,
    compute_probs,
    compute_prompt_logprobs,
    gather_logprobs,
)

__all__ = [
    "CANDIDATE_SIZES",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRow",
    "SparseLogitEdit",
    "compute_probs",
    "compute_prompt_logprobs",
    "gather_logprobs",
    "greedy_tokens",
    "is_plain_greedy",
    "make_generator",
    "min_tokens_stop_ids",
]
