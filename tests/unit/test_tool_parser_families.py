"""Tool-call parsers of the other served families: mistral, granite, phi4_mini_json (a JSON
array of calls), qwen3_coder (XML) and pythonic (Python calls), and `auto`'s choice.

Outputs are written as each family's models write them; every case is also streamed split
at every position (the stream's events joined equal `extract`), and what a parser writes
(`format_call`, what a forced call's grammar produces) reads back as the same calls.
"""
from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tool_parsers import call, check_agrees, random_chunks

from aioengine.tool_parsers import (PROMPT_EXAMPLE, TOOL_PARSERS, ContentDelta,
                                    ExtractedToolCalls, ToolCallArgsDelta, ToolCallStart,
                                    ToolParser, detect_tool_parser, get_tool_parser)
from aioengine.tool_parsers.qwen3_xml import typed_value

MISTRAL = get_tool_parser("mistral")
GRANITE = get_tool_parser("granite")
PHI4 = get_tool_parser("phi4_mini_json")
WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array"}, "where": {"type": "object"}, "ratio": {"type": "number"},
    "note": {"type": ["string", "null"]}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
QWEN = get_tool_parser("qwen3_coder").bind({"get_weather": WEATHER_SCHEMA})
PY = get_tool_parser("pythonic")
NEW_PARSERS = [MISTRAL, GRANITE, PHI4, QWEN, PY]
E = ExtractedToolCalls
W = "get_weather"

MISTRAL_CASES = [
    ("", E("", [])),
    ("The weather is fine.", E("The weather is fine.", [])),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
     E(None, [call(W, '{"city": "Paris", "unit": "celsius"}')])),
    # two calls, text before, a key order a model may choose, whitespace inside the array
    ('Let me look.[TOOL_CALLS] [ {"name": "get_weather", "arguments": {"city": "Oslo"}} ,\n'
     '{"arguments": {"zone": "UTC"}, "name": "get_time"}]',
     E("Let me look.", [call(W, '{"city": "Oslo"}'), call("get_time", '{"zone": "UTC"}')])),
    # brackets, quotes, escapes and unicode inside strings
    ('[TOOL_CALLS][{"name": "search", "arguments": {"q": "a]}[{\\"x\\"", "u": "東京 \\u00e9"}}]',
     E(None, [call("search", '{"q": "a]}[{\\"x\\"", "u": "東京 \\u00e9"}')])),
    # arguments as a JSON string; an element that is not a call is dropped beside calls
    ('[TOOL_CALLS][{"name": "f", "arguments": "{\\"a\\": 1}"}, 7, {"name": "g"}]',
     E(None, [call("f", '{"a": 1}'), call("g", "{}")])),
    # recent templates: name[ARGS]{...} per call
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
     E(None, [call(W, '{"city": "Paris"}'), call("get_time", '{"zone": "CET"}')])),
    ('[TOOL_CALLS]get_weather[ARGS]{"q": "}"}\nDone.', E("\nDone.", [call(W, '{"q": "}"}')])),
    # malformed: content as written
    ("[TOOL_CALLS] sure", E("[TOOL_CALLS] sure", [])),
    ("[TOOL_CALLS][1, 2]", E("[TOOL_CALLS][1, 2]", [])),
    ('[TOOL_CALLS][{"name": 3, "arguments": {}}] ok',
     E('[TOOL_CALLS][{"name": 3, "arguments": {}}] ok', [])),
    ('[TOOL_CALLS][{"name": "f", "arguments": {}} oops',
     E(" oops", [call("f", "{}")])),
    ("[TOOL_CALLS]get weather[ARGS]{}", E("[TOOL_CALLS]get weather[ARGS]{}", [])),
    ("[TOOL_CALLS]f[ARGS] x", E("[TOOL_CALLS]f[ARGS] x", [])),
    ('[TOOL_CALLS][{"name": "f", "arguments": [1]}]',
     E('[TOOL_CALLS][{"name": "f", "arguments": [1]}]', [])),
    # cut by max_tokens
    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": [1, "',
     E(None, [call("f", '{"a": [1, "')])),
    ('[TOOL_CALLS][{"name": "f", "argu', E('[TOOL_CALLS][{"name": "f", "argu', [])),
    ("[TOOL_CALL", E("[TOOL_CALL", [])),
]
GRANITE_CASES = [
    ('<|tool_call|>[{"arguments": {"city": "Boston"}, "name": "get_weather"}]',
     E(None, [call(W, '{"city": "Boston"}')])),
    ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Boston"}}, '
     '{"name": "get_time", "arguments": {"zone": "EST"}}]',
     E(None, [call(W, '{"city": "Boston"}'), call("get_time", '{"zone": "EST"}')])),
    ('<|tool_call|>[{"arguments": {"q": "a\\"]},\\\\"}, "name": "f"}, {"name": "g", '
     '"arguments": {}}]', E(None, [call("f", '{"q": "a\\"]},\\\\"}'), call("g", "{}")])),
    ("<|tool_call|>no", E("<|tool_call|>no", [])),
    ("a <|tool_", E("a <|tool_", [])),
]
PHI4_CASES = [
    ('functools[{"name": "get_weather", "arguments": {"city": "Seattle", "days": 2}}]',
     E(None, [call(W, '{"city": "Seattle", "days": 2}')])),
    ("I used functools.partial here.", E("I used functools.partial here.", [])),
    ('functools [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": null}}]',
     E(None, [call("a", "{}"), call("b", '{"x": null}')])),
]
QWEN_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
             "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
