"""Speculative decoding is part of a step's shape, not an EngineFeature: a request's drafts
(Request.spec_token_ids, from the runner's Proposer after sampling) take room in the
scheduler's token budget next to its decode row, and the runner verifies them in that
step. Its state lives in two parts because the two sides run apart and own different
things:

- `DraftScheduling` (here), the scheduler's part, on the event loop: which steps verify
  drafts, how many of a request's drafts fit this step's budget, the lookahead slots a
  draft head writes into, and the counters of what was verified. Plain numbers and the
  counters, no tensors.
- `DraftVerifier` (worker/verify.py), the runner's part, on the worker thread: the
  proposer, the tree rows' scratch blocks, and the verification of a step's drafts
  against the target's logits. Device state (KV caches, generators, the draft head) the
  loop must never touch.

SpeculativeDecoding is the engine's one handle on it: the resolved config and the
counters the scheduler's part keeps, reported as vLLM's spec_decode_* numbers.
"""
from __future__ import annotations

from aioengine.config import SchedulerConfig
from aioengine.metrics import SPEC_PER_POS_PREFIX, spec_method_key
from aioengine.request import Request
from aioengine.sched.request_tokens import draws_own_noise
from aioengine.sched.spec_stats import SpecDecodingStats
from aioengine.spec_decode.config import SpeculativeConfig
from aioengine.spec_decode.row_cost import row_cost

# The most steps a resting proposer sits out (DraftScheduling.note_proposals): the
# longest a request whose text starts to repeat waits for its first draft.
MAX_REST_STEPS = 16
# Steps whose verified draft rows cost less than this share of a token (row_cost.py:
# steps of fewer than 7 requests) never rest: there any draft found pays, and a rest
# skips the first drafts of a repeat (single-stream agent-replay: 2.12x off with resting,
# 2.50x without, 2026-12-07), for a saving that is a fraction of one step's.
REST_MIN_ROW_COST = 0.25


class SpeculativeDecoding:
    def __init__(self, config: SpeculativeConfig | None) -> None:
        """`config` None: no drafts (the counters stay at zero)."""
        self.config = config
        # Updated by the scheduler's DraftScheduling as it verifies drafts.
        self.counters = SpecDecodingStats(config.num_speculative_tokens if config else 0,
                                          config.draft_methods if config else ())

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
                   for pos, n in enumerate(st.num_accepted_tokens_per_pos)},
                **{spec_method_key(pos, method): n
                   for method, counts in st.accepted_per_pos_by_method.items()
                   for pos, n in enumerate(counts)}}


class DraftScheduling:
    """The scheduler's part of speculative decoding (see the module docstring). The
    scheduler holds one only when drafts are configured (None otherwise: one check)."""

    def __init__(self, config: SchedulerConfig, counters: SpecDecodingStats) -> None:
        self.disable_by_batch_size = config.spec_disable_by_batch_size
        # Slots past a step's tokens for a draft head's chain (vLLM's num_lookahead_tokens).
        self.num_lookahead_tokens = config.num_lookahead_tokens
        self.max_model_len = config.max_model_len
        self.counters = counters
        # Resting (method auto): steps left before one proposes again, and proposal rounds
        # in a row that found nothing worth verifying.
        self.rest_when_idle = config.spec_rest_when_idle
        self.rest_steps = 0
        self.idle_rounds = 0

    @classmethod
    def from_config(cls, config: SchedulerConfig,
                    counters: SpecDecodingStats | None = None) -> DraftScheduling | None:
        """None when `config` drafts no tokens."""
        if config.num_speculative_tokens <= 0:
            return None
        return cls(config, counters or SpecDecodingStats(config.num_speculative_tokens))

    def verifies(self, num_running: int) -> bool:
        """Whether a step of `num_running` requests verifies (and proposes) drafts."""
        limit = self.disable_by_batch_size
        return limit is None or num_running <= limit

    def proposes(self, admitting: bool) -> bool:
        """Whether a step that verifies drafts also proposes them for the next one: unless
        the proposer is resting and no request is joining (a new request's drafts are
        looked for at once)."""
        return admitting or self.rest_steps == 0

    def count_step(self) -> None:
        """A step was scheduled: one fewer to rest."""
        self.rest_steps = max(0, self.rest_steps - 1)

    def note_proposals(self, drafted: bool, num_requests: int) -> None:
        """A step of `num_requests` requests proposed; `drafted`: some request got drafts.
        While a proposer that chooses per request (auto) finds nothing worth verifying in
        steps where a row costs REST_MIN_ROW_COST or more, steps propose ever more rarely
        (1, 2, 4 ... MAX_REST_STEPS steps apart): those that do not propose can be
        scheduled ahead and hand their output over unread, which is what such traffic
        loses to speculation otherwise. The first drafts, or a smaller step, end the
        rest."""
        if not self.rest_when_idle:
            return
        if drafted or row_cost(num_requests) < REST_MIN_ROW_COST:
            self.idle_rounds = self.rest_steps = 0
            return
        self.rest_steps = min(MAX_REST_STEPS, 1 << self.idle_rounds)
        self.idle_rounds = min(self.idle_rounds + 1, MAX_REST_STEPS.bit_length())

    def num_drafts(self, request: Request, budget: int) -> int | None:
        """How many of a decoding request's drafts ride along with its decode row, with
        `budget` tokens left after that row; None: it waits for a step with room, since
        fewer drafts would change how its own generator is drawn from, so its tokens
        would depend on the batch."""
        drafts = len(request.spec_token_ids)
        if drafts <= budget:
            return drafts
        return None if draws_own_noise(request) else budget

    def lookahead(self, request: Request, end: int) -> int:
        """Slots past a step ending at token `end` that a draft head writes its chain into,
        never past the request's last possible token (so a request that fits the cache
        still does)."""
        last = min(self.max_model_len,
                   request.num_prompt_tokens + (request.sampling_params.max_tokens or 0))
        return max(0, min(self.num_lookahead_tokens, last - end))

    def observe(self, num_drafts: int, num_accepted: int, method: str = "") -> None:
        """A request's `num_drafts` verified, `num_accepted` of them kept; `method` drafted
        them ("": the config's one method)."""
        self.counters.observe(num_drafts, num_accepted, method)
