"""Tool calling through /v1/chat/completions with the real `openai` client on the bundled
model: forced calls always parse and validate, auto calls are read back by the parser,
streaming deltas join to the non-streamed call, and every bad tool setting is a 400."""
from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from server_process import ServerProcess, openai_client, serving

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                   "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def model(tool_client: openai.OpenAI) -> str:
    return tool_client.models.list().data[0].id


def check_calls(message, finish_reason: str) -> list:
    """Every call names an offered function and its arguments validate."""
    assert finish_reason == "tool_calls" and message.tool_calls
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)
    return message.tool_calls


def joined_stream(stream) -> tuple[dict[int, dict], str | None]:
    """Tool-call deltas of one choice joined: index -> {id, name, arguments}."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:  # the first delta of a call carries id and name
                assert d.id and d.function.name and d.type == "function"
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and not d.function.name
            calls[d.index]["arguments"] += d.function.arguments or ""
        if choice.finish_reason is not None:
            assert finish is None
            finish = choice.finish_reason
    return calls, finish


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_named_call_is_that_function_with_valid_arguments(tool_client, model,
                                                          temperature: float) -> None:
    for seed in range(3):
        r = tool_client.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=60,
            temperature=temperature, seed=seed)
        calls = check_calls(r.choices[0].message, r.choices[0].finish_reason)
        assert [c.function.name for c in calls] == ["get_weather"]
        assert r.choices[0].message.content is None
        assert r.usage.completion_tokens > 0


def test_required_calls_offered_functions(tool_client, model) -> None:
    r = tool_client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                            tool_choice="required", max_tokens=120,
                                            temperature=1.0, seed=1, n=3)
    for choice in r.choices:
        calls = choice.message.tool_calls
        assert calls and choice.message.content is None
        assert {c.function.name for c in calls} <= set(SCHEMAS)
        # The tiny model may repeat calls until max_tokens: then only the last is cut short.
        whole = calls if choice.finish_reason == "tool_calls" else calls[:-1]
        assert choice.finish_reason in ("tool_calls", "length")
        for call in whole:
            jsonschema.validate(json.loads(call.function.arguments),
                                SCHEMAS[call.function.name])


def test_parallel_tool_calls_false_gives_one_call(tool_client, model) -> None:
    r = tool_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Paris and time in UTC?"}],
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=120,
        temperature=1.0, seed=3, n=4)
    for choice in r.choices:
        assert len(check_calls(choice.message, choice.finish_reason)) == 1


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_streamed_call_joins_to_the_non_streamed_one(tool_client, model, tool_choice) -> None:
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                  max_tokens=120, temperature=0)
    r = tool_client.chat.completions.create(**kwargs)
    want = check_calls(r.choices[0].message, r.choices[0].finish_reason)
    calls, finish = joined_stream(tool_client.chat.completions.create(**kwargs, stream=True))
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in want]


def test_streaming_n_choices_each_get_their_calls(tool_client, model) -> None:
    stream = tool_client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120,
        parallel_tool_calls=False, temperature=1.0, seed=5, n=2, stream=True)
    per_choice: dict[int, dict[int, dict]] = {0: {}, 1: {}}
    finishes: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                call = per_choice[choice.index].setdefault(
                    d.index, {"name": d.function.name, "arguments": ""})
                call["arguments"] += d.function.arguments or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "tool_calls", 1: "tool_calls"}
    for calls in per_choice.values():
        assert calls
        for call in calls.values():
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_second_turn_with_the_tool_result(tool_client, model) -> None:
    r = tool_client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                            tool_choice=NAMED, max_tokens=60, temperature=0)
    call = check_calls(r.choices[0].message, r.choices[0].finish_reason)[0]
    history = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    follow = tool_client.chat.completions.create(model=model, messages=history, tools=TOOLS,
                                                 tool_choice="none", max_tokens=30,
                                                 temperature=0)
    assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls
    # The call and its result are in the prompt (with "none" the tools are not).
    alone = tool_client.chat.completions.create(model=model, messages=ASK, max_tokens=1)
    assert follow.usage.prompt_tokens > alone.usage.prompt_tokens + 20


def test_auto_may_answer_in_text(tool_client, model) -> None:
    r = tool_client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                            max_tokens=40, temperature=0)
    choice = r.choices[0]
    if choice.message.tool_calls:
        check_calls(choice.message, choice.finish_reason)
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


def error_of(client: openai.OpenAI, **kwargs) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"messages": ASK, "max_tokens": 5, **kwargs})
    assert e.value.status_code == 400
    return e.value.body


@pytest.mark.parametrize("kwargs,param,match", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools",
     "needs a function name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}]}, "tools", "object schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": 7}}}}}]}, "tools",
     "not a valid JSON schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs at least one tool"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be 'none'"),
    ({"tools": TOOLS, "extra_body": {"structured_outputs": {"regex": "a+"}}},
     "structured_outputs", "can only be a JSON schema"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}, "messages",
     "function.name")])
def test_bad_tool_requests_are_400s(tool_client, model, kwargs: dict, param: str,
                                    match: str) -> None:
    body = error_of(tool_client, model=model, **kwargs)
    assert body["param"] == param and match in body["message"], body
    assert body["type"] == "invalid_request_error"


# ---- auto calls in the llama3_json format (the bundled model's own habit: bare JSON) ----

@pytest.fixture(scope="module")
def llama3_server() -> Iterator[ServerProcess]:
    yield from serving("--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")


def test_auto_calls_are_parsed_and_constrained(llama3_server: ServerProcess) -> None:
    client = openai_client(llama3_server)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Call get_weather for Paris in celsius."}]
    r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                       max_tokens=60, temperature=0)
    calls = check_calls(r.choices[0].message, r.choices[0].finish_reason)
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments)["city"] == "Paris"
    streamed, finish = joined_stream(client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, max_tokens=60, temperature=0,
        stream=True))
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
        (c.function.name, c.function.arguments) for c in calls]


def test_tokenize_renders_messages_as_chat_does(tool_server, tool_client, model) -> None:
    """/tokenize with tools counts the default tool prompt, as the chat request's usage."""
    status, raw = tool_server.request("POST", "/tokenize", {
        "model": model, "messages": ASK, "tools": TOOLS, "tool_choice": "required"})
    assert status == 200
    r = tool_client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                            tool_choice="required", max_tokens=60,
                                            temperature=0)
    assert json.loads(raw)["count"] == r.usage.prompt_tokens
    status, raw = tool_server.request("POST", "/tokenize", {"model": model, "messages": ASK})
    assert json.loads(raw)["count"] < r.usage.prompt_tokens - 50


@pytest.mark.parametrize("max_tokens", [4, 12, 40])
def test_a_forced_call_cut_by_max_tokens_leaves_no_markup(tool_client, model,
                                                          max_tokens: int) -> None:
    """Only calls may be written: the start of a call cut short is never content."""
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                  max_tokens=max_tokens, temperature=0)
    r = tool_client.chat.completions.create(**kwargs)
    assert r.choices[0].message.content is None
    assert r.choices[0].finish_reason in ("length", "tool_calls")
    for chunk in tool_client.chat.completions.create(**kwargs, stream=True):
        assert not (chunk.choices and chunk.choices[0].delta.content)
