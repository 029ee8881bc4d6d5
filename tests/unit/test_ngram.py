"""The n-gram proposer against a brute-force reading of vLLM's rule."""
from __future__ import annotations

import random

import numpy as np

from aioengine.spec_decode.ngram import propose_ngram


def brute_force(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Longest n in [lo, hi] whose suffix n-gram occurs earlier (ending before the last
    token), earliest occurrence, then the up to k tokens after it."""
    num = len(tokens)
    for n in range(min(hi, num - 1), lo - 1, -1):
        suffix = tokens[num - n:]
        for start in range(num - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_examples() -> None:
    t = np.array([1, 2, 3, 4, 9, 9, 1, 2, 3])
    assert propose_ngram(t, 1, 3, 3) == [4, 9, 9]
    assert propose_ngram(t, 1, 3, 10) == [4, 9, 9, 1, 2, 3]  # up to the context's end
    assert propose_ngram(t, 4, 5, 3) == []  # "9 1 2 3" never occurred before
    # Two occurrences of the longest match: the earliest wins.
    assert propose_ngram(np.array([5, 6, 7, 5, 6, 8, 5, 6]), 1, 2, 1) == [7]
    assert propose_ngram(np.array([7]), 1, 1, 3) == []


def test_random_contexts_match_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(5000):
        tokens = [rng.randrange(rng.randint(1, 4)) for _ in range(rng.randint(1, 40))]
        lo = rng.randint(1, 4)
        hi, k = rng.randint(lo, 6), rng.randint(1, 6)
        assert propose_ngram(np.array(tokens), lo, hi, k) == brute_force(tokens, lo, hi, k)
