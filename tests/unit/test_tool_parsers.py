"""Tool-call parsers (hermes, llama3_json): extract, streaming, and their agreement.

The central property: for any text and any split of it into deltas, the stream's events
joined equal `extract(text)`. Since one could pass it by being wrong in the same way both
ways, extract's results are also pinned case by case, and so is what a stream sends when.
"""
from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioengine.tool_parsers import (PROMPT_EXAMPLE, TOOL_PARSERS, ContentDelta,
                                           ExtractedToolCalls, ParsedToolCall,
                                           ToolCallArgsDelta, ToolCallStart, ToolEvent,
                                           ToolParser, get_tool_parser)

HERMES = get_tool_parser("hermes")
LLAMA = get_tool_parser("llama3_json")
PARSERS = [HERMES, LLAMA]
HERMES_CALL_F = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
LLAMA_CALL_F = '{"name": "f", "parameters": {"a": 1}}'


def call(name: str, arguments: str) -> ParsedToolCall:
    return ParsedToolCall(name, arguments)


def joined(events: list[ToolEvent]) -> tuple[str, list[ParsedToolCall]]:
    """Content and calls of an event sequence, checking it is well formed: no empty deltas,
    starts numbered 0, 1, ..., argument fragments only for the call started last."""
    content, calls = [], []
    for e in events:
        if isinstance(e, ContentDelta):
            assert e.text
            content.append(e.text)
        elif isinstance(e, ToolCallStart):
            assert e.index == len(calls)
            calls.append((e.name, []))
        else:
            assert isinstance(e, ToolCallArgsDelta) and e.text
            assert e.index == len(calls) - 1
            calls[-1][1].append(e.text)
    return "".join(content), [ParsedToolCall(n, "".join(parts)) for n, parts in calls]


def streamed(parser: ToolParser, chunks: list[str]) -> tuple[str, list[ParsedToolCall]]:
    stream = parser.stream()
    events = [e for chunk in chunks for e in stream.feed(chunk)]
    return joined(events + stream.finish())


def check_agrees(parser: ToolParser, text: str, chunks: list[str]) -> None:
    assert "".join(chunks) == text
    found = parser.extract(text)
    assert streamed(parser, chunks) == (found.content or "", found.calls), chunks
    if not found.calls:  # content is None only beside calls
        assert found.content is not None


def random_chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


