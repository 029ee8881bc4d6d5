"""The Responses API's items <-> chat messages, its Response object, and the builder of
output items and stream events.

`input` (a string, or a list of message / function_call / function_call_output items) and a
previous response's conversation become chat messages, which the same chat-template path as
/v1/chat/completions renders. The model's output becomes output items: a `message` with one
`output_text` part, and one `function_call` per call; with --reasoning-parser, a `reasoning`
item (one `reasoning_text` part, no summary) before them holds the model's reasoning,
streamed as `response.reasoning_text.delta` / `.done` between its part's added and done
events. Reasoning items given back in `input` are skipped (templates drop past reasoning).

A response that has ended keeps its output items as JSON bytes (`ResponseState.freeze`): a
stored response is then a handful of objects the garbage collector tracks, whatever its
size, so a full collection never walks the store (issue 48: an object-heavy store made
every collection a loop stall).
"""
from __future__ import annotations

import copy
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from aioengine.outputs import CompletionOutput
from aioengine.reasoning_parsers import ReasoningSplit, ReasoningStream
from aioengine.server.protocol import ApiError
from aioengine.server.request_limits import (METADATA_MAX_KEY_CHARS, METADATA_MAX_KEYS,
                                             METADATA_MAX_VALUE_CHARS)
from aioengine.server.serving_engine import check_failed, failure_body
from aioengine.tool_parsers import (ContentDelta, ToolCallArgsDelta, ToolCallStart,
                                           ToolEvent)
from aioengine.server.tools import ToolPlan

