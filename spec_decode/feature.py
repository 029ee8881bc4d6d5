"""Speculative decoding as an EngineFeature (aioengine.engine.features).

It has no per-request state of its own (a request's drafts are Request.spec_token_ids,
verified and refilled by the scheduler) and adds nothing to a step's inputs on the loop
(the runner's Proposer drafts after sampling, the scheduler decides which steps propose):
what it gives the engine through the protocol is its counters, vLLM's spec_decode_*.
"""
from __future__ import annotations

from aioengine.core.spec_stats import SpecDecodingStats
from aioengine.engine.features import EngineFeature
from aioengine.metrics import SPEC_PER_POS_PREFIX
from aioengine.spec_decode.config import SpeculativeConfig


class SpecDecodeFeature(EngineFeature):
    name = "spec_decode"

    def __init__(self, config: SpeculativeConfig, counters: SpecDecodingStats) -> None:
        self.config = config
        self.counters = counters  # the scheduler's, updated as it verifies drafts

    def get_stats(self) -> dict[str, float]:
        """vLLM's spec_decode_* counters; the accepted drafts at position i (0-based) are
        `spec_decode_num_accepted_tokens_per_pos_<i>`."""
        st = self.counters
        return {"spec_decode_num_drafts": st.num_drafts,
                "spec_decode_num_draft_tokens": st.num_draft_tokens,
                "spec_decode_num_accepted_tokens": st.num_accepted_tokens,
                **{f"{SPEC_PER_POS_PREFIX}{pos}": n
                   for pos, n in enumerate(st.num_accepted_tokens_per_pos)}}
