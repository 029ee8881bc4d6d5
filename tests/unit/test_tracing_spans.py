"""aioengine/tracing.py on its own: what a request's spans are made of (plain functions over
real Requests and ScheduledRequests), the spans the real SDK exports to a real OTLP/HTTP
receiver and to a real gRPC one, the endpoint checks, and the extra in the lock. The
engine and server side is tests/e2e/test_tracing.py."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import pytest

from aioengine.config import ConfigError, EngineArgs
from aioengine.request import Request
from aioengine.sampling_params import SamplingParams
from aioengine.sched.scheduler_output import ScheduledRequest, SchedulerOutput
from aioengine.tracing import (DecodePhase, PrefillChunk, RequestOutcome, RequestTrace,
                               child_spans, http_traces_url, observe_scheduled,
                               request_attributes)

ROOT = Path(__file__).parents[2]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def _trace(**kw) -> RequestTrace:
    base = dict(request_id="cmpl-1-0", model="m", operation="chat", received_time=10.0,
                num_prompt_tokens=300,
                request_attributes={"gen_ai.request.max_tokens": 8,
                                    "gen_ai.request.temperature": 0.5})
    return RequestTrace(**{**base, **kw})


def _outcome(**kw) -> RequestOutcome:
    base = dict(finish_time=11.0, arrival_time=10.25, first_scheduled_time=10.5,
                first_token_time=10.75, last_token_time=10.9, num_output_tokens=8,
                num_cached_tokens=16, num_preemptions=0, finish_reasons=["length"])
    return RequestOutcome(**{**base, **kw})


def test_request_attributes_are_genai_and_vllm_latencies() -> None:
    attrs = request_attributes(_trace(), _outcome())
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == "m"
    assert attrs["gen_ai.response.id"] == "cmpl-1-0"
    assert (attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"]) == (300, 8)
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert attrs["gen_ai.request.temperature"] == 0.5
    assert attrs["aioengine.usage.cached_tokens"] == 16
    assert attrs["gen_ai.latency.time_in_queue"] == pytest.approx(0.25)
    assert attrs["gen_ai.latency.time_to_first_token"] == pytest.approx(0.5)
    assert attrs["gen_ai.latency.time_in_model_prefill"] == pytest.approx(0.25)
    assert attrs["gen_ai.latency.time_in_model_decode"] == pytest.approx(0.15)
    assert attrs["gen_ai.latency.e2e"] == pytest.approx(0.75)
    assert "error.type" not in attrs
    # Never scheduled (aborted while queued): no latency it did not have.
    aborted = request_attributes(_trace(), _outcome(
        first_scheduled_time=None, first_token_time=None, last_token_time=None,
        num_output_tokens=0, finish_reasons=["abort"]))
    assert not {"gen_ai.latency.time_in_queue", "gen_ai.latency.time_to_first_token",
                "gen_ai.latency.time_in_model_decode"} & set(aborted)
    failed = request_attributes(_trace(), _outcome(error="RuntimeError: boom"))
    assert failed["error.type"] == "RuntimeError"


def _scheduled(request: Request, computed: int, n: int, drafts: int = 0) -> ScheduledRequest:
    return ScheduledRequest(request, computed, [1] * n, [], num_samples=1,
                            spec_token_ids=[7] * drafts)


def test_steps_become_prefill_chunks_and_one_decode_phase() -> None:
    first = Request("r", [1] * 300, SamplingParams(max_tokens=8), parent_id="r")
    fork = Request("r#1", [1] * 300, SamplingParams(max_tokens=8), parent_id="r",
                   sample_index=1)
    trace = _trace()
    chunks = [(0, 128), (128, 128), (256, 44)]
    for step, (computed, n) in enumerate(chunks):
        out = SchedulerOutput([_scheduled(first, computed, n)], n + 5, step_id=step)
        observe_scheduled(trace, out.scheduled[0], out, [3], step, step + 0.5)
    # Both samples in one step count as one decode step; drafts 3 of which 2 accepted.
    out = SchedulerOutput([_scheduled(first, 300, 4, drafts=3), _scheduled(fork, 300, 1)],
                          5, step_id=3)
    for item in out.scheduled:
        observe_scheduled(trace, item, out, [5, 6, 7] if item.request is first else [9],
                          3.0, 3.5)
    out = SchedulerOutput([_scheduled(first, 303, 1)], 1, step_id=4)
    observe_scheduled(trace, out.scheduled[0], out, [4], 4.0, 4.5)
    assert [(c.num_computed_tokens, c.num_tokens, c.step_tokens) for c in
            trace.prefill_chunks] == [(0, 128, 133), (128, 128, 133), (256, 44, 49)]
    assert trace.decode == DecodePhase(3.0, 4.5, num_steps=2, num_draft_tokens=3,
                                       num_accepted_tokens=2, last_step_id=4)
    spans = child_spans(trace)
    assert [s.name for s in spans] == ["prefill_chunk"] * 3 + ["decode"]
    assert [s.attributes["aioengine.prefill.chunk_index"] for s in spans[:3]] == [0, 1, 2]
    assert spans[3].attributes == {"aioengine.decode.num_steps": 2,
                                   "aioengine.spec_decode.num_draft_tokens": 3,
                                   "aioengine.spec_decode.num_accepted_tokens": 2}
    # A prompt chunk that ends the prompt and runs on into tokens already generated (the
    # recompute after a preemption) counts only its prompt tokens.
    recompute = _trace()
    out = SchedulerOutput([_scheduled(first, 256, 50)], 50, step_id=9)
    observe_scheduled(recompute, out.scheduled[0], out, [1], 0.0, 1.0)
    assert recompute.prefill_chunks[0].num_tokens == 44


def test_grammar_compile_is_the_first_child() -> None:
    trace = _trace(grammar_compile=(9.0, 9.5),
                   prefill_chunks=[PrefillChunk(10.0, 10.2, 300, 0, 300, 1)])
    assert [(s.name, s.start, s.end) for s in child_spans(trace)] == [
        ("grammar_compile", 9.0, 9.5), ("prefill_chunk", 10.0, 10.2)]


def test_http_traces_url() -> None:
    assert http_traces_url("http://h:4318") == "http://h:4318/v1/traces"
    assert http_traces_url("http://h:4318/") == "http://h:4318/v1/traces"
    assert http_traces_url("https://h/custom/path") == "https://h/custom/path"


def test_bad_endpoint_or_protocol_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for endpoint in ("localhost:4318", "ftp://h/v1/traces", "http://"):
        with pytest.raises(ConfigError, match="--otlp-traces-endpoint must be"):
            EngineArgs(otlp_traces_endpoint=endpoint).validate()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ConfigError, match="http/json"):
        EngineArgs(otlp_traces_endpoint="http://h:4318").validate()


def test_missing_sdk_stops_serve_before_the_model_loads() -> None:
    """Without the extra (opentelemetry made unimportable in a fresh process), `serve`
    exits 2 with an error naming the install command, before anything loads."""
    code = ("import sys; sys.modules['opentelemetry'] = None\n"
            "from aioengine.__main__ import main\n"
            "sys.argv = ['aioengine', 'serve', '--port', '0', '--otlp-traces-endpoint', "
            "'http://127.0.0.1:9/v1/traces']\n"
            "sys.exit(main())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'aioengine[tracing]'" in proc.stderr
    assert "engine ready" not in proc.stderr and "Traceback" not in proc.stderr


def test_the_lock_installs_the_tracing_extra() -> None:
    """`make test` installs requirements.lock: it must hold the extra, so the tracing tests
    run in CI instead of skipping."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["tracing"]
    locked = {line.split("==")[0].lower() for line in (ROOT / "requirements.lock")
              .read_text().splitlines() if "==" in line}
    assert {req.split(">")[0].split("=")[0].lower() for req in extra} <= locked


