"""The Sampler: one token per logits row, plus the logprobs the batch asked for.

Logprobs follow vLLM: they come from the RAW model logits (log_softmax before any bias,
penalty or temperature), and the sampled token is always reported with its rank, ahead
of the top-K alternatives:

    logprob_token_ids[i] = [sampled_i, top1_i, top2_i, ..., topK_i]     (K+1 columns)
    logprobs[i]          = their log-probabilities under the raw logits
    sampled_token_ranks  = rank of sampled_i, 1 = most likely

K is the largest `logprobs` asked for in the batch; a row that asked for fewer keeps
only its first `1 + params.logprobs` columns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from aioengine.sample.candidates import random_row_probs, sample_random_rows
from aioengine.sample.metadata import SamplingMetadata
from aioengine.sample.ops import apply_logits_processors, greedy_tokens, scratch


@dataclass
class SamplerOutput:
    sampled_token_ids: Tensor  # [N] int64
    logprob_token_ids: Tensor | None  # [N, K+1] int64: the sampled token, then the top-K
    logprobs: Tensor | None  # [N, K+1] float32
    sampled_token_ranks: Tensor | None  # [N] int64, rank of the sampled token (1 = best)


def gather_logprobs(logprobs: Tensor, token_ids: Tensor,
                    num_logprobs: int) -> tuple[Tensor, Tensor, Tensor]:
    """`[N, V]` logprobs and `[N]` chosen tokens -> ids `[N, K+1]`, logprobs `[N, K+1]`,
    ranks `[N]`. The rank counts strictly better tokens, plus one: ties share the best."""
    token_ids = token_ids.to(torch.int64).unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    # int32 accumulation is ~2x faster than the default int64 on CPU.
    ranks = (logprobs > token_logprobs).sum(dim=1, dtype=torch.int32).to(torch.int64) + 1
    if num_logprobs == 0:
        return token_ids, token_logprobs, ranks
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=1)
    return (torch.cat([token_ids, top_ids], dim=1),
            torch.cat([token_logprobs, top_logprobs], dim=1), ranks)


def compute_prompt_logprobs(logits: Tensor, target_token_ids: Tensor,
                            num_logprobs: int) -> tuple[Tensor, Tensor, Tensor]:
    """Prompt logprobs: row i of `logits` predicts `target_token_ids[i]` (the next prompt
    token). Same `[N, K+1]` ids / logprobs and `[N]` ranks layout as the sampler's."""
    logprobs = torch.log_softmax(logits.float(), dim=1)
    return gather_logprobs(logprobs, target_token_ids, num_logprobs)


class Sampler:
    """Turns `[N, V]` logits into N tokens (see ops.py for the pipeline order).

    `generator` is the RNG shared by rows without their own seed (None = torch's global
    RNG). The sampler takes ownership of `logits` and may modify them in place.
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator
        # Flat scratch buffers reused across steps ("logprobs", "workspace"), grown to the
        # largest batch seen: fresh [N, V] tensors cost page faults (see ops.scratch).
        self._buffers: dict[str, Tensor] = {}

    def _buffer(self, name: str, like: Tensor) -> Tensor:
        buf = self._buffers.get(name)
        if (buf is None or buf.numel() < like.numel() or buf.device != like.device
                or buf.dtype != like.dtype):
            buf = self._buffers[name] = torch.empty(like.numel(), dtype=like.dtype,
                                                    device=like.device)
        return buf

    def __call__(self, logits: Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if logits.shape != (metadata.num_rows, metadata.vocab_size):
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match metadata "
                             f"({metadata.num_rows}, {metadata.vocab_size})")
        logits = logits.float()
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            # Before any processing: reported logprobs are the model's own (vLLM).
            raw_logprobs = torch.log_softmax(
                logits, dim=1, out=scratch(self._buffer("logprobs", logits), logits))
        sampled = self.sample(apply_logits_processors(logits, metadata), metadata)
        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        ids, logprobs, ranks = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled, ids, logprobs, ranks)

    def sample(self, logits: Tensor, metadata: SamplingMetadata) -> Tensor:
        """Processed logits -> tokens: argmax for greedy rows, a random draw otherwise."""
        if metadata.all_random:
            return sample_random_rows(logits, metadata, self.generator,
                                      self._buffer("workspace", logits))
        sampled = greedy_tokens(logits)
        if not metadata.all_greedy:
            random_rows = metadata.random_row_indices
            assert random_rows is not None
            sampled[random_rows] = sample_random_rows(
                logits[random_rows], metadata, self.generator, self._buffer("workspace", logits))
        return sampled


def compute_probs(logits: Tensor, metadata: SamplingMetadata) -> Tensor:
    """The exact `[N, V]` distribution each row samples from under `Sampler` (one-hot
    argmax for greedy rows): every processor and filter applied. Consumes `logits`.
    For tests and for a rejection sampler; the Sampler itself never builds it."""
    logits = apply_logits_processors(logits.float(), metadata)
    if metadata.all_random:
        return random_row_probs(logits, metadata)
    probs = torch.zeros_like(logits).scatter_(1, logits.argmax(dim=1, keepdim=True), 1.0)
    if not metadata.all_greedy:
        random_rows = metadata.random_row_indices
        assert random_rows is not None
        probs[random_rows] = random_row_probs(logits[random_rows], metadata)
    return probs
