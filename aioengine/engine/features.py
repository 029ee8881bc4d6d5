"""EngineFeature: the one shape of an engine feature (LoRA, structured output) as the
front ends, EngineCore, the scheduler and the ModelRunner call it. EngineCore builds the
enabled ones from EngineArgs (core.enabled_features) and loops over them: nothing on the
request path names a feature.

    prepare(params)              front end, blocking (LLM), once per request before it is
                                 queued: raises an aioengine.errors.EngineError subclass
                                 (InvalidRequestError) to refuse it (a grammar compiles)
    prepare_async(params)        the same on the event loop (AsyncEngine), awaiting its
                                 work off the loop
    admit(request)               EngineCore.add_request, per sample: the feature's typed
                                 state for it (None: the feature does not apply), kept in
                                 request.feature_state[feature.name]
    allows_tree_drafts(request)  EngineCore.add_request, per sample: False when drafts
                                 for it must be a chain (request.allows_tree_drafts)
    draft_pool(request)          EngineCore.add_request, per sample: which requests' outputs
                                 may draft for it (request.draft_pool; suffix decoding's
                                 global tree), None when the feature does not split them
    begin_admission(running)     scheduler, before it admits waiting requests in a step
    can_admit(request)           scheduler, per waiting request: False skips it this step
                                 (it stays waiting); raising AdmissionFailed fails it
    admitted(request)            scheduler, once it is admitted
    allows_schedule_ahead(req)   scheduler: False when the next step's inputs for it need
                                 this step's update first (a grammar advances on it)
    forced_tokens(req, tok, n)   scheduler, after each token it appends: up to n tokens the
                                 feature forces next (jump-forward), appended as output
    usable_drafts(req, d, n)     scheduler: the prefix of a request's next drafts d it keeps
                                 (n: the tokens it may still produce)
    prepare_step(output)         event loop, right after schedule(): step inputs the
                                 feature adds to the SchedulerOutput (grammar bitmask)
    begin_execute(output)        worker, right before the step's forward
    end_execute(output)          worker, after it (always, also when it failed)
    get_stats()                  point-in-time numbers for EngineCore.stats()
    shutdown()                   the engine stops (worker processes, pools)

The two sides matter: with async scheduling the loop prepares step N+1 while the worker
runs step N, so anything the forward reads (LoRA's adapter slots) is set in
begin_execute, never in prepare_step. Every hook but get_stats defaults to nothing, so a
feature implements only the phases it takes part in. A feature's per-request state is
read only inside the feature's own folder (its typed accessor, e.g.
structured.manager.structured_state); everything else asks the feature's hooks.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Hashable, Sequence

if TYPE_CHECKING:
    from aioengine.sched.scheduler_output import SchedulerOutput
    from aioengine.request import Request
    from aioengine.sampling_params import SamplingParams


class AdmissionFailed(Exception):
    """Raised by can_admit: the request can never run (its message becomes its error)."""


class EngineFeature(ABC):
    """Base of the engine's features; see the module docstring for when each hook runs."""

    name: ClassVar[str]  # what stats and logs call it

    def prepare(self, params: SamplingParams) -> None:
        """Front end, blocking: refuse (raise) what this feature can never run."""

    async def prepare_async(self, params: SamplingParams) -> None:
        """Front end, on the event loop: `prepare` without blocking the loop (the default
        calls it: override where its work takes long)."""
        self.prepare(params)

    def admit(self, request: Request) -> object | None:
        """One sample's state for this feature (its params are the sample's own: its seed);
        must not block (queued work is waited for in can_admit)."""
        return None

    def allows_tree_drafts(self, request: Request) -> bool:
        """Whether speculative decoding may draft a tree for the admitted `request` (else
        a chain: the tree's most likely path)."""
        return True

    def draft_pool(self, request: Request) -> Hashable | None:
        """What must be equal between two admitted requests for one's output to draft
        for the other (a proposer that learns across requests keeps one pool per value);
        None: this feature lets any request's output draft for it."""
        return None

    def begin_admission(self, running: Sequence[Request]) -> None:
        """Scheduler: a step's admissions start; `running` as they start from."""

    def can_admit(self, request: Request) -> bool:
        """Scheduler: whether the waiting `request` may be admitted now."""
        return True

    def admitted(self, request: Request) -> None:
        """Scheduler: `request` was admitted (it now runs) in this step."""

    def allows_schedule_ahead(self, request: Request) -> bool:
        """Scheduler: whether a step after the one in flight may be scheduled for
        `request` before that one's tokens are known."""
        return True

    def forced_tokens(self, request: Request, token: int, room: int) -> list[int]:
        """Scheduler: after `token` was appended to `request`, at most `room` tokens that
        must follow it (computed as one chunk next step)."""
        return []

    def usable_drafts(self, request: Request, drafts: list[int], room: int) -> list[int]:
        """Scheduler: the prefix of the drafts proposed for `request` worth verifying;
        `room`: the tokens it may still produce (the first draft's among them)."""
        return drafts

    def prepare_step(self, scheduler_output: SchedulerOutput) -> None:
        """On the event loop, for every step schedule() makes."""

    def begin_execute(self, scheduler_output: SchedulerOutput) -> None:
        """On the worker, before the step's forward."""

    def end_execute(self, scheduler_output: SchedulerOutput) -> None:
        """On the worker, after the step's forward, whether or not it raised."""

    @abstractmethod
    def get_stats(self) -> dict[str, float]:
        """This feature's numbers (names unique across features)."""

    def shutdown(self) -> None:
        """The engine stops: end what the feature started (worker processes)."""


def prepare_request(features: tuple[EngineFeature, ...], params: SamplingParams) -> None:
    """Every feature's prepare (blocking); the first refusal raises."""
    for feature in features:
        feature.prepare(params)


async def prepare_request_async(features: tuple[EngineFeature, ...],
                                params: SamplingParams) -> None:
    """Every feature's prepare_async, in order; the first refusal raises."""
    for feature in features:
        await feature.prepare_async(params)


def admit_request(features: tuple[EngineFeature, ...], request: Request) -> None:
    """Every feature's admit, allows_tree_drafts and draft_pool for one new sample, into
    its feature_state, allows_tree_drafts and draft_pool (before it is queued)."""
    for feature in features:
        state = feature.admit(request)
        if state is not None:
            request.feature_state[feature.name] = state
    request.allows_tree_drafts = all(f.allows_tree_drafts(request) for f in features)
    request.draft_pool = tuple((f.name, key) for f in features
                               if (key := f.draft_pool(request)) is not None)


def prepare_step(features: tuple[EngineFeature, ...],
                 scheduler_output: SchedulerOutput) -> SchedulerOutput:
    """Every feature's prepare_step, in order; returns the output for chaining."""
    for feature in features:
        feature.prepare_step(scheduler_output)
    return scheduler_output


def feature_stats(features: tuple[EngineFeature, ...]) -> dict[str, float]:
    """Every feature's get_stats() in one dict, in the features' order."""
    out: dict[str, float] = {}
    for feature in features:
        out.update(feature.get_stats())
    return out


def shutdown(features: tuple[EngineFeature, ...]) -> None:
    """Every feature's shutdown."""
    for feature in features:
        feature.shutdown()
