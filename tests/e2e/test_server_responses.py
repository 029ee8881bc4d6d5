"""POST /v1/responses, GET /v1/responses/{id} and cancel, through the real `openai`
client on the bundled model: plain, streamed (the event sequence, joined equal to the
non-streamed output), function tools, text.format, previous_response_id, background."""
from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}}
CITY = {"type": "object", "properties": {"city": {"type": "string"},
                                         "country": {"type": "string"}},
        "required": ["city", "country"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model(tool_client: openai.OpenAI) -> str:
    return tool_client.models.list().data[0].id


def test_plain_response(tool_client, model) -> None:
    r = tool_client.responses.create(model=model, input="What is the capital of France?",
                                     instructions="Answer in one sentence.",
                                     max_output_tokens=30, temperature=0)
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
    assert [item.type for item in r.output] == ["message"]
    assert r.output_text and r.output[0].role == "assistant"
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 30
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Answer in one sentence." and r.max_output_tokens == 30


def test_max_output_tokens_makes_it_incomplete(tool_client, model) -> None:
    r = tool_client.responses.create(model=model, input="Tell me a long story.",
                                     max_output_tokens=5, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5


def test_streamed_events_join_to_the_response(tool_client, model) -> None:
    kwargs = dict(model=model, input="Name three colors.", max_output_tokens=30,
                  temperature=0)
    # Both compared requests find the prompt in the prefix cache: with bf16 weights a
    # cached and an uncached prefill can round differently and change greedy tokens.
    tool_client.responses.create(**kwargs)
    want = tool_client.responses.create(**kwargs)
    events = list(tool_client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{want.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == want.output_text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == want.usage.output_tokens


def test_the_sdk_stream_helper_rebuilds_the_response(tool_client, model) -> None:
    """The SDK's `responses.stream()` helper reads the events to the end; each event carries
    the item as it was then (an added item is empty: the deltas fill it)."""
    kwargs = dict(model=model, input="Weather in Rome?", tools=[WEATHER],
                  tool_choice="required", parallel_tool_calls=False, temperature=0)
    with tool_client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert len(added) == 1 and added[0].arguments == "" and added[0].status == "in_progress"
    assert [o.type for o in final.output] == ["function_call"]
    assert final.output[0].arguments == deltas
    with tool_client.responses.stream(model=model, input="Say hi.", max_output_tokens=100,
                                      temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and final.output_text == text
    added = [e for e in events if e.type in ("response.output_item.added",
                                             "response.content_part.added")]
    assert added[0].item.content[0].text == "" and added[1].part.text == ""


def test_function_tool_call_and_its_result(tool_client, model) -> None:
    r = tool_client.responses.create(model=model, input="What is the weather in Paris?",
                                     tools=[WEATHER], tool_choice="required",
                                     parallel_tool_calls=False, temperature=0)
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # The tool's result as the next input, on top of the stored response.
    follow = tool_client.responses.create(
        model=model, previous_response_id=r.id, tools=[WEATHER], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "sunny, 21 C"}], max_output_tokens=20, temperature=0)
    assert follow.status in ("completed", "incomplete") and follow.output_text
    assert follow.previous_response_id == r.id
    assert follow.usage.input_tokens > r.usage.input_tokens - 150  # the history is there


def test_streamed_function_call_arguments(tool_client, model) -> None:
    kwargs = dict(model=model, input="Weather in Rome?", tools=[WEATHER],
                  tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    want = tool_client.responses.create(**kwargs).output[0]
    events = list(tool_client.responses.create(**kwargs, stream=True))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert len(added) == 1 and added[0].item.type == "function_call"
    assert added[0].item.name == "get_weather"
    args = "".join(e.delta for e in events
                   if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == want.arguments == done[0].arguments
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].arguments == args


def test_text_format_json_schema(tool_client, model) -> None:
    r = tool_client.responses.create(
        model=model, input="Give me a city and its country.", temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY,
                         "strict": True}})
    jsonschema.validate(json.loads(r.output_text), CITY)


def test_previous_response_id_continues_the_conversation(tool_client, model) -> None:
    first = tool_client.responses.create(model=model, input="My name is Ada.",
                                         max_output_tokens=20, temperature=0)
    second = tool_client.responses.create(model=model, input="What is my name?",
                                          previous_response_id=first.id,
                                          max_output_tokens=20, temperature=0)
    # The second prompt holds the first turn (its input and output) before the new input.
    assert second.usage.input_tokens >= first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's KV reused
    got = tool_client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text


def test_store_false_is_not_kept(tool_client, model) -> None:
    r = tool_client.responses.create(model=model, input="Hi", store=False,
                                     max_output_tokens=3)
    with pytest.raises(openai.NotFoundError):
        tool_client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        tool_client.responses.create(model=model, input="Hi", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"


def test_background_response_can_be_polled_and_cancelled(tool_client, model) -> None:
    r = tool_client.responses.create(model=model, input="Count to a thousand.",
                                     background=True, max_output_tokens=4000,
                                     extra_body={"ignore_eos": True})
    assert r.status in ("queued", "in_progress")
    deadline = time.monotonic() + 30
    while tool_client.responses.retrieve(r.id).usage is None and time.monotonic() < deadline:
        time.sleep(0.2)
        if tool_client.responses.retrieve(r.id).output:
            break
    cancelled = tool_client.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    assert tool_client.responses.retrieve(r.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="synchronous"):
        done = tool_client.responses.create(model=model, input="Hi", max_output_tokens=2)
        tool_client.responses.cancel(done.id)


@pytest.mark.parametrize("kwargs,param,match", [
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input", "unsupported type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "unsupported type"),
    ({"input": "hi", "tools": [{"type": "function", "parameters": {"type": "object"}}]},
     "tools", "needs a function name"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}},
     "tool_choice", "not in tools"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice", "needs at least one tool"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text", "text.format.type"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                         "schema": {"type": "object", "properties": {
                                             "a": {"type": 5}}}}}},
     "text", "invalid JSON schema"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input", "call_id"),
    ({"input": "hi", "background": True, "store": False}, "background", "stored")])
def test_bad_responses_requests_are_400s(tool_client, model, kwargs: dict, param: str,
                                         match: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        tool_client.responses.create(model=model, max_output_tokens=5, **kwargs)
    assert e.value.body["param"] == param and match in e.value.body["message"], e.value.body
