"""Structured output through a real `aioengine serve` process and the `openai` client:
response_format, vLLM's structured_outputs object and guided_* fields, streaming with
n > 1, and a 400 (never a 500, never a stuck request) for every invalid constraint."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import orjson
import pytest
from server_process import MODEL, ServerProcess

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 30},
    "colors": {"type": "array", "items": {"enum": ["black", "white", "orange"]},
               "maxItems": 2}},
    "required": ["name", "age", "colors"]}
CAT = [{"role": "user", "content": "Describe a cat as JSON."}]
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "cat", "schema": SCHEMA, "strict": True}}


def test_chat_json_schema(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=CAT, temperature=0,
                                         max_tokens=60, response_format=RESPONSE_FORMAT)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)


def test_chat_stream_n2_seeded_json_schema(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=CAT, temperature=1.0, seed=3, n=2, max_tokens=60,
                  response_format=RESPONSE_FORMAT)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == [c.message.content for c in sorted(full.choices, key=lambda c: c.index)]
    for text in streamed:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_chat_json_object(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=80, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'A JSON object with keys "name" and "age".'}])
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_completions_guided_fields_and_structured_outputs(client: openai.OpenAI) -> None:
    regex = r"[0-9]{3}-[0-9]{4}"
    out = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=20,
                                    temperature=1.0, seed=1, n=3,
                                    extra_body={"guided_regex": regex})
    assert all(re.fullmatch(regex, c.text) and c.finish_reason == "stop" for c in out.choices)
    choices = ["red", "green", "blue"]
    out = client.completions.create(model=MODEL, prompt="My favourite color is", max_tokens=5,
                                    temperature=0, extra_body={"guided_choice": choices})
    assert out.choices[0].text in choices
    out = client.chat.completions.create(
        model=MODEL, messages=CAT, max_tokens=10, temperature=0,
        extra_body={"structured_outputs": {"grammar": 'root ::= "cat" | "dog"'}})
    assert out.choices[0].message.content in ("cat", "dog")
    out = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=60, temperature=0,
                                    extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)


@pytest.mark.parametrize("path,fields,param,match", [
    ("/v1/chat/completions",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                  "schema": {"type": 5}}}},
     "response_format", "invalid JSON schema"),
    ("/v1/completions", {"structured_outputs": {"regex": "(ab"}}, "structured_outputs",
     "invalid regex"),
    ("/v1/completions", {"guided_grammar": "root ::= nowhere"}, "guided_grammar",
     "invalid grammar"),
    ("/v1/chat/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice",
     "one output constraint"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format",
     "must be 'text'"),
    ("/v1/completions", {"guided_json": "{not json", "stream": True}, "guided_json",
     "not valid JSON"),
    ("/v1/chat/completions", {"guided_regex": "[", "stream": True}, "guided_regex",
     "invalid regex"),
])
def test_invalid_constraints_are_400s(server: ServerProcess, path: str, fields: dict,
                                      param: str, match: str) -> None:
    body = {"model": MODEL, "max_tokens": 5, **fields}
    body.update({"messages": CAT} if "chat" in path else {"prompt": "Hi"})
    status, raw = server.request("POST", path, body)
    error = orjson.loads(raw)["error"]
    assert status == 400 and error["param"] == param, error
    assert re.search(match, error["message"]), error["message"]


def test_server_is_idle_and_healthy_after_errors(client: openai.OpenAI,
                                                 server: ServerProcess) -> None:
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0,
                                    extra_body={"guided_regex": "(ab)+"})
    assert re.fullmatch("(ab)+", out.choices[0].text)
    metrics = server.wait_idle()
    assert metrics["aioengine:num_requests_running"] == 0