QWEN_CASES = [
    ("", E("", [])),
    (QWEN_CALL, E(None, [call(W, '{"city": "Paris", "days": 3}')])),
    # text before, two calls, every type of the schema, a multi-line string with markup
    ("Checking.\n" + QWEN_CALL + "\n<tool_call>\n<function=get_weather>\n"
     "<parameter=city>\nSão Paulo\n\"quoted\" <b>\n</parameter>\n<parameter=metric>\nTrue\n"
     "</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=where>\n"
     "{'lat': 1.5}\n</parameter>\n<parameter=ratio>\n2\n</parameter>\n<parameter=note>\nnull\n"
     "</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>",
     E("Checking.", [call(W, '{"city": "Paris", "days": 3}'), call(W, (
         '{"city": "São Paulo\\n\\"quoted\\" <b>", "metric": true, "hours": [1, 2], '
         '"where": {"lat": 1.5}, "ratio": 2, "note": null, "unit": "celsius"}'))])),
    # strings stay strings even when they look like numbers; untyped values parsed if JSON
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\n123\n</parameter>\n"
     "<parameter=extra>\n{\"a\": 1}\n</parameter>\n<parameter=days>\nmany\n</parameter>\n"
     "</function>\n</tool_call>",
     E(None, [call(W, '{"city": "123", "extra": {"a": 1}, "days": "many"}')])),
    # another function (no schema), no parameters, a parameter left open
    ("<tool_call>\n<function=ping>\n</function>\n</tool_call>", E(None, [call("ping", "{}")])),
    ("<tool_call><function=f><parameter=a>x<parameter=b>2</function></tool_call> after",
     E(" after", [call("f", '{"a": "x", "b": 2}')])),
    # malformed: content as written
    ("<tool_call>\nhello\n</tool_call>", E("<tool_call>\nhello\n</tool_call>", [])),
    ("<tool_call>\n<function=>\n", E("<tool_call>\n<function=>\n", [])),
    ("a <tool", E("a <tool", [])),
    # cut by max_tokens: the open value ends there, the object is closed
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
     E(None, [call(W, '{"city": "Par"}')])),
    ("<tool_call>\n<function=get_weather>\n<parameter=ci", E(None, [call(W, "{}")])),
    ("<tool_call>\n<function=get_wea", E("<tool_call>\n<function=get_wea", [])),
]
PY_CASES = [
    ("", E("", [])),
    ('[get_weather(city="Paris", unit="celsius")]',
     E(None, [call(W, '{"city": "Paris", "unit": "celsius"}')])),
    ("[get_weather(city='San Francisco', days=3), get_time(zone=\"PST\")]",
     E(None, [call(W, '{"city": "San Francisco", "days": 3}'),
              call("get_time", '{"zone": "PST"}')])),
    # literals: nested, negative, JSON's true/null, tuples; brackets and quotes in strings
    ('[f(a=[1, -2.5, (3, 4)], b={"k": None, "t": True}, c=true, d=null, e="x])\\"y\'")]',
     E(None, [call("f", '{"a": [1, -2.5, [3, 4]], "b": {"k": null, "t": true}, "c": true, '
                        '"d": null, "e": "x])\\"y\'"}')])),
    ('<|python_start|>[f(q="東京")]<|python_end|>', E(None, [call("f", '{"q": "東京"}')])),
    ("Sure: [f()]", E("Sure:", [call("f", "{}")])),
    # Python keywords are valid tool and parameter names (found by the property test below)
    ('[as()]', E(None, [call("as", "{}")])),
    ('[route(from="A", to="B", in_=1, lambda={"if": "in"})]',
     E(None, [call("route", '{"from": "A", "to": "B", "in_": 1, "lambda": {"if": "in"}}')])),
    # a line separator inside a string before a keyword on the next line
    ('[f(a="x\u2028y",\nfrom=1)]', E(None, [call("f", '{"a": "x\u2028y", "from": 1}')])),
    # not calls: content as written
    ("A list [1, 2] and [x for x in y]", E("A list [1, 2] and [x for x in y]", [])),
    ("[f(1)]", E("[f(1)]", [])),
    ("[f(x=g())]", E("[f(x=g())]", [])),
    ("[f(x=1), 2]", E("[f(x=1), 2]", [])),
    ("[f(**kw)]", E("[f(**kw)]", [])),
    ("[f(x={1: 2})]", E("[f(x={1: 2})]", [])),
    ("[os.system(x='rm')]", E("[os.system(x='rm')]", [])),
    # cut by max_tokens
    ('[f(x="a', E('[f(x="a', [])),
]

