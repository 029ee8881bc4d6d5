"""AsyncEngine: the embedding API. One background task drives the engine loop:

    loop task:  schedule N ─┬─> forward N (worker thread) ─┬─> update N ─> schedule N+1 ...
                            └─> detokenize + stream N-1 ───┘   (on the loop, overlapped)

With async scheduling, in steady decoding, step N+1 is scheduled and queued right after
step N is submitted (its input ids are the tokens N samples), so the worker runs
N, N+1, N+2, ... back to back while the loop updates, streams and schedules behind it.

Callers `async for out in engine.generate(...)`; each request has a RequestOutputCollector
the output processor fills (updates the consumer has not read yet are merged into one).
Cancelling the consuming task aborts the request. Pooling requests (`encode`, embeddings
and scores) are run by the AsyncPooling object the engine holds (async_pooling.py).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, Sequence

from aioengine import envs
from aioengine.config import EngineArgs
from aioengine.sched.scheduler_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from aioengine.engine.async_pooling import AsyncPooling
from aioengine.engine.client import EngineClient, PreparedRequest, PromptType, render_prompt
from aioengine.engine.core import EngineCore
from aioengine.engine.faults import FaultInjector
from aioengine.engine.output_processor import OutputProcessor
from aioengine.engine.step_worker import StepWorker
from aioengine.worker.async_output import AsyncModelRunnerOutput
from aioengine.engine.loop_lag import watch_loop_lag
from aioengine.engine.timeline import StepRecord, StepTimeline, step_kind, step_rows
from aioengine.errors import EngineDeadError, InvalidRequestError
from aioengine.lora.request import LoRARequest
from aioengine.metrics import EngineMetrics, MetricFactory, SpecDecodingLogging
from aioengine.outputs import PoolingRequestOutput, RequestOutput, RequestOutputCollector
from aioengine.pooling_params import PoolingParams
from aioengine.request import Request, RequestStatus
from aioengine.sampling_params import SamplingParams
from aioengine.tracing import RequestTracer

logger = logging.getLogger("aioengine")


def _forward_executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="aioengine-forward")


class AsyncEngine(EngineClient):
    def __init__(self, core: EngineCore, served_model_name: str | None = None,
                 executor: ThreadPoolExecutor | None = None,
                 metrics_factory: MetricFactory | None = None) -> None:
        """`executor`: the one-thread pool that runs the forward; `create` passes the one
        that loaded the model, so a single thread does all of torch's parallel work.
        `metrics_factory`: where the engine's metrics are also written (EngineMetrics)."""
        self.core = core
        self.model_name = served_model_name or os.path.basename(core.loaded.model_path)
        spec = core.speculative_config
        self.metrics = EngineMetrics(self.model_name, stats_provider=core.stats,
                                     num_speculative_tokens=spec.num_speculative_tokens
                                     if spec else 0, metrics_factory=metrics_factory)
        if core.lora is not None:  # vLLM's lora_requests_info gauge
            self.metrics.track_lora_requests(core.lora.config.max_loras,
                                             core.lora_requests_info)
        # --otlp-traces-endpoint: spans of every request (tracing.py); None costs nothing.
        endpoint = core.args.otlp_traces_endpoint
        self._tracer = None if endpoint is None else RequestTracer(endpoint)
        self.processor = OutputProcessor(core.tokenizer, self.metrics, self._tracer)
        # Per-step timings for `aioengine bench profile`; set .enabled to record.
        self.timeline = StepTimeline()
        self._samples: dict[str, list[Request]] = {}
        self._queues: dict[str, RequestOutputCollector] = {}
        self._wakeup = asyncio.Event()
        self._executor = executor or _forward_executor()
        self.faults = FaultInjector()  # in-process fault injection (tests, soak runs)
        self._pooling = AsyncPooling(self, core.admission)
        self._worker = StepWorker(self._executor, self._execute)
        # Waits for CUDA events of steps in flight (AsyncModelRunnerOutput); made on first use.
        self._event_pool: ThreadPoolExecutor | None = None
        self._dead: BaseException | None = None
        self._closing = False
        self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())
        self._lag_task = asyncio.get_running_loop().create_task(
            watch_loop_lag(self.metrics.event_loop_lag.observe))
        # The periodic stats log: only speculative decoding has a line so far.
        interval = envs.AIOENGINE_LOG_STATS_INTERVAL
        self._stat_logger = SpecDecodingLogging(core.stats) if spec and interval > 0 else None
        self._log_task = (None if self._stat_logger is None else asyncio.get_running_loop()
                          .create_task(self._log_stats(self._stat_logger, interval)))

    @classmethod
    async def create(cls, model: str | None = None, served_model_name: str | None = None,
                     metrics_factory: MetricFactory | None = None,
                     **engine_args: object) -> AsyncEngine:
        """Loads the model off the event loop and starts the engine loop.
        `served_model_name` labels metrics (default: the model file or folder name)."""
        args = EngineArgs.from_kwargs(model=model, **engine_args)
        # Loaded on the thread that will run every forward. Each thread that starts OpenMP
        # work keeps a thread team; with more of those threads than cores, libgomp stops
        # spin-waiting between parallel regions and every op pays a futex wake-up: a
        # 1-token decode step measured 28 ms on one thread, 38 ms after loading on another.
        executor = _forward_executor()
        try:
            core = await asyncio.get_running_loop().run_in_executor(executor, EngineCore, args)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(core, served_model_name, executor, metrics_factory)

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    def _execute(self, scheduler_output: SchedulerOutput,
                 hand_over: Callable[[], None]) -> ModelRunnerOutput:
        self.faults.check_forward()
        return self.core.execute(scheduler_output, hand_over)

    def inject_fault(self, kind: str, count: int = 1) -> None:
        """Arms a fault (see aioengine/engine/faults.py); wakes an idle loop for "loop"."""
        self.faults.arm(kind, count)
        self._wakeup.set()

    def num_waiting_requests(self) -> int:
        """Requests queued and not yet running (each sample of n > 1 counts)."""
        return len(self.core.scheduler.waiting)

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._closing

    # ---- requests -----------------------------------------------------------------------

    async def prepare(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                      lora_request: LoRARequest | None = None, fit_kv_cache: bool = False,
                      trace_headers: Mapping[str, str] | None = None) -> PreparedRequest:
        """Admits a request once, queueing nothing (see prepare_batch); `generate` runs it."""
        return (await self.prepare_batch([prompt], sampling_params, lora_request,
                                         fit_kv_cache=fit_kv_cache,
                                         trace_headers=trace_headers))[0]

    async def prepare_batch(self, prompts: Sequence[PromptType],
                            sampling_params: SamplingParams | None = None,
                            lora_request: LoRARequest | None = None, fit_kv_cache: bool = False,
                            admit: Callable[[], None] | None = None,
                            trace_headers: Mapping[str, str] | None = None,
                            ) -> list[PreparedRequest]:
        """Prepares each prompt with the same params and adapter: the adapter loaded first
        if its name is not (off the loop), every prompt rendered and validated, with its
        own copy of the params (EngineCore.prepare), then `admit()` (a server's admission
        control: what it raises refuses the call), then the grammar compiled on a thread
        pool (once: compiles are cached by constraint). Raises InvalidRequestError (a bad
        prompt, params, schema, regex or grammar), LoRANotFoundError, LoRAError; nothing is
        queued. `fit_kv_cache`: an unset max_tokens is capped to what fits the KV cache.
        `trace_headers`: the caller's W3C trace context (traceparent, tracestate), which
        each request's span continues when tracing is on (vLLM's argument)."""
        received = time.monotonic()
        params = sampling_params if sampling_params is not None else SamplingParams()
        await self._load_lora_if_missing(lora_request)
        prepared = [self.core.admission.prepare(token_ids, params, lora_request, text,
                                                fit_kv_cache)
                    for text, token_ids in (render_prompt(self.tokenizer, p) for p in prompts)]
        if admit is not None:
            admit()
        compile_start = time.monotonic()
        await self.core.admission.prepare_features_async(params)
        compiled = ((compile_start, time.monotonic())
                    if params.structured_outputs is not None else None)
        for prompt, request in zip(prompts, prepared):
            request.received_time, request.grammar_compile = received, compiled
            request.trace_headers = trace_headers
            request.operation = "chat" if _is_chat(prompt) else "text_completion"
        return prepared

    def _given_prepared(self, prompt: PromptType | PreparedRequest,
                        params: SamplingParams | PoolingParams | None,
                        lora_request: LoRARequest | None) -> PreparedRequest | None:
        """`prompt` when it is a PreparedRequest (which carries its own params and adapter:
        none may be given); None for a prompt still to prepare, if the engine runs."""
        if isinstance(prompt, PreparedRequest):
            if params is not None or lora_request is not None:
                raise ValueError("a prepared request carries its own params and adapter")
            return prompt
        if not self.is_running:
            raise EngineDeadError("the engine is not running") from self._dead
        return None

    def _start_request(self, prepared: PreparedRequest, request_id: str | None,
                       priority: int) -> tuple[str, list[Request]]:
        """Queues a prepared request (generate's or encode's: one id space) under
        `request_id` or a fresh one; returns the id and its samples. The caller registers
        its output with the processor before it next awaits, and forgets it at the end."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running") from self._dead
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._queues or request_id in self._samples:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        samples = self.core.add_request(request_id, prepared, priority=priority)
        self._samples[request_id] = samples
        self._wakeup.set()
        return request_id, samples

    def _add_request(self, prepared: PreparedRequest, request_id: str | None = None,
                     priority: int = 0) -> tuple[str, RequestOutputCollector]:
        """Queues a prepared request; returns its id and output queue. Only generate()
        calls it: its `finally` is what forgets the queue."""
        request_id, samples = self._start_request(prepared, request_id, priority)
        queue = RequestOutputCollector()
        self._queues[request_id] = queue
        self.processor.add_request(request_id, prepared.prompt_text, samples, queue.put)
        if self._tracer is not None:
            self._tracer.begin(request_id, prepared, self._served_name(prepared))
        return request_id, queue

    def _served_name(self, prepared: PreparedRequest) -> str:
        """The model a request runs on, as callers name it: its adapter, else the model."""
        lora = prepared.lora_request
        return self.model_name if lora is None else lora.lora_name

    async def generate(self, prompt: PromptType | PreparedRequest,
                       sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       lora_request: LoRARequest | None = None,
                       trace_headers: Mapping[str, str] | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """Streams RequestOutputs until the request finishes. Cancelling the task aborts
        the request and frees its KV blocks at once; so does closing the generator early
        (`contextlib.aclosing`, or when Python collects it).

        `prompt`: a prompt, prepared here (`prepare`: raises InvalidRequestError for bad
        input on the first iteration, before anything is queued, an invalid schema, regex
        or grammar too), or a PreparedRequest, queued as it is (it carries its own params
        and adapter). `lora_request` runs it with an adapter: one loaded under that name,
        or else loaded from its lora_path first (off the loop). Raises LoRANotFoundError
        (an unknown name, a missing path) or LoRAError (bad adapter files).
        `trace_headers` (a prompt, not a prepared request: that carries its own): the
        caller's W3C trace context, continued by the request's span when tracing is on."""
        prepared = self._given_prepared(prompt, sampling_params, lora_request)
        if prepared is None:
            prepared = await self.prepare(prompt, sampling_params, lora_request,
                                          trace_headers=trace_headers)
        elif trace_headers is not None:
            raise ValueError("a prepared request carries its own trace headers")
        request_id, queue = self._add_request(prepared, request_id, priority)
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._abort(request_id)
            self._forget(request_id)

    # ---- pooling requests (embeddings, scores): AsyncPooling's ---------------------------

    async def prepare_pooling(self, prompts: Sequence[PromptType],
                              pooling_params: PoolingParams | None = None,
                              lora_request: LoRARequest | None = None,
                              admit: Callable[[], None] | None = None,
                              ) -> list[PreparedRequest]:
        """Admits pooling requests (EngineCore.prepare_pooling), queueing nothing; then
        `admit()` (a server's admission control). Raises InvalidRequestError,
        LoRANotFoundError, LoRAError."""
        return await self._pooling.prepare(prompts, pooling_params, lora_request, admit)

    def encode(self, prompt: PromptType | PreparedRequest,
               pooling_params: PoolingParams | None = None,
               request_id: str | None = None, lora_request: LoRARequest | None = None,
               priority: int = 0) -> AsyncIterator[PoolingRequestOutput]:
        """vLLM's encode: a prefill-only request, batched with everything else, that yields
        one PoolingRequestOutput (the pooled final hidden states; `outputs` None and
        `error` set if it failed). Its KV blocks are freed when it ends. Cancelling the
        consumer aborts it. `prompt`: a prompt (prepared here: InvalidRequestError before
        anything is queued) or a PreparedRequest from `prepare_pooling`."""
        # AsyncPooling's generator itself, not one wrapping it: closing it aborts at once.
        return self._pooling.encode(prompt, pooling_params, request_id, lora_request,
                                    priority)

    # ---- LoRA adapters (vLLM's add_lora / remove_lora; list_loras: EngineClient) ---------

    async def _off_loop(self, fn, *args):
        """On the forward's own thread, between steps: a thread of its own would start a
        second OpenMP thread team, and with more teams than cores every later step pays
        futex wake-ups (see `create`)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _load_lora_if_missing(self, lora_request: LoRARequest | None) -> None:
        """Loads a request's adapter (off the loop) unless one is loaded under its name."""
        if lora_request is not None and self.get_lora(lora_request.lora_name) is None:
            await self._off_loop(self.core.admission.load_lora_if_missing, lora_request)

    async def add_lora(self, lora_request: LoRARequest) -> LoRARequest:
        """Loads an adapter (its files read off the loop) and registers it under its name;
        returns it with the lora_int_id of this load. Raises LoRAError when the name is
        taken or the files are bad, LoRANotFoundError for a missing path."""
        return await self._off_loop(self.core.admission.add_lora, lora_request)

    async def remove_lora(self, lora_name: str) -> None:
        """Unloads an adapter: new requests naming it are refused at once, those already
        running finish on it. Raises LoRANotFoundError for a name not loaded."""
        self.core.admission.remove_lora(lora_name)

    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        samples = self._samples.get(request_id)
        if samples is None:
            return
        self.core.finish_requests(samples, RequestStatus.FINISHED_ABORTED)
        self.processor.abort(request_id, "abort")

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._samples.pop(request_id, None)

    async def shutdown(self) -> None:
        """Aborts what is in flight and stops the loop; idempotent."""
        if self._closing:
            return
        self._closing = True
        for request_id in list(self._samples):
            self._abort(request_id)
        self._wakeup.set()
        await asyncio.gather(self._loop_task, return_exceptions=True)
        self._lag_task.cancel()
        await asyncio.gather(self._lag_task, return_exceptions=True)
        if self._log_task is not None:
            self._log_task.cancel()
            await asyncio.gather(self._log_task, return_exceptions=True)
        if self._stat_logger is not None:
            self._stat_logger.log()  # what the last interval did
        self._executor.shutdown(wait=True)
        if self._event_pool is not None:
            self._event_pool.shutdown(wait=True)
        self._worker.close()
        self.core.shutdown()
        if self._tracer is not None:  # the spans of what just ended, exported off the loop
            await asyncio.to_thread(self._tracer.shutdown)

    # ---- the engine loop ---------------------------------------------------------------

    def _event_waiter(self) -> ThreadPoolExecutor:
        if self._event_pool is None:
            self._event_pool = ThreadPoolExecutor(max_workers=1,
                                                  thread_name_prefix="aioengine-events")
        return self._event_pool

    @staticmethod
    async def _log_stats(stat_logger: SpecDecodingLogging, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            stat_logger.log()

    async def _run_loop(self) -> None:
        pending: list[EngineCoreOutput] = []
        # A step scheduled ahead (async scheduling), already queued behind the one running.
        ahead: tuple[SchedulerOutput, asyncio.Future] | None = None
        try:
            while not self._closing:
                self.faults.check_loop()
                started = time.perf_counter()
                if ahead is None:
                    step = await self._schedule(pending)
                    if step is None:
                        pending = []
                        continue
                else:
                    step, ahead = ahead, None
                scheduler_output, future = step
                # Step N+1 is queued before the loop turns to anything else, so the worker
                # goes on to it as soon as step N ends.
                next_output = self.core.schedule_ahead(scheduler_output)
                if next_output is not None:
                    ahead = next_output, self._worker.submit(next_output)
                scheduled = time.perf_counter()
                # Overlap: fill step N's grammar bitmask and stream step N-1 while step N
                # runs on the worker thread.
                self.core.fill_bitmask(scheduler_output)
                self._process(pending)
                record = StepRecord(step_kind(scheduler_output),
                                    scheduler_output.total_num_scheduled_tokens,
                                    len(scheduler_output.scheduled),
                                    schedule=scheduled - started,
                                    process=time.perf_counter() - scheduled,
                                    idle=self.timeline.take_idle())
                if self.timeline.enabled or self._tracer is not None:
                    record.start = time.monotonic() - (time.perf_counter() - started)
                if self.timeline.enabled:
                    record.decode_rows, record.draft_tokens = step_rows(scheduler_output)
                pending = await self._finish_step(future, scheduler_output, record)
            self._process(pending)
            if ahead is not None:  # shutting down: let the queued step end quietly
                await asyncio.gather(ahead[1], return_exceptions=True)
        except BaseException as e:  # the loop itself broke: fail everything, stay dead
            self._dead = e
            logger.exception("engine loop died")
            for request_id in list(self._samples):
                self.processor.abort(request_id, "error", error=f"engine died: {e!r}")
            raise

    async def _schedule(self, pending: list[EngineCoreOutput],
                        ) -> tuple[SchedulerOutput, asyncio.Future] | None:
        """With no step in flight: schedules and submits the next one. None when there is
        nothing to run (after streaming `pending` and waiting for a request)."""
        if not self.core.has_unfinished_requests():
            self._process(pending)
            if not self.core.has_unfinished_requests():
                self._wakeup.clear()
                self.timeline.mark_idle()
                await self._wakeup.wait()
            return None
        scheduler_output = self.core.schedule()
        self._process([], self.core.take_failed())
        if scheduler_output.is_empty:
            self._process(pending)
            # Only compiling grammars can leave waiting requests unschedulable here: yield
            # briefly rather than spin against the compile threads.
            await asyncio.sleep(0.001 if self.core.has_unfinished_requests() else 0)
            return None
        return scheduler_output, self._worker.submit(scheduler_output)

    async def _finish_step(self, future: asyncio.Future, scheduler_output: SchedulerOutput,
                           record: StepRecord) -> list[EngineCoreOutput]:
        waiting = time.perf_counter()
        try:
            runner_output = await future
            if isinstance(runner_output, AsyncModelRunnerOutput):
                # On CUDA: the step is launched, its sampled ids are on their way to the
                # host; the event is awaited on a thread of its own, never on the loop.
                runner_output = await runner_output.resolve(self._event_waiter())
        except Exception as e:  # noqa: BLE001 - fail this batch's requests, not the engine
            logger.exception("forward failed")
            self._process([], self.core.fail_step(scheduler_output, e))
            return []
        updating = time.perf_counter()
        timings = runner_output.timings
        self.metrics.observe_step(scheduler_output.total_num_scheduled_tokens,
                                  sum(timings.values()) if timings else None,
                                  runner_output.executor)
        if self._tracer is not None:  # before the update: it ends requests
            self._tracer.observe_step(scheduler_output, runner_output, record.start,
                                      time.monotonic())
        outputs = self.core.update(scheduler_output, runner_output)
        record.wait, record.update = updating - waiting, time.perf_counter() - updating
        for phase, seconds in runner_output.timings.items():
            setattr(record, phase, seconds)
        record.executor = runner_output.executor
        self.timeline.add(record)
        return outputs

    def _process(self, outputs: list[EngineCoreOutput], failed: list[Request] = ()) -> None:
        if not outputs and not failed:
            return
        self.core.apply_finish_orders(self.processor.process_outputs(outputs, failed))


def _is_chat(prompt: PromptType) -> bool:
    """Chat messages (rendered through the template), not text or token ids."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
