"""Chat messages (with tools) -> prompt token ids, as the server's chat routes and
LLM.chat render them (shared here: the engine never imports the server). Tools are given
as OpenAI chat tool dicts (`{"type": "function", "function": {...}}`, FunctionTool.chat_dict).

Past tool calls (assistant `tool_calls`) and tool results (`role: "tool"`) render in every
template. A template that takes `tools` (it mentions them) gets the tools and the messages
as Hugging Face templates expect them (arguments as objects). Any other template, such as
the bundled SmolLM2's, gets the default tool prompt instead: a system block listing the
tools and the call format of the server's tool-call parser; past calls are written back in
that format and tool results become user turns in `<tool_response>` blocks.

The prompt boundary (`render_chat`): unless the caller is trusted, a message's role must be
one the template takes, and special-token text in anything a message or tool carries is
tokenized as plain text (tokenizer_utils.PromptBoundary), so message text cannot open or
close turns; only the template's own special tokens are control tokens.
"""
from __future__ import annotations

import functools
import json
import os
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from aioengine.tool_parsers import ToolParser
from aioengine.tokenizer_utils import (ChatTemplateError, PromptBoundary, prompt_boundary,
                                       render_chat_template)

DEFAULT_TOOL_PROMPT = """\
You are a function calling AI model. You may call one or more functions to assist with \
the user query. Don't make assumptions about what values to plug into functions. Here are \
the available functions:
<tools>
{tools}
</tools>
{call_format}"""

_TOOLS_RE = re.compile(r"\btools\b")
# The roles every template is given (developer as sent: Chat Completions does not map it),
# and those a template names where it compares a message's role (e.g. Llama 3.1's ipython).
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
_ROLE_TEST_RE = re.compile(
    r"""role['"]?\]?\s*(?:==|!=|is\s+not|is|(?:not\s+)?in)\s*[\[(]?((?:\s*['"][\w-]+['"]\s*,?)+)""")
_QUOTED_RE = re.compile(r"""['"]([\w-]+)['"]""")


def tool_dict(name: str, description: str | None, parameters: dict) -> dict:
    """A function tool as Chat Completions writes it (what chat templates expect)."""
    function: dict[str, Any] = {"name": name}
    if description:
        function["description"] = description
    function["parameters"] = parameters
    return {"type": "function", "function": function}


def normalize_tool(tool: Any) -> dict:
    """An OpenAI tool dict (nested `function`, or flat as the Responses API writes it) as
    the server renders it (tool_dict: name, description if any, parameters defaulting to
    an empty object schema). ChatTemplateError for one without a name."""
    function = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ChatTemplateError("each tool must be a function tool with a name")
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return tool_dict(function["name"], function.get("description"), parameters)


def load_chat_template(value: str) -> str:
    """`--chat-template`: a file's contents, or the value itself when it is a template."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def template_takes_tools(template: str | dict | None) -> bool:
    if isinstance(template, dict):  # named templates: transformers picks "tool_use"
        return "tool_use" in template or any(map(template_takes_tools, template.values()))
    return bool(template) and bool(_TOOLS_RE.search(template))  # type: ignore[arg-type]


def default_tool_prompt(tools: list[dict], parser: ToolParser) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return DEFAULT_TOOL_PROMPT.format(tools=listed, call_format=parser.prompt_instructions())


def _past_calls(message: dict, index: int) -> list[tuple[str, Any]]:
    """(name, arguments) of an assistant message's `tool_calls`, checked."""
    calls = message.get("tool_calls") or []
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise ChatTemplateError(f"{where} must be a list")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ChatTemplateError(f"{where}[{j}] needs function.name")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            _check_arguments(arguments, f"{where}[{j}].function.arguments")
        elif not isinstance(arguments, dict):
            raise ChatTemplateError(f"{where}[{j}].function.arguments must be a JSON string")
        out.append((function["name"], arguments))
    return out


def _check_arguments(arguments: str, where: str) -> None:
    """A past call's arguments are a JSON object, as the model is to write them (a call
    the model is shown with broken arguments teaches it to write broken ones)."""
    try:
        value = json.loads(arguments)
    except ValueError as e:
        raise ChatTemplateError(f"{where} is not valid JSON ({e}): {arguments[:80]!r}") from None
    if not isinstance(value, dict):
        raise ChatTemplateError(f"{where} must be a JSON object, got {type(value).__name__}")


def _as_object(arguments: str | dict) -> Any:
    return arguments if isinstance(arguments, dict) else json.loads(arguments)


def _for_tool_template(messages: list[dict]) -> list[dict]:
    """Hugging Face templates read `tool_calls[i].function.arguments` as an object."""
    out = []
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("tool_calls"):
            calls = [{**c, "function": {"name": name, "arguments": _as_object(args)}}
                     for c, (name, args) in zip(message["tool_calls"], _past_calls(message, i))]
            message = {**message, "tool_calls": calls}
        out.append(message)
    return out


