"""How many tokens of a request a step computes: fair prefill.

A long prompt is computed in chunks so that other requests' prefills and decodes have
room in every step, the step in flight when a short request arrives included (vLLM's
`long_prefill_token_threshold`). A token count alone does not bound a chunk's cost: each
of its tokens attends to every position before it, so at the end of an 8,000-token
prompt a 128-token chunk costs ~100x what it costs at the start (0.86 s a step on the
bundled model, against 18 ms for a short chat's whole prefill). The attention budget
caps the chunk of a long prompt so that its tokens times the positions they attend stay
within `long_prefill_attention_budget`: the chunk shrinks as the context grows, down to
one token a step. A long prompt alone in the engine gets ALONE_FACTOR times the budget:
fewer, larger steps (each step costs ~15 ms besides its attention here), while the step
a new request arrives during stays bounded.

A long prompt also sits out the step after a new request arrives (requests waiting to
be admitted) once its context makes a chunk costly (the attention budget binds): the
newcomer's prefill gets that step to itself instead of sharing it with a chunk that
attends to thousands of positions, so its time to first token is the step in
flight plus its own. Never two steps running, so steady arrivals cannot starve it.

Only a long prompt (more than the threshold left to compute when it was admitted) is
capped by attention: a short turn appended to a long cached conversation is computed
in one step, as it would be without the budget.

Chunk sizes never change what is computed: attention is split at fixed absolute
positions and the GEMM reduces each output in one order whatever the rows
(docs/architecture.md, "Deterministic by construction").
"""
from __future__ import annotations

import math

from aioengine.config import SchedulerConfig
from aioengine.request import Request

# The attention budget of a long prompt with no other request running or waiting, in
# units of the budget (docs/benchmarks.md, "Fair prefill"): 2 keeps the step a newcomer
# arrives during short (a 16-token chat's TTFT 2.4-2.7x its TTFT alone, against 3.6-4.3x
# with 4) for ~18% more time to an 8,000-token prompt's first token.
ALONE_FACTOR = 2


def attention_chunk_cap(num_computed: int, budget: int, window: int | None = None) -> int:
    """The largest chunk c >= 1 starting at position `num_computed` whose (query, key)
    pairs, c * (num_computed + c), stay within `budget` (1 when even one exceeds it). With
    a sliding window on every layer a query sees at most `window` keys: the context counts
    up to the window only."""
    p = num_computed if window is None else min(num_computed, window)
    c = (math.isqrt(p * p + 4 * budget) - p) // 2
    while c > 1 and c * (p + c) > budget:  # isqrt rounds down; this only guards it
        c -= 1
    return max(1, c)


class PrefillChunker:
    """The number of new tokens of a request in a step, under the step's token budget,
    the chunk cap and the attention budget of a long prompt."""

    def __init__(self, config: SchedulerConfig, sliding_window: int | None = None) -> None:
        """`sliding_window`: every layer's (the KV manager's), bounding each token's
        attention."""
        self.chunked = config.enable_chunked_prefill
        self.sliding_window = sliding_window
        self.chunk_cap = config.prefill_chunk_cap
        self.attention_budget = config.prefill_attention_budget
        self._newcomers = False
        self._sat_out: set[str] = set()  # long prompts that sat out this step
        self._sat_out_before: set[str] = set()  # ... and the step before

    def begin_step(self, newcomers: bool) -> None:
        """A new step; `newcomers`: requests wait to be admitted (and may be)."""
        self._sat_out_before, self._sat_out = self._sat_out, set()
        self._newcomers = newcomers

    def num_new_tokens(self, request: Request, num_computed: int, budget: int,
                       alone: bool = False, running: bool = False) -> int:
        """All that `request` lacks from `num_computed` on, within `budget`, the chunk
        cap, and for a long prompt the attention budget (ALONE_FACTOR times it when
        `alone`: no other request running or waiting); 0 when chunked prefill is off and
        the rest does not fit, or for a `running` long prompt sitting this step out."""
        num_new = request.num_tokens - num_computed
        if not self.chunked and num_new > budget:
            return 0
        if running and self._sits_out(request, num_computed):
            return 0
        cap = self.chunk_cap or num_new
        if self.attention_budget and self._is_long_prefill(request, num_computed):
            pairs = self.attention_budget * (ALONE_FACTOR if alone else 1)
            cap = min(cap, attention_chunk_cap(num_computed, pairs, self.sliding_window))
        return min(num_new, budget, cap)

    def _sits_out(self, request: Request, num_computed: int) -> bool:
        """Whether a long prompt leaves this step to the newcomers: only where its context
        makes a chunk costly (the attention budget binds), and not twice running."""
        if (not self._newcomers or not self.attention_budget
                or request.request_id in self._sat_out_before
                or not self._is_long_prefill(request, num_computed)
                or attention_chunk_cap(num_computed, self.attention_budget,
                                       self.sliding_window) >= self.chunk_cap):
            return False
        self._sat_out.add(request.request_id)
        return True

    def _is_long_prefill(self, request: Request, num_computed: int) -> bool:
        """Whether `request` is prefilling a prompt that had more than the chunk cap left
        to compute when it was first scheduled (`num_computed` at admission)."""
        if not self.chunk_cap or num_computed >= request.num_prompt_tokens:
            return False
        start = request.num_cached_tokens if request.num_cached_tokens >= 0 else num_computed
        return request.num_prompt_tokens - start > self.chunk_cap
