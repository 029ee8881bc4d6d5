"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

A Messages body is translated into a Chat Completions body (messages_protocol.py) and
prepared by `ChatHandler.prepare`: the same template, tool plan, sampling defaults, limits
and engine request as /v1/chat/completions. Only the answer's shape differs. One output's
text goes through one incremental path, `MessageBuilder` (the reasoning parser, then the
tool-call parser when tools are offered), which builds the content blocks and, when
streaming, Anthropic's events:

    message_start, ping,
    per block: content_block_start, content_block_delta... (thinking_delta, text_delta or
               input_json_delta), content_block_stop
    message_delta (stop_reason, stop_sequence, usage), message_stop
    an `error` event in place of the rest if the engine fails after the start

Blocks come in the order the model wrote them: thinking, then text and tool_use blocks.
"""
from __future__ import annotations

import json
import uuid
from contextlib import aclosing
from typing import Any

from aiohttp import web

from aioengine.outputs import CompletionOutput
from aioengine.reasoning_parsers import ReasoningStream
from aioengine.server.messages_protocol import anthropic_error_body, messages_to_chat
from aioengine.server.offload import body_bytes
from aioengine.server.protocol import ApiError
from aioengine.server.serving_chat import ChatHandler, chat_prompt
from aioengine.server.serving_engine import (ApiCall, Outputs, PreparedCall, SSEStream,
                                             ServingContext, check_failed, failure_body,
                                             json_response, trace_headers)
from aioengine.server.tools import ToolPlan
from aioengine.tool_parsers import ContentDelta, ToolCallArgsDelta, ToolCallStart, ToolEvent

# (event name, payload); the payload's "type" is the event name.
Event = tuple[str, dict[str, Any]]

# Thinking blocks carry a signature field; ours is not a signature of anything (as vLLM).
THINKING_SIGNATURE = ""


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _tool_input(arguments: str) -> Any:
    """A call's arguments as tool_use.input: the object, or {} for arguments cut short
    (max_tokens), whose text the stream has sent as partial_json."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageBuilder:
    """One output's text deltas in; its content blocks and stream events out."""

    def __init__(self, plan: ToolPlan | None, reasoning: ReasoningStream | None) -> None:
        self.plan = plan
        self.tool_stream = plan.parser.stream() if plan else None
        self.reasoning = reasoning
        self.blocks: list[dict[str, Any]] = []
        self.open = False  # the last block is open (it still takes deltas)
        # The open block's text (thinking, text or tool_use arguments), joined at its stop:
        # a list, so that a long answer costs O(its length), not O(length^2).
        self.pieces: list[str] = []
        self.calls = 0

    def feed(self, text: str, final: bool) -> list[Event]:
        events: list[Event] = []
        content = text
        if self.reasoning is not None:
            split = self.reasoning.feed(text)
            thinking, content = split.reasoning, split.content
            if final:
                rest = self.reasoning.finish()
                thinking, content = thinking + rest.reasoning, content + rest.content
            if thinking:
                self._delta(events, "thinking", thinking)
        for event in self._answer_events(content, final):
            self._answer_event(events, event)
        if final:
            if not self.blocks:  # an empty answer is one empty text block
                self._start(events, {"type": "text", "text": ""})
            self._stop(events)
        return events

    def _answer_events(self, content: str, final: bool) -> list[ToolEvent]:
        if self.tool_stream is None:
            return [ContentDelta(content)] if content else []
        events = self.tool_stream.feed(content) if content else []
        if final:
            events += self.tool_stream.finish()
        if self.plan is not None and self.plan.forced:  # only calls: any text is a cut call
            events = [e for e in events if not isinstance(e, ContentDelta)]
        return events

    def _answer_event(self, events: list[Event], event: ToolEvent) -> None:
        if isinstance(event, ContentDelta):
            self._delta(events, "text", event.text)
        elif isinstance(event, ToolCallStart):
            self._start(events, {"type": "tool_use", "id": new_tool_use_id(),
                                 "name": event.name, "input": {}})
            self.calls += 1
        else:
            assert isinstance(event, ToolCallArgsDelta)
            self.pieces.append(event.text)
            events.append(self._event("content_block_delta", delta={
                "type": "input_json_delta", "partial_json": event.text}))

    def _delta(self, events: list[Event], kind: str, text: str) -> None:
        """Text of a thinking or text block: the open one, or a new one after it."""
        if not (self.open and self.blocks[-1]["type"] == kind):
            start = ({"type": "thinking", "thinking": "", "signature": THINKING_SIGNATURE}
                     if kind == "thinking" else {"type": "text", "text": ""})
            self._start(events, start)
        self.pieces.append(text)
        events.append(self._event("content_block_delta", delta={
            "type": f"{kind}_delta", kind: text}))

    def _start(self, events: list[Event], block: dict[str, Any]) -> None:
        self._stop(events)
        self.blocks.append(block)
        self.open = True
        events.append(self._event("content_block_start", content_block=dict(block)))

    def _stop(self, events: list[Event]) -> None:
        if not self.open:
            return
        block, text = self.blocks[-1], "".join(self.pieces)
        if block["type"] == "tool_use":
            block["input"] = _tool_input(text)
        else:
            block[block["type"]] = text  # "text" or "thinking"
        self.pieces = []
        self.open = False
        events.append(self._event("content_block_stop"))

    def _event(self, name: str, **fields: Any) -> Event:
        return name, {"type": name, "index": len(self.blocks) - 1, **fields}


