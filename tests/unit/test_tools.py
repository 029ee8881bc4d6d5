"""Function tools: validation, tool_choice, the structural tags of each choice (compiled and
run through a real xgrammar matcher on the bundled tokenizer), and the chat prompt."""
from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from aioengine.model.loader import load_tokenizer
from aioengine.chat_prompt import (load_chat_template, render_chat_prompt,
                                          template_takes_tools)
from aioengine.server.protocol import ApiError
from aioengine.tool_parsers import get_tool_parser
from aioengine.server.tools import (FunctionTool, ToolChoice, ToolPlan, ToolServingConfig,
                                    chat_tool_plan, parse_tool_choice, parse_tools)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object",
                                       "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"]}}}
AUTO = ToolServingConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> xgr.GrammarCompiler:
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer),
                                              stop_token_ids=[tokenizer.eos_token_id])
    return xgr.GrammarCompiler(info, max_threads=1)


def accepts(compiler, tokenizer, plan: ToolPlan, text: str) -> bool:
    """Whether the plan's grammar accepts `text` followed by EOS."""
    grammar = compiler.compile_structural_tag(json.dumps(plan.structural_tag()))
    matcher = xgr.GrammarMatcher(grammar)
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return all(matcher.accept_token(t) for t in ids)


@pytest.mark.parametrize("tools,match", [
    ([{"type": "function", "function": {"description": "x"}}], "needs a function name"),
    ([{"type": "function", "function": {"name": "a b"}}], "invalid name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
     "object schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "JSON schema object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nope"}}}}}], "not a valid JSON schema"),
    ([{"type": "code_interpreter"}], "not supported"),
    ([WEATHER, WEATHER], "twice"),
    ({"name": "f"}, "must be a list")])
def test_bad_tools_are_400s_naming_tools(tools, match: str) -> None:
    with pytest.raises(ApiError, match=match) as e:
        parse_tools(tools)
    assert e.value.status == 400 and e.value.param == "tools"


@pytest.mark.parametrize("body,match", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not in tools"),
    ({"tool_choice": "required"}, "needs at least one tool"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "must be 'none'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "function's name")])
def test_bad_tool_choice_is_a_400(body: dict, match: str) -> None:
    with pytest.raises(ApiError, match=match) as e:
        chat_tool_plan(body, AUTO)
    assert e.value.status == 400 and e.value.param == "tool_choice"


def test_auto_needs_the_server_flags() -> None:
    with pytest.raises(ApiError, match="--enable-auto-tool-choice") as e:
        chat_tool_plan({"tools": [WEATHER]}, ToolServingConfig())
    assert e.value.param == "tool_choice"
    # Forced calls work without them (in the default hermes format).
    plan = chat_tool_plan({"tools": [WEATHER], "tool_choice": "required"}, ToolServingConfig())
    assert plan is not None and plan.parser.name == "hermes"


def test_choice_defaults_and_none() -> None:
    tools = parse_tools([WEATHER])
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, []) == ToolChoice("none")
    assert chat_tool_plan({"tools": [WEATHER], "tool_choice": "none"}, AUTO) is None
    flat = parse_tools([{"type": "function", **WEATHER["function"]}], flat=True)
    assert flat == tools
    assert parse_tool_choice({"type": "function", "name": "get_weather"}, flat,
                             flat=True) == ToolChoice("function", "get_weather")
    # No parameters = a function without arguments.
    assert parse_tools([{"type": "function", "function": {"name": "f"}}])[0].parameters == {
        "type": "object", "properties": {}}


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'


def plan_of(choice: object, parallel: bool = True) -> ToolPlan:
    plan = chat_tool_plan({"tools": [WEATHER, TIME], "tool_choice": choice,
                           "parallel_tool_calls": parallel}, AUTO)
    assert plan is not None
    return plan


@pytest.mark.parametrize("choice,parallel,text,ok", [
    ("auto", True, "It is sunny.", True),
    ("auto", True, "Let me check. " + CALL, True),
    ("auto", True, CALL + "\n" + CALL2, True),
    ("auto", True, '<tool_call>\n{"name": "get_weather", "arguments": {"town": "x"}}\n'
     "</tool_call>", False),  # an argument the schema does not have
    ("auto", True, '<tool_call>\n{"name": "delete_all", "arguments": {}}\n</tool_call>',
     False),  # a function that is not offered
    ("required", True, "It is sunny.", False),
    ("required", True, CALL, True),
    ("required", True, CALL + "\n" + CALL2, True),
    ("required", False, CALL + "\n" + CALL2, False),
    ("required", True, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "pst"}}\n'
     "</tool_call>", False),  # not in the enum
    ({"type": "function", "function": {"name": "get_time"}}, True, CALL2, True),
    ({"type": "function", "function": {"name": "get_time"}}, True, CALL, False),
    ({"type": "function", "function": {"name": "get_time"}}, True, CALL2 + "\n" + CALL2,
     False)])
