"""Calls that are a JSON object after a tag: `hermes` (Hermes 2 Pro, Qwen2.5, Qwen3) and
`llama3_json` (Llama 3.1+). A constrained call is exactly `tag_begin(name) + <arguments
JSON> + tag_end()`.

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
from abc import abstractmethod
from typing import Any, ClassVar

from aioengine.tool_call_stream import (INSIDE_STRING, JSON_WS, JsonScan, ParsedToolCall,
                                        ToolCallStream)
from aioengine.tool_parsers.base import (PROMPT_EXAMPLE, ToolParser, json_content,
                                         match_json_header, parse_json_call)

_QUOTE_OR_TAG = re.compile(r'["<]')


def json_end(buf: str, depth: int, final: bool) -> int | None:
    """Where the JSON value open `depth` levels at buf[0] closes; at the end of the output
    the whole rest if it never does; None: not known yet."""
    end = JsonScan(depth).advance(buf)
    return end if end >= 0 else (len(buf) if final else None)


class JsonObjectToolParser(ToolParser):
    """A call is `tag_begin(name) + arguments + tag_end()`; its stream is ToolCallStream,
    which asks the parser where a canonical header ends (`match_header`), where any other
    block ends and what call it holds (`other_block`), and where a canonical call's trailer
    ends (`trailer_end`)."""

    separator: ClassVar[str]  # between calls when only calls are allowed
    args_key: ClassVar[str]
    _head: ClassVar[str]  # tag_begin up to the name's JSON string
    _end: ClassVar[str]
    _args_required: ClassVar[bool] = False  # a non-canonical block without them is content

    def tag_begin(self, name: str) -> str:
        return f'{self._head}{json.dumps(name)}, "{self.args_key}": '

    def tag_end(self) -> str:
        return self._end

    def format_call(self, name: str, arguments: str) -> str:
        return self.tag_begin(name) + arguments + self.tag_end()

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"type": "tag", "begin": self.tag_begin(name), "content": json_content(schema),
                "end": self.tag_end()}

    def only_calls(self, tags: list[dict[str, Any]], single: bool) -> dict[str, Any]:
        return self._separated(tags, self.separator, single, at_least_one=True)

    def auto_calls(self, tags: list[dict[str, Any]], single: bool) -> dict[str, Any]:
        if self.calls_end_output:  # text without a call start, then calls, if any
            return {"type": "sequence", "elements": [
                {"type": "any_text", "excludes": [self.trigger]},
                self._separated(tags, self.separator, single, at_least_one=False)]}
        return self._triggered(tags, single)

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
        return match_json_header(buf, self._head, f', "{self.args_key}": ')

    def _parse_call(self, text: str) -> ParsedToolCall | None:
        """A call written as a JSON object in any layout, or None."""
        return parse_json_call(text, (self.args_key, "arguments", "parameters"),
                               self._args_required)


class HermesToolParser(JsonObjectToolParser):
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


class Llama3JsonToolParser(JsonObjectToolParser):
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
        n = json_end(buf, 0, final)
        return None if n is None else (n, self._parse_call(buf[:n]))

    def trailer_end(self, buf: str, final: bool) -> int | None:
        return json_end(buf, 1, final)  # the rest of the call's object