ALL_CASES = ([(MISTRAL, t, e) for t, e in MISTRAL_CASES]
             + [(GRANITE, t, e) for t, e in GRANITE_CASES]
             + [(PHI4, t, e) for t, e in PHI4_CASES]
             + [(QWEN, t, e) for t, e in QWEN_CASES] + [(PY, t, e) for t, e in PY_CASES])
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


def test_registry_names_every_family() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "granite",
                                 "phi4_mini_json", "qwen3_coder", "pythonic"}


def test_json_array_stream_sends_a_call_when_its_name_is_read() -> None:
    s = MISTRAL.stream()
    assert s.feed("Ok.[TOOL_") == [ContentDelta("Ok.")]
    assert s.feed('CALLS][{"name": "f", "arguments": ') == []
    assert s.feed('{"a": "]') == [ToolCallStart(0, "f"), ToolCallArgsDelta(0, '{"a": "]')]
    assert s.feed('"}}, {"arguments": {}, ') == [ToolCallArgsDelta(0, '"}')]
    assert s.feed('"name": "g"}]') == [ToolCallStart(1, "g"), ToolCallArgsDelta(1, "{}")]
    assert s.finish() == []


def test_qwen_stream_sends_each_parameter_when_it_ends() -> None:
    s = QWEN.stream()
    assert s.feed("<tool_call>\n<function=get_weather>") == [ToolCallStart(0, W)]
    assert s.feed("\n<parameter=days>\n4") == []
    assert s.feed("\n</parameter>\n<parameter=city>\nRome\n</param") == [
        ToolCallArgsDelta(0, '{"days": 4')]
    assert s.feed("eter>\n</function>") == [ToolCallArgsDelta(0, ', "city": "Rome"'),
                                           ToolCallArgsDelta(0, "}")]
    assert s.feed("\n</tool_call>") == []
    assert s.finish() == []


def test_pythonic_stream_holds_a_block_to_its_end() -> None:
    s = PY.stream()
    assert "".join(e.text for e in s.feed("See [1] or [f(")) == "See [1] or"
    assert s.feed("x=']')") == []
    assert s.feed("]") == [ToolCallStart(0, "f"), ToolCallArgsDelta(0, '{"x": "]"}')]


@pytest.mark.parametrize("raw,schema,value", [
    ("42", {"type": "integer"}, 42), ("4.0", {"type": "integer"}, 4),
    ("4.5", {"type": "number"}, 4.5), ("x", {"type": "integer"}, "x"),
    ("FALSE", {"type": "boolean"}, False), ("yes", {"type": "boolean"}, "yes"),
    ("None", {"type": ["integer", "null"]}, None), ("null", {"type": "string"}, "null"),
    ("[1, 'a']", {"type": "array"}, [1, "a"]), ("{oops", {"type": "object"}, "{oops"),
    ("NaN", {"type": "number"}, "NaN"), ("NaN", None, "NaN"), ("2", {"enum": ["1", "2"]}, "2"),
    ("2", {"enum": [1, 2]}, 2), (" spaced ", {"type": "string"}, " spaced "),
    ("7", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 7)])
def test_qwen_values_are_typed_by_the_schema(raw: str, schema, value) -> None:
    assert typed_value(raw, schema) == value


@pytest.mark.parametrize("parser", NEW_PARSERS, ids=lambda p: p.name)
def test_prompt_instructions_carry_a_parsable_example(parser: ToolParser) -> None:
    text = parser.prompt_instructions()
    example = parser.format_call(*PROMPT_EXAMPLE)
    assert example in text and "\n\n" not in text
    assert parser.extract(example).calls[0] == call(*PROMPT_EXAMPLE)
    assert parser.extract(text).calls[0] == call(*PROMPT_EXAMPLE)


