"""EngineFeature: the one shape of an engine feature (LoRA, structured output, speculative
decoding) as EngineCore and the ModelRunner call it.

    admit(params, lora_request)  a sample's typed state (or None: the feature does not
                                 apply to it); raises an aioengine.errors.EngineError
                                 subclass (InvalidRequestError, NotFoundError) to refuse it
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
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from aioengine.core.scheduler_output import SchedulerOutput
    from aioengine.lora.request import LoRARequest
    from aioengine.sampling_params import SamplingParams


class EngineFeature(ABC):
    """Base of the engine's features; see the module docstring for when each hook runs."""

    name: ClassVar[str]  # what stats and logs call it

    def admit(self, params: SamplingParams,
              lora_request: LoRARequest | None) -> object | None:
        """One sample's state for this feature (params are the sample's own: its seed)."""
        return None

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
