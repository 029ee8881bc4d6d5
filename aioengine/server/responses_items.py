"""The Responses API's items <-> chat messages, and its Response object.

`input` (a string, or a list of message / function_call / function_call_output items) and a
previous response's conversation become chat messages, which the same chat-template path as
/v1/chat/completions renders. The model's output becomes output items: a `message` with one
`output_text` part, and one `function_call` per call.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aioengine.server.protocol import ApiError

_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}.content[{j}] has unsupported type {kind!r:.40}; only "
                           "text parts (input_text, output_text) are supported", "input")
        texts.append(part["text"])
    return "\n".join(texts)


def _function_call(item: dict, where: str) -> dict[str, Any]:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise ApiError(400, f"{where} (function_call) needs a string {key!r}", "input")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` as chat messages; 400 (param "input") for anything else."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ApiError(400, "input must be a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where} must be an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise ApiError(400, f"{where}.role must be one of {', '.join(_MESSAGE_ROLES)}, "
                               f"got {role!r:.40}", "input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # calls of one turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ApiError(400, f"{where} (function_call_output) needs a string 'call_id'",
                               "input")
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, where)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        else:
            raise ApiError(400, f"{where} has unsupported type {kind!r:.40}; supported: "
                           "message, function_call, function_call_output", "input")
    return messages


def message_item(text: str, item_id: str | None = None,
                 status: str = "completed") -> dict[str, Any]:
    return {"id": item_id or new_item_id("msg"), "type": "message", "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def function_call_item(name: str, arguments: str, item_id: str | None = None,
                       call_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id or new_item_id("fc"), "type": "function_call", "status": status,
            "call_id": call_id or f"call_{uuid.uuid4().hex[:24]}", "name": name,
            "arguments": arguments}


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the assistant turn(s) of a chat conversation."""
    messages: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":
            messages.append({"role": "assistant",
                             "content": "".join(p["text"] for p in item["content"])})
        elif item["type"] == "function_call":
            call = _function_call(item, "output")
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return messages


@dataclass
class ResponseState:
    """One response as the API shows it; `body()` is the Response object."""

    id: str
    model: str
    request: dict[str, Any]  # the echoed request settings (tools, instructions, ...)
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "in_progress"
    output: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None

    def set_usage(self, prompt: int, cached: int, completion: int) -> None:
        self.usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                      "output_tokens": completion,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": prompt + completion}

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": self.status, "model": self.model, "output": list(self.output),
                "usage": self.usage, "error": self.error,
                "incomplete_details": self.incomplete_details, **self.request}
