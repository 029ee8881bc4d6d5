"""Request traces (issue 54) from a real `aioengine serve --otlp-traces-endpoint` to a real
OTLP/HTTP receiver in this process (tests/otlp_receiver.py): one `llm_request` span per
request with its children and the GenAI attributes, checked against the API's own answer;
a client's `traceparent` continued on the OpenAI and Anthropic routes, a malformed one
ignored; a grammar-compile span; and a server without the flag never imports
opentelemetry."""
from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

from server_process import MODEL, ServerProcess, openai_client, serving  # noqa: E402

from tests.otlp_receiver import OtlpReceiver, attributes  # noqa: E402

pytestmark = pytest.mark.slow

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
# Each server writes its imports to its log (python -X importtime), so the test can see
# which modules it loaded.
IMPORT_LOG = {"PYTHONPROFILEIMPORTTIME": "1"}


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    rx = OtlpReceiver().start()
    yield rx
    rx.stop()


@pytest.fixture(scope="module")
def server(receiver: OtlpReceiver) -> Iterator[ServerProcess]:
    # Export every 50 ms instead of the SDK's 5 s, so spans arrive while the test waits.
    yield from serving("--otlp-traces-endpoint", receiver.url,
                       env={"OTEL_BSP_SCHEDULE_DELAY": "50", **IMPORT_LOG})


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server)


def _request_span(receiver: OtlpReceiver, response_id: str):
    """The one request span of the engine request `response_id`-0 (one prompt)."""
    spans = receiver.wait_for(lambda s: s.name == "llm_request" and attributes(s).get(
        "gen_ai.response.id") == f"{response_id}-0")
    assert len(spans) == 1, spans
    return spans[0]


def _check_children_inside(receiver: OtlpReceiver, span) -> list:
    children = receiver.children(span)
    for child in children:
        assert span.start_time_unix_nano <= child.start_time_unix_nano
        assert child.start_time_unix_nano <= child.end_time_unix_nano <= span.end_time_unix_nano
    return children


def test_request_span_children_and_attributes(client: openai.OpenAI,
                                              receiver: OtlpReceiver) -> None:
    """A 300-token prompt in chunks of at most 128 (a quarter of the 512-token step):
    three prefill chunks, then one decode span of the other 11 tokens' steps."""
    prompt = " ".join(f"w{i}" for i in range(150))
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                    temperature=0.7, top_p=0.9,
                                    extra_body={"ignore_eos": True})
    usage = out.usage
    span = _request_span(receiver, out.id)
    attrs = attributes(span)
    assert attrs["gen_ai.system"] == "aioengine"
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.model"] == MODEL == attrs["gen_ai.response.model"]
    assert attrs["gen_ai.usage.input_tokens"] == usage.prompt_tokens > 256
    assert attrs["gen_ai.usage.output_tokens"] == usage.completion_tokens == 12
    assert attrs["gen_ai.request.max_tokens"] == 12
    assert attrs["gen_ai.request.temperature"] == pytest.approx(0.7)
    assert attrs["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    latency = {k.removeprefix("gen_ai.latency."): v for k, v in attrs.items()
               if k.startswith("gen_ai.latency.")}
    assert set(latency) == {"time_in_queue", "time_to_first_token", "e2e",
                            "time_in_model_prefill", "time_in_model_decode"}
    assert 0 <= latency["time_in_queue"] < latency["time_to_first_token"] < latency["e2e"]
    assert latency["time_in_model_decode"] > 0
    assert span.parent_span_id == b""  # no traceparent: a root
    children = _check_children_inside(receiver, span)
    names = [c.name for c in children]
    assert names == ["prefill_chunk"] * (len(names) - 1) + ["decode"] and len(names) >= 4
    chunks = [attributes(c) for c in children[:-1]]
    cached = usage.prompt_tokens_details.cached_tokens
    assert sum(c["aioengine.prefill.num_tokens"] for c in chunks) == usage.prompt_tokens - cached
    assert [c["aioengine.prefill.chunk_index"] for c in chunks] == list(range(len(chunks)))
    assert all(c["aioengine.prefill.num_tokens"] <= 128 for c in chunks)
    decode = attributes(children[-1])
    # The first token comes from the last prefill chunk; each other from one decode step
    # or, kept, from a draft one verified (speculation is on by default).
    assert (decode["aioengine.decode.num_steps"]
            + decode["aioengine.spec_decode.num_accepted_tokens"]) == usage.completion_tokens - 1
    assert (0 <= decode["aioengine.spec_decode.num_accepted_tokens"]
            <= decode["aioengine.spec_decode.num_draft_tokens"])


def test_traceparent_is_the_parent_on_chat(client: openai.OpenAI,
                                           receiver: OtlpReceiver) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=5,
        extra_headers={"traceparent": TRACEPARENT})
    span = _request_span(receiver, out.id)
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    attrs = attributes(span)
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.usage.output_tokens"] == out.usage.completion_tokens
    assert attrs["gen_ai.response.finish_reasons"] == [out.choices[0].finish_reason]
    assert all(c.trace_id.hex() == TRACE_ID for c in receiver.children(span))


def test_traceparent_is_the_parent_on_messages(server: ServerProcess,
                                               receiver: OtlpReceiver) -> None:
    """Anthropic's /v1/messages, streamed, continues the client's trace too."""
    status, raw = server.request("POST", "/v1/messages", {
        "model": MODEL, "max_tokens": 4, "stream": True,
        "messages": [{"role": "user", "content": "Say hi."}]},
        headers={"traceparent": TRACEPARENT.replace(PARENT_ID, "1111111111111111")})
    assert status == 200, raw
    start = next(json.loads(line[6:]) for line in raw.decode().splitlines()
                 if line.startswith("data: ") and '"message_start"' in line)
    span = _request_span(receiver, start["message"]["id"])
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == "1111111111111111"


def test_malformed_traceparent_starts_a_new_trace(client: openai.OpenAI,
                                                  receiver: OtlpReceiver) -> None:
    for header in ("00-xyz", f"00-{'0' * 32}-{PARENT_ID}-01", "garbage" * 100):
        out = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=2,
                                        extra_headers={"traceparent": header})
        span = _request_span(receiver, out.id)
        assert span.parent_span_id == b"" and span.trace_id.hex() != "0" * 32


def test_json_schema_request_has_a_grammar_compile_span(client: openai.OpenAI,
                                                        receiver: OtlpReceiver) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A number as JSON."}],
        max_tokens=20, temperature=0, response_format={
            "type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    json.loads(out.choices[0].message.content)
    span = _request_span(receiver, out.id)
    children = _check_children_inside(receiver, span)
    assert children[0].name == "grammar_compile"
    assert children[0].end_time_unix_nano <= children[1].start_time_unix_nano
    assert "prefill_chunk" in {c.name for c in children[1:]}


def test_opentelemetry_is_imported_only_with_the_flag(server: ServerProcess) -> None:
    """The traced server's import log names the SDK; one without the flag, after serving a
    request, never imported any opentelemetry module."""
    assert any("opentelemetry.sdk.trace" in line for line in server.log)
    plain = next(serving(env=IMPORT_LOG))
    try:
        out = openai_client(plain).completions.create(model=MODEL, prompt="Hi", max_tokens=3)
        assert out.usage.completion_tokens == 3
        assert plain.request("GET", "/metrics")[0] == 200
    finally:
        plain.stop_cleanly()
    # The log does list imports: the tracer's own module (it imports nothing of the SDK).
    assert any(line.endswith("aioengine.tracing\n") for line in plain.log)
    assert not [line for line in plain.log if "opentelemetry" in line]
