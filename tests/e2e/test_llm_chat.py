"""LLM.chat renders conversations exactly as the server's chat route does (same prompt ids
as /tokenize with messages, tools and chat_template_kwargs-free rendering, same greedy
text as /v1/chat/completions), one conversation or many, with a progress bar over many
prompts only."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import orjson
import pytest
from server_process import ServerProcess, openai_client, serving

from aioengine import LLM, InvalidRequestError, SamplingParams

from tests.tiny_models import make_tiny_model_dir

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there!"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3 + 3?"}],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("chat") / "llama", seed=4)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    yield from serving(str(model_dir), "--served-model-name", "tiny", "--dtype", "float32",
                       "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=128)


def server_ids(server: ServerProcess, messages: list[dict], tools: list | None = None) -> list:
    body = {"model": "tiny", "messages": messages}
    if tools:
        body["tools"] = tools
    status, raw = server.request("POST", "/tokenize", body)
    assert status == 200, raw
    return orjson.loads(raw)["tokens"]


def test_chat_renders_and_generates_as_the_server(llm: LLM, server: ServerProcess,
                                                  client: openai.OpenAI) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.chat(CONVERSATIONS, params)
    assert len(outs) == len(CONVERSATIONS)
    for messages, out in zip(CONVERSATIONS, outs):
        assert out.prompt_token_ids == server_ids(server, messages)
        resp = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                              max_tokens=8, extra_body={"ignore_eos": True})
        assert out.outputs[0].text == resp.choices[0].message.content
    one = llm.chat(CONVERSATIONS[0], params)  # a single conversation
    assert len(one) == 1 and one[0].outputs[0].text == outs[0].outputs[0].text


def test_chat_with_tools_renders_as_the_server(llm: LLM, server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=2), tools=[WEATHER])
    assert out[0].prompt_token_ids == server_ids(server, messages, [WEATHER])
    assert out[0].prompt_token_ids != server_ids(server, messages)


def test_chat_template_kwargs_and_errors(llm: LLM) -> None:
    template = "{% for m in messages %}{{ greeting }} {{ m['content'] }}\n{% endfor %}"
    out = llm.chat(CONVERSATIONS[0], SamplingParams(max_tokens=1), chat_template=template,
                   chat_template_kwargs={"greeting": "Ahoy"})
    assert llm.tokenizer.decode(out[0].prompt_token_ids).startswith("Ahoy Hello there!")
    with pytest.raises(InvalidRequestError):
        llm.chat([], SamplingParams(max_tokens=1))


def test_progress_bar_over_many_prompts_only(llm: LLM, capfd: pytest.CaptureFixture) -> None:
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate(["a", "b", "c"], params)
    assert "Processed prompts" in capfd.readouterr().err
    llm.generate("a", params)
    llm.embed(["a", "b"], use_tqdm=False)
    assert "Processed prompts" not in capfd.readouterr().err
    llm.embed(["a", "b"])
    assert "Pooled prompts" in capfd.readouterr().err
