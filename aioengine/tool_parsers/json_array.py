"""Calls as a JSON array after a marker: `mistral` (`[TOOL_CALLS][{"name": ..., "arguments":
{...}}, ...]`, and recent Mistral templates' `[TOOL_CALLS]name[ARGS]{...}`), `granite`
(`<|tool_call|>[...]`) and `phi4_mini_json` (`functools[...]`).

A block is the marker, optional whitespace, then `[` and elements separated by `,` up to the
`]`. An element in the canonical layout `{"name": <string>, "arguments": {` is a call as
soon as that much is read, its arguments streamed as they come (the object's raw text,
string-aware bracket matching); any other element is held to its end and is a call if it is
a JSON object with a string "name" (arguments re-serialised), else dropped. A block that
yields no call is content, as written; so is a marker followed by neither `[` nor (mistral)
`name[ARGS]{`. A block ends at its `]`, or before anything other than `,` after an
element; whatever follows is text again, read the same way.
"""
from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from aioengine.tool_call_stream import INSIDE_STRING, JSON_WS, UNDECIDED, ToolCallStream
from aioengine.tool_parsers.base import (PROMPT_EXAMPLE, ToolParser, json_content,
                                         match_json_header, parse_json_call)
from aioengine.tool_parsers.json_object import json_end

_HEAD, _MID = '{"name": ', ', "arguments": '
_ARGS_TAG = "[ARGS]"
_NAMED = re.compile(r"([A-Za-z0-9_.\-]{1,64})\[ARGS\][ \t\n\r]*")
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-]*")
_DELIMITERS = re.compile(r'[\[\]{}",]')


class _ElementScan:
    """Where an array element ends: at the `,` or `]` after it outside strings and
    brackets. Reads text that may arrive in pieces; `pos`: how far it has read."""

    def __init__(self) -> None:
        self.depth, self.in_str, self.pos = 0, False, 0

    def advance(self, buf: str, final: bool) -> int | None:
        """The element's length (at the end of the output, all of `buf` if it does not
        end); None: not known yet."""
        i = self.pos
        while (m := (INSIDE_STRING if self.in_str else _DELIMITERS).search(buf, i)) is not None:
            c, i = m.group(), m.end()
            if c == "\\":
                if i == len(buf):  # the escaped character has not arrived: read it again
                    self.pos = i - 1
                    return len(buf) if final else None
                i += 1
            elif c == '"':
                self.in_str = not self.in_str
            elif c in "[{":
                self.depth += 1
            elif self.depth == 0:
                return i - 1
            elif c != ",":
                self.depth -= 1
        self.pos = len(buf)
        return len(buf) if final else None


class JsonArrayToolParser(ToolParser):
    separator: ClassVar[str] = ", "
    named_calls: ClassVar[bool] = False  # also reads `marker + name[ARGS]{...}` (mistral)

    def stream(self) -> ToolCallStream:
        return JsonArrayStream(self)

    def format_call(self, name: str, arguments: str) -> str:
        return f"{self.trigger}[{_HEAD}{json.dumps(name)}{_MID}{arguments}}}]"

    def prompt_instructions(self) -> str:
        example = self.format_call(*PROMPT_EXAMPLE)
        return (f"To call functions, reply with {self.trigger} followed by a JSON array of "
                'the calls, each an object {"name": <the function name>, "arguments": <an '
                f"object of its arguments>}}. For example:\n{example}")

    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"type": "tag", "begin": f"{_HEAD}{json.dumps(name)}{_MID}",
                "content": json_content(schema), "end": "}"}

    def only_calls(self, tags: list[dict[str, Any]], single: bool) -> dict[str, Any]:
        return {"type": "sequence", "elements": [
            {"type": "const_string", "value": self.trigger + "["},
            self._separated(tags, self.separator, single, True),
            {"type": "const_string", "value": "]"}]}

    def auto_calls(self, tags: list[dict[str, Any]], single: bool) -> dict[str, Any]:
        block = {"type": "tag", "begin": self.trigger + "[",
                 "content": self._separated(tags, self.separator, single, True), "end": "]"}
        return self._triggered([block], single)

    def named_header(self, rest: str, final: bool) -> tuple[str, int] | None:
        """(name, length up to the `{`) of `name[ARGS]` at the start of `rest` (the text
        after the marker), UNDECIDED, or None (named_calls only)."""
        if not self.named_calls:
            return None
        m = _NAMED.match(rest)
        if m is not None and m.end() < len(rest):
            return (m.group(1), m.end()) if rest[m.end()] == "{" else None
        if final:
            return None
        if m is not None:
            return UNDECIDED
        name = _NAME_CHARS.match(rest)
        tail = rest[name.end():]  # type: ignore[union-attr]
        return UNDECIDED if _ARGS_TAG.startswith(tail) else None


