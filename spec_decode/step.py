"""Speculative decoding is part of a step's shape, not an EngineFeature: a request's drafts
(Request.spec_token_ids, from the runner's Proposer after sampling) take room in the
scheduler's token budget next to its decode row, and the runner verifies them in that
step (worker/verify.py; trees: worker/spec_tree.py). SpeculativeDecoding is the engine's
one handle on it: the resolved config and the counters the scheduler keeps as it
verifies drafts, reported as vLLM's spec_decode_* numbers.
"""
from __future__ import annotations

from aioengine.sched.spec_stats import SpecDecodingStats
from aioengine.metrics import SPEC_PER_POS_PREFIX
from aioengine.spec_decode.config import SpeculativeConfig


class SpeculativeDecoding:
    def __init__(self, config: SpeculativeConfig | None) -> None:
        """`config` None: no drafts (the counters stay at zero)."""
        self.config = config
        # Updated by the scheduler as it verifies drafts (Scheduler.update_from_output).
        self.counters = SpecDecodingStats(config.num_speculative_tokens if config else 0)

    @property
    def enabled(self) -> bool:
        return self.config is not None

    def get_stats(self) -> dict[str, float]:
        """vLLM's spec_decode_* counters, none when it is off; the accepted drafts at
        position i (0-based) are `spec_decode_num_accepted_tokens_per_pos_<i>`."""
        if self.config is None:
            return {}
        st = self.counters
        return {"spec_decode_num_drafts": st.num_drafts,
                "spec_decode_num_draft_tokens": st.num_draft_tokens,
                "spec_decode_num_accepted_tokens": st.num_accepted_tokens,
                **{f"{SPEC_PER_POS_PREFIX}{pos}": n
                   for pos, n in enumerate(st.num_accepted_tokens_per_pos)}}