def _for_plain_template(messages: list[dict], parser: ToolParser) -> list[dict]:
    """Past calls as text in the parser's format; tool results as user turns."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            out.append(message)
            continue
        if message.get("tool_calls"):
            written = [parser.format_call(name, args if isinstance(args, str)
                                          else json.dumps(args, ensure_ascii=False))
                       for name, args in _past_calls(message, i)]
            content = message.get("content")
            text = "\n".join(([content] if isinstance(content, str) and content else [])
                             + written)
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = text
        elif message.get("role") == "tool":
            content = message.get("content")
            if isinstance(content, list):  # text parts
                content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
            message = {"role": "user",
                       "content": f"<tool_response>\n{content or ''}\n</tool_response>"}
        out.append(message)
    return out


def _with_system_block(messages: list[dict], block: str) -> list[dict]:
    first = messages[0] if messages else None
    if isinstance(first, dict) and first.get("role") in ("system", "developer") \
            and isinstance(first.get("content"), str):
        return [{**first, "role": "system", "content": f"{first['content']}\n\n{block}"},
                *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


@functools.lru_cache(maxsize=16)
def _roles(template: str) -> frozenset[str]:
    named = (role for group in _ROLE_TEST_RE.findall(template)
             for role in _QUOTED_RE.findall(group))
    return frozenset(CHAT_ROLES).union(named)  # words only (_QUOTED_RE)


def template_roles(template: str | dict | None) -> frozenset[str]:
    """CHAT_ROLES plus the roles `template` compares a message's role with."""
    if isinstance(template, str):
        return _roles(template)
    texts = template.values() if isinstance(template, dict) else []
    return frozenset(CHAT_ROLES).union(*(_roles(t) for t in texts if isinstance(t, str)))


def _has_control_chars(text: str) -> bool:
    return any(unicodedata.category(c)[0] in "CZ" for c in text)  # Z: spaces, separators


def check_roles(messages: list, template: str | dict | None,
                boundary: PromptBoundary) -> None:
    """ChatTemplateError for a role the template does not take: a role is written into the
    prompt as text, so one with a newline or a special token would forge turns."""
    allowed = template_roles(template)  # clean words: a role in it needs no other check
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or not role or role in allowed:
            continue  # (normalize_messages says what is wrong with a missing role)
        if _has_control_chars(role) or boundary.has_special(role):
            raise ChatTemplateError(f"messages[{i}].role must not contain whitespace, control "
                                    f"characters or special tokens, got {role[:40]!r}")
        raise ChatTemplateError(f"messages[{i}].role {role[:40]!r} is not one of this "
                                f"chat template's roles: {', '.join(sorted(allowed))}")


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat. `boundary` None: `text` is encoded as it is (special tokens
    recognized: there was no special-token text in the messages, or the caller is
    trusted); else `text` holds sentinels and only `boundary.encode` tokenizes it."""
    text: str
    boundary: PromptBoundary | None = None

    def encode(self, tokenizer: Any) -> list[int]:
        if self.boundary is not None:
            return self.boundary.encode(self.text)
        return list(tokenizer.encode(self.text, add_special_tokens=False))


def render_chat(tokenizer: Any, messages: Any, tools: list[dict], parser: ToolParser,
                chat_template: str | None = None, add_generation_prompt: bool = True,
                chat_template_kwargs: dict | None = None,
                trust_special_tokens: bool = False) -> ChatPrompt:
    """`messages` with `tools` offered, rendered behind the prompt boundary (module doc);
    `trust_special_tokens`: as rendered before it (any role; special-token text in messages
    acts as control tokens). ChatTemplateError for malformed messages or roles."""
    if trust_special_tokens:
        return ChatPrompt(render_chat_text(tokenizer, messages, tools, parser, chat_template,
                                           add_generation_prompt, chat_template_kwargs))
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    boundary = prompt_boundary(tokenizer)
    check_roles(messages, chat_template or getattr(tokenizer, "chat_template", None), boundary)
    # The template variables too: a template may write them into the prompt.
    escaped_messages, escaped_tools = boundary.escape(messages), boundary.escape(tools)
    escaped_kwargs = boundary.escape(chat_template_kwargs)
    try:
        text = render_chat_text(tokenizer, escaped_messages, escaped_tools, parser,
                                chat_template, add_generation_prompt, escaped_kwargs)
    except ChatTemplateError as e:  # its message may quote escaped text
        raise ChatTemplateError(boundary.unescape(str(e))) from e.__cause__
    if (escaped_messages is messages and escaped_tools is tools
            and escaped_kwargs is chat_template_kwargs):
        return ChatPrompt(text)  # nothing escaped: the ids are those of the text as it is
    return ChatPrompt(text, boundary)


def render_chat_text(tokenizer: Any, messages: Any, tools: list[dict],
                     parser: ToolParser, chat_template: str | None = None,
                     add_generation_prompt: bool = True,
                     chat_template_kwargs: dict | None = None) -> str:
    """The prompt text of `messages` with `tools` offered (empty: none); the template
    writes its own special tokens, so it is encoded without adding any. ChatTemplateError
    for malformed messages or a failing template. No prompt boundary: `render_chat`."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template_takes_tools(template):
        return render_chat_template(tokenizer, _for_tool_template(messages),
                                    add_generation_prompt,
                                    tools or None, chat_template, chat_template_kwargs)
    messages = _for_plain_template(messages, parser)
    if tools:
        messages = _with_system_block(messages, default_tool_prompt(tools, parser))
    return render_chat_template(tokenizer, messages, add_generation_prompt, None,
                                chat_template, chat_template_kwargs)


def render_chat_prompt(tokenizer: Any, messages: Any, tools: list[dict],
                       parser: ToolParser, chat_template: str | None = None,
                       add_generation_prompt: bool = True,
                       chat_template_kwargs: dict | None = None,
                       trust_special_tokens: bool = False) -> list[int]:
    """Token ids of `messages` with `tools` offered (render_chat, encoded)."""
    return render_chat(tokenizer, messages, tools, parser, chat_template,
                       add_generation_prompt, chat_template_kwargs,
                       trust_special_tokens).encode(tokenizer)