# (text, expected extract): hermes
HERMES_CASES = [
    ("", ExtractedToolCalls("", [])),
    ("Hello, world.", ExtractedToolCalls("Hello, world.", [])),
    ("  \n\t", ExtractedToolCalls("  \n\t", [])),
    ("a < b and <tool", ExtractedToolCalls("a < b and <tool", [])),
    (HERMES_CALL_F, ExtractedToolCalls(None, [call("f", '{"a": 1}')])),
    ("\n" + HERMES_CALL_F + "\n\n", ExtractedToolCalls(None, [call("f", '{"a": 1}')])),
    ("Sure.\n" + HERMES_CALL_F, ExtractedToolCalls("Sure.", [call("f", '{"a": 1}')])),
    (HERMES_CALL_F + "\nDone.", ExtractedToolCalls("\nDone.", [call("f", '{"a": 1}')])),
    ("A " + HERMES_CALL_F + " B \n" + HERMES_CALL_F + "\n",
     ExtractedToolCalls("A B", [call("f", '{"a": 1}')] * 2)),
    (HERMES.format_call("get_weather", '{"city": "Paris"}') + "\n"
     + HERMES.format_call("get_time", '{"tz": "CET", "fmt": [1, {"x": null}]}'),
     ExtractedToolCalls(None, [call("get_weather", '{"city": "Paris"}'),
                               call("get_time", '{"tz": "CET", "fmt": [1, {"x": null}]}')])),
    # brackets and tags inside JSON strings do not end the arguments
    (HERMES.format_call("f", r'{"q": "a}b", "r": "}\n</tool_call>", "s": "\"}"}') + "\nok",
     ExtractedToolCalls("\nok", [call("f", r'{"q": "a}b", "r": "}\n</tool_call>", "s": "\"}"}')])),
    # unicode: names escaped by tag_begin or written raw, arguments kept as written
    (HERMES.format_call("天気", '{"都市": "東京"}'),
     ExtractedToolCalls(None, [call("天気", '{"都市": "東京"}')])),
    ('<tool_call>\n{"name": "naïve", "arguments": {"é": "\\u00e9"}}\n</tool_call>',
     ExtractedToolCalls(None, [call("naïve", '{"é": "\\u00e9"}')])),
    # non-canonical blocks: any layout, key order; arguments re-serialised
    ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>',
     ExtractedToolCalls(None, [call("f", '{"a": 1}')])),
    ('x<tool_call>\n  {"name":"f","arguments":{"k":"é}</tool_call>"}}  \n</tool_call>y',
     ExtractedToolCalls("xy", [call("f", '{"k": "é}</tool_call>"}')])),
    ('<tool_call>{"name": "f"}</tool_call>', ExtractedToolCalls(None, [call("f", "{}")])),
    ('<tool_call>{"name": "f", "arguments": {"q": "say \\"</tool_call>\\" x"}}</tool_call>',
     ExtractedToolCalls(None, [call("f", '{"q": "say \\"</tool_call>\\" x"}')])),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": [1]}"}</tool_call>',
     ExtractedToolCalls(None, [call("f", '{"a": [1]}')])),
    ('<tool_call>\n{"name": "f", "arguments": "oops"}\n</tool_call>',
     ExtractedToolCalls('<tool_call>\n{"name": "f", "arguments": "oops"}\n</tool_call>', [])),
    # invalid blocks stay content, as written
    ("Hi <tool_call>{not json}</tool_call> bye",
     ExtractedToolCalls("Hi <tool_call>{not json}</tool_call> bye", [])),
    ("<tool_call>[1, 2]</tool_call>", ExtractedToolCalls("<tool_call>[1, 2]</tool_call>", [])),
    ('<tool_call>{"name": 3}</tool_call>\n' + HERMES_CALL_F,
     ExtractedToolCalls('<tool_call>{"name": 3}</tool_call>', [call("f", '{"a": 1}')])),
    ('<tool_call>"oops</tool_call> then ' + HERMES_CALL_F,
     ExtractedToolCalls('<tool_call>"oops</tool_call> then', [call("f", '{"a": 1}')])),
    # cut by max_tokens
    ('<tool_call>\n{"name": "f", "arguments": {"a": [1, "}',
     ExtractedToolCalls(None, [call("f", '{"a": [1, "}')])),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool',
     ExtractedToolCalls(None, [call("f", '{"a": 1}')])),
    ('<tool_call>\n{"name": "f", "arguments": {',
     ExtractedToolCalls(None, [call("f", "{")])),
    ('ok <tool_call>\n{"name": "f", "argu',
     ExtractedToolCalls('ok <tool_call>\n{"name": "f", "argu', [])),
    ('<tool_call>{"name": "f", "arguments": {}}',
     ExtractedToolCalls('<tool_call>{"name": "f", "arguments": {}}', [])),
    # a canonical call whose object goes on, or whose block is never closed
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}, "id": "</tool_call>"}\n</tool_call>z',
     ExtractedToolCalls("z", [call("f", '{"a": 1}')])),
    ('<tool_call>\n{"name": "f", "arguments": {}}\n' + HERMES_CALL_F,
     ExtractedToolCalls(None, [call("f", "{}"), call("f", '{"a": 1}')])),
    ('<tool_call>\n{"name": "f", "arguments":  {"a":1}}\n</tool_call>',  # kept as written
     ExtractedToolCalls(None, [call("f", '{"a":1}')])),
]

