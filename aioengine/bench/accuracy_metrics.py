"""The arithmetic of `aioengine bench accuracy` (accuracy.py): greedy agreement with a
reference up to each prompt's first divergence, and sliding-window perplexity (Hugging
Face's recipe: windows of `context` tokens every `stride` tokens, each scoring only the
tokens the previous one did not)."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any


# ---- greedy agreement ------------------------------------------------------------------


def first_divergence(reference: list[int], output: list[int]) -> int | None:
    """The first position where `output` differs from `reference` (a length mismatch
    diverges at the shorter length); None when they are equal."""
    for i, (a, b) in enumerate(zip(reference, output)):
        if a != b:
            return i
    return None if len(reference) == len(output) else min(len(reference), len(output))


@dataclass(frozen=True)
class GreedyAgreement:
    """A configuration's greedy outputs against the reference's, prompt by prompt."""

    # Per prompt: first position that differs from the reference (None if identical),
    # and the reference's output length.
    divergences: list[int | None]
    output_lens: list[int]

    @property
    def num_prompts(self) -> int:
        return len(self.divergences)

    @property
    def num_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_identical_prompts(self) -> int:
        return sum(d is None for d in self.divergences)

    @property
    def num_identical_tokens(self) -> int:
        """Tokens before each prompt's first divergence (all of them if none)."""
        return sum(n if d is None else d for d, n in zip(self.divergences, self.output_lens))

    @property
    def token_agreement(self) -> float:
        return self.num_identical_tokens / self.num_tokens if self.num_tokens else 1.0

    @property
    def prompt_agreement(self) -> float:
        return self.num_identical_prompts / self.num_prompts if self.num_prompts else 1.0

    @property
    def mean_first_divergence(self) -> float | None:
        """Over the prompts that diverge (None if none does)."""
        diverged = [d for d in self.divergences if d is not None]
        return statistics.fmean(diverged) if diverged else None

    @property
    def median_first_divergence(self) -> float | None:
        diverged = [d for d in self.divergences if d is not None]
        return float(statistics.median(diverged)) if diverged else None

    def summary(self) -> dict[str, Any]:
        return {"num_prompts": self.num_prompts, "num_tokens": self.num_tokens,
                "num_identical_tokens": self.num_identical_tokens,
                "token_agreement": self.token_agreement,
                "num_identical_prompts": self.num_identical_prompts,
                "prompt_agreement": self.prompt_agreement,
                "mean_first_divergence": self.mean_first_divergence,
                "median_first_divergence": self.median_first_divergence,
                "first_divergences": self.divergences}


def greedy_agreement(reference: list[list[int]], outputs: list[list[int]]) -> GreedyAgreement:
    if len(reference) != len(outputs):
        raise ValueError(f"{len(reference)} reference outputs but {len(outputs)} outputs")
    return GreedyAgreement([first_divergence(r, o) for r, o in zip(reference, outputs)],
                           [len(r) for r in reference])


# ---- perplexity ------------------------------------------------------------------------


@dataclass(frozen=True)
class PplWindow:
    """One prompt of the perplexity run: tokens [begin, end) of the text, scoring the
    log-likelihood of tokens [score_from, end) (the ones no earlier window scored)."""

    begin: int
    end: int
    score_from: int


def ppl_windows(num_tokens: int, context: int, stride: int) -> list[PplWindow]:
    """Windows of `context` tokens starting every `stride` tokens, until the text's end.

    Token 0 has no context and is never scored; every other token is scored exactly once,
    with all tokens before it as context in the first window and at least
    `context - stride` (>= 1: a window's first token has no logprob) in the others.
    """
    if context < 2 or not 1 <= stride < context:
        raise ValueError(f"need context >= 2 and 1 <= stride < context, got context "
                         f"{context}, stride {stride}")
    if num_tokens < 2:
        raise ValueError(f"need at least 2 tokens for a perplexity, got {num_tokens}")
    windows, begin, scored_to = [], 0, 1
    while scored_to < num_tokens:
        end = min(begin + context, num_tokens)
        windows.append(PplWindow(begin, end, scored_to))
        begin, scored_to = begin + stride, end
    return windows


def window_nll(window: PplWindow, token_ids: list[int],
               prompt_logprobs: list[dict[int, Any] | None]) -> float:
    """Summed negative log-likelihood of the window's scored tokens.

    `prompt_logprobs` is the engine's for the prompt `token_ids[begin:end]`: entry j
    (None at j = 0) maps token j of the window, among others, to its Logprob."""
    if len(prompt_logprobs) != window.end - window.begin:
        raise ValueError(f"{len(prompt_logprobs)} prompt logprobs for a window of "
                         f"{window.end - window.begin} tokens")
    nll = 0.0
    for pos in range(window.score_from, window.end):
        entry = prompt_logprobs[pos - window.begin]
        token = token_ids[pos]
        if entry is None or token not in entry:
            raise ValueError(f"no prompt logprob for token {token} at text position {pos}")
        nll -= entry[token].logprob
    return nll


def perplexity(nll: float, num_tokens: int) -> float:
    return math.exp(nll / num_tokens)
