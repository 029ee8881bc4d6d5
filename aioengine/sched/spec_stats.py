"""Speculative decoding's counters, kept by the scheduler as it verifies drafts."""
from __future__ import annotations


class SpecDecodingStats:
    """vLLM's speculative-decoding counters: steps with drafts, draft tokens verified,
    drafts accepted, and acceptances at each draft position. Accepted counts what the
    rejection sampler kept (vLLM's counting), including tokens a stop in the run then
    dropped. Ratios (mean acceptance length, rates) are metrics.spec_decode_delta's."""

    def __init__(self, num_speculative_tokens: int, methods: tuple[str, ...] = ()) -> None:
        """`methods`: the proposers' names a draft may come from (the first is a draft's
        when none is named); each gets its own per-position counts, from zero."""
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * num_speculative_tokens
        self.accepted_per_pos_by_method = {m: [0] * num_speculative_tokens for m in methods}

    def observe(self, num_draft_tokens: int, num_accepted: int, method: str = "") -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        by_method = self.accepted_per_pos_by_method
        mine = by_method.get(method) or next(iter(by_method.values()), None)
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1
            if mine is not None:
                mine[pos] += 1
