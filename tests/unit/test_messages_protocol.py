"""/v1/messages' translation (messages_protocol.py) and its output side (MessageBuilder):
an Anthropic body becomes the chat body the chat path serves, every mistake is a 400 naming
the Anthropic field, and the blocks a stream builds are the same at every split of the
output into deltas."""
from __future__ import annotations

import json

import pytest

from aioengine.server.messages_protocol import (anthropic_error_body, is_messages_path,
                                                messages_to_chat)
from aioengine.server.protocol import ApiError
from aioengine.server.serving_messages import MessageBuilder
from aioengine.server.tools import FunctionTool, ToolChoice, ToolPlan
from aioengine.tool_parsers import get_tool_parser

BASE = {"model": "m", "max_tokens": 16}
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


def chat(**fields) -> dict:
    return messages_to_chat({**BASE, **fields})


def bad(field: str, **fields) -> str:
    with pytest.raises(ApiError) as e:
        messages_to_chat({**BASE, **fields})
    assert e.value.status == 400 and e.value.param == field
    return e.value.message


def test_plain_message_and_sampling_fields() -> None:
    body = chat(messages=[{"role": "user", "content": "Hi"}], temperature=0.5, top_p=0.9,
                top_k=4, stop_sequences=["\n"], metadata={"user_id": "u1"}, stream=True)
    assert body["messages"] == [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert (body["max_tokens"], body["stream"], body["stop"]) == (16, True, ["\n"])
    assert (body["temperature"], body["top_p"], body["top_k"]) == (0.5, 0.9, 4)
    assert "chat_template_kwargs" not in body and "tools" not in body


@pytest.mark.parametrize("system", ["Be brief.", [{"type": "text", "text": "Be brief."}]])
def test_system_as_string_or_text_blocks(system) -> None:
    first = chat(system=system, messages=[{"role": "user", "content": "Hi"}])["messages"][0]
    assert first["role"] == "system"
    text = first["content"] if isinstance(first["content"], str) else \
        "".join(p["text"] for p in first["content"])
    assert text == "Be brief."


def test_tool_round_trip_becomes_tool_calls_and_tool_messages() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": ""},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "sunny"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom",
             "is_error": True},
            {"type": "text", "text": "Thanks"}]}]
    out = chat(messages=messages, tools=[WEATHER],
               tool_choice={"type": "tool", "name": "get_weather",
                            "disable_parallel_tool_use": True})["messages"]
    assistant = out[1]
    assert assistant["content"] == "Let me look."
    assert assistant["tool_calls"] == [{"id": "toolu_1", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]
    assert out[2:] == [{"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
                       {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"},
                       {"role": "user", "content": [{"type": "text", "text": "Thanks"}]}]


def test_tools_and_tool_choice() -> None:
    ask = [{"role": "user", "content": "x"}]
    body = chat(messages=ask, tools=[WEATHER], tool_choice={"type": "tool",
                                                            "name": "get_weather"})
    assert body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": WEATHER["input_schema"]}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["parallel_tool_calls"] is True
    for kind, want in (("auto", "auto"), ("any", "required"), ("none", "none")):
        assert chat(messages=ask, tools=[WEATHER],
                    tool_choice={"type": kind})["tool_choice"] == want
    assert "tool_choice" not in chat(messages=ask, tools=[WEATHER])
    assert chat(messages=ask, tools=[WEATHER], tool_choice={
        "type": "any", "disable_parallel_tool_use": True})["parallel_tool_calls"] is False


def test_thinking_becomes_enable_thinking() -> None:
    ask = [{"role": "user", "content": "x"}]
    on = chat(messages=ask, thinking={"type": "enabled", "budget_tokens": 1024})
    off = chat(messages=ask, thinking={"type": "disabled"})
    assert on["chat_template_kwargs"] == {"enable_thinking": True}
    assert off["chat_template_kwargs"] == {"enable_thinking": False}


def test_output_config_and_vllm_extras() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = chat(messages=[{"role": "user", "content": "x"}], seed=3, ignore_eos=True,
                output_config={"effort": "low", "format": {"type": "json_schema",
                                                           "schema": schema}})
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"schema": schema}}
    assert (body["seed"], body["ignore_eos"]) == (3, True)
    assert "output_config" in bad("output_config", messages=[{"role": "user", "content": "x"}],
                                  output_config={"format": {"type": "regex"}})
    adaptive = chat(messages=[{"role": "user", "content": "x"}], thinking={"type": "adaptive"})
    assert "chat_template_kwargs" not in adaptive


def test_count_only_needs_no_max_tokens() -> None:
    body = messages_to_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]},
                            count_only=True)
    assert "max_tokens" not in body and "stream" not in body