# ---- the real SDK and exporters --------------------------------------------------------

@pytest.fixture
def receiver() -> Iterator:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    from tests.otlp_receiver import OtlpReceiver

    rx = OtlpReceiver().start()
    yield rx
    rx.stop()


def _finished_trace(headers: dict[str, str] | None) -> RequestTrace:
    return _trace(trace_headers=headers, grammar_compile=(9.5, 9.75),
                  prefill_chunks=[PrefillChunk(10.5, 10.75, 284, 16, 290, 2)],
                  decode=DecodePhase(10.8, 10.9, num_steps=7, last_step_id=9))


def test_spans_reach_an_otlp_http_receiver(receiver) -> None:
    from aioengine.tracing import RequestTracer

    tracer = RequestTracer(receiver.url.removesuffix("/v1/traces"))  # the path is added
    tracer.emit(_finished_trace({"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}), _outcome())
    tracer.emit(_finished_trace({"traceparent": "00-not-a-trace-context"}), _outcome())
    tracer.emit(_finished_trace(None), _outcome(error="RuntimeError: boom"))
    tracer.shutdown()  # flushes
    requests = receiver.wait_for(lambda s: s.name == "llm_request", count=3)
    assert len(requests) == 3
    continued, malformed, plain = requests
    assert continued.trace_id.hex() == TRACE_ID and continued.parent_span_id.hex() == PARENT_ID
    assert continued.kind == continued.SPAN_KIND_SERVER
    for root in (malformed, plain):  # a malformed traceparent is ignored: a new root
        assert root.parent_span_id == b"" and root.trace_id.hex() != TRACE_ID
    assert plain.status.code == plain.status.STATUS_CODE_ERROR
    assert plain.status.message == "RuntimeError: boom"
    children = receiver.children(continued)
    assert [c.name for c in children] == ["grammar_compile", "prefill_chunk", "decode"]
    # The engine's monotonic times, kept apart exactly: spans start and end where it said.
    base = continued.start_time_unix_nano  # received_time 10.0
    offsets = [((c.start_time_unix_nano - base) / 1e9, (c.end_time_unix_nano - base) / 1e9)
               for c in children]
    assert offsets == [pytest.approx(p, abs=1e-6) for p in
                       [(-0.5, -0.25), (0.5, 0.75), (0.8, 0.9)]]
    assert (continued.end_time_unix_nano - base) / 1e9 == pytest.approx(1.0, abs=1e-6)
    assert receiver.resources[0]["service.name"] == "aioengine"


def test_spans_reach_an_otlp_grpc_receiver(monkeypatch: pytest.MonkeyPatch) -> None:
    """OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc: the gRPC exporter, to a real gRPC server."""
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc")
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    from aioengine.tracing import RequestTracer

    received = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 - gRPC's name
            received.extend(s for rs in request.resource_spans for ss in rs.scope_spans
                            for s in ss.spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
        tracer = RequestTracer(f"http://127.0.0.1:{port}")
        assert tracer.protocol == "grpc"
        tracer.emit(_finished_trace(None), _outcome())
        tracer.shutdown()
    finally:
        server.stop(None)
    assert sorted(s.name for s in received) == [
        "decode", "grammar_compile", "llm_request", "prefill_chunk"]


def test_llm_refuses_an_endpoint_it_would_not_use() -> None:
    """The synchronous LLM has no tracer: an endpoint is refused before anything loads."""
    from aioengine import LLM

    with pytest.raises(ConfigError, match="AsyncEngine"):
        LLM(otlp_traces_endpoint="http://127.0.0.1:4318")
