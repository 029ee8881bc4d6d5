"""OpenTelemetry traces of requests (`--otlp-traces-endpoint`, vLLM's flag; issue 54).

One span per request, vLLM's `llm_request`, with the OpenTelemetry GenAI semantic-convention
attributes and vLLM's latency attributes, and its children: `grammar_compile` (a request
with structured output), one `prefill_chunk` per step that computed prompt tokens of the
request, and one `decode` span for the rest (its step count and drafts). No span per token.

Spans are made when a request finishes, with the start and end times the engine recorded
(time.monotonic(), turned into epoch nanoseconds), and handed to a BatchSpanProcessor whose
own thread exports them: nothing on the event loop waits for the collector.

The seam: AsyncEngine holds a RequestTracer only when an endpoint is set; it `begin`s a
request as it queues it and `observe_step`s each step, and the OutputProcessor `finish`es
it where it delivers the request's last output. Without an endpoint none of this runs and
opentelemetry is never imported (the SDK and exporters are the optional `tracing` extra).
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from aioengine.errors import ConfigError

if TYPE_CHECKING:
    from aioengine.engine.prepared_request import PreparedRequest
    from aioengine.sched.scheduler_output import (ModelRunnerOutput, ScheduledRequest,
                                                  SchedulerOutput)

INSTALL_HINT = "pip install 'aioengine[tracing]'"
# OpenTelemetry's own variable for the traces exporter's protocol (vLLM reads it too).
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
PROTOCOLS = ("http/protobuf", "grpc")
# The W3C trace-context headers a request may carry (TraceContextTextMapPropagator's).
TRACE_HEADERS = ("traceparent", "tracestate")
REQUEST_SPAN = "llm_request"

AttributeValue = str | int | float | bool | Sequence[str]


def traces_protocol() -> str:
    """The OTLP protocol: $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, http/protobuf by default."""
    protocol = os.environ.get(PROTOCOL_ENV, "http/protobuf").strip() or "http/protobuf"
    if protocol not in PROTOCOLS:
        raise ConfigError(f"{PROTOCOL_ENV}={protocol!r} is not supported; use one of "
                          f"{list(PROTOCOLS)}")
    return protocol


def check_traces_endpoint(endpoint: str) -> None:
    """ConfigError for an endpoint the exporter cannot use, or when the OpenTelemetry SDK
    or the protocol's OTLP exporter is not installed (the error names the extra). Called
    when the engine's arguments are validated, before the model loads."""
    protocol = traces_protocol()
    url = urlsplit(endpoint if "://" in endpoint or protocol == "http/protobuf"
                   else f"http://{endpoint}")  # gRPC also takes a bare host:port
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ConfigError(f"--otlp-traces-endpoint must be an http:// or https:// URL, got "
                          f"{endpoint!r}")
    try:
        _exporter_class(protocol)
    except ImportError as e:
        raise ConfigError(f"--otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP "
                          f"exporter ({e}); install them with: {INSTALL_HINT}") from None


def _exporter_class(protocol: str) -> type:
    """The OTLP span exporter class of `protocol`; imports the SDK (ImportError if absent)."""
    import opentelemetry.sdk.trace  # noqa: F401  (the SDK itself, not only the API)

    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter


def http_traces_url(endpoint: str) -> str:
    """An OTLP/HTTP endpoint as the exporter posts to it: a URL without a path gets the
    collector's `/v1/traces` (what OTEL_EXPORTER_OTLP_ENDPOINT does); any other is used as
    given (what OTEL_EXPORTER_OTLP_TRACES_ENDPOINT does)."""
    url = urlsplit(endpoint)
    return endpoint.rstrip("/") + "/v1/traces" if url.path in ("", "/") else endpoint


# ---- what a request's spans are made of (plain data: no opentelemetry) -------------------

@dataclass
class PrefillChunk:
    """One step that computed prompt tokens of the request."""
    start: float  # time.monotonic(): the loop began the step
    end: float  # the step's results reached the loop
    num_tokens: int  # prompt tokens of this request in the step
    num_computed_tokens: int  # the request's computed tokens before it
    step_tokens: int  # every request's tokens in the step
    step_requests: int


@dataclass
class DecodePhase:
    """The steps that computed the request's output tokens (any sample's), one span."""
    start: float | None = None
    end: float | None = None
    num_steps: int = 0
    num_draft_tokens: int = 0  # drafts verified (speculative decoding)
    num_accepted_tokens: int = 0
    last_step_id: int = -1  # a step counts once for all samples of an n > 1 request