LLAMA_CASES = [
    ("", ExtractedToolCalls("", [])),
    ("The answer is {x}.", ExtractedToolCalls("The answer is {x}.", [])),
    (LLAMA_CALL_F, ExtractedToolCalls(None, [call("f", '{"a": 1}')])),
    ("<|python_tag|>" + LLAMA_CALL_F, ExtractedToolCalls(None, [call("f", '{"a": 1}')])),
    ("<|python_tag|>hello", ExtractedToolCalls("hello", [])),
    ("<|python", ExtractedToolCalls("<|python", [])),
    ("x<|python_tag|>", ExtractedToolCalls("x<|python_tag|>", [])),
    ("Let me check.\n" + LLAMA_CALL_F,
     ExtractedToolCalls("Let me check.", [call("f", '{"a": 1}')])),
    (LLAMA.separator.join([LLAMA_CALL_F, LLAMA.format_call("g", '{"b": "c;d"}')]) + ";\n",
     ExtractedToolCalls(None, [call("f", '{"a": 1}'), call("g", '{"b": "c;d"}')])),
    (LLAMA_CALL_F + ";\n" + LLAMA_CALL_F + " Done.",
     ExtractedToolCalls(" Done.", [call("f", '{"a": 1}')] * 2)),
    (LLAMA.format_call("f", '{"q": "a}b", "r": "{\\"name\\": "}'),
     ExtractedToolCalls(None, [call("f", '{"q": "a}b", "r": "{\\"name\\": "}')])),
    (LLAMA.format_call("天気", '{"都市": "東京"}'),
     ExtractedToolCalls(None, [call("天気", '{"都市": "東京"}')])),
    ('{"name": "f", "arguments": {"a": "é"}}',
     ExtractedToolCalls(None, [call("f", '{"a": "é"}')])),
    ('{"name": "f", "description": "x", "parameters": {"a": 1}}',
     ExtractedToolCalls(None, [call("f", '{"a": 1}')])),
    ('{"name": "Bob", "age": 3}', ExtractedToolCalls('{"name": "Bob", "age": 3}', [])),
    ('{"name": "f", "parameters" {}} x',
     ExtractedToolCalls('{"name": "f", "parameters" {}} x', [])),
    ('{"name": "f", "parameters": {"a": 1}, "x": "}"} tail',
     ExtractedToolCalls(" tail", [call("f", '{"a": 1}')])),
    ('{"name": "f", "parameters": {"q": "x', ExtractedToolCalls(None, [call("f", '{"q": "x')])),
    ('{"name": "f", "arguments": {}', ExtractedToolCalls('{"name": "f", "arguments": {}', [])),
]

ALL_CASES = [(HERMES, t, e) for t, e in HERMES_CASES] + [(LLAMA, t, e) for t, e in LLAMA_CASES]
CASE_IDS = [f"{p.name}-{i}" for i, (p, _, _) in enumerate(ALL_CASES)]


@pytest.mark.parametrize("parser,text,expected", ALL_CASES, ids=CASE_IDS)
def test_extract(parser: ToolParser, text: str, expected: ExtractedToolCalls) -> None:
    assert parser.extract(text) == expected


@pytest.mark.parametrize("parser,text,expected", ALL_CASES, ids=CASE_IDS)
def test_stream_agrees_at_every_split(parser: ToolParser, text: str,
                                      expected: ExtractedToolCalls) -> None:
    for i in range(len(text) + 1):
        check_agrees(parser, text, [text[:i], text[i:]])
    check_agrees(parser, text, list(text))
    rng = random.Random(len(text))
    for _ in range(20):
        if text:
            check_agrees(parser, text, random_chunks(text, rng))


