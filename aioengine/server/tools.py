"""Function tools of a chat or Responses request: validation, `tool_choice`, and the
constraint that makes a call parse.

A request's tools become one `ToolPlan`. Its constraint is an xgrammar structural tag built
from the tool-call parser's own format (`call_tag(name, schema)` per function, wrapped by
`only_calls` / `auto_calls`: tool_parsers/base.py), so the text the grammar allows is
exactly the text the parser reads back:

    tool_choice        structural tag                        what the model may write
    "auto"             auto_calls: triggered_tags             free text; a call once opened
                       (trigger = call start)                 names an offered function and
                                                              its arguments match its schema
                       (a parser whose calls end the output: text without the trigger, then
                       only calls)
    "required"         only_calls, at_least_one               only calls (one or more)
    {"function": f}    only_calls over f's tag alone,         exactly one call of f
                       stop_after_first
    "none"             no constraint, no tools in the prompt

With `parallel_tool_calls: false` every form stops after the first call.
"""
from __future__ import annotations

import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema

from aioengine.sampling_params import StructuredOutputs
from aioengine.server.protocol import ApiError, get_bool
from aioengine.chat_prompt import tool_dict
from aioengine.tool_parsers import (AUTO_TOOL_PARSER, DEFAULT_TOOL_PARSER, ToolParser,
                                    detect_tool_parser, get_tool_parser)

logger = logging.getLogger("aioengine.server")

# OpenAI: a-z, A-Z, 0-9, underscores and dashes (dots accepted too, as vLLM does), <= 64.
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

ToolChoiceMode = Literal["none", "auto", "required", "function"]


@dataclass(frozen=True)
class FunctionTool:
    name: str
    parameters: dict[str, Any]
    description: str | None = None

    def chat_dict(self) -> dict[str, Any]:
        """The tool as Chat Completions writes it (what chat templates expect)."""
        return tool_dict(self.name, self.description, self.parameters)


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolChoiceMode
    name: str | None = None  # mode "function"


@dataclass(frozen=True)
class ToolServingConfig:
    """The server's tool settings (vLLM's flags); `auto` resolved (`resolve`)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    @classmethod
    def resolve(cls, enable_auto_tool_choice: bool, tool_call_parser: str | None,
                chat_template: str | dict | None) -> ToolServingConfig:
        """The settings with `--tool-call-parser auto` replaced by the parser whose format
        `chat_template` (the one the server renders with) writes, logged; ConfigError
        naming the choices when it writes none we know."""
        if tool_call_parser == AUTO_TOOL_PARSER:
            tool_call_parser = detect_tool_parser(chat_template)
            logger.info("--tool-call-parser auto: the chat template writes %s tool calls",
                        tool_call_parser)
        return cls(enable_auto_tool_choice, tool_call_parser)

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # ValueError for an unknown name
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")

    @property
    def parser(self) -> ToolParser:
        """The configured parser, else the default format (forced calls, past calls)."""
        return get_tool_parser(self.tool_call_parser or DEFAULT_TOOL_PARSER)


def _check_parameters(value: Any, where: str, param: str) -> dict[str, Any]:
    if value is None:
        return dict(_EMPTY_PARAMETERS)
    if not isinstance(value, dict):
        raise ApiError(400, f"{where}.parameters must be a JSON schema object, got "
                       f"{type(value).__name__}", param)
    if value.get("type", "object") != "object":
        raise ApiError(400, f"{where}.parameters must be an object schema (type 'object'), "
                       f"got type {value.get('type')!r:.40}", param)
    try:
        jsonschema.validators.validator_for(value).check_schema(value)
    except jsonschema.SchemaError as e:
        at = "/".join(str(p) for p in e.path)
        raise ApiError(400, f"{where}.parameters is not a valid JSON schema"
                       f"{f' at {at}' if at else ''}: {e.message:.200}", param) from None
    return value if "type" in value else {"type": "object", **value}


def parse_tool(item: Any, index: int, param: str = "tools", flat: bool = False) -> FunctionTool:
    """One function tool: Chat Completions' `{"type": "function", "function": {...}}`, or
    the Responses API's flat `{"type": "function", "name": ...}` when `flat`."""
    where = f"{param}[{index}]"
    if not isinstance(item, dict):
        raise ApiError(400, f"{where} must be an object, got {type(item).__name__}", param)
    if item.get("type", "function") != "function":
        raise ApiError(400, f"{where}.type {item.get('type')!r:.40} is not supported; only "
                       "'function' tools are", param)
    spec = item if flat else item.get("function")
    if not isinstance(spec, dict):
        raise ApiError(400, f"{where}.function must be an object", param)
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"{where} needs a function name", param)
    if not _NAME_RE.match(name):
        raise ApiError(400, f"{where} has an invalid name {name!r:.80}: use a-z, A-Z, 0-9, "
                       "'_', '-' or '.', at most 64 characters", param)
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise ApiError(400, f"{where}.description must be a string", param)
    return FunctionTool(name, _check_parameters(spec.get("parameters"), where, param),
                        description)


