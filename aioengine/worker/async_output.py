"""A step's output still on its way from the device (vLLM's AsyncModelRunnerOutput).

On CUDA the runner does not wait for sampling to finish: it queues copies of the sampled
ids (and logprobs) into pinned host buffers on its copy stream, records an event after
them and returns, so the worker thread goes straight on to launch the next step. The
event loop awaits the event on a thread of its own (`resolve`: never a synchronize() or a
.tolist() on the loop) and only then turns the host buffers into the step's lists.

    worker:  | launch N | launch N+1 | launch N+2 ...        (returns at once)
    device:  | forward N, sample N, copy N | forward N+1 ...
    loop:               ... await event N | update N, schedule, stream N ...
"""
from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Callable

import torch
from torch import Tensor

from aioengine.sched.scheduler_output import ModelRunnerOutput


class AsyncModelRunnerOutput:
    """`finalize()` reads the host copies into a ModelRunnerOutput; it runs once, after
    `event` (None: the copies are already complete, as on the CPU)."""

    def __init__(self, event: torch.cuda.Event | None,
                 finalize: Callable[[], ModelRunnerOutput]) -> None:
        self._event = event
        self._finalize: Callable[[], ModelRunnerOutput] | None = finalize
        self._output: ModelRunnerOutput | None = None

    def is_ready(self) -> bool:
        return self._event is None or self._event.query()

    def get_output(self) -> ModelRunnerOutput:
        """The output; blocks until the copies are done (call `resolve` on the loop)."""
        if self._output is None:
            assert self._finalize is not None
            if self._event is not None:
                self._event.synchronize()
            self._output, self._finalize = self._finalize(), None
        return self._output

    async def resolve(self, waiter: Executor) -> ModelRunnerOutput:
        """Awaits the event on `waiter`'s thread (the loop goes on meanwhile), then reads."""
        if not self.is_ready():
            assert self._event is not None
            await asyncio.get_running_loop().run_in_executor(waiter, self._event.synchronize)
        return self.get_output()


def resolve_now(output: ModelRunnerOutput | AsyncModelRunnerOutput) -> ModelRunnerOutput:
    """The synchronous paths (LLM, EngineCore.step) wait where they are."""
    return output.get_output() if isinstance(output, AsyncModelRunnerOutput) else output


class HostCopier:
    """Device tensors -> pinned host tensors on a copy stream, with an event after them."""

    def __init__(self, device: torch.device) -> None:
        self.stream: torch.cuda.Stream | None = (
            torch.cuda.Stream(device) if device.type == "cuda" else None)

    def copy(self, tensors: list[Tensor]) -> tuple[list[Tensor], torch.cuda.Event | None]:
        """`tensors` (on one device, at least one) -> their host copies and the event."""
        if self.stream is None:
            return tensors, None
        # The copies start once sampling (on the current stream) is done.
        self.stream.wait_stream(torch.cuda.current_stream(tensors[0].device))
        hosts = []
        with torch.cuda.stream(self.stream):
            for t in tensors:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                t.record_stream(self.stream)  # not reused by the compute stream too early
                hosts.append(host)
            event = torch.cuda.Event()
            event.record(self.stream)
        return hosts, event
