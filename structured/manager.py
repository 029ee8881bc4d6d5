"""StructuredOutputManager: the engine's one handle on structured output.

An EngineFeature (aioengine.engine.features); the engine reaches it through its hooks:

    front ends      -> prepare(params)        compile (blocking; a bad grammar raises)
                       prepare_async(params)  compile in a worker (the event loop waits)
    add_request     -> admit(request)         a sample's state (request.feature_state),
                                              its compile on the pool (cached: done)
                       allows_tree_drafts     never for a constrained request
    scheduler       -> can_admit(request)     skip until compiled (fail a failed compile)
                       allows_schedule_ahead  never for a constrained request
                       forced_tokens(...)     the matcher advanced, jump-forward tokens
                       usable_drafts(...)     the drafts the matcher accepts
    after schedule  -> prepare_step(output) sets output.grammar_bitmask; the loop calls
                       bitmask.fill() while the forward runs, the runner calls
                       bitmask.apply(logits) before sampling
"""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from aioengine.engine.features import AdmissionFailed, EngineFeature
from aioengine.sampling_params import SamplingParams, StructuredOutputs
from aioengine.structured.bitmask import GrammarBitmask
from aioengine.structured.compiler import (DEFAULT_CACHE_BYTES, DEFAULT_COMPILE_TIMEOUT_S,
                                          GrammarCompileCache)
from aioengine.structured.reasoning_gate import ReasoningGate
from aioengine.structured.request_state import StructuredRequestState, StructuredStats

if TYPE_CHECKING:
    from aioengine.sched.scheduler_output import SchedulerOutput
    from aioengine.request import Request

NAME = "structured"


def structured_state(request: Request) -> StructuredRequestState | None:
    """The request's grammar matcher state; None when it is unconstrained."""
    return request.feature_state.get(NAME)  # type: ignore[return-value]