def test_structural_tags_allow_exactly_valid_calls(compiler, tokenizer, choice, parallel,
                                                   text: str, ok: bool) -> None:
    assert accepts(compiler, tokenizer, plan_of(choice, parallel), text) is ok


L3_CALL = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'


@pytest.mark.parametrize("choice,text,ok", [
    ("required", L3_CALL, True),
    ("required", '{"name": "get_weather", "parameters": {}}', False),
    ("required", "Oslo is nice.", False),
    ("auto", "Oslo is nice.", True),
    ("auto", "Sure. " + L3_CALL, True),
    ("auto", L3_CALL + "; " + L3_CALL, True),
    ("auto", L3_CALL + " and more text", False),  # calls end a llama3_json reply
    ("auto", '{"name": "get_time", "parameters": {}}', False)])
def test_llama3_json_tags(compiler, tokenizer, choice: str, text: str, ok: bool) -> None:
    plan = ToolPlan(parse_tools([WEATHER]), ToolChoice(choice), get_tool_parser("llama3_json"))
    assert accepts(compiler, tokenizer, plan, text) is ok


def test_default_tool_prompt_and_past_calls(tokenizer) -> None:
    """SmolLM2's template takes no tools: the default prompt lists them in a system block;
    a past call is written back in the parser's format and its result as a user turn."""
    assert not template_takes_tools(tokenizer.chat_template)
    parser = get_tool_parser("hermes")
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    weather = [t.chat_dict() for t in parse_tools([WEATHER])]
    ids = render_chat_prompt(tokenizer, messages, weather, parser)
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a function calling AI model")
    assert '"name": "get_weather"' in text and "<tool_call>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in text
    # Without tools offered, past calls still render, and no tool prompt is added.
    plain = tokenizer.decode(render_chat_prompt(tokenizer, messages, [], parser))
    assert "function calling AI model" not in plain and "<tool_response>" in plain


TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {% if m.tool_calls %}{% for c in m.tool_calls %}"
    "CALL {{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}\n{% endfor %}assistant:")


def test_a_template_that_takes_tools_gets_them(tokenizer, tmp_path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TOOL_TEMPLATE)
    template = load_chat_template(str(path))
    assert template == TOOL_TEMPLATE and template_takes_tools(template)
    assert load_chat_template(TOOL_TEMPLATE) == TOOL_TEMPLATE
    with pytest.raises(ValueError, match="neither a file nor"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Rome"}'}}]}]
    weather = [t.chat_dict() for t in parse_tools([WEATHER])]
    text = tokenizer.decode(render_chat_prompt(tokenizer, messages, weather,
                                               get_tool_parser("hermes"), template))
    # The tools reached the template, and the arguments arrived as an object.
    # (transformers renders with trim_blocks: the newline after a block tag is dropped)
    assert text == "TOOLS:get_weather;user: hiassistant: CALL get_weather Romeassistant:"


def test_function_tool_chat_dict() -> None:
    tool = FunctionTool("f", {"type": "object"}, "d")
    assert tool.chat_dict() == {"type": "function", "function": {
        "name": "f", "description": "d", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("argv,match", [
    (["--enable-auto-tool-choice"], "requires --tool-call-parser"),
    (["--tool-call-parser", "nope"], "invalid choice"),
    (["--chat-template", "/no/such/template.jinja"], "neither a file nor"),
    (["--max-stored-responses", "-1"], ">= 0")])
def test_serve_tool_flags_are_checked_before_anything_loads(argv: list[str], match: str,
                                                            capsys) -> None:
    from aioengine.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", *argv])
    assert e.value.code == 2 and match in capsys.readouterr().err