def test_registry_and_unknown_name() -> None:
    assert {"hermes", "llama3_json"} <= set(TOOL_PARSERS)
    assert isinstance(HERMES, TOOL_PARSERS["hermes"]) and HERMES.args_key == "arguments"
    assert LLAMA.args_key == "parameters"
    with pytest.raises(ValueError, match="'nope'.*hermes.*llama3_json"):
        get_tool_parser("nope")


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
def test_tags(parser: ToolParser) -> None:
    assert parser.tag_begin('a"b').startswith(parser.trigger)
    written = parser.format_call("f", '{"x": 1}')
    assert written == parser.tag_begin("f") + '{"x": 1}' + parser.tag_end()
    if parser is HERMES:
        assert parser.format_call("f", "{}") == (
            '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
    else:
        assert parser.format_call("f", "{}") == '{"name": "f", "parameters": {}}'


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
def test_prompt_instructions_carry_a_parsable_example(parser: ToolParser) -> None:
    text = parser.prompt_instructions()
    example = parser.format_call(*PROMPT_EXAMPLE)
    assert example in text and "\n\n" not in text
    assert parser.extract(example).calls == [call(*PROMPT_EXAMPLE)]


def test_hermes_stream_sends_early_and_holds_back_what_may_change() -> None:
    s = HERMES.stream()
    assert s.feed("Sure") == [ContentDelta("Sure")]
    assert s.feed(".\n<tool") == [ContentDelta(".")]  # "\n<tool" may start a call
    assert s.feed('_call>\n{"name": "f", "arguments": ') == []
    assert s.feed('{"q": "a}') == [ToolCallStart(0, "f"), ToolCallArgsDelta(0, '{"q": "a}')]
    assert s.feed('b"}}\n</') == [ToolCallArgsDelta(0, 'b"}')]  # no tag_end text as arguments
    assert s.feed("tool_call>\n") == []
    assert s.feed("<tool_call>{") == []  # not canonical: held to the block's end
    assert s.feed('"name": "g"}</tool_call>') == [ToolCallStart(1, "g"), ToolCallArgsDelta(1, "{}")]
    assert s.feed(" \n") == []
    assert s.finish() == []


def test_hermes_stream_held_text_is_sent_when_no_call_follows() -> None:
    s = HERMES.stream()
    assert s.feed("a \n<tool_") == [ContentDelta("a")]
    assert s.feed("box>") == [ContentDelta(" \n<tool_box>")]
    assert s.feed("  ") == []
    assert s.finish() == [ContentDelta("  ")]


def test_llama_stream_sends_early() -> None:
    s = LLAMA.stream()
    assert s.feed("<|python_") == []
    assert s.feed('tag|>{"name": "f", "parameters": {"a"') == [
        ToolCallStart(0, "f"), ToolCallArgsDelta(0, '{"a"')]
    assert s.feed(': "}"}};') == [ToolCallArgsDelta(0, ': "}"}')]
    assert s.feed(' {"name": "g", "arguments": {}}') == [  # not canonical: one whole call
        ToolCallStart(1, "g"), ToolCallArgsDelta(1, "{}")]
    assert s.feed(" So") == [ContentDelta(" So")]
    assert s.finish() == []


# Property tests: texts built from pieces that exercise every rule, cut anywhere.
PIECES = ["<tool_call>", "</tool_call>", "<tool_call>\n", "\n</tool_call>", "<|python_tag|>",
          '{"name": ', '"f"', '"g\\u00e9"', ', "arguments": ', ', "parameters": ', "{", "}",
          "[", "]", '"', "\\", "\\\"", ":", ", ", ";", "; ", " ", "\n", "x", "é", "<", "</",
          '"a}b"', '"</tool_call>"', '{"a": 1}', "null", HERMES_CALL_F, LLAMA_CALL_F,
          HERMES.format_call("h", '{"k": ["}", "]"]}'), LLAMA.format_call("h", '{"k": "\\""}'),
          '<tool_call>{"name": "f"}</tool_call>', '{"name": "f", "arguments": {}}']
texts = st.lists(st.sampled_from(PIECES) | st.text(alphabet='ab <>{}":;\n\\', max_size=4),
                 max_size=14).map("".join)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parser=st.sampled_from(PARSERS), text=texts, data=st.data())
def test_stream_agrees_with_extract_for_any_text_and_split(parser: ToolParser, text: str,
                                                           data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=10)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    check_agrees(parser, text, chunks)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6),
    lambda inner: (st.lists(inner, max_size=3)
                   | st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=8)
names = st.text(min_size=1, max_size=8)
arguments = st.dictionaries(st.text(max_size=6), json_values, max_size=4)
call_lists = st.lists(st.tuples(names, arguments, st.booleans()), min_size=1, max_size=3)


@settings(max_examples=200, deadline=None)
@given(parser=st.sampled_from(PARSERS), calls=call_lists,
       before=st.text(alphabet="ab .,\n", max_size=8), data=st.data())
def test_written_calls_read_back_exactly(parser: ToolParser, calls: list, before: str,
                                         data: st.DataObject) -> None:
    """What the grammar makes a model write (tag_begin + arguments + tag_end, joined by the
    separator) comes back as the same calls, arguments byte for byte, streamed or not."""
    written = [(n, json.dumps(a, ensure_ascii=escape)) for n, a, escape in calls]
    text = before + parser.separator.join(parser.format_call(n, a) for n, a in written)
    found = parser.extract(text)
    assert found == ExtractedToolCalls(before.rstrip() or None, [call(n, a) for n, a in written])
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8)))
    check_agrees(parser, text, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
