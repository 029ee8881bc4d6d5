"""A GGUF's own `tokenizer.chat_template` is the template tool prompts are rendered with
(the tools reach it, and `--tool-call-parser auto` reads its format), and `--chat-template`
overrides it: on a tiny GGUF written like llama.cpp writes one, through the real loader."""
from __future__ import annotations

import pytest
from gguf_writer import tokenizer_fields, write_tiny_gguf
from tiny_models import make_tiny_hf_model

from aioengine.chat_prompt import render_chat_text
from aioengine.model.gguf_loader import FastGGUFReader
from aioengine.model.loader import load_tokenizer
from aioengine.server.tools import ToolServingConfig
from aioengine.tool_parsers import get_tool_parser

VOCAB = 512
GGUF_TEMPLATE = (  # writes Mistral's markers and lists the tools itself
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS]"
    "{{ m.tool_calls | map(attribute='function') | list | tojson }}"
    "{% else %}[INST]{{ m.content }}[/INST]{% endif %}{% endfor %}")
OVERRIDE = (  # a Hermes-style template given with --chat-template
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>"
    "<tool_call>{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def gguf_tokenizer(bundled_gguf_path: str, tmp_path_factory):
    tok = tokenizer_fields(FastGGUFReader(bundled_gguf_path))
    tok["tokenizer.chat_template"] = GGUF_TEMPLATE
    path = tmp_path_factory.mktemp("gguf") / "tools.gguf"
    write_tiny_gguf(make_tiny_hf_model("llama", vocab_size=VOCAB), "llama", path, tok)
    return load_tokenizer(str(path))


def test_the_gguf_template_renders_the_tools(gguf_tokenizer) -> None:
    assert gguf_tokenizer.chat_template == GGUF_TEMPLATE
    config = ToolServingConfig.resolve(True, "auto", gguf_tokenizer.chat_template)
    assert config.tool_call_parser == "mistral"
    past = [*ASK, {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]
    text = render_chat_text(gguf_tokenizer, past, TOOLS, config.parser)
    assert text.startswith('[AVAILABLE_TOOLS][{"type": "function", "function": '
                           '{"name": "get_weather"')
    assert text.endswith('[INST]Weather in Paris?[/INST][TOOL_CALLS][{"name": "get_weather", '
                         '"arguments": {"city": "Paris"}}]')
    assert config.parser.extract(text[text.index("[TOOL_CALLS]"):]).calls[0].name == \
        "get_weather"


def test_chat_template_overrides_the_gguf_template(gguf_tokenizer) -> None:
    config = ToolServingConfig.resolve(True, "auto", OVERRIDE)
    assert config.tool_call_parser == "hermes"
    text = render_chat_text(gguf_tokenizer, ASK, TOOLS, get_tool_parser("hermes"), OVERRIDE)
    assert text == "<tools>get_weather;</tools><tool_call><|user|>Weather in Paris?"
