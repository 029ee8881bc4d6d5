"""Tool-call parsers: a model's call text <-> OpenAI tool calls (vLLM's `--tool-call-parser`).

One parser per call format (base.py says what a parser is):
- json_object.py: a JSON object after a tag: `hermes`, `llama3_json`;
- json_array.py: a JSON array of calls after a marker: `mistral`, `granite`, `phi4_mini_json`;
- qwen3_xml.py: Qwen3-Coder's XML: `qwen3_coder`;
- pythonic.py: a Python list of calls: `pythonic`.

`auto` (`detect_tool_parser`) picks the parser from the markers a chat template writes.
"""
from __future__ import annotations

import re

from aioengine.errors import ConfigError
# The stream and its events, re-exported: the server and the tests import them from here.
from aioengine.tool_call_stream import (ContentDelta, ExtractedToolCalls, ParsedToolCall,
                                        ToolCallArgsDelta, ToolCallStart, ToolCallStream,
                                        ToolEvent)
from aioengine.tool_parsers.base import PROMPT_EXAMPLE, ToolParser
from aioengine.tool_parsers.json_array import (GraniteToolParser, JsonArrayToolParser,
                                               MistralToolParser, Phi4MiniJsonToolParser)
from aioengine.tool_parsers.json_object import (HermesToolParser, JsonObjectToolParser,
                                                Llama3JsonToolParser)
from aioengine.tool_parsers.pythonic import PythonicToolParser
from aioengine.tool_parsers.qwen3_xml import Qwen3CoderToolParser

__all__ = ["AUTO_TOOL_PARSER", "ContentDelta", "DEFAULT_TOOL_PARSER", "ExtractedToolCalls",
           "GraniteToolParser", "HermesToolParser", "JsonArrayToolParser",
           "JsonObjectToolParser", "Llama3JsonToolParser", "MistralToolParser",
           "PROMPT_EXAMPLE", "ParsedToolCall", "Phi4MiniJsonToolParser", "PythonicToolParser",
           "Qwen3CoderToolParser", "TOOL_PARSERS", "ToolCallArgsDelta", "ToolCallStart",
           "ToolCallStream", "ToolEvent", "ToolParser", "detect_tool_parser",
           "get_tool_parser"]

# The call format used for forced calls and past calls when no parser is configured.
DEFAULT_TOOL_PARSER = "hermes"
AUTO_TOOL_PARSER = "auto"  # --tool-call-parser auto: chosen from the chat template

TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesToolParser, Llama3JsonToolParser, MistralToolParser, GraniteToolParser,
    Phi4MiniJsonToolParser, Qwen3CoderToolParser, PythonicToolParser)}

# What a template writes -> its format, first match wins (Qwen3-Coder's template also
# writes <tool_call>; a pythonic Llama template may also name <|python_tag|>).
_TEMPLATE_MARKERS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"<tool_call>[\s\S]*<function=|<function=[\s\S]*<tool_call>"), "qwen3_coder"),
    (re.compile(r"<tool_call>"), "hermes"),
    (re.compile(r"\[TOOL_CALLS\]"), "mistral"),
    (re.compile(r"<\|tool_call\|>"), "granite"),
    (re.compile(r"functools|<\|/tool\|>"), "phi4_mini_json"),  # Phi-4-mini's <|tool|> list
    (re.compile(r"\[func_name\d*\(|\[\s*\w+\(\s*\w+\s*=\s*\w+"), "pythonic"),
    (re.compile(r"<\|python_tag\|>|[\"']parameters[\"']\s*:"), "llama3_json"),
]


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


def detect_tool_parser(template: str | dict | None) -> str:
    """The parser whose format a chat template writes (`--tool-call-parser auto`);
    ConfigError (a ValueError) naming the choices when it writes none we know."""
    text = "\n".join(v for v in template.values() if isinstance(v, str)) \
        if isinstance(template, dict) else template or ""
    for pattern, name in _TEMPLATE_MARKERS:
        if pattern.search(text):
            return name
    where = "the model has no chat template" if not text else \
        "its chat template writes none of the known call formats"
    raise ConfigError(f"--tool-call-parser auto cannot tell the model's tool-call format: "
                     f"{where}; name one of {', '.join(TOOL_PARSERS)}")