_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def check_metadata(value: Any) -> dict[str, str]:
    """`metadata` under OpenAI's rules: an object of at most 16 string keys of at most 64
    characters, each value a string of at most 512; a 400 (param "metadata") otherwise.
    None is {}."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ApiError(400, f"metadata must be an object, got {type(value).__name__}",
                       "metadata")
    if len(value) > METADATA_MAX_KEYS:
        raise ApiError(400, f"metadata has {len(value)} keys; at most {METADATA_MAX_KEYS} are "
                       "allowed", "metadata")
    for key, item in value.items():
        if len(key) > METADATA_MAX_KEY_CHARS:
            raise ApiError(400, f"metadata key {key[:20]!r}... has {len(key)} characters; at "
                           f"most {METADATA_MAX_KEY_CHARS} are allowed", "metadata")
        if not isinstance(item, str):
            raise ApiError(400, f"metadata[{key!r}] must be a string, got "
                           f"{type(item).__name__}", "metadata")
        if len(item) > METADATA_MAX_VALUE_CHARS:
            raise ApiError(400, f"metadata[{key!r}] has {len(item)} characters; at most "
                           f"{METADATA_MAX_VALUE_CHARS} are allowed", "metadata")
    return value


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
        elif kind != "reasoning":  # a past output's reasoning: not rendered again
            raise ApiError(400, f"{where} has unsupported type {kind!r:.40}; supported: "
                           "message, function_call, function_call_output, reasoning", "input")
    return messages


def message_item(text: str, item_id: str | None = None,
                 status: str = "completed") -> dict[str, Any]:
    return {"id": item_id or new_item_id("msg"), "type": "message", "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def reasoning_item(text: str, item_id: str | None = None,
                   status: str = "completed") -> dict[str, Any]:
    return {"id": item_id or new_item_id("rs"), "type": "reasoning", "status": status,
            "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


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
    # The echoed request settings (tools, instructions, ...); a large value may be an
    # orjson.Fragment (its JSON, serialized once).
    request: dict[str, Any]
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "in_progress"
    output: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    # The output items as JSON once the response has ended (`freeze`); `output` is then [].
    output_json: bytes | None = None

    def freeze(self) -> int:
        """Keeps the ended response's output items as JSON (no more items come); returns
        their size in bytes."""
        if self.output_json is None:
            self.output_json = orjson.dumps(self.output)
            self.output = []
        return len(self.output_json)

    def set_usage(self, prompt: int, cached: int, completion: int, reasoning: int = 0) -> None:
        self.usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                      "output_tokens": completion,
                      "output_tokens_details": {"reasoning_tokens": reasoning},
                      "total_tokens": prompt + completion}

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": self.status, "model": self.model,
                "output": copy.deepcopy(self.output) if self.output_json is None
                else orjson.Fragment(self.output_json),
                "usage": self.usage, "error": self.error,
                "incomplete_details": self.incomplete_details, **self.request}


class _TextStream:
    """The output stream of a response without tools: all text is message text."""

    def feed(self, delta: str) -> list[ToolEvent]:
        return [ContentDelta(delta)]

    def finish(self) -> list[ToolEvent]:
        return []


@dataclass
class ResponseBuilder:
    """Turns one sample's output into output items and Responses events."""

    state: ResponseState
    plan: ToolPlan | None
    # With a reasoning parser: the output's split (its answer goes on to `stream`).
    reasoning: ReasoningStream | None = None
    seq: int = 0
    open_item: dict[str, Any] | None = None
    stream: Any = field(init=False)
    num_reasoning_tokens: int = 0  # set when the output finishes

    def __post_init__(self) -> None:
        self.stream = self.plan.parser.stream() if self.plan else _TextStream()

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def lifecycle(self, kind: str) -> dict[str, Any]:
        return self.event(kind, response=self.state.body())

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.state.output.append(item)
        self.open_item = item
        # Events carry copies: the item grows after them, and a batch of events is only
        # serialised when the whole update has been applied.
        events = [self.event("response.output_item.added", output_index=self._index(),
                             item=copy.deepcopy(item))]
        if item["type"] in ("message", "reasoning"):
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=self._index(), content_index=0,
                                     part=dict(item["content"][0])))
        return events

    def _index(self) -> int:
        return len(self.state.output) - 1

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self.open_item = self.open_item, None
        if item is None:
            return []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": self._index()}
        if item["type"] == "message":
            part = item["content"][0]
            events = [self.event("response.output_text.done", **where, content_index=0,
                                 text=part["text"], logprobs=[]),
                      self.event("response.content_part.done", **where, content_index=0,
                                 part=dict(part))]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events = [self.event("response.reasoning_text.done", **where, content_index=0,
                                 text=part["text"]),
                      self.event("response.content_part.done", **where, content_index=0,
                                 part=dict(part))]
        else:
            events = [self.event("response.function_call_arguments.done", **where,
                                 name=item["name"], arguments=item["arguments"])]
        return events + [self.event("response.output_item.done", output_index=self._index(),
                                    item=copy.deepcopy(item))]

    def apply(self, ev: ToolEvent) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if isinstance(ev, ContentDelta) and self.plan is not None and self.plan.forced:
            return events  # a call cut short by max_output_tokens, not text
        if isinstance(ev, ContentDelta):
            if self.open_item is None or self.open_item["type"] != "message":
                events += self.close()
                events += self._open(message_item("", status="in_progress"))
            assert self.open_item is not None
            self.open_item["content"][0]["text"] += ev.text
            events.append(self.event("response.output_text.delta", item_id=self.open_item["id"],
                                     output_index=self._index(), content_index=0,
                                     delta=ev.text, logprobs=[]))
        elif isinstance(ev, ToolCallStart):
            events += self.close()
            events += self._open(function_call_item(ev.name, "", status="in_progress"))
        else:
            assert isinstance(ev, ToolCallArgsDelta) and self.open_item is not None
            self.open_item["arguments"] += ev.text
            events.append(self.event("response.function_call_arguments.delta",
                                     item_id=self.open_item["id"], output_index=self._index(),
                                     delta=ev.text))
        return events

    def apply_reasoning(self, text: str) -> list[dict[str, Any]]:
        """Reasoning text into the open reasoning item (opened first if need be)."""
        events: list[dict[str, Any]] = []
        if self.open_item is None or self.open_item["type"] != "reasoning":
            events += self.close()
            events += self._open(reasoning_item("", status="in_progress"))
        assert self.open_item is not None
        self.open_item["content"][0]["text"] += text
        events.append(self.event("response.reasoning_text.delta", item_id=self.open_item["id"],
                                 output_index=self._index(), content_index=0, delta=text))
        return events

    def _split(self, c: CompletionOutput) -> ReasoningSplit:
        """The update's new text as reasoning and answer (all answer without a parser)."""
        if self.reasoning is None:
            return ReasoningSplit("", c.text)
        split = self.reasoning.feed(c.text) if c.text else ReasoningSplit()
        if c.finished:  # reasoning held back (a partial tag) comes before any answer
            rest = self.reasoning.finish()
            split = ReasoningSplit(split.reasoning + rest.reasoning, split.content + rest.content)
        return split

    def advance(self, c: CompletionOutput) -> list[dict[str, Any]]:
        """Events for one update of the sample; on its last, the items are closed and the
        response's status set."""
        check_failed(c.finish_reason, c.error)
        split = self._split(c)
        events = self.apply_reasoning(split.reasoning) if split.reasoning else []
        answer = split.content
        events += [e for ev in (self.stream.feed(answer) if answer else []) for e in self.apply(ev)]
        if not c.finished:
            return events
        if self.reasoning is not None:
            self.num_reasoning_tokens = self.reasoning.count_tokens(c.cumulative_token_ids)
        events += [e for ev in self.stream.finish() for e in self.apply(ev)]
        incomplete = c.finish_reason == "length"
        events += self.close("incomplete" if incomplete else "completed")
        if incomplete:
            self.state.status = "incomplete"
            self.state.incomplete_details = {"reason": "max_output_tokens"}
        elif c.finish_reason == "abort":
            self.state.status = "cancelled"
        else:
            self.state.status = "completed"
        return events

    def fail(self, e: BaseException) -> dict[str, Any]:
        self.state.status = "failed"
        self.state.error = {"code": "server_error", "message": failure_body(e)[1]["error"]
                            ["message"]}
        return self.lifecycle("response.failed")

    def final_event(self) -> dict[str, Any]:
        kind = {"completed": "response.completed", "incomplete": "response.incomplete",
                "cancelled": "response.cancelled"}.get(self.state.status, "response.failed")
        return self.lifecycle(kind)
