"""Anthropic's Messages API shapes: a request body -> the Chat Completions body the chat
path serves, and errors -> Anthropic's error body.

The translation is the whole of /v1/messages' request side: what it makes is validated,
rendered and prepared by `ChatHandler.prepare` exactly as a chat body is. Every Anthropic
mistake it can see is a 400 naming the Anthropic field (`messages[2].content[0]`), before
the chat path's own checks run.

    Anthropic                                   Chat Completions
    system (string | text blocks)               a first "system" message
    user text blocks                            a "user" message's text parts
    user tool_result blocks                     "tool" messages (tool_call_id, content)
    assistant text / tool_use blocks            an "assistant" message: content, tool_calls
    assistant thinking blocks                   dropped (the template shows no past reasoning)
    tools[{name, description, input_schema}]    tools[{type: function, function: {...}}]
    tool_choice auto | any | tool | none        "auto" | "required" | named | "none"
    disable_parallel_tool_use                   parallel_tool_calls: false
    stop_sequences                              stop
    temperature, top_p, top_k, vLLM's extras    the same fields
    thinking {type: enabled | disabled}         chat_template_kwargs.enable_thinking
    thinking {type: adaptive}                   (the template's default)
    output_config.format (json_schema)          response_format (json_schema)
"""
from __future__ import annotations

import json
from typing import Any

from aioengine.server.protocol import ApiError, get_bool, get_int

__all__ = ["MESSAGES_PATH", "anthropic_error_body", "is_messages_path", "messages_to_chat"]

MESSAGES_PATH = "/v1/messages"

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                504: "timeout_error", 529: "overloaded_error"}
# The content blocks a text model cannot take.
_MEDIA_BLOCKS = ("image", "document", "search_result", "container_upload")
# Fields passed to the chat body as they are (validated there as chat validates them):
# Anthropic's sampling fields, then vLLM's extras that make sense here (as /v1/responses).
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos")


def is_messages_path(path: str) -> bool:
    """Whether a request path is the Messages API's (its errors take Anthropic's shape)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_error_body(status: int, body: dict[str, Any]) -> dict[str, Any]:
    """An error body the server wrote in OpenAI's shape (`{"error": {"message", ...}}`)
    in Anthropic's: `{"type": "error", "error": {"type", "message"}}`, typed by status."""
    error = body.get("error")
    message = error.get("message") if isinstance(error, dict) else None
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": str(message or "")}}


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param)


def _text_of(block: dict, where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad(f"{where}.text must be a string", "messages")
    return text


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict):
        raise _bad(f"{where} must be an object, got {type(block).__name__}", "messages")
    kind = block.get("type")
    if kind in _MEDIA_BLOCKS:
        raise _bad(f"{where}: content blocks of type {kind!r} are not supported: this "
                   "server serves a text-only model", "messages")
    if not isinstance(kind, str):
        raise _bad(f"{where}.type must be a string", "messages")
    return kind