# Property tests: what a parser writes reads back, streamed or not; any text, any split.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6),
    lambda inner: (st.lists(inner, max_size=3)
                   | st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=8)
identifiers = st.from_regex(r"[a-z_][a-z0-9_]{0,7}", fullmatch=True)
call_lists = st.lists(st.tuples(identifiers, st.dictionaries(identifiers, json_values,
                                                             max_size=4)),
                      min_size=1, max_size=3)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parser=st.sampled_from([MISTRAL, GRANITE, PHI4, PY, get_tool_parser("qwen3_coder")]),
       calls=call_lists, before=st.text(alphabet="ab .,\n", max_size=8), data=st.data())
def test_written_calls_read_back(parser: ToolParser, calls: list, before: str,
                                 data: st.DataObject) -> None:
    """format_call's text comes back as the same calls (the same JSON values: the XML and
    Python formats re-serialise; untyped XML strings that look like JSON are the one
    ambiguity, so those are compared after the parser's own reading)."""
    written = [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls]
    text = before + "\n".join(parser.format_call(n, a) for n, a in written)
    found = parser.extract(text)
    assert found.content == (before.rstrip() or None)
    assert [c.name for c in found.calls] == [n for n, _ in written]
    for got, (_, a) in zip(found.calls, calls):
        if parser.name == "qwen3_coder":
            want = {k: v if not isinstance(v, str) else typed_value(v, None)
                    for k, v in a.items()}
        else:
            want = a
        assert json.loads(got.arguments) == want
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8)))
    check_agrees(parser, text, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])


PIECES = ["[TOOL_CALLS]", "<|tool_call|>", "functools", "<tool_call>", "</tool_call>",
          "<function=f>", "<function=g>", "</function>", "<parameter=a>", "<parameter=b>",
          "</parameter>", "<|python_start|>", "<|python_end|>", "[ARGS]", "f", "g(", "(", ")",
          '{"name": ', '"f"', ', "arguments": ', "{", "}", "[", "]", '"', "'", "\\", ":",
          ", ", " ", "\n", "x=", "1", "True", "é", "<", '{"a": 1}',
          '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]', "[f(a=1)]", QWEN_CALL]
texts = st.lists(st.sampled_from(PIECES) | st.text(alphabet='ab <>{}[]()"\'=:\n\\', max_size=4),
                 max_size=14).map("".join)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parser=st.sampled_from(NEW_PARSERS), text=texts, data=st.data())
def test_stream_agrees_with_extract_for_any_text_and_split(parser: ToolParser, text: str,
                                                           data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=10)))
    check_agrees(parser, text, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])


# `--tool-call-parser auto`: the markers each family's template writes.
@pytest.mark.parametrize("template,name", [
    ("{% for t in tools %}...{% endfor %}<tool_call>\n<function={{ name }}>\n"
     "<parameter=...>", "qwen3_coder"),
    ('{%- if tools %}<tools>{{ tools }}</tools> <tool_call>\n{"name": ...}</tool_call>',
     "hermes"),
    ("{{ '[AVAILABLE_TOOLS]' }}{{ tools | tojson }}{{ '[TOOL_CALLS]' }}", "mistral"),
    ("<|start_of_role|>available_tools<|end_of_role|>... <|tool_call|>", "granite"),
    ("<|tool|>{{ tools }}<|/tool|> functools[...]", "phi4_mini_json"),
    ("{{ '<|system|>' + m['content'] + '<|tool|>' + m['tools'] + '<|/tool|>' }}",
     "phi4_mini_json"),  # Phi-4-mini's own template names no call format
    ("[func_name1(params_name1=params_value1, params_name2=params_value2...)]", "pythonic"),
    ('Respond in the format {"name": function name, "parameters": dictionary of argument '
     "name and its value}. <|python_tag|>", "llama3_json"),
    ({"default": "{{ messages }}", "tool_use": "{{ '[TOOL_CALLS]' }}"}, "mistral")])
def test_auto_picks_the_parser_from_the_template(template, name: str) -> None:
    assert detect_tool_parser(template) == name


@pytest.mark.parametrize("template", [None, "", "{% for m in messages %}{{ m.content }}"
                                      "{% endfor %}"])
def test_auto_without_a_known_format_names_the_choices(template) -> None:
    with pytest.raises(ValueError, match="auto cannot tell.*hermes.*pythonic"):
        detect_tool_parser(template)
