"""What every tool-call parser is: one model family's call syntax, read back into OpenAI tool
calls and written as the xgrammar structural tag that constrains a call.

A parser owns its format end to end: `stream()` turns text deltas into events, `extract`
is that stream fed the whole text (so for any split of a text into deltas, the events
joined equal `extract(text)`); `call_tag(name, schema)` is the structural tag of one call
of a function, and `only_calls` / `auto_calls` wrap those tags into an output of calls only
or text with calls (tools.py picks one by `tool_choice`). `format_call` writes a past call
back into a prompt, `prompt_instructions` tells a model without a tool template how to call.

Parsers whose calls are a JSON object after a tag (hermes, llama3_json) share
`json_object.JsonObjectToolParser`; the others (a JSON array of calls, Qwen3-Coder's XML,
Python calls) each have their own stream over the same events (tool_call_stream.py).
"""
from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from aioengine.tool_call_stream import (JSON_WS, UNDECIDED, ExtractedToolCalls,
                                        ParsedToolCall, ToolCallStream, collect_events)

# The call in the default tool prompt's example: a function no request is likely to offer,
# so the example does not steer a model towards one of the real tools' arguments.
PROMPT_EXAMPLE = ("lookup_word", '{"word": "example"}')

_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\.)*"')  # a complete JSON string literal
_OPEN_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\.)*\\?\Z')  # one that may still close


def json_content(schema: dict[str, Any]) -> dict[str, Any]:
    """A structural tag's content: JSON of `schema`, at most one whitespace character in a
    row between tokens (a small model cannot wander into endless indentation)."""
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}


def match_json_header(buf: str, head: str, mid: str) -> tuple[str, int] | None:
    """(name, length) of `head + <JSON string> + mid` at the start of `buf`, then optional
    whitespace and the `{` that opens the arguments (not counted). UNDECIDED: it may still
    become one; None: it will not."""
    if not buf.startswith(head):
        return UNDECIDED if head.startswith(buf) else None
    m = _STRING.match(buf, len(head))
    if m is None:
        undecided = len(buf) == len(head) or _OPEN_STRING.match(buf, len(head))
        return UNDECIDED if undecided else None
    got = buf[m.end():m.end() + len(mid)]
    if got != mid:
        return UNDECIDED if mid.startswith(got) else None
    n = len(buf) - len(buf[m.end() + len(mid):].lstrip(JSON_WS))
    if n == len(buf):
        return UNDECIDED
    if buf[n] != "{":
        return None
    try:
        return json.loads(m.group()), n
    except ValueError:  # an invalid escape
        return None


def parse_json_call(text: str, arg_keys: tuple[str, ...] = ("arguments", "parameters"),
                    args_required: bool = False) -> ParsedToolCall | None:
    """A call written as a JSON object `{"name": ..., <arg key>: {...}}` in any layout and
    key order (arguments re-serialised; a JSON string of an object accepted), or None."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in arg_keys if k in obj), None)
    if key is None and args_required:
        return None
    args = {} if key is None or obj[key] is None else obj[key]
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser(ABC):
    """One call format (module docstring). A stream reads `trigger` (a prefix of every
    call: where one may start), `start_tag` (dropped at the start of an output) and `gap`
    (text around calls that is dropped)."""

    name: ClassVar[str]
    trigger: ClassVar[str]
    start_tag: ClassVar[str] = ""
    gap: ClassVar[str] = JSON_WS
    # Whether calls end an output (a reply is text or calls, nothing after).
    calls_end_output: ClassVar[bool] = False

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A new stream over one output."""

    def extract(self, text: str) -> ExtractedToolCalls:
        stream = self.stream()
        return collect_events(stream.feed(text) + stream.finish())

    def bind(self, schemas: dict[str, dict[str, Any]]) -> ToolParser:
        """This parser for a request offering functions with these parameter schemas (a
        format whose arguments are not typed in the text reads their types from them)."""
        return self

    @abstractmethod
    def format_call(self, name: str, arguments: str) -> str:
        """One past call (arguments: JSON text of an object) as the model writes it."""

    @abstractmethod
    def prompt_instructions(self) -> str:
        """One paragraph for a system prompt: how to write a call, with an example."""

    @abstractmethod
    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        """The structural tag of one call of `name` whose arguments match `schema`."""

    @abstractmethod
    def only_calls(self, tags: list[dict[str, Any]], single: bool) -> dict[str, Any]:
        """An output of one or more calls and nothing else, each one of `tags` (`single`:
        exactly one)."""

    @abstractmethod
    def auto_calls(self, tags: list[dict[str, Any]], single: bool) -> dict[str, Any]:
        """Free text in which a call, once started, is one of `tags`."""

    def _triggered(self, tags: list[dict[str, Any]], single: bool) -> dict[str, Any]:
        return {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags,
                "at_least_one": False, "stop_after_first": single}

    def _separated(self, tags: list[dict[str, Any]], separator: str, single: bool,
                   at_least_one: bool) -> dict[str, Any]:
        return {"type": "tags_with_separator", "tags": tags, "separator": separator,
                "at_least_one": at_least_one, "stop_after_first": single}