def _blocks(content: Any, where: str) -> list[dict]:
    """A message's content as blocks: a string is one text block."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of content blocks, got "
                   f"{type(content).__name__}", "messages")
    return content


def _tool_result(block: dict, where: str) -> dict[str, Any]:
    """A tool_result block as a "tool" message (an error's text says it is one)."""
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{where}.tool_use_id must be a non-empty string", "messages")
    content = block.get("content")
    if content is None:
        text = ""
    else:
        parts = []
        for j, part in enumerate(_blocks(content, f"{where}.content")):
            inner = f"{where}.content[{j}]"
            if _block_type(part, inner) != "text":
                raise _bad(f"{inner}: a tool_result holds text blocks only", "messages")
            parts.append(_text_of(part, inner))
        text = "\n".join(parts)
    if get_bool(block, "is_error", False):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _tool_call(block: dict, where: str) -> dict[str, Any]:
    """A tool_use block as a Chat Completions tool call (arguments: its input as JSON)."""
    call_id, name, args = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{where}.id must be a non-empty string", "messages")
    if not isinstance(name, str) or not name:
        raise _bad(f"{where}.name must be a non-empty string", "messages")
    if not isinstance(args, dict):
        raise _bad(f"{where}.input must be an object", "messages")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _user_turn(blocks: list, where: str) -> list[dict[str, Any]]:
    """A user message: its tool results as "tool" messages, then its text (if any)."""
    results, parts = [], []
    for j, block in enumerate(blocks):
        inner = f"{where}[{j}]"
        kind = _block_type(block, inner)
        if kind == "text":
            parts.append({"type": "text", "text": _text_of(block, inner)})
        elif kind == "tool_result":
            results.append(_tool_result(block, inner))
        else:
            raise _bad(f"{inner}: a user message cannot hold a {kind!r} block", "messages")
    return results + ([{"role": "user", "content": parts}] if parts or not results else [])


def _assistant_turn(blocks: list, where: str) -> dict[str, Any]:
    parts, calls = [], []
    for j, block in enumerate(blocks):
        inner = f"{where}[{j}]"
        kind = _block_type(block, inner)
        if kind == "text":
            parts.append(_text_of(block, inner))
        elif kind == "tool_use":
            calls.append(_tool_call(block, inner))
        elif kind not in ("thinking", "redacted_thinking"):
            raise _bad(f"{inner}: an assistant message cannot hold a {kind!r} block",
                       "messages")
    # Text as one string: a template without tools writes past calls after string content.
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(parts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _system(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "system", "content": value}] if value else []
    if not isinstance(value, list):
        raise _bad("system must be a string or a list of text blocks", "system")
    parts = []
    for j, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text" \
                or not isinstance(block.get("text"), str):
            raise _bad(f"system[{j}] must be a text block", "system")
        parts.append({"type": "text", "text": block["text"]})
    return [{"role": "system", "content": parts}] if parts else []


def _chat_messages(body: dict) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if messages is None:
        raise _bad("messages is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    out = _system(body.get("system"))
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(f"{where} must be an object", "messages")
        role = message.get("role")
        if "content" not in message:
            raise _bad(f"{where}.content is required", "messages")
        blocks = _blocks(message["content"], f"{where}.content")
        if role == "user":
            out += _user_turn(blocks, f"{where}.content")
        elif role == "assistant":
            out.append(_assistant_turn(blocks, f"{where}.content"))
        else:
            raise _bad(f"{where}.role must be 'user' or 'assistant', got {role!r:.40}",
                       "messages")
    return out


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _bad("tools must be a list", "tools")
    tools = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(f"{where} must be an object", "tools")
        if tool.get("type", "custom") != "custom":
            raise _bad(f"{where}: tools of type {tool.get('type')!r:.60} are not supported; "
                       "only client tools (name, description, input_schema) are", "tools")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad(f"{where}.input_schema is required: a JSON schema object", "tools")
        spec = {"name": tool.get("name"), "parameters": schema}
        if tool.get("description") is not None:
            spec["description"] = tool["description"]
        tools.append({"type": "function", "function": spec})
    return tools


def _tool_choice(value: Any, has_tools: bool) -> tuple[Any, bool]:
    """(Chat Completions' tool_choice, parallel_tool_calls)."""
    if value is None:
        return None, True
    if not isinstance(value, dict):
        raise _bad("tool_choice must be an object with a type", "tool_choice")
    parallel = not get_bool(value, "disable_parallel_tool_use", False)
    kind = value.get("type")
    if kind in ("any", "tool") and not has_tools:
        raise _bad(f"tool_choice {kind!r} needs at least one tool in tools", "tool_choice")
    if kind == "tool":
        name = value.get("name")
        if not isinstance(name, str):
            raise _bad("tool_choice of type 'tool' needs the tool's name", "tool_choice")
        return {"type": "function", "function": {"name": name}}, parallel
    chat = {"auto": "auto", "any": "required", "none": "none"}.get(kind)  # type: ignore[arg-type]
    if chat is None:
        raise _bad("tool_choice.type must be 'auto', 'any', 'tool' or 'none', got "
                   f"{kind!r:.40}", "tool_choice")
    return chat, parallel


def _thinking(value: Any) -> bool | None:
    """`thinking` as the templates' enable_thinking (None: the template's default, for
    "adaptive" too: the model decides)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "enabled":
        get_int(value, "budget_tokens", None, lo=1)  # accepted; the template decides
        return True
    if kind in ("disabled", "adaptive"):
        return False if kind == "disabled" else None
    raise _bad("thinking.type must be 'enabled' (with budget_tokens), 'disabled' or "
               f"'adaptive', got {kind!r:.40}", "thinking")


def _output_format(value: Any) -> dict[str, Any] | None:
    """`output_config.format` (a JSON schema) as Chat Completions' response_format."""
    if value is None:
        return None
    fmt = value.get("format") if isinstance(value, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
            or not isinstance(fmt.get("schema"), dict):
        raise _bad("output_config.format must be {\"type\": \"json_schema\", \"schema\": "
                   "{...}}", "output_config")
    return {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}


def _stop(value: Any) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise _bad("stop_sequences must be a list of non-empty strings", "stop_sequences")
    return value


def messages_to_chat(body: dict, count_only: bool = False) -> dict[str, Any]:
    """The Chat Completions body of a Messages body (`count_only`: a count_tokens body,
    which has no max_tokens). Fields chat checks (model, sampling) are checked there."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model is required: a string", "model")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise _bad("metadata must be an object", "metadata")
    chat: dict[str, Any] = {"model": model, "messages": _chat_messages(body)}
    tools = _tools(body.get("tools"))
    choice, parallel = _tool_choice(body.get("tool_choice"), bool(tools))
    if tools:
        chat["tools"], chat["parallel_tool_calls"] = tools, parallel
        if choice is not None:
            chat["tool_choice"] = choice
    thinking = _thinking(body.get("thinking"))
    if thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": thinking}
    output_format = _output_format(body.get("output_config"))
    if count_only:
        return chat
    if body.get("max_tokens") is None:
        raise _bad("max_tokens is required", "max_tokens")
    chat["max_tokens"] = get_int(body, "max_tokens", None, lo=1)
    chat["stream"] = bool(get_bool(body, "stream", False))
    chat["stop"] = _stop(body.get("stop_sequences"))
    chat.update((k, body[k]) for k in _SAMPLING_FIELDS if body.get(k) is not None)
    if output_format is not None:
        chat["response_format"] = output_format
    return chat
