"""The forced-call constraints of the mistral, granite, phi4_mini_json, qwen3_coder and
pythonic formats, compiled by xgrammar and run through a real matcher on the bundled
tokenizer: they accept exactly the calls the parser reads back, with valid arguments."""
from __future__ import annotations

import json

import pytest
from test_tools import TIME, WEATHER, accepts, compiler, tokenizer  # noqa: F401 (fixtures)

from aioengine.server.tools import ToolChoice, ToolPlan, ToolServingConfig, parse_tools, plan_tools
from aioengine.tool_parsers import get_tool_parser
from aioengine.tool_parsers.pythonic import keywords_grammar

OSLO, UTC, PST = {"city": "Oslo"}, {"zone": "utc"}, {"zone": "pst"}
NAMED_TIME = ToolChoice("function", "get_time")


def written(parser_name: str, *calls: tuple[str, dict]) -> str:
    """Calls as the family's models write several at once."""
    parser = get_tool_parser(parser_name)
    if parser_name in ("mistral", "granite", "phi4_mini_json"):
        items = [f'{{"name": "{n}", "arguments": {json.dumps(a)}}}' for n, a in calls]
        return f"{parser.trigger}[{', '.join(items)}]"
    if parser_name == "pythonic":
        return "[" + ", ".join(parser.format_call(n, json.dumps(a))[1:-1] for n, a in calls) + "]"
    return "\n".join(parser.format_call(n, json.dumps(a)) for n, a in calls)


def plan(parser_name: str, choice: ToolChoice, parallel: bool = True) -> ToolPlan:
    config = ToolServingConfig(enable_auto_tool_choice=True, tool_call_parser=parser_name)
    found = plan_tools(parse_tools([WEATHER, TIME]), choice, parallel, config)
    assert found is not None
    return found


FAMILIES = ["mistral", "granite", "phi4_mini_json", "qwen3_coder", "pythonic"]
CASES = [  # (choice, parallel, calls or text, accepted)
    (ToolChoice("required"), True, [("get_weather", OSLO)], True),
    (ToolChoice("required"), True, [("get_weather", OSLO), ("get_time", UTC)], True),
    (ToolChoice("required"), False, [("get_weather", OSLO), ("get_time", UTC)], False),
    (ToolChoice("required"), True, [("get_time", PST)], False),  # not in the enum
    (ToolChoice("required"), True, [("get_time", {})], False),  # a required key missing
    (ToolChoice("required"), True, [("get_date", UTC)], False),  # not offered
    (ToolChoice("required"), True, "It is sunny.", False),
    (NAMED_TIME, True, [("get_time", UTC)], True),
    (NAMED_TIME, True, [("get_weather", OSLO)], False),
    (NAMED_TIME, True, [("get_time", UTC), ("get_time", UTC)], False),
    (ToolChoice("auto"), True, "It is sunny in [brackets] (and parentheses).", True),
    (ToolChoice("auto"), True, [("get_weather", OSLO), ("get_time", UTC)], True),
    (ToolChoice("auto"), True, [("get_time", PST)], False),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("choice,parallel,calls,ok", CASES)
def test_forced_and_auto_constraints(compiler, tokenizer, family: str, choice: ToolChoice,
                                     parallel: bool, calls, ok: bool) -> None:
    text = calls if isinstance(calls, str) else written(family, *calls)
    the_plan = plan(family, choice, parallel)
    assert accepts(compiler, tokenizer, the_plan, text) is ok
    if ok and not isinstance(calls, str):  # what the grammar allows reads back as the calls
        found = the_plan.parser.extract(text)
        assert [(c.name, json.loads(c.arguments)) for c in found.calls] == calls


def test_auto_text_before_a_call(compiler, tokenizer) -> None:
    for family in FAMILIES:
        text = "Let me check. " + written(family, ("get_weather", OSLO))
        assert accepts(compiler, tokenizer, plan(family, ToolChoice("auto")), text), family


@pytest.mark.parametrize("schema,text,ok", [
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
      "required": ["b"]}, 'a=-3, b="x\\"y"', True),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
      "required": ["b"]}, 'b="x"', True),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
      "required": ["b"]}, "a=1", False),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, "", True),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, "a=1.5", False),
    ({"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}}},
     "a=True, b=None", True),
    ({"type": "object", "properties": {"a": {"type": "array"}}}, 'a=[1, {"k": [None]}]', True),
    ({"type": "object", "properties": {"u": {"enum": ["c", 2, True]}}}, "u=True", True),
    ({"type": "object", "properties": {"u": {"enum": ["c", 2, True]}}}, 'u="d"', False)])
def test_pythonic_keywords_grammar(schema: dict, text: str, ok: bool) -> None:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgr.Grammar.from_ebnf(keywords_grammar(schema))
    assert _is_grammar_accept_string(grammar, text) is ok
