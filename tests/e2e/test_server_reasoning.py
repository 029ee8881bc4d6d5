"""--reasoning-parser with the real `openai` client against a real server on a tiny thinking
model (tests/thinking_models.py): the reasoning comes back as `reasoning_content`, apart
from the answer (streamed as its own delta field, joining to the non-streamed split), tool
calls and structured output apply to the answer only, the Responses API returns a
reasoning item, and `chat_template_kwargs` / `enable_thinking` reach the template.

The weights are random, so the reasoning is forced: with thinking closed by the prompt
(`enable_thinking: false`), a regex whose text holds the think tags; with thinking opened by
the prompt (`enable_thinking: true`), a logit bias on `</think>` ends it at once, and the
grammar (a schema, a forced call) must still hold for the answer after it."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from server_process import ServerProcess, openai_client, serving

from thinking_models import make_thinking_model_dir
from tiny_models import make_tiny_model_dir

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is 2 + 2?"}]
CLOSED = {"chat_template_kwargs": {"enable_thinking": False}}
# The forced output: reasoning (letters), then the answer.
THOUGHT_RE = r"<think>[a-z]{4,12}</think>\n\nAnswer: [0-9]"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}},
          "required": ["answer"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_thinking_model_dir(tmp_path_factory.mktemp("thinking") / "qwen3", "qwen3")


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    yield from serving(str(model_dir), "--dtype", "float32", "--reasoning-parser", "qwen3",
                       "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def end_think(server: ServerProcess) -> str:
    status, body = server.request("POST", "/tokenize", {"prompt": "</think>"})
    assert status == 200
    (token_id,) = json.loads(body)["tokens"]
    return str(token_id)


def forced_thought(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=ASK, temperature=0, max_tokens=40,
        extra_body={**CLOSED, "structured_outputs": {"regex": THOUGHT_RE}}, **kwargs)


def test_reasoning_content_apart_from_the_answer(client: openai.OpenAI) -> None:
    message = forced_thought(client).choices[0].message
    assert re.fullmatch(r"\n\nAnswer: [0-9]", message.content), message  # as vLLM: unstripped
    assert re.fullmatch(r"[a-z]{4,12}", message.reasoning_content), message
    assert "think" not in message.content


def test_streamed_reasoning_joins_to_the_split(client: openai.OpenAI) -> None:
    message = forced_thought(client).choices[0].message
    reasoning, content, finish = [], [], None
    for chunk in forced_thought(client, stream=True):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            reasoning.append(delta.get("reasoning_content") or "")
            content.append(delta.get("content") or "")
            finish = choice.finish_reason or finish
    assert "".join(reasoning) == message.reasoning_content
    assert "".join(content) == message.content
    assert finish == "stop"
    assert all("<think" not in c and "think>" not in c for c in content)


def test_no_reasoning_is_none(client: openai.OpenAI) -> None:
    """Thinking closed by the prompt and an answer without tags: all content."""
    message = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=ASK, temperature=0, max_tokens=8,
        extra_body={**CLOSED, "structured_outputs": {"regex": "Answer: [0-9]"}}
    ).choices[0].message
    assert message.reasoning_content is None and re.fullmatch("Answer: [0-9]", message.content)


def test_forced_tool_call_after_reasoning(client: openai.OpenAI, end_think: str) -> None:
    """The prompt opens the reasoning; the forced call's grammar waits for `</think>` (had
    it constrained the first token, the output would be all reasoning and no call)."""
    for stream in (False, True):
        response = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=ASK, temperature=0,
            max_tokens=60, tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            logit_bias={end_think: 100}, stream=stream,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        if not stream:
            message = response.choices[0].message
            assert response.choices[0].finish_reason == "tool_calls"
            (call,) = message.tool_calls
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments),
                                WEATHER["function"]["parameters"])
            assert message.content is None and not message.reasoning_content
            continue
        names, arguments = [], []
        for chunk in response:
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or ():
                    names.append(call.function.name or "")
                    arguments.append(call.function.arguments or "")
                assert not choice.delta.content
        assert "".join(names) == "get_weather"
        jsonschema.validate(json.loads("".join(arguments)), WEATHER["function"]["parameters"])


def test_structured_output_after_reasoning(client: openai.OpenAI, end_think: str) -> None:
    """A JSON schema constrains the answer after the reasoning the prompt opened."""
    response = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=ASK, temperature=0, max_tokens=60,
        logit_bias={end_think: 100},
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": SCHEMA}},
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(message.content), SCHEMA)
    assert message.reasoning_content is None  # the bias ended it at once


def test_template_kwargs_change_the_prompt(client: openai.OpenAI) -> None:
    """enable_thinking false closes the block in the prompt (4 more tokens: `<think>`,
    blank lines, `</think>`, blank lines), true opens it (2); the top-level shorthand
    is the same variable."""
    def prompt_tokens(**extra) -> int:
        return client.chat.completions.create(
            model=client.models.list().data[0].id, messages=ASK, max_tokens=1,
            extra_body=extra).usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(**CLOSED) == plain + 4
    assert prompt_tokens(enable_thinking=False) == plain + 4
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == plain + 2
    assert prompt_tokens(enable_thinking=False,
                         chat_template_kwargs={"enable_thinking": True}) == plain + 2


@pytest.mark.parametrize("extra,match", [
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs must be an object"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "must be a boolean"),
    ({"enable_thinking": 1}, "enable_thinking"),
    ({"chat_template_kwargs": {"tokenize": True}}, "not a template variable"),
])
def test_bad_template_kwargs_are_400(client: openai.OpenAI, extra: dict, match: str) -> None:
    with pytest.raises(openai.BadRequestError, match=match):
        client.chat.completions.create(model=client.models.list().data[0].id, messages=ASK,
                                       max_tokens=1, extra_body=extra)


def test_a_model_without_think_tokens_is_refused(tmp_path: Path) -> None:
    plain = make_tiny_model_dir("qwen3", tmp_path / "plain")
    proc = subprocess.run(
        [sys.executable, "-m", "aioengine.cli", "serve", str(plain), "--port", "0",
         "--num-kv-blocks", "64", "--reasoning-parser", "deepseek_r1"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr
    assert "error: --reasoning-parser deepseek_r1: the tokenizer has no <think> or </think>" \
        in proc.stderr
    assert "Traceback" not in proc.stderr


# ---- the Responses API ------------------------------------------------------------------

OPENED = {"chat_template_kwargs": {"enable_thinking": True}}


def test_responses_reasoning_item(client: openai.OpenAI) -> None:
    """The prompt opens the reasoning and the output is cut inside it: one reasoning item
    (OpenAI's shape), no message; the stream's reasoning events join to its text."""
    model = client.models.list().data[0].id
    response = client.responses.create(model=model, input="What is 2 + 2?", temperature=0,
                                       max_output_tokens=8, extra_body=OPENED)
    assert response.status == "incomplete"
    details = response.usage.output_tokens_details
    assert details.reasoning_tokens == response.usage.output_tokens == 8  # all reasoning
    (item,) = response.output
    assert item.type == "reasoning" and item.id.startswith("rs_") and item.summary == []
    (part,) = item.content
    assert part.type == "reasoning_text" and part.text and "think>" not in part.text
    events = list(client.responses.create(model=model, input="What is 2 + 2?", temperature=0,
                                          max_output_tokens=8, extra_body=OPENED, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.reasoning_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == part.text == events[-4].text
    assert events[2].item.type == "reasoning" and events[-2].item.content[0].text == part.text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # Replayed as input (as clients pass output back), the reasoning item is accepted.
    again = client.responses.create(
        model=model, max_output_tokens=2,
        input=[{"role": "user", "content": "Hi"}, item.model_dump(exclude_none=True),
               {"role": "user", "content": "And now?"}])
    assert again.status in ("completed", "incomplete")


def test_responses_without_reasoning_has_no_reasoning_item(client: openai.OpenAI) -> None:
    response = client.responses.create(model=client.models.list().data[0].id, input="Hi",
                                       temperature=0, max_output_tokens=4,
                                       extra_body={"enable_thinking": False})
    assert [item.type for item in response.output] == ["message"]
    assert response.usage.output_tokens_details.reasoning_tokens == 0


# ---- run-batch shares the server's configuration ------------------------------------------

def run_batch(model: Path, tmp_path: Path, body: dict) -> subprocess.CompletedProcess:
    lines = tmp_path / "in.jsonl"
    lines.write_text(json.dumps({"custom_id": "a", "method": "POST",
                                 "url": "/v1/chat/completions", "body": body}) + "\n")
    return subprocess.run(
        [sys.executable, "-m", "aioengine.cli", "run-batch", "-i", str(lines), "-o",
         str(tmp_path / "out.jsonl"), str(model), "--dtype", "float32", "--no-progress",
         "--num-kv-blocks", "64", "--reasoning-parser", "qwen3"],
        capture_output=True, text=True, timeout=300)


def test_run_batch_splits_reasoning(model_dir: Path, tmp_path: Path) -> None:
    body = {"messages": ASK, "temperature": 0, "max_tokens": 40, **CLOSED,
            "structured_outputs": {"regex": THOUGHT_RE}}
    proc = run_batch(model_dir, tmp_path, body)
    assert proc.returncode == 0, proc.stderr
    (record,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    message = record["response"]["body"]["choices"][0]["message"]
    assert re.fullmatch(r"[a-z]{4,12}", message["reasoning_content"])
    assert re.fullmatch(r"\n\nAnswer: [0-9]", message["content"])


def test_run_batch_refuses_a_model_without_think_tokens(tmp_path: Path) -> None:
    plain = make_tiny_model_dir("qwen3", tmp_path / "plain")
    proc = run_batch(plain, tmp_path, {"messages": ASK})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "error: --reasoning-parser qwen3: the tokenizer has no <think>" in proc.stderr
