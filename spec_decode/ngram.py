"""The n-gram proposer (prompt lookup), vLLM's semantics, vectorised with numpy.

The context's last n tokens (the suffix n-gram) are looked for earlier in the context, for
the longest n in [prompt_lookup_min, prompt_lookup_max] that occurs; among occurrences of
that length the earliest wins; the up to k tokens that followed it are the draft.

    context  a b c d x y a b c   (suffix "a b c", n = 3)
    match    ^ at 0              -> draft "d x y" (k = 3)

For every end position i < L - 1 we count how many tokens, read backwards from i, equal the
suffix read backwards (capped at prompt_lookup_max): one vectorised comparison per n.
"""
from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Draft of up to `k` tokens for the context `tokens` [L] (int), or [] without a match."""
    num_tokens = tokens.shape[0]
    if k <= 0 or num_tokens <= min_n:
        return []
    max_n = min(max_n, num_tokens - 1)
    num_ends = num_tokens - 1  # an occurrence ends before the suffix's last token
    # matched[i]: the n-gram ending at i still equals the suffix over the j tokens so far.
    matched = np.ones(num_ends, dtype=bool)
    length = np.zeros(num_ends, dtype=np.int32)
    for j in range(max_n):
        matched[:j] = False  # the n-gram would start before the context
        matched[j:] &= tokens[:num_ends - j] == tokens[num_tokens - 1 - j]
        if not matched.any():
            break
        length += matched
    best = int(length.max()) if num_ends else 0
    if best < min_n:
        return []
    start = int(np.argmax(length == best)) + 1  # earliest end position of the longest match
    return tokens[start:start + k].tolist()


class NgramLookup:
    """Drafts for a request from its own tokens (prompt and output); no model, no state."""

    def __init__(self, min_n: int, max_n: int, k: int) -> None:
        self.min_n, self.max_n, self.k = min_n, max_n, k

    def propose(self, token_ids: list[int], max_draft: int | None = None) -> list[int]:
        k = self.k if max_draft is None else min(self.k, max_draft)
        return propose_ngram(np.asarray(token_ids, dtype=np.int64), self.min_n, self.max_n, k)
