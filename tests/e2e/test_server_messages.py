"""POST /v1/messages and /v1/messages/count_tokens with the real `anthropic` SDK against a
real server on the bundled model (with --api-key: the SDK sends x-api-key): messages in
every content form, a stream read with the SDK's helpers (events in Anthropic's order, the
same text as the non-streamed answer), stop reasons, a tool round trip, and every error as
the SDK's typed exception."""
from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import jsonschema
import orjson
import pytest
from conftest import TOOL_SERVER_ARGS
from server_process import API_KEY, ServerProcess, openai_client, serving, start_server

pytestmark = pytest.mark.slow

WEATHER = {"name": "get_weather", "description": "Get the current weather of a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"]}}
TIME = {"name": "get_time", "description": "The current time in a time zone",
        "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}},
                         "required": ["zone"]}}
SCHEMAS = {t["name"]: t["input_schema"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# The SDK no longer takes sampling fields as arguments; the API still does.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from serving(*TOOL_SERVER_ARGS, "--api-key", API_KEY)


def anthropic_client(server: ServerProcess, **auth: str) -> anthropic.Anthropic:
    """The real SDK on the server, without retries (a failure must show)."""
    auth = auth or {"api_key": API_KEY}
    return anthropic.Anthropic(base_url=server.url, max_retries=0, timeout=120, **auth)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic_client(server)


@pytest.fixture(scope="module")
def model(server: ServerProcess) -> str:
    return server.model


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_plain_message_string_and_block_content_agree(client, model) -> None:
    plain = client.messages.create(model=model, max_tokens=20, extra_body=GREEDY,
                                   system="You are brief.",
                                   messages=[{"role": "user", "content": "Say hello."}])
    blocks = client.messages.create(
        model=model, max_tokens=20, extra_body=GREEDY,
        system=[{"type": "text", "text": "You are brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}])
    assert plain.type == "message" and plain.role == "assistant" and plain.model == model
    assert plain.id.startswith("msg_")
    assert [b.type for b in plain.content] == ["text"] and text_of(plain)
    assert text_of(plain) == text_of(blocks)
    assert plain.stop_reason in ("end_turn", "max_tokens")
    assert plain.usage.input_tokens > 0 and 0 < plain.usage.output_tokens <= 20
    assert plain.usage.input_tokens == blocks.usage.input_tokens


def test_same_answer_as_chat_completions(server, client, model) -> None:
    """The translation's prompt and sampling are chat's: the same greedy answer."""
    message = client.messages.create(model=model, max_tokens=24, extra_body=GREEDY, system="Hi.",
                                     messages=[{"role": "user", "content": "Name a color."}])
    chat = openai_client(server, API_KEY).chat.completions.create(
        model=model, max_tokens=24, extra_body=GREEDY,
        messages=[{"role": "system", "content": "Hi."},
                  {"role": "user", "content": "Name a color."}])
    assert text_of(message) == chat.choices[0].message.content
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens


def test_stream_events_in_order_and_text_equals_the_answer(client, model) -> None:
    kwargs = dict(model=model, max_tokens=32, extra_body=GREEDY,
                  messages=[{"role": "user", "content": "Tell me about Paris."}])
    want = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    names = [e.type for e in events if e.type in (
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop")]
    assert names[0] == "message_start" and names[1] == "content_block_start"
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert "".join(deltas) == text_of(want) == text_of(final)
    assert final.stop_reason == want.stop_reason
    assert final.usage.output_tokens == want.usage.output_tokens
    assert final.usage.input_tokens == want.usage.input_tokens


def test_raw_stream_has_event_lines_and_a_ping(server, model) -> None:
    status, raw = server.request("POST", "/v1/messages", {
        "model": model, "max_tokens": 4, "stream": True,
        "messages": [{"role": "user", "content": "Hi"}]}, headers={"x-api-key": API_KEY})
    assert status == 200
    frames = [f for f in raw.decode().split("\n\n") if f]
    names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    for frame in frames:  # every data payload's type is its event's name
        head, data = frame.split("\n")
        assert orjson.loads(data.removeprefix("data: "))["type"] == head.removeprefix("event: ")
    assert "[DONE]" not in raw.decode()


def test_max_tokens_and_stop_sequence_stop_reasons(client, model) -> None:
    cut = client.messages.create(model=model, max_tokens=3, extra_body=GREEDY,
                                 messages=[{"role": "user", "content": "Count to ten."}])
    assert cut.stop_reason == "max_tokens" and cut.stop_sequence is None
    assert cut.usage.output_tokens == 3
    full = client.messages.create(model=model, max_tokens=40, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": "Count to ten."}])
    text = text_of(full)
    word = next(w for w in text.split()[1:] if w.strip())  # a stop string it will write
    stopped = client.messages.create(model=model, max_tokens=40, extra_body=GREEDY,
                                     stop_sequences=[word],
                                     messages=[{"role": "user", "content": "Count to ten."}])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert text.startswith(text_of(stopped)) and word not in text_of(stopped)


def check_tool_use(message, names=frozenset(SCHEMAS)) -> list:
    """Every tool_use block names an offered tool and its input validates."""
    uses = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and uses
    for use in uses:
        assert use.id.startswith("toolu_") and use.name in names
        jsonschema.validate(use.input, SCHEMAS[use.name])
    return uses


def test_forced_tool_round_trip(client, model) -> None:
    first = client.messages.create(model=model, max_tokens=60, extra_body=GREEDY, messages=ASK,
                                   tools=[WEATHER, TIME],
                                   tool_choice={"type": "tool", "name": "get_weather"})
    [use] = check_tool_use(first, {"get_weather"})
    assert [b.type for b in first.content] == ["tool_use"]
    answer = client.messages.create(
        model=model, max_tokens=30, extra_body=GREEDY, tools=[WEATHER, TIME],
        messages=[*ASK, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "18 degrees and sunny"}]}])
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    errored = client.messages.count_tokens(
        model=model, tools=[WEATHER],
        messages=[*ASK, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "18 degrees", "is_error": True}]}])
    assert errored.input_tokens > 0


def test_any_and_a_streamed_forced_call(client, model) -> None:
    kwargs = dict(model=model, max_tokens=80, extra_body=GREEDY, messages=ASK,
                  tools=[WEATHER, TIME], tool_choice={"type": "any",
                                                      "disable_parallel_tool_use": True})
    message = client.messages.create(**kwargs)
    [use] = check_tool_use(message)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta")
    assert json.loads(partial) == use.input
    [streamed] = check_tool_use(final)
    assert (streamed.name, streamed.input) == (use.name, use.input)


def test_auto_tool_choice_is_accepted(client, model) -> None:
    message = client.messages.create(model=model, max_tokens=60, extra_body=GREEDY, messages=ASK,
                                     tools=[WEATHER], tool_choice={"type": "auto"})
    assert message.content
    if message.stop_reason == "tool_use":
        check_tool_use(message)


def test_output_config_format_constrains_the_answer(client, model) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    message = client.messages.create(
        model=model, max_tokens=40, extra_body=GREEDY, messages=ASK,
        output_config={"format": {"type": "json_schema", "schema": schema}})
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(text_of(message)), schema)


def test_count_tokens_is_the_prompt_of_the_message(client, model) -> None:
    kwargs = dict(model=model, system="Be brief.",
                  messages=[{"role": "user", "content": "Say hello."}])
    counted = client.messages.count_tokens(**kwargs)
    sent = client.messages.create(**kwargs, max_tokens=1)
    assert counted.input_tokens == sent.usage.input_tokens > 0
    with_tools = client.messages.count_tokens(**kwargs, tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens


def test_errors_are_the_sdks_typed_exceptions(server, client, model) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=5, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic_client(server, api_key="wrong").messages.create(
            model=model, max_tokens=5, messages=ASK)
    assert e.value.body == {"type": "error", "error": {
        "type": "authentication_error", "message": "Incorrect API key provided."}}
    bearer = anthropic_client(server, auth_token=API_KEY)  # Authorization: Bearer works too
    assert bearer.messages.create(model=model, max_tokens=2, messages=ASK).content
    bad_requests = [
        dict(messages=[{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]),
        dict(messages=ASK, tools=[{"name": "f"}]),  # no input_schema
        dict(messages=ASK, tools=[{"name": "f", "input_schema": {"type": "string"}}]),
        dict(messages=ASK, tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}),
        dict(messages=ASK, extra_body={"temperature": "hot"}),
        dict(messages=[{"role": "user", "content": "word " * 10000}]),  # over the context
    ]
    for fields in bad_requests:
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model=model, max_tokens=5, **fields)
        assert e.value.body["type"] == "error"
        assert e.value.body["error"]["type"] == "invalid_request_error"
        assert e.value.body["error"]["message"]


@pytest.mark.parametrize("raw,words", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}',
     "max_tokens is required"),
    (b'{"model": "m", "max_tokens": 5, "messages": []}', "non-empty"),
])
def test_raw_bodies_get_anthropic_400s(server, model, raw, words) -> None:
    raw = raw.replace(b'"m"', orjson.dumps(model))
    status, body = server.request("POST", "/v1/messages", raw, headers={"x-api-key": API_KEY})
    assert status == 400, body
    error = orjson.loads(body)
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"]


