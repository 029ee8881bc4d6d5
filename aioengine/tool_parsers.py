"""Tool-call parsers: a model's call text <-> OpenAI tool calls (vLLM's `--tool-call-parser`).

The server builds xgrammar structural tags from a parser's `trigger`, `separator`,
`tag_begin(name)` and `tag_end()` (a constrained call is exactly `tag_begin(name) + <arguments
JSON> + tag_end()`); `extract` splits a finished output into content and calls; `stream()`
turns text deltas into events. `extract` is a stream fed the whole text at once, and a stream
decides a piece of text only once no later text can change the decision: so for any split of
a text into deltas, the events joined equal `extract(text)` (tested).

A canonical call starts with `tag_begin(name)` (any JSON string literal as the name), then the
`{` of the arguments: its arguments are that object's raw text, ended by string-aware bracket
matching (a `}` or `</tool_call>` in a JSON string does not end it), streamed as they come;
what follows up to the call's end is dropped. Any other block is held to its end: a JSON
object with a string "name" is then one call (arguments re-serialised), else it is content.

Content is the text outside calls. With calls, text before a call is right-stripped
(whitespace, and `;` for llama3_json) and text after the last one is dropped if only that;
with none, it is the text as is (llama3_json drops a leading <|python_tag|> in any case).
"""
from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import ClassVar

# The stream and its events, re-exported: the server and the tests import them from here.
from aioengine.tool_call_stream import (INSIDE_STRING, JSON_WS, UNDECIDED, ContentDelta,
                                        ExtractedToolCalls, JsonScan, ParsedToolCall,
                                        ToolCallArgsDelta, ToolCallStart, ToolCallStream,
                                        ToolEvent, collect_events)

__all__ = ["ContentDelta", "DEFAULT_TOOL_PARSER", "ExtractedToolCalls", "HermesToolParser",
           "Llama3JsonToolParser", "PROMPT_EXAMPLE", "ParsedToolCall", "TOOL_PARSERS",
           "ToolCallArgsDelta", "ToolCallStart", "ToolCallStream", "ToolEvent", "ToolParser",
           "get_tool_parser"]

# The call in the default tool prompt's example: a function no request is likely to offer,
# so the example does not steer a model towards one of the real tools' arguments.
PROMPT_EXAMPLE = ("lookup_word", '{"word": "example"}')

_QUOTE_OR_TAG = re.compile(r'["<]')
_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\.)*"')  # a complete JSON string literal
_OPEN_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\.)*\\?\Z')  # one that may still close


def _json_end(buf: str, depth: int, final: bool) -> int | None:
    """Where the JSON value open `depth` levels at buf[0] closes; at the end of the output
    the whole rest if it never does; None: not known yet."""
    end = JsonScan(depth).advance(buf)
    return end if end >= 0 else (len(buf) if final else None)


class ToolParser(ABC):
    name: ClassVar[str]
    trigger: ClassVar[str]  # a prefix of every tag_begin: where a call starts
    separator: ClassVar[str]  # between calls when only calls are allowed
    args_key: ClassVar[str]
    # Whether calls end an output (llama3_json: a reply is text or calls, nothing after).
    calls_end_output: ClassVar[bool] = False
    _head: ClassVar[str]  # tag_begin up to the name's JSON string
    _end: ClassVar[str]
    gap: ClassVar[str] = JSON_WS  # text around calls that is dropped
    start_tag: ClassVar[str] = ""  # dropped at the start of an output
    _args_required: ClassVar[bool] = False  # a non-canonical block without them is content

    def tag_begin(self, name: str) -> str:
        return f'{self._head}{json.dumps(name)}, "{self.args_key}": '

    def tag_end(self) -> str:
        return self._end

    def format_call(self, name: str, arguments: str) -> str:
        return self.tag_begin(name) + arguments + self.tag_end()

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    def extract(self, text: str) -> ExtractedToolCalls:
        stream = self.stream()
        return collect_events(stream.feed(text) + stream.finish())

    @abstractmethod
    def prompt_instructions(self) -> str:
        """One paragraph for a system prompt: how to write a call, with an example."""

    @abstractmethod
    def other_block(self, buf: str, final: bool) -> tuple[int, ParsedToolCall | None] | None:
        """The length of the non-canonical block at the start of `buf` and its call (None:
        it stays content); None if its end is not known yet."""

    @abstractmethod
    def trailer_end(self, buf: str, final: bool) -> int | None:
        """Length of what ends a canonical call after its arguments (None: not known yet)."""

    def match_header(self, buf: str) -> tuple[str, int] | None:
        """(name, length) of a canonical header at the start of `buf`: tag_begin(name) for
        any JSON string literal, then optional whitespace and the `{` that opens the
        arguments (not counted). UNDECIDED: it may still become one; None: it will not."""
        head = self._head
        if not buf.startswith(head):
            return UNDECIDED if head.startswith(buf) else None
        m = _STRING.match(buf, len(head))
        if m is None:
            undecided = len(buf) == len(head) or _OPEN_STRING.match(buf, len(head))
            return UNDECIDED if undecided else None
        mid = f', "{self.args_key}": '
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

    def _parse_call(self, text: str) -> ParsedToolCall | None:
        """A call written as a JSON object in any layout, or None."""
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        key = next((k for k in (self.args_key, "arguments", "parameters") if k in obj), None)
        if key is None and self._args_required:
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