class StructuredOutputManager(EngineFeature):
    name = NAME

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int],
                 jump_forward: bool = True, max_workers: int = 2,
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 max_cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.jump_forward = jump_forward
        # Compile budget and byte-bounded cache (issue 27); compiles in worker processes,
        # killed past their budget or when their clients left (issue 48): compiler.py.
        self.compiler = GrammarCompileCache(tokenizer, vocab_size, sorted(stop_token_ids),
                                            max_workers=max_workers,
                                            compile_timeout_s=compile_timeout_s,
                                            max_cache_bytes=max_cache_bytes)
        self.stats = StructuredStats()

    # ---- requests ---------------------------------------------------------------------

    def compile(self, constraint: StructuredOutputs) -> None:
        """Compiles now (blocking); raises GrammarCompileError (an InvalidRequestError)."""
        self.compiler.compile(constraint)

    async def compile_async(self, constraint: StructuredOutputs) -> None:
        """Compiles in a worker; raises GrammarCompileError before anything is queued.
        Cancelling it (the client left) abandons a compile nobody else waits for."""
        await self.compiler.compile_async(constraint)

    def new_request_state(self, params: SamplingParams) -> StructuredRequestState | None:
        """One sample's grammar state (None if unconstrained). Never blocks: the compile
        may still be running, and the scheduler skips the request until it is done.
        Jump-forward is off for requests that want logprobs (forced tokens have none). A
        constraint with reasoning token ids gets a reasoning gate (reasoning_gate.py)."""
        constraint = params.structured_outputs
        if constraint is None:
            return None
        self.stats.num_requests += 1
        gate = None
        if constraint.reasoning_end_token_id is not None:
            gate = ReasoningGate(constraint.reasoning_end_token_id,
                                 constraint.reasoning_start_token_id)
        return StructuredRequestState(
            grammar=self.compiler.submit(constraint), encode=self._encode,
            jump_forward=self.jump_forward and params.logprobs is None, stats=self.stats,
            gate=gate)

    def prepare(self, params: SamplingParams) -> None:
        """EngineFeature.prepare: the grammar compiled (blocking); a bad one raises."""
        if params.structured_outputs is not None:
            self.compile(params.structured_outputs)

    async def prepare_async(self, params: SamplingParams) -> None:
        """EngineFeature.prepare_async: the grammar compiled in a worker; a bad one raises
        before anything is queued."""
        if params.structured_outputs is not None:
            await self.compile_async(params.structured_outputs)

    def admit(self, request: Request) -> StructuredRequestState | None:
        """EngineFeature.admit: new_request_state (a bad grammar fails at compile time:
        front ends compile first, the scheduler fails a request whose compile failed)."""
        return self.new_request_state(request.sampling_params)

    def allows_tree_drafts(self, request: Request) -> bool:
        """A grammar validates and masks drafts as a chain."""
        return structured_state(request) is None

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---- the scheduler's hooks --------------------------------------------------------

    def can_admit(self, request: Request) -> bool:
        """False while the request's grammar compiles; a failed compile fails the request
        (front ends compile first and answer 400, so this is a safety net)."""
        state = structured_state(request)
        if state is None:
            return True
        if not state.is_ready():
            return False
        if state.error is not None:
            raise AdmissionFailed(state.error)
        return True

    def allows_schedule_ahead(self, request: Request) -> bool:
        """The next step's mask needs the matcher advanced by this step's token."""
        return structured_state(request) is None

    def forced_tokens(self, request: Request, token: int, room: int) -> list[int]:
        """Advances the matcher by `token`; the jump-forward tokens after it (<= room)."""
        state = structured_state(request)
        if state is None:
            return []
        return state.advance(request, token, room)

    def usable_drafts(self, request: Request, drafts: list[int], room: int) -> list[int]:
        """The prefix of `drafts` the matcher accepts, up to the first that jump-forward
        tokens would follow (StructuredRequestState.num_valid_drafts)."""
        state = structured_state(request)
        if state is None:
            return drafts
        return drafts[:state.num_valid_drafts(drafts, room)]

    # ---- the step ---------------------------------------------------------------------

    def prepare_step(self, scheduler_output: SchedulerOutput) -> None:
        """EngineFeature.prepare_step: the step's grammar bitmask, unfilled (None when no
        row is constrained)."""
        scheduler_output.grammar_bitmask = self.prepare_bitmask(scheduler_output)

    def prepare_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarBitmask | None:
        """The step's (unfilled) bitmask, rows in the runner's sampling order: each item
        that samples, its request then the forks sampled with it. None if no row is
        constrained."""
        states: list[StructuredRequestState | None] = []
        drafts: list[list[int]] = []
        for item in scheduler_output.scheduled:
            if item.num_samples == 0:
                continue
            if item.spec_token_ids:  # one row per verified position, after drafts[:j]
                n = len(item.spec_token_ids) + 1
                states.extend([structured_state(item.request)] * n)
                drafts.extend(item.spec_token_ids[:j] for j in range(n))
                continue
            samples = [item.request] + item.request.pending_forks[:item.num_samples - 1]
            states.extend(structured_state(sample) for sample in samples)
            drafts.extend([] for _ in samples)
        if all(s is None for s in states):
            return None
        return GrammarBitmask(states, self.vocab_size, drafts)

    # ---- numbers ----------------------------------------------------------------------

    def get_stats(self) -> dict[str, float]:
        times = self.compiler.compile_seconds
        return {
            "structured_requests": self.stats.num_requests,
            "structured_jump_forward_tokens": self.stats.num_jump_forward_tokens,
            "structured_jump_forwards": self.stats.num_jump_forwards,
            "structured_compiles": len(times),
            "structured_compile_seconds_median": statistics.median(times) if times else 0.0,
            "structured_compile_timeouts": self.compiler.num_timeouts,
            "structured_compiles_abandoned": self.compiler.num_abandoned,
        }

    def shutdown(self) -> None:
        """EngineFeature.shutdown: the compile workers stop."""
        self.compiler.shutdown()
