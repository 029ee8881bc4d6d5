"""Hands steps to the forward's thread and their results back to the event loop.

A result normally goes to the loop as soon as its step ends. When the next step is already
queued behind it (async scheduling), it goes once that next step's inputs are embedded,
right before its layers run (the model's `before_layers` hook):

    worker:  | prepare N+1 | layers N+1 (no GIL) ........... | sample N+1 | prepare N+2 |
                           ^ result of N to the loop: update N, schedule N+2, stream N
                             run here, beside the forward

Handed over at once, the loop's Python work lands on the worker's preparation instead and
the two take turns on the GIL: measured on 2 CPU cores, 0.45 ms of each ~12 ms decode step
went by between the end of one step and the start of the next.

The hand-over itself must not let go of the GIL either. asyncio's call_soon_threadsafe
writes to the loop's wake-up socket with the GIL released; the woken loop took the GIL
during that write and the worker waited out its whole turn (0.38 ms a step) before it
could start the layers. So results go into a deque, and the worker wakes the loop by
writing one byte to a pipe of its own with libc's write() called under the GIL (a few
microseconds, never blocking: the pipe is non-blocking and a full pipe already wakes the
loop). The loop then gets the GIL when the worker enters the layers' C kernel.
"""
from __future__ import annotations

import asyncio
import collections
import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from aioengine.sched.scheduler_output import ModelRunnerOutput, SchedulerOutput

# (scheduler_output, before_layers) -> runner output; calls before_layers() right before the
# model's layers run (EngineCore.execute).
ExecuteFn = Callable[[SchedulerOutput, Callable[[], None]], ModelRunnerOutput]
_Result = tuple[asyncio.Future, ModelRunnerOutput | None, BaseException | None]


def _make_wake() -> Callable[[int], None]:
    """Writes one byte to a non-blocking fd: with libc's write() through ctypes.PyDLL,
    which keeps the GIL (os.write releases it); os.write where libc's symbols are not at
    hand. A full pipe (EAGAIN) is fine: the loop has bytes to read already."""
    try:
        libc_write = ctypes.PyDLL(None).write
    except (AttributeError, OSError):
        libc_write = None

    def wake(fd: int) -> None:
        if libc_write is not None:
            libc_write(fd, b"\0", 1)  # returns -1 on EAGAIN, never raises
            return
        try:
            os.write(fd, b"\0")
        except BlockingIOError:
            pass

    if libc_write is not None:
        libc_write.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
        libc_write.restype = ctypes.c_ssize_t
    return wake


_wake = _make_wake()


class StepWorker:
    def __init__(self, executor: ThreadPoolExecutor, execute: ExecuteFn) -> None:
        self._executor = executor
        self._execute = execute
        self._lock = threading.Lock()
        self._num_queued = 0  # submitted steps not yet started
        self._held: _Result | None = None  # a finished step, not yet handed over (worker only)
        self._results: collections.deque[_Result] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pipe: tuple[int, int] | None = None  # (read end, write end)

    def submit(self, scheduler_output: SchedulerOutput) -> asyncio.Future[ModelRunnerOutput]:
        """Queues a step behind those already submitted; the future resolves on the loop."""
        if self._pipe is None:
            self._start(asyncio.get_running_loop())
        assert self._loop is not None
        future: asyncio.Future[ModelRunnerOutput] = self._loop.create_future()
        with self._lock:
            self._num_queued += 1
        self._executor.submit(self._run, scheduler_output, future)
        return future

    def close(self) -> None:
        """Stops listening for results (on the loop, once no step is in flight)."""
        pipe, self._pipe = self._pipe, None
        if pipe is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(pipe[0])
        for fd in pipe:
            os.close(fd)

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        read_fd, write_fd = os.pipe()
        for fd in (read_fd, write_fd):
            os.set_blocking(fd, False)
        loop.add_reader(read_fd, self._on_results)
        self._loop, self._pipe = loop, (read_fd, write_fd)

    def _on_results(self) -> None:  # on the loop
        assert self._pipe is not None
        try:
            os.read(self._pipe[0], 4096)
        except BlockingIOError:
            pass
        while self._results:
            future, output, error = self._results.popleft()
            if future.cancelled():
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(output)

    # ---- on the worker thread -------------------------------------------------------

    def _run(self, scheduler_output: SchedulerOutput, future: asyncio.Future) -> None:
        with self._lock:
            self._num_queued -= 1
        try:
            output = self._execute(scheduler_output, self._hand_over_held)
        except BaseException as e:  # noqa: BLE001 - the loop fails the step's requests
            self._hand_over_held()
            self._hand_over((future, None, e))
            return
        self._hand_over_held()  # a step that never reached its layers
        with self._lock:
            queued = self._num_queued
        if queued:
            self._held = (future, output, None)
        else:
            self._hand_over((future, output, None))

    def _hand_over_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self._hand_over(held)

    def _hand_over(self, result: _Result) -> None:
        self._results.append(result)
        pipe = self._pipe
        if pipe is not None:
            _wake(pipe[1])