@dataclass
class RequestTrace:
    """One traced request while it runs, made at `begin` (times: time.monotonic())."""
    request_id: str
    model: str
    operation: str  # gen_ai.operation.name: "chat" or "text_completion"
    received_time: float  # when the front end began preparing it: the span's start
    num_prompt_tokens: int
    request_attributes: dict[str, AttributeValue]  # the request's parameters
    trace_headers: Mapping[str, str] | None = None
    grammar_compile: tuple[float, float] | None = None
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    decode: DecodePhase = field(default_factory=DecodePhase)


@dataclass
class RequestOutcome:
    """How a traced request ended, from the output processor (times: time.monotonic())."""
    finish_time: float
    arrival_time: float  # queued in the engine (RequestOutput.metrics' arrival_time)
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    num_output_tokens: int  # tokens delivered, all samples: the API's completion_tokens
    num_cached_tokens: int
    num_preemptions: int
    finish_reasons: list[str]
    error: str | None = None


def request_parameters(prepared: PreparedRequest) -> dict[str, AttributeValue]:
    """gen_ai.request.* of a prepared request (max_tokens as the engine resolved it)."""
    params = prepared.sampling_params
    attributes: dict[str, AttributeValue] = {
        "gen_ai.request.max_tokens": params.max_tokens, "gen_ai.request.n": params.n,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p}
    if params.seed is not None:
        attributes["gen_ai.request.seed"] = params.seed
    return {k: v for k, v in attributes.items() if v is not None}


def request_attributes(trace: RequestTrace, outcome: RequestOutcome) -> dict[str, AttributeValue]:
    """The request span's attributes: GenAI semantic conventions, vLLM's latencies."""
    attributes: dict[str, AttributeValue] = {
        "gen_ai.system": "aioengine", "gen_ai.operation.name": trace.operation,
        "gen_ai.request.model": trace.model, "gen_ai.response.model": trace.model,
        "gen_ai.request.id": trace.request_id, "gen_ai.response.id": trace.request_id,
        **trace.request_attributes,
        "gen_ai.usage.input_tokens": trace.num_prompt_tokens,
        "gen_ai.usage.output_tokens": outcome.num_output_tokens,
        "gen_ai.response.finish_reasons": list(outcome.finish_reasons),
        "aioengine.usage.cached_tokens": outcome.num_cached_tokens,
        "aioengine.num_preemptions": outcome.num_preemptions,
        "gen_ai.latency.e2e": outcome.finish_time - outcome.arrival_time,
    }
    scheduled, first, last = (outcome.first_scheduled_time, outcome.first_token_time,
                              outcome.last_token_time)
    if scheduled is not None:
        attributes["gen_ai.latency.time_in_queue"] = scheduled - outcome.arrival_time
    if first is not None:
        attributes["gen_ai.latency.time_to_first_token"] = first - outcome.arrival_time
        if scheduled is not None:
            attributes["gen_ai.latency.time_in_model_prefill"] = first - scheduled
        if last is not None:
            attributes["gen_ai.latency.time_in_model_decode"] = last - first
    if outcome.error is not None:
        attributes["error.type"] = outcome.error.split(":", 1)[0]
    return attributes


@dataclass(frozen=True)
class ChildSpan:
    name: str
    start: float
    end: float
    attributes: dict[str, AttributeValue]


def child_spans(trace: RequestTrace) -> list[ChildSpan]:
    """The request span's children, in time order: grammar compile, prefill chunks, decode."""
    spans = []
    if trace.grammar_compile is not None:
        spans.append(ChildSpan("grammar_compile", *trace.grammar_compile, {}))
    for i, chunk in enumerate(trace.prefill_chunks):
        spans.append(ChildSpan("prefill_chunk", chunk.start, chunk.end, {
            "aioengine.prefill.chunk_index": i,
            "aioengine.prefill.num_tokens": chunk.num_tokens,
            "aioengine.prefill.num_computed_tokens": chunk.num_computed_tokens,
            "aioengine.step.num_tokens": chunk.step_tokens,
            "aioengine.step.num_requests": chunk.step_requests}))
    decode = trace.decode
    if decode.num_steps and decode.start is not None and decode.end is not None:
        spans.append(ChildSpan("decode", decode.start, decode.end, {
            "aioengine.decode.num_steps": decode.num_steps,
            "aioengine.spec_decode.num_draft_tokens": decode.num_draft_tokens,
            "aioengine.spec_decode.num_accepted_tokens": decode.num_accepted_tokens}))
    return spans