def test_no_key_and_wrong_method_in_anthropic_shape(server) -> None:
    status, body = server.request("POST", "/v1/messages/count_tokens", {"model": "x"})
    assert status == 401
    assert orjson.loads(body)["error"]["type"] == "authentication_error"
    status, body = server.request("GET", "/v1/messages", headers={"x-api-key": API_KEY})
    assert status == 405 and orjson.loads(body)["type"] == "error"
    # Other routes keep OpenAI's shape.
    status, body = server.request("POST", "/v1/chat/completions", {"model": "x"})
    assert status == 401 and orjson.loads(body)["error"]["code"] == "invalid_api_key"


def test_server_is_idle_after_the_module(server) -> None:
    metrics = server.wait_idle()
    assert metrics["aioengine:kv_cache_usage_perc"] == 0


@pytest.fixture(scope="module")
def fault_server() -> Iterator[ServerProcess]:
    # Not `serving()`: injected failures are logged as errors, on purpose.
    srv = start_server(env={"AIOENGINE_FAULT_INJECTION": "1"})
    yield srv
    assert srv.stop() == 0


def test_engine_failure_mid_stream_is_an_error_event(fault_server) -> None:
    client = anthropic_client(fault_server, api_key="unused")
    long_ask = [{"role": "user", "content": "Write a long story about the sea."}]
    with client.messages.stream(model=fault_server.model, max_tokens=200,
                                messages=long_ask) as stream:
        events = iter(stream)
        assert next(events).type == "message_start"  # the stream has begun
        status, body = fault_server.request("POST", "/debug/faults", {"kind": "forward"})
        assert status == 200, body
        with pytest.raises(anthropic.APIStatusError, match="injected forward failure") as e:
            for _ in events:
                pass
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "api_error"
    fault_server.request("POST", "/debug/faults", {"kind": "forward"})
    with pytest.raises(anthropic.InternalServerError) as e:
        client.messages.create(model=fault_server.model, max_tokens=20, messages=long_ask)
    assert e.value.status_code == 500 and e.value.body["error"]["type"] == "api_error"
    assert fault_server.wait_idle()["aioengine:kv_cache_usage_perc"] == 0


def test_count_tokens_with_tools_on_a_server_without_auto_tool_choice(fault_server) -> None:
    client = anthropic_client(fault_server, api_key="unused")
    kwargs = dict(model=fault_server.model, messages=ASK, tools=[WEATHER])
    counted = client.messages.count_tokens(**kwargs)
    with pytest.raises(anthropic.BadRequestError, match="enable-auto-tool-choice"):
        client.messages.create(**kwargs, max_tokens=5)
    forced = client.messages.create(**kwargs, max_tokens=1, tool_choice={"type": "any"})
    assert counted.input_tokens == forced.usage.input_tokens