def parse_tools(value: Any, param: str = "tools", flat: bool = False) -> list[FunctionTool]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ApiError(400, f"{param} must be a list of tools, got {type(value).__name__}", param)
    tools = [parse_tool(item, i, param, flat) for i, item in enumerate(value)]
    seen: set[str] = set()
    for tool in tools:  # a set, not names.count(): 100,000 tools must not take minutes
        if tool.name in seen:
            raise ApiError(400, f"{param} names the function {tool.name!r} twice", param)
        seen.add(tool.name)
    return tools


def parse_tool_choice(value: Any, tools: list[FunctionTool], param: str = "tool_choice",
                      flat: bool = False) -> ToolChoice:
    """`"none" | "auto" | "required"` or a named function (`{"type": "function",
    "function": {"name": ...}}`; flat `{"type": "function", "name": ...}` for Responses).
    Absent: "auto" with tools, else "none"."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise ApiError(400, f"{param} must be 'none', 'auto', 'required' or a named "
                           f"function, got {value!r:.40}", param)
        if value == "required" and not tools:
            raise ApiError(400, f"{param} 'required' needs at least one tool in tools", param)
        return ToolChoice(value)  # type: ignore[arg-type]
    if not isinstance(value, dict) or value.get("type") != "function":
        raise ApiError(400, f"{param} must be a string or an object with type 'function'", param)
    spec = value if flat else value.get("function")
    name = spec.get("name") if isinstance(spec, dict) else None
    if not isinstance(name, str):
        raise ApiError(400, f"{param} needs the function's name", param)
    if name not in {t.name for t in tools}:
        raise ApiError(400, f"{param} names the function {name!r:.80}, which is not in tools",
                       param)
    return ToolChoice("function", name)


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses its tools: which are offered, how the model must answer, and in
    which format calls are written and parsed."""

    tools: list[FunctionTool]
    choice: ToolChoice
    parser: ToolParser
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """Only calls may be written: any other text is the start of a call cut short by
        max_tokens, never content."""
        return self.choice.mode in ("required", "function")

    def _tags(self, tools: list[FunctionTool]) -> list[dict[str, Any]]:
        return [self.parser.call_tag(t.name, t.parameters) for t in tools]

    def structural_tag(self, text_schema: dict[str, Any] | None = None) -> dict[str, Any]:
        """The constraint of the output (see the module docstring). With `text_schema`
        (a response format) an "auto" answer is either that JSON or calls."""
        single = not self.parallel
        if self.choice.mode == "function":
            named = [t for t in self.tools if t.name == self.choice.name]
            fmt = self.parser.only_calls(self._tags(named), single=True)
        elif self.choice.mode == "required":
            fmt = self.parser.only_calls(self._tags(self.tools), single)
        elif text_schema is not None:
            fmt = {"type": "or", "elements": [
                {"type": "json_schema", "json_schema": text_schema},
                self.parser.only_calls(self._tags(self.tools), single)]}
        else:
            fmt = self.parser.auto_calls(self._tags(self.tools), single)
        return {"type": "structural_tag", "format": fmt}

    def constraint(self, response_format: StructuredOutputs | None,
                   format_param: str | None) -> StructuredOutputs:
        """The request's one constraint: the tools' structural tag, folding in a JSON
        response format for "auto" (a forced call has no text to format)."""
        text_schema = None
        if response_format is not None and self.choice.mode == "auto":
            if response_format.json is not None:
                text_schema = response_format.json
            elif response_format.json_object:
                text_schema = {"type": "object"}
            else:
                raise ApiError(400, "with tools, the response format can only be a JSON "
                               "schema or json_object", format_param)
        return StructuredOutputs(structural_tag=self.structural_tag(text_schema))


def plan_tools(tools: list[FunctionTool], choice: ToolChoice, parallel: bool,
               config: ToolServingConfig, param: str = "tool_choice") -> ToolPlan | None:
    """The request's plan, or None when no tool may be called (no tools, or "none")."""
    if choice.mode == "none" or not tools:
        return None
    if choice.mode == "auto" and not config.enable_auto_tool_choice:
        raise ApiError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                       "--tool-call-parser to be set", param)
    parser = config.parser.bind({t.name: t.parameters for t in tools})
    return ToolPlan(tools, choice, parser, parallel)


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def chat_tool_plan(body: dict, config: ToolServingConfig) -> ToolPlan | None:
    """The plan of a /v1/chat/completions body (`tools`, `tool_choice`,
    `parallel_tool_calls`); every mistake is a 400 before anything is queued."""
    tools = parse_tools(body.get("tools"))
    choice = parse_tool_choice(body.get("tool_choice"), tools)
    parallel = get_bool(body, "parallel_tool_calls", True)
    return plan_tools(tools, choice, bool(parallel), config)