class HermesToolParser(ToolParser):
    """Hermes 2 Pro / Qwen2.5: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`."""

    name = "hermes"
    trigger = "<tool_call>"
    separator = "\n"
    args_key = "arguments"
    _head = '<tool_call>\n{"name": '
    _end = "}\n</tool_call>"
    _close = "</tool_call>"

    def prompt_instructions(self) -> str:
        example = self.format_call(*PROMPT_EXAMPLE)
        return ("To call a function, write one block per call: <tool_call> on its own line, "
                'then a JSON object {"name": <the function name>, "arguments": <an object of '
                "its arguments>} on one line, then </tool_call>. Write several blocks, one "
                f"after the other, to call several functions. For example:\n{example}")

    def other_block(self, buf: str, final: bool) -> tuple[int, ParsedToolCall | None] | None:
        n = self._tag_end_at(buf, len(self.trigger), final)
        if n is None:
            return None
        if not buf.endswith(self._close, 0, n):  # unterminated
            return n, None
        return n, self._parse_call(buf[len(self.trigger):n - len(self._close)])

    def trailer_end(self, buf: str, final: bool) -> int | None:
        return self._tag_end_at(buf, 0, final)

    def _tag_end_at(self, buf: str, start: int, final: bool) -> int | None:
        """From `start`: just past the first </tool_call> outside a JSON string, or at a
        <tool_call> there (the model never closed this block). At the end of the output,
        an unbalanced quote no longer hides a tag, and without one the block runs to the end."""
        opener, close = self.trigger, self._close
        i, in_str = start, False
        while (m := (INSIDE_STRING if in_str else _QUOTE_OR_TAG).search(buf, i)) is not None:
            c, i = m.group(), m.end()
            if c == "\\":
                i += 1
            elif c == '"':
                in_str = not in_str
            elif buf.startswith(close, i - 1):
                return i - 1 + len(close)
            elif buf.startswith(opener, i - 1):
                return i - 1
        if not final:  # also when a tag may be arriving at the end
            return None
        c, o = buf.find(close, start), buf.find(opener, start)
        if c >= 0 and (o < 0 or c < o):
            return c + len(close)
        return o if o >= 0 else len(buf)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1+ JSON calls: `{"name": ..., "parameters": {...}}`, several joined by "; "."""

    name = "llama3_json"
    trigger = '{"name": '
    separator = "; "
    args_key = "parameters"
    calls_end_output = True
    _head = '{"name": '
    _end = "}"
    gap = JSON_WS + ";"  # the separator between calls
    start_tag = "<|python_tag|>"
    _args_required = True  # so that any JSON object with a "name" is not taken for a call

    def prompt_instructions(self) -> str:
        example = self.format_call(*PROMPT_EXAMPLE)
        return ('To call a function, reply with a JSON object {"name": <the function name>, '
                '"parameters": <an object of its arguments>}; to call several functions, '
                f'separate their objects with "; ". For example:\n{example}')

    def other_block(self, buf: str, final: bool) -> tuple[int, ParsedToolCall | None] | None:
        n = _json_end(buf, 0, final)
        return None if n is None else (n, self._parse_call(buf[:n]))

    def trailer_end(self, buf: str, final: bool) -> int | None:
        return _json_end(buf, 1, final)  # the rest of the call's object




# The call format used for forced calls and past calls when no parser is configured.
DEFAULT_TOOL_PARSER = "hermes"

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