def observe_scheduled(trace: RequestTrace, item: ScheduledRequest,
                      scheduler_output: SchedulerOutput,
                      sampled: list[int] | None, start: float, end: float) -> None:
    """One step's share of a request (`item`): a prefill chunk when it computed prompt
    positions, else a decode step (with its drafts, and of those the accepted: all sampled
    tokens but the last). A step counts once however many samples of the request it ran."""
    request, computed = item.request, item.num_computed_tokens
    num_prompt = request.num_prompt_tokens
    if computed < num_prompt:
        trace.prefill_chunks.append(PrefillChunk(
            start, end, min(computed + item.num_new_tokens, num_prompt) - computed, computed,
            scheduler_output.total_num_scheduled_tokens, len(scheduler_output.scheduled)))
        return
    decode = trace.decode
    if decode.last_step_id != scheduler_output.step_id:
        decode.last_step_id = scheduler_output.step_id
        decode.num_steps += 1
        if decode.start is None:
            decode.start = start
        decode.end = end
    if item.spec_token_ids:
        decode.num_draft_tokens += len(item.spec_token_ids)
        decode.num_accepted_tokens += max(0, len(sampled or ()) - 1)


# ---- the exporter --------------------------------------------------------------------------

class RequestTracer:
    """Turns finished requests into spans exported over OTLP. Made only when an endpoint
    is set (this is where opentelemetry is first imported)."""

    def __init__(self, endpoint: str) -> None:
        check_traces_endpoint(endpoint)
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        import aioengine

        protocol = traces_protocol()
        exporter = _exporter_class(protocol)(
            endpoint=http_traces_url(endpoint) if protocol == "http/protobuf" else endpoint)
        # $OTEL_SERVICE_NAME, when set, names the service instead (the SDK reads it).
        name = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "aioengine"}
        self._provider = TracerProvider(resource=Resource.create(
            {**name, "service.version": aioengine.__version__}))
        # Spans are queued here and exported in batches by the processor's own thread
        # ($OTEL_BSP_SCHEDULE_DELAY etc. tune it), so the loop never waits on the network.
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("aioengine", aioengine.__version__)
        self._propagator = TraceContextTextMapPropagator()
        # monotonic -> epoch: the engine's times are time.monotonic(), spans want epoch ns.
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()
        self.endpoint, self.protocol = endpoint, protocol
        self._traces: dict[str, RequestTrace] = {}

    def begin(self, request_id: str, prepared: PreparedRequest, model: str) -> None:
        """A request is queued (under `request_id`; its samples' parent_id)."""
        received = prepared.received_time
        self._traces[request_id] = RequestTrace(
            request_id, model, prepared.operation,
            time.monotonic() if received is None else received,
            len(prepared.prompt_token_ids), request_parameters(prepared),
            prepared.trace_headers, prepared.grammar_compile)

    def observe_step(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                     start: float, end: float) -> None:
        """A step's results reached the loop (before the scheduler's update): each traced
        request in it gets a prefill chunk or a decode step. Requests that ended while it
        ran (their tokens are dropped) are left out."""
        for item in scheduler_output.scheduled:
            request = item.request
            trace = self._traces.get(request.parent_id or request.request_id)
            if trace is None or request.is_finished:
                continue
            observe_scheduled(trace, item, scheduler_output,
                              runner_output.sampled_token_ids.get(request.request_id),
                              start, end)

    def finish(self, request_id: str, outcome: RequestOutcome) -> None:
        """The request's last output was delivered: its spans are made and queued."""
        trace = self._traces.pop(request_id, None)
        if trace is not None:
            self.emit(trace, outcome)

    def emit(self, trace: RequestTrace, outcome: RequestOutcome) -> None:
        """The request span (a child of the caller's trace when its headers carry a valid
        traceparent; a malformed one is ignored: a new root) and its children."""
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

        parent = (self._propagator.extract(carrier=dict(trace.trace_headers))
                  if trace.trace_headers else None)
        span = self._tracer.start_span(
            REQUEST_SPAN, context=parent, kind=SpanKind.SERVER,
            start_time=self._ns(trace.received_time),
            attributes=request_attributes(trace, outcome))
        if outcome.error is not None:
            span.set_status(Status(StatusCode.ERROR, outcome.error))
        inside = set_span_in_context(span)
        for child in child_spans(trace):
            self._tracer.start_span(child.name, context=inside, start_time=self._ns(child.start),
                                    attributes=child.attributes).end(self._ns(child.end))
        span.end(self._ns(outcome.finish_time))

    def _ns(self, monotonic: float) -> int:
        return self._epoch_offset_ns + int(monotonic * 1e9)

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Exports what is queued now (blocking: call it off the loop)."""
        return self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Flushes and stops the exporter thread (blocking: call it off the loop)."""
        self._traces.clear()
        self._provider.shutdown()
