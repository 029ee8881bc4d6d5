"""EngineFeature: the one shape of an engine feature (LoRA, structured output, speculative
decoding) as EngineCore and the ModelRunner call it.

    admit(params, lora_request)  a sample's typed state (or None: the feature does not
                                 apply to it); raises an aioengine.errors.EngineError
                                 subclass (InvalidRequestError, NotFoundError) to refuse it
    begin_admission(running)     scheduler, before it admits waiting requests in a step
    can_admit(request)           scheduler, per waiting request: False skips it this step
                                 (it stays waiting); raising AdmissionFailed fails it
    admitted(request)            scheduler, once it is admitted
    allows_schedule_ahead(req)   scheduler: False when the next step's inputs for it need
                                 this step's update first (a grammar advances on it)
    forced_tokens(req, tok, n)   scheduler, after each token it appends: up to n tokens the
                                 feature forces next (jump-forward), appended as output
    usable_drafts(req, drafts)   scheduler: the prefix of a request's next drafts it keeps
    prepare_step(output)         event loop, right after schedule(): step inputs the
                                 feature adds to the SchedulerOutput (grammar bitmask)
    begin_execute(output)        worker, right before the step's forward
    end_execute(output)          worker, after it (always, also when it failed)
    get_stats()                  point-in-time numbers for EngineCore.stats()

The two sides matter: with async scheduling the loop prepares step N+1 while the worker
runs step N, so anything the forward reads (LoRA's adapter slots) is set in
begin_execute, never in prepare_step. Every hook but get_stats defaults to nothing, so a
feature implements only the phases it takes part in.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Sequence

if TYPE_CHECKING:
    from aioengine.core.scheduler_output import SchedulerOutput
    from aioengine.lora.request import LoRARequest
    from aioengine.request import Request
    from aioengine.sampling_params import SamplingParams


class AdmissionFailed(Exception):
    """Raised by can_admit: the request can never run (its message becomes its error)."""


class EngineFeature(ABC):
    """Base of the engine's features; see the module docstring for when each hook runs."""

    name: ClassVar[str]  # what stats and logs call it

    def admit(self, params: SamplingParams,
              lora_request: LoRARequest | None) -> object | None:
        """One sample's state for this feature (params are the sample's own: its seed)."""
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

    def usable_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """Scheduler: the prefix of the drafts proposed for `request` worth verifying."""
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
