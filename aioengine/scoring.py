"""Scores (vLLM's /score, LLM.score) and reranking (Jina/Cohere /rerank) of an embedding
model: the cosine similarity of the two texts' pooled vectors. Shared by LLM and the
server, which check their inputs with the same rules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, TypeVar

import torch

from aioengine.errors import InvalidRequestError

T = TypeVar("T")


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """One pair's score (vLLM's name); `prompt_token_ids` of both texts, text_1's first."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]


def score_pairs(text_1: T | Sequence[T], text_2: T | Sequence[T],
                is_one: type | tuple[type, ...] = str) -> list[tuple[T, T]]:
    """vLLM's pairing: one text_1 against each text_2 (1 -> N), or text_1[i] with text_2[i]
    (N -> N). `is_one`: what a single item is (a string; token ids are lists)."""
    firsts = [text_1] if isinstance(text_1, is_one) else list(text_1)  # type: ignore[arg-type]
    seconds = [text_2] if isinstance(text_2, is_one) else list(text_2)  # type: ignore[arg-type]
    if not firsts or not seconds:
        raise InvalidRequestError("text_1 and text_2 must not be empty",
                                  "text_1" if not firsts else "text_2")
    if len(firsts) == 1:
        return [(firsts[0], s) for s in seconds]
    if len(firsts) != len(seconds):
        raise InvalidRequestError(
            f"text_1 has {len(firsts)} items and text_2 {len(seconds)}: give one text_1, or "
            "as many as text_2", "text_2")
    return list(zip(firsts, seconds))


def cosine_similarity(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of two vectors, in float64 (0 for a zero vector)."""
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    denom = float(a64.norm() * b64.norm())
    return 0.0 if denom == 0.0 else float(a64 @ b64) / denom


def cosine_similarities(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> list[float]:
    """`cosine_similarity(a[i], b[i])` of each i, in a few tensor calls: one call per pair
    held the server's event loop ~0.15 s for 2,048 rerank documents."""
    if not a:
        return []
    a64, b64 = torch.stack(list(a)).to(torch.float64), torch.stack(list(b)).to(torch.float64)
    denom = a64.norm(dim=-1) * b64.norm(dim=-1)
    dots = (a64 * b64).sum(dim=-1)
    return torch.where(denom == 0, 0.0, dots / denom).tolist()