class _MessagesCall(ApiCall):
    """One /v1/messages call in flight (one sample)."""

    def __init__(self, model: str, num_prompt_tokens: int, builder: MessageBuilder) -> None:
        super().__init__(new_message_id(), model, [num_prompt_tokens])
        self.builder = builder
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None

    def _advance(self, c: CompletionOutput) -> list[Event]:
        check_failed(c.finish_reason, c.error)
        if c.finish_reason == "abort":
            raise ApiError(503, "the request was aborted: the server is shutting down",
                           type="service_unavailable_error")
        events = self.builder.feed(c.text, c.finished)
        if c.finished:
            self.stop_reason = self._stop_reason(c)
        return events

    def _stop_reason(self, c: CompletionOutput) -> str:
        if c.finish_reason == "length":
            return "max_tokens"
        if self.builder.calls:
            return "tool_use"
        if isinstance(c.stop_reason, str):  # a stop string (a token id is the model's end)
            self.stop_sequence = c.stop_reason
            return "stop_sequence"
        return "end_turn"

    def _usage(self) -> dict[str, int]:
        usage = self.usage.body()
        return {"input_tokens": usage["prompt_tokens"],
                "output_tokens": usage["completion_tokens"]}

    def message(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": self.stop_reason,
                "stop_sequence": self.stop_sequence, "usage": self._usage()}

    async def collect(self, outputs: Outputs) -> web.Response:
        try:
            async with aclosing(outputs):
                async for i, out in outputs:
                    self.usage.update(i, out)
                    for c in out.outputs:
                        self._advance(c)
        except Exception as e:  # noqa: BLE001 - the engine's failure, not the caller's
            status, body = failure_body(e)
            return json_response(anthropic_error_body(status, body), status)
        return json_response(self.message(self.builder.blocks))

    async def stream(self, request: web.Request, outputs: Outputs,
                     include_usage: bool) -> web.StreamResponse:
        sse = SSEStream(request)
        await sse.start()
        try:
            async with aclosing(outputs):
                await sse.send({"type": "message_start", "message": self.message([])},
                               "message_start")
                await sse.send({"type": "ping"}, "ping")
                async for i, out in outputs:
                    self.usage.update(i, out)
                    for c in out.outputs:
                        for name, event in self._advance(c):
                            await sse.send(event, name)
            await sse.send({"type": "message_delta",
                            "delta": {"stop_reason": self.stop_reason,
                                      "stop_sequence": self.stop_sequence},
                            "usage": self._usage()}, "message_delta")
            await sse.send({"type": "message_stop"}, "message_stop")
        except ConnectionError:  # the client left; closing `outputs` aborted its request
            return sse.response
        except Exception as e:  # noqa: BLE001 - sent as the stream's last event
            try:
                await sse.send(anthropic_error_body(*failure_body(e)), "error")
            except ConnectionError:
                return sse.response
        try:
            await sse.response.write_eof()
        except ConnectionError:
            pass
        return sse.response


def _count_tokens(ctx: ServingContext, chat_body: dict) -> int:
    return len(chat_prompt(ctx, chat_body)[1])


class MessagesHandler:
    """The Messages routes, on the chat path (`ChatHandler.prepare`)."""

    def __init__(self, ctx: ServingContext, chat: ChatHandler) -> None:
        self.ctx = ctx
        self.chat = chat

    async def create(self, request: web.Request, body: dict) -> web.StreamResponse:
        size = body_bytes(request)
        chat_body = await self.ctx.work.run_sized(size, messages_to_chat, body)
        chat = await self.chat.prepare(chat_body, size, trace_headers(request))
        parser = self.ctx.reasoning_parser
        reasoning = parser.stream(chat.in_reasoning) if parser is not None else None
        call = _MessagesCall(chat.model, len(chat.prompt_ids),
                             MessageBuilder(chat.plan, reasoning))
        return await PreparedCall(call, chat.outputs(self.ctx, call.id),
                                  chat.stream).respond(request)

    async def count_tokens(self, request: web.Request, body: dict) -> web.Response:
        """`{"input_tokens": N}`: the prompt a Messages body (less max_tokens) would have,
        tools included; a prompt that could never run is a 400, as it would be there."""
        chat_body = await self.ctx.work.run(request, messages_to_chat, body, True)
        self.ctx.check_model(chat_body)
        if chat_body.get("tools") and chat_body.get("tool_choice") in (None, "auto"):
            # Every tool choice renders the same prompt; "auto" alone needs the server's
            # --enable-auto-tool-choice, which a count does not.
            chat_body["tool_choice"] = "required"
        count = await self.ctx.work.run(request, _count_tokens, self.ctx, chat_body)
        return json_response({"input_tokens": count})
