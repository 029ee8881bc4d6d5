"""Turns EngineCoreOutputs into streamed RequestOutputs: detokenizes, finds stop strings,
groups the samples of an n > 1 request, and hands each update to the caller's sink.

It runs on the event loop while the next forward runs (AsyncEngine), so its cost overlaps
device work. A stop string found here ends the sample one step late in the scheduler;
the extra token computed meanwhile is dropped (vLLM v1 does the same).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import torch
from transformers import PreTrainedTokenizerBase

from aioengine.sched.scheduler_output import EngineCoreOutput
from aioengine.detokenizer import IncrementalDetokenizer
from aioengine.metrics import EngineMetrics
from aioengine.outputs import (CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput,
                               PositionLogprobs, RequestOutput)
from aioengine.request import Request, RequestStatus
from aioengine.tracing import RequestOutcome, RequestTracer

Sink = Callable[[RequestOutput], None]
PoolingSink = Callable[[PoolingRequestOutput], None]
# (sample, status to end it with, stop string or error message)
FinishOrder = tuple[Request, RequestStatus, "str | None"]


@dataclass
class SampleState:
    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_sent_tokens: int = 0
    finished: bool = False
    last_token_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleState]
    sink: Sink
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase,
                 metrics: EngineMetrics | None = None,
                 tracer: RequestTracer | None = None) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        # --otlp-traces-endpoint: a request's spans are made where its last output goes out.
        self.tracer = tracer
        self.states: dict[str, RequestState] = {}
        # Pooling requests in flight: request_id -> (prompt ids, sink).
        self.pooling: dict[str, tuple[list[int], PoolingSink]] = {}
        self._decode_one = lru_cache(maxsize=65536)(
            lambda tok: tokenizer.decode([tok], skip_special_tokens=False))

    def add_request(self, request_id: str, prompt: str | None, samples: list[Request],
                    sink: Sink) -> None:
        first = samples[0]
        states = [SampleState(s, IncrementalDetokenizer(self.tokenizer, s.prompt_token_ids,
                                                         s.sampling_params)) for s in samples]
        self.states[request_id] = RequestState(
            request_id, prompt, first.prompt_token_ids, states, sink,
            prompt_logprobs=[None] if first.sampling_params.prompt_logprobs is not None else None,
            arrival_time=first.arrival_time)

    def add_pooling_request(self, request_id: str, prompt_token_ids: list[int],
                            sink: PoolingSink) -> None:
        self.pooling[request_id] = (prompt_token_ids, sink)

    def _deliver_pooled(self, request: Request, data: torch.Tensor | None,
                        finish_reason: str = "stop", error: str | None = None) -> None:
        entry = self.pooling.pop(request.request_id, None)
        if entry is None:
            return
        prompt_token_ids, sink = entry
        sink(PoolingRequestOutput(
            request.request_id, prompt_token_ids,
            None if data is None else PoolingOutput(data.cpu()),
            num_cached_tokens=max(request.num_cached_tokens, 0),
            finish_reason=finish_reason, error=error))

    def process_outputs(self, outputs: list[EngineCoreOutput],
                        failed: list[Request] = ()) -> list[FinishOrder]:
        """Delivers one update per request that advanced. Returns the samples that end
        here (a stop string in their text, or an error processing them) with the status and
        stop string / error: the caller ends them in the scheduler."""
        to_finish: list[FinishOrder] = []
        updates: dict[str, list[CompletionOutput]] = {}
        for out in outputs:
            if out.pooled is not None:
                self._deliver_pooled(out.request, out.pooled)
                continue
            state = self.states.get(out.request.parent_id or out.request.request_id)
            if state is None:
                continue
            if out.prompt_logprobs and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(self._decode_logprobs(out.prompt_logprobs))
            if not out.new_token_ids:
                continue
            try:
                completion, stop_str = self._advance(state, out)
            except Exception as e:  # noqa: BLE001 - one broken request must not stop the loop
                sample = state.samples[out.request.sample_index]
                error = f"output processing failed: {type(e).__name__}: {e}"
                completion = self._finish_sample(state, sample, "error", error=error)
                stop_str = None
                to_finish.append((out.request, RequestStatus.FINISHED_ERROR, error))
            if stop_str is not None:
                to_finish.append((out.request, RequestStatus.FINISHED_STOPPED, stop_str))
            if completion is not None:
                updates.setdefault(state.request_id, []).append(completion)
        for request in failed:
            if request.request_id in self.pooling:
                self._deliver_pooled(request, None, "error", request.error)
                continue
            state = self.states.get(request.parent_id or request.request_id)
            if state is not None:
                updates.setdefault(state.request_id, []).append(self._finish_sample(
                    state, state.samples[request.sample_index], "error", error=request.error))
        for request_id, completions in updates.items():
            self._deliver(self.states[request_id], completions)
        return to_finish

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> None:
        """Ends every unfinished sample of a request with `reason` and delivers it."""
        if request_id in self.pooling:
            prompt_token_ids, sink = self.pooling.pop(request_id)
            sink(PoolingRequestOutput(request_id, prompt_token_ids, None,
                                      finish_reason=reason, error=error))
            return
        state = self.states.get(request_id)
        if state is None:
            return
        completions = [self._finish_sample(state, s, reason, error=error)
                       for s in state.samples if not s.finished]
        self._deliver(state, completions)

    # ---- internals ----------------------------------------------------------------------

    def _advance(self, state: RequestState,
                 out: EngineCoreOutput) -> tuple[CompletionOutput | None, str | None]:
        sample = state.samples[out.request.sample_index]
        if sample.finished:
            return None, None
        self._observe_tokens(state, sample, len(out.new_token_ids))
        request = out.request
        stop_terminated = (request.status == RequestStatus.FINISHED_STOPPED)
        stop_str = sample.detokenizer.update(out.new_token_ids, stop_terminated)
        finished = request.is_finished or stop_str is not None
        delta = sample.detokenizer.get_next_output_text(finished, delta=True)
        sample.text += delta
        token_ids = request.output_token_ids
        new_logprobs = out.new_logprobs
        if stop_str is not None:
            # Tokens after the stop string's end (a step can bring several: drafts,
            # jump-forward) are dropped, as a one-token step would never have made them.
            kept = len(sample.detokenizer.output_token_ids)
            if new_logprobs is not None:
                new_logprobs = new_logprobs[:max(0, len(new_logprobs) - (len(token_ids) - kept))]
            token_ids = token_ids[:kept]
        new_ids = token_ids[sample.num_sent_tokens:]
        sample.num_sent_tokens = len(token_ids)
        sample.finished = finished
        if stop_str is not None:
            reason, stop_reason = "stop", stop_str
        else:
            reason, stop_reason = request.status.finish_reason, request.stop_reason
        if finished:
            self._observe_finished(state, sample, reason)
        return CompletionOutput(
            index=request.sample_index, text=delta, token_ids=new_ids,
            cumulative_text=sample.text, cumulative_token_ids=list(token_ids),
            logprobs=self._decode_logprobs(new_logprobs),
            finished=finished, finish_reason=reason if finished else None,
            stop_reason=stop_reason if finished else None), stop_str

    def _finish_sample(self, state: RequestState, sample: SampleState, reason: str,
                       error: str | None = None) -> CompletionOutput:
        sample.finished, sample.error = True, error
        self._observe_finished(state, sample, reason)
        delta = sample.detokenizer.get_next_output_text(True, delta=True)
        sample.text += delta
        token_ids = sample.request.output_token_ids
        new_ids = token_ids[sample.num_sent_tokens:]
        sample.num_sent_tokens = len(token_ids)
        return CompletionOutput(
            index=sample.request.sample_index, text=delta, token_ids=new_ids,
            cumulative_text=sample.text, cumulative_token_ids=list(token_ids),
            finished=True, finish_reason=reason, error=error)

    def _observe_tokens(self, state: RequestState, sample: SampleState, num_tokens: int) -> None:
        now = time.monotonic()
        if state.first_token_time is None:
            state.first_token_time = now
            if self.metrics is not None:
                self.metrics.observe_first_token(now - state.arrival_time,
                                                 len(state.prompt_token_ids))
        if self.metrics is not None:
            itl = None if sample.last_token_time is None else now - sample.last_token_time
            self.metrics.observe_tokens(num_tokens, itl)
        sample.last_token_time = now

    def _observe_finished(self, state: RequestState, sample: SampleState, reason: str) -> None:
        sample.finish_reason = reason
        if self.metrics is None:
            return
        request = sample.request
        queue_time = (None if request.first_scheduled_time is None
                      else request.first_scheduled_time - request.arrival_time)
        now, num_out = time.monotonic(), len(request.output_token_ids)
        # TPOT as vLLM's request_time_per_output_token_seconds: first to last token, per
        # token after the first.
        tpot = (None if state.first_token_time is None or num_out < 2
                else (now - state.first_token_time) / (num_out - 1))
        self.metrics.observe_finished(reason, now - state.arrival_time, queue_time, tpot)

    def _deliver(self, state: RequestState, completions: list[CompletionOutput]) -> None:
        finished = state.finished
        if finished:
            del self.states[state.request_id]
            if self.tracer is not None:
                self.tracer.finish(state.request_id, _outcome(state))
        first = state.samples[0].request
        metrics = {"arrival_time": state.arrival_time}
        if first.first_scheduled_time is not None:
            metrics["first_scheduled_time"] = first.first_scheduled_time
        if state.first_token_time is not None:
            metrics["first_token_time"] = state.first_token_time
        state.sink(RequestOutput(
            request_id=state.request_id, prompt_token_ids=state.prompt_token_ids,
            outputs=completions, finished=finished, prompt=state.prompt,
            prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=max(first.num_cached_tokens, 0), metrics=metrics))

    def _decode_logprobs(self, logprobs: list[PositionLogprobs] | None
                         ) -> list[PositionLogprobs] | None:
        if not logprobs:
            return None
        return [{tok: Logprob(lp.logprob, lp.rank, self._decode_one(tok))
                 for tok, lp in entry.items()} for entry in logprobs]


def _outcome(state: RequestState) -> RequestOutcome:
    """How a finished request went, for its trace: what was delivered, over all samples."""
    samples = state.samples
    first = samples[0].request
    last_token_times = [s.last_token_time for s in samples if s.last_token_time is not None]
    return RequestOutcome(
        finish_time=time.monotonic(), arrival_time=state.arrival_time,
        first_scheduled_time=first.first_scheduled_time,
        first_token_time=state.first_token_time,
        last_token_time=max(last_token_times, default=None),
        num_output_tokens=sum(s.num_sent_tokens for s in samples),
        num_cached_tokens=max(first.num_cached_tokens, 0),
        num_preemptions=sum(s.request.num_preemptions for s in samples),
        finish_reasons=[s.finish_reason or "abort" for s in samples],
        error=next((s.error for s in samples if s.error is not None), None))
