"""/v1/messages on a thinking model with --reasoning-parser qwen3 (tests/thinking_models.py),
with the real `anthropic` SDK: the reasoning is a `thinking` block before the answer, the
same split as chat's reasoning_content, streamed as thinking_delta events, and `thinking`
reaches the template as enable_thinking.

The weights are random and nothing forces the text here: with `thinking` enabled the prompt
opens `<think>`, so the output starts inside the reasoning and whatever the model writes
before a `</think>` is the thinking block. A split with both blocks is tested on recorded
text in tests/unit/test_messages_protocol.py."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
from server_process import ServerProcess, openai_client, serving

from thinking_models import make_thinking_model_dir

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is 2 + 2?"}]
ON = {"type": "enabled", "budget_tokens": 1024}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir: Path = make_thinking_model_dir(tmp_path_factory.mktemp("thinking") / "qwen3",
                                              "qwen3")
    yield from serving(str(model_dir), "--dtype", "float32", "--reasoning-parser", "qwen3")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                               timeout=120)


def split_of(server: ServerProcess, enable_thinking: bool) -> tuple[str | None, str]:
    """Chat's (reasoning_content, content) of the same greedy request."""
    chat: openai.OpenAI = openai_client(server)
    message = chat.chat.completions.create(
        model=server.model, messages=ASK, max_tokens=24, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": enable_thinking}},
    ).choices[0].message
    return message.model_dump().get("reasoning_content"), message.content or ""


def test_thinking_block_is_chats_reasoning(server, client) -> None:
    reasoning, content = split_of(server, True)
    message = client.messages.create(model=server.model, max_tokens=24, messages=ASK,
                                     thinking=ON, extra_body=GREEDY)
    assert reasoning  # the prompt opened <think>: the output starts as reasoning
    thinking = message.content[0]
    assert thinking.type == "thinking" and thinking.thinking == reasoning
    assert thinking.signature == ""
    text = "".join(b.text for b in message.content[1:] if b.type == "text")
    assert text == content
    assert [b.type for b in message.content] in (["thinking"], ["thinking", "text"])
    if not content:  # still thinking at max_tokens
        assert message.stop_reason == "max_tokens"

    with client.messages.stream(model=server.model, max_tokens=24, messages=ASK,
                                thinking=ON, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == reasoning
    assert "".join(d.text for d in deltas if d.type == "text_delta") == content
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == [b.type for b in message.content]
    assert final.content[0].thinking == reasoning and final.stop_reason == message.stop_reason


def test_thinking_disabled_is_all_text(server, client) -> None:
    reasoning, content = split_of(server, False)
    message = client.messages.create(model=server.model, max_tokens=24, messages=ASK,
                                     thinking={"type": "disabled"}, extra_body=GREEDY)
    assert not reasoning and [b.type for b in message.content] == ["text"]
    assert message.content[0].text == content


def test_thinking_reaches_the_template(client, server) -> None:
    """The qwen3 template closes the block for disabled (4 more tokens than no switch:
    `<think>`, `</think>` and their newlines) and opens it for enabled (2 more)."""
    def count(**fields) -> int:
        return client.messages.count_tokens(model=server.model, messages=ASK,
                                            **fields).input_tokens
    plain = count()
    assert count(thinking={"type": "disabled"}) == plain + 4
    assert count(thinking=ON) == plain + 2
    assert count(thinking={"type": "adaptive"}) == plain