@pytest.mark.parametrize("field,fields,words", [
    ("max_tokens", {"max_tokens": None}, "max_tokens is required"),
    ("max_tokens", {"max_tokens": 0}, ">= 1"),
    ("max_tokens", {"max_tokens": "10"}, "integer"),
    ("model", {"model": None}, "model is required"),
    ("messages", {"messages": []}, "non-empty"),
    ("messages", {"messages": [{"role": "system", "content": "x"}]}, "'user' or 'assistant'"),
    ("messages", {"messages": [{"role": "user"}]}, "content is required"),
    ("messages", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA=="}}]}]}, "text-only"),
    ("messages", {"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}, "cannot hold"),
    ("messages", {"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": "x"}]}]}, "input must be"),
    ("messages", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "content": "x"}]}]}, "tool_use_id"),
    ("system", {"system": [{"type": "image"}]}, "text block"),
    ("tools", {"tools": [{"name": "f"}]}, "input_schema is required"),
    ("tools", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "not supported"),
    ("tool_choice", {"tool_choice": {"type": "any"}}, "needs at least one tool"),
    ("tool_choice", {"tool_choice": {"type": "sometimes"}, "tools": [WEATHER]},
     "'auto', 'any', 'tool' or 'none'"),
    ("thinking", {"thinking": {"type": "maybe"}}, "enabled"),
    ("stop_sequences", {"stop_sequences": "x"}, "list of non-empty strings"),
    ("metadata", {"metadata": "x"}, "object"),
])
def test_mistakes_are_400s_naming_the_field(field, fields, words) -> None:
    fields.setdefault("messages", [{"role": "user", "content": "x"}])
    assert words in bad(field, **fields)


def test_error_bodies_in_anthropic_shape() -> None:
    openai_body = {"error": {"message": "no", "type": "x", "param": None, "code": None}}
    for status, kind in ((400, "invalid_request_error"), (401, "authentication_error"),
                         (404, "not_found_error"), (413, "request_too_large"),
                         (503, "overloaded_error"), (500, "api_error")):
        assert anthropic_error_body(status, openai_body) == {
            "type": "error", "error": {"type": kind, "message": "no"}}
    assert is_messages_path("/v1/messages") and is_messages_path("/v1/messages/count_tokens")
    assert not is_messages_path("/v1/messagesx") and not is_messages_path("/v1/chat/completions")


def run(builder: MessageBuilder, deltas: list[str]) -> list[tuple[str, dict]]:
    events = []
    for i, delta in enumerate(deltas):
        events += builder.feed(delta, i == len(deltas) - 1)
    return events


def check_event_order(events: list[tuple[str, dict]], blocks: list[dict]) -> None:
    """Each block: a start, its deltas, a stop, at its index, one after the other."""
    index = -1
    open_ = False
    for name, payload in events:
        assert payload["type"] == name
        if name == "content_block_start":
            assert not open_ and payload["index"] == index + 1
            index, open_ = index + 1, True
        else:
            assert open_ and payload["index"] == index
            open_ = name != "content_block_stop"
    assert not open_ and index == len(blocks) - 1


def test_plain_text_is_one_text_block_at_every_split() -> None:
    text = "Hello there, world"
    for cut in range(len(text) + 1):
        builder = MessageBuilder(None, None)
        events = run(builder, [text[:cut], text[cut:]])
        assert builder.blocks == [{"type": "text", "text": text}]
        check_event_order(events, builder.blocks)
    builder = MessageBuilder(None, None)
    assert run(builder, [""]) and builder.blocks == [{"type": "text", "text": ""}]


def _hermes_plan(mode: str) -> ToolPlan:
    tool = FunctionTool("get_weather", WEATHER["input_schema"])
    name = "get_weather" if mode == "function" else None
    return ToolPlan([tool], ToolChoice(mode, name), get_tool_parser("hermes"))  # type: ignore[arg-type]


def test_tool_calls_become_tool_use_blocks_at_every_split() -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text = "Let me check." + call
    want = None
    for cut in range(len(text) + 1):
        builder = MessageBuilder(_hermes_plan("auto"), None)
        events = run(builder, [text[:cut], text[cut:]])
        blocks = [{k: v for k, v in b.items() if k != "id"} for b in builder.blocks]
        assert blocks == [{"type": "text", "text": "Let me check."},
                          {"type": "tool_use", "name": "get_weather",
                           "input": {"city": "Paris"}}]
        assert builder.blocks[1]["id"].startswith("toolu_") and builder.calls == 1
        check_event_order(events, builder.blocks)
        partial = "".join(p["delta"]["partial_json"] for n, p in events
                          if n == "content_block_delta" and p["index"] == 1)
        assert json.loads(partial) == {"city": "Paris"}
        want = want or blocks
    forced = MessageBuilder(_hermes_plan("function"), None)
    run(forced, [call])
    assert [b["type"] for b in forced.blocks] == ["tool_use"]


def test_reasoning_becomes_a_thinking_block_before_the_text() -> None:
    from aioengine.reasoning_parsers import get_reasoning_parser
    from thinking_models import thinking_tokenizer

    parser = get_reasoning_parser("deepseek_r1", thinking_tokenizer("deepseek_r1"))
    text = "I should greet.</think>Hello!"
    for cut in range(len(text) + 1):
        builder = MessageBuilder(None, parser.stream(True))
        events = run(builder, [text[:cut], text[cut:]])
        assert builder.blocks == [
            {"type": "thinking", "thinking": "I should greet.", "signature": ""},
            {"type": "text", "text": "Hello!"}]
        check_event_order(events, builder.blocks)
        kinds = {p["delta"]["type"] for n, p in events if n == "content_block_delta"}
        assert kinds == {"thinking_delta", "text_delta"}
