"""The streaming half of the tool-call parsers (tool_parsers/: the call formats and the
rules): text deltas in, ContentDelta / ToolCallStart / ToolCallArgsDelta events out, and the
JSON scanning the parsers share. A stream reads its parser's format (`trigger`, `start_tag`,
`gap`): text up to a trigger is content (whitespace before a call dropped), and what follows
a trigger is the parser's to decide. ToolCallStream itself decides it for calls that are a
JSON object after a tag (json_object.py): it asks where a canonical header ends
(`match_header`), where any other block ends and what call it holds (`other_block`), and
where a canonical call's trailer ends (`trailer_end`): the CallFormat protocol. The other
formats' streams subclass it and replace `_header`, the step taken at a trigger."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Protocol


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True)
class ExtractedToolCalls:
    content: str | None  # None when there are calls and no other text
    calls: list[ParsedToolCall]


class CallFormat(Protocol):
    """What a stream reads of its parser (a ToolParser, tool_parsers.py, which makes its
    streams: naming the parts keeps this module from importing the parsers')."""

    trigger: str  # a prefix of every canonical header: where a call starts
    start_tag: str  # dropped at the start of an output
    gap: str  # text around calls that is dropped

    def match_header(self, buf: str) -> tuple[str, int] | None:
        """(name, length) of a canonical header at the start of `buf`; UNDECIDED: it may
        still become one; None: it will not."""
        ...

    def other_block(self, buf: str, final: bool) -> tuple[int, ParsedToolCall | None] | None:
        """The length of the non-canonical block at the start of `buf` and its call (None:
        it stays content); None if its end is not known yet."""
        ...

    def trailer_end(self, buf: str, final: bool) -> int | None:
        """Length of what ends a canonical call after its arguments (None: not known yet)."""
        ...


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int  # 0, 1, ... per call of one output
    name: str


@dataclass(frozen=True)
class ToolCallArgsDelta:
    index: int
    text: str


ToolEvent = ContentDelta | ToolCallStart | ToolCallArgsDelta

_OUTSIDE = re.compile(r'[\[\]{}"]')
INSIDE_STRING = re.compile(r'["\\]')  # what ends or escapes something inside a JSON string
JSON_WS = " \t\n\r\f\v"
UNDECIDED = ("", 0)  # match_header: the text may still become a canonical header


@dataclass
class JsonScan:
    """String-aware bracket matching over JSON text that may arrive in pieces."""

    depth: int = 0
    in_str: bool = False
    esc: bool = False

    def advance(self, text: str, i: int = 0) -> int:
        """Scans text[i:]; the index just past the bracket that brings the depth to 0, or -1."""
        while i < len(text):
            if self.esc:
                self.esc, i = False, i + 1
                continue
            m = (INSIDE_STRING if self.in_str else _OUTSIDE).search(text, i)
            if m is None:
                return -1
            c, i = m.group(), m.end()
            if c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = not self.in_str
            elif c in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    return i
        return -1


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolCallStream:
    """One output's streaming state: text deltas in, events out.

    `_buf` holds the text not decided yet; `_step` says what its start is (content, a call
    header, arguments, a call's trailer, a non-canonical block) and consumes what it can.
    """

    def __init__(self, parser: CallFormat) -> None:
        self._p = parser
        self._buf = ""
        self._step: Callable[[bool], bool] = self._at_start
        self._scan = JsonScan()  # over a canonical call's arguments
        self._after_arguments: Callable[[bool], bool] = self._trailer
        self._out: list[ToolEvent] = []
        self._held = ""  # gap text at the end of the current content piece: unsent
        self._piece_has_text = False  # the current content piece has sent text
        self._calls = 0

    def feed(self, delta: str) -> list[ToolEvent]:
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> list[ToolEvent]:
        events = self._run(final=True)
        if self._held and (self._calls == 0 or self._piece_has_text):
            events.append(ContentDelta(self._held))
        self._held = ""
        return events

    def _run(self, final: bool) -> list[ToolEvent]:
        while self._step(final):  # a step returns True when the next one may go on
            pass
        out, self._out = self._out, []
        return out

    def _at_start(self, final: bool) -> bool:
        tag = self._p.start_tag
        if self._buf.startswith(tag):
            self._buf = self._buf[len(tag):]
        elif tag.startswith(self._buf) and not final:
            return False
        self._step = self._text
        return True

    def _text(self, final: bool) -> bool:
        i = self._buf.find(self._p.trigger)
        if i >= 0:
            self._content(self._buf[:i])
            self._buf, self._step = self._buf[i:], self._header
            return True
        n = len(self._buf) - (0 if final else partial_suffix(self._buf, self._p.trigger))
        self._content(self._buf[:n])
        self._buf = self._buf[n:]
        return False

    def _header(self, final: bool) -> bool:
        found = self._p.match_header(self._buf)
        if found == UNDECIDED and not final:
            return False
        if found is None or found == UNDECIDED:
            self._step = self._block
            return True
        self._start(found[0])
        self._begin_arguments(self._buf[found[1]:], self._trailer)
        return True

    def _begin_arguments(self, rest: str, then: Callable[[bool], bool]) -> None:
        """`rest` starts with a call's arguments object: stream it, then go on with `then`."""
        self._buf, self._scan = rest, JsonScan()
        self._step, self._after_arguments = self._arguments, then

    def _arguments(self, final: bool) -> bool:
        end = self._scan.advance(self._buf)
        n = len(self._buf) if end < 0 else end
        self._args(self._buf[:n])
        self._buf = self._buf[n:]
        if end >= 0:
            self._step = self._after_arguments
        return end >= 0

    def _trailer(self, final: bool) -> bool:
        n = self._p.trailer_end(self._buf, final)
        if n is None:
            return False
        self._buf, self._step = self._buf[n:], self._text
        return True

    def _block(self, final: bool) -> bool:
        found = self._p.other_block(self._buf, final)
        if found is None:
            return False
        n, call = found
        block, self._buf = self._buf[:n], self._buf[n:]
        if call is None:
            self._content(block)
        else:
            self._start(call.name)
            self._args(call.arguments)
        self._step = self._text
        return True

    # Events. Gap text is held back: dropped if a call follows, sent if text does.
    def _content(self, text: str) -> None:
        body = text.rstrip(self._p.gap)
        if not body:
            self._held += text
            return
        self._out.append(ContentDelta(self._held + body))
        self._held, self._piece_has_text = text[len(body):], True

    def _start(self, name: str) -> None:
        self._held, self._piece_has_text = "", False
        self._out.append(ToolCallStart(self._calls, name))
        self._calls += 1

    def _args(self, text: str) -> None:
        if text:
            self._out.append(ToolCallArgsDelta(self._calls - 1, text))


def collect_events(events: list[ToolEvent]) -> ExtractedToolCalls:
    """A whole output's events joined into its content and calls (`ToolParser.extract`)."""
    content: list[str] = []
    calls: list[tuple[str, list[str]]] = []
    for e in events:
        if isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, ToolCallStart):
            calls.append((e.name, []))
        else:
            calls[e.index][1].append(e.text)
    parsed = [ParsedToolCall(name, "".join(parts)) for name, parts in calls]
    text = "".join(content)
    return ExtractedToolCalls(None if parsed and not text else text, parsed)
