"""StepWorker: steps run in order on one thread; a result is handed to the loop at once,
or, when the next step is already queued, once that step's forward begins."""
from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from aioengine.sched.scheduler_output import ModelRunnerOutput, SchedulerOutput
from aioengine.engine.step_worker import StepWorker


class Recorder:
    """An execute function that logs, on the worker thread, which steps the loop has
    received (`delivered`) when it prepares and when it starts the forward of each step."""

    def __init__(self, fail: set[int] = frozenset()) -> None:
        self.delivered: set[int] = set()  # filled on the loop
        self.seen: list[tuple[int, str, set[int]]] = []
        self.fail = fail
        self.release = threading.Event()

    def look(self, step: int, when: str) -> None:
        time.sleep(0.05)  # time for the loop to run anything handed to it
        self.seen.append((step, when, set(self.delivered)))

    def __call__(self, scheduler_output: SchedulerOutput, before_layers) -> ModelRunnerOutput:
        step = scheduler_output.step_id
        self.release.wait(5)  # lets the test queue steps before the first one runs
        self.look(step, "prepared")
        if step in self.fail:
            raise RuntimeError(f"step {step} failed")
        before_layers()
        self.look(step, "forward")
        return ModelRunnerOutput(sampled_token_ids={"r": [step]})


def step(step_id: int) -> SchedulerOutput:
    return SchedulerOutput(scheduled=[], total_num_scheduled_tokens=0, step_id=step_id)


async def deliveries(worker: StepWorker, recorder: Recorder, steps: list[int]) -> list:
    futures = [worker.submit(step(i)) for i in steps]
    for i, future in zip(steps, futures):
        future.add_done_callback(lambda f, i=i: recorder.delivered.add(i))
    recorder.release.set()
    return await asyncio.gather(*futures, return_exceptions=True)


async def test_a_queued_step_holds_the_result_before_it_until_its_forward() -> None:
    recorder = Recorder()
    with ThreadPoolExecutor(1) as executor:
        results = await deliveries(StepWorker(executor, recorder), recorder, [1, 2, 3])
    assert [r.sampled_token_ids["r"] for r in results] == [[1], [2], [3]]
    assert recorder.seen == [(1, "prepared", set()), (1, "forward", set()),
                             (2, "prepared", set()), (2, "forward", {1}),
                             (3, "prepared", {1}), (3, "forward", {1, 2})]


async def test_a_lone_step_is_delivered_at_once() -> None:
    recorder = Recorder()
    recorder.release.set()
    with ThreadPoolExecutor(1) as executor:
        worker = StepWorker(executor, recorder)
        assert (await worker.submit(step(1))).sampled_token_ids == {"r": [1]}
        assert (await worker.submit(step(2))).sampled_token_ids == {"r": [2]}


async def test_a_failed_step_delivers_the_held_result_then_its_error() -> None:
    recorder = Recorder(fail={2})
    with ThreadPoolExecutor(1) as executor:
        results = await deliveries(StepWorker(executor, recorder), recorder, [1, 2, 3])
    assert results[0].sampled_token_ids == {"r": [1]}
    with pytest.raises(RuntimeError, match="step 2 failed"):
        raise results[1]
    assert results[2].sampled_token_ids == {"r": [3]}
    # Step 2 never reached its forward: step 1's result went with its error.
    assert recorder.seen[2:] == [(2, "prepared", set()), (3, "prepared", {1, 2}),
                                 (3, "forward", {1, 2})]


async def test_close_stops_listening_and_closes_the_pipe() -> None:
    recorder = Recorder()
    recorder.release.set()
    with ThreadPoolExecutor(1) as executor:
        worker = StepWorker(executor, recorder)
        await worker.submit(step(1))
        read_fd, write_fd = worker._pipe
    worker.close()
    worker.close()  # idempotent
    for fd in (read_fd, write_fd):
        with pytest.raises(OSError):
            os.fstat(fd)