class MistralToolParser(JsonArrayToolParser):
    """Mistral 7B v0.3, Mixtral, Mistral Small/Nemo (`[TOOL_CALLS]` a JSON array), and the
    templates that write `[TOOL_CALLS]name[ARGS]{...}` per call (read, never written)."""

    name = "mistral"
    trigger = "[TOOL_CALLS]"
    named_calls = True


class GraniteToolParser(JsonArrayToolParser):
    """IBM Granite 3.x: `<|tool_call|>` then a JSON array of calls."""

    name = "granite"
    trigger = "<|tool_call|>"


class Phi4MiniJsonToolParser(JsonArrayToolParser):
    """Phi-4-mini: `functools` then a JSON array of calls."""

    name = "phi4_mini_json"
    trigger = "functools"


class JsonArrayStream(ToolCallStream):
    """ToolCallStream's text and events, with a block of array elements at each marker
    (module docstring). `_raw` is the block's text, marker included, while it has no call
    yet: its content if it ends without one."""

    _p: JsonArrayToolParser

    def __init__(self, parser: JsonArrayToolParser) -> None:
        super().__init__(parser)
        self._raw = ""
        self._block_calls = 0
        self._element_scan = _ElementScan()

    def _header(self, final: bool) -> bool:
        marker = self._p.trigger
        rest = self._buf[len(marker):]
        body = rest.lstrip(JSON_WS)
        if not body and not final:
            return False
        if body.startswith("["):
            self._raw, self._block_calls = "", 0
            self._eat(len(self._buf) - len(body) + 1)
            self._step = self._element
            return True
        named = self._p.named_header(rest, final)
        if named == UNDECIDED:
            return False
        if named is not None:
            self._start(named[0])
            self._begin_arguments(rest[named[1]:], self._text)
            return True
        self._content(marker)  # not a block: the marker is text
        self._buf, self._step = rest, self._text
        return True

    def _element(self, final: bool) -> bool:
        body = self._buf.lstrip(JSON_WS)
        if not body:
            return self._end_block() if final else False
        self._eat(len(self._buf) - len(body))
        if body[0] == "]":
            self._eat(1)
            return self._end_block()
        found = match_json_header(body, _HEAD, _MID)
        if found == UNDECIDED and not final:
            return False
        if found is None or found == UNDECIDED:
            self._element_scan, self._step = _ElementScan(), self._held_element
            return True
        self._call(found[0])
        self._begin_arguments(body[found[1]:], self._element_rest)
        return True

    def _element_rest(self, final: bool) -> bool:
        """The rest of a canonical element's object after its arguments (dropped)."""
        n = json_end(self._buf, 1, final)
        if n is None:
            return False
        self._buf, self._step = self._buf[n:], self._after_element
        return True

    def _held_element(self, final: bool) -> bool:
        n = self._element_scan.advance(self._buf, final)
        if n is None:
            return False
        call = parse_json_call(self._buf[:n])
        self._eat(n)
        if call is not None:
            self._call(call.name)
            self._args(call.arguments)
        self._step = self._after_element
        return True

    def _after_element(self, final: bool) -> bool:
        body = self._buf.lstrip(JSON_WS)
        if not body:
            return self._end_block() if final else False
        if body[0] not in ",]":  # the block ends here: what follows is text
            return self._end_block()
        self._eat(len(self._buf) - len(body) + 1)
        if body[0] == ",":
            self._step = self._element
            return True
        return self._end_block()

    def _eat(self, n: int) -> None:
        if self._block_calls == 0:
            self._raw += self._buf[:n]
        self._buf = self._buf[n:]

    def _call(self, name: str) -> None:
        self._start(name)
        self._block_calls += 1
        self._raw = ""

    def _end_block(self) -> bool:
        if self._block_calls == 0:
            self._content(self._raw)
        self._raw, self._step = "", self._text
        return True
