"""POST /v1/responses (OpenAI's Responses API), GET /v1/responses/{id} and
POST /v1/responses/{id}/cancel.

A response is one chat request underneath: `instructions` + the previous response's
conversation + `input` become chat messages (`responses_items.py`), rendered and generated
as in /v1/chat/completions, with the same tool plan. The output text always goes through
the same incremental path (the tool-call parser's stream when tools are offered), which
both builds the output items and, when streaming, sends the Responses events:

    response.created, response.in_progress,
    per message:  output_item.added, content_part.added, output_text.delta..., then
                  output_text.done, content_part.done, output_item.done
    per call:     output_item.added, function_call_arguments.delta..., then
                  function_call_arguments.done, output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

Stored responses (`store`, default true) live in a bounded in-memory store, least recently
stored dropped first; `background: true` runs the response as a task that GET polls and
cancel stops.
"""
from __future__ import annotations

import asyncio
import re
from collections import OrderedDict
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from aioengine.sampling_params import SamplingParams
from aioengine.server.protocol import (ApiError, build_sampling_params, get_bool, get_int,
                                       get_priority, get_str)
from aioengine.server.responses_items import (ResponseBuilder, ResponseState, input_messages,
                                              new_item_id, output_messages)
from aioengine.server.serving_chat import apply_tool_plan, render_messages
from aioengine.server.serving_engine import (Outputs, SSEStream, ServingContext, UsageTracker,
                                             failure_body, json_response, merged_outputs)
from aioengine.server.tools import ToolPlan, parse_tool_choice, parse_tools, plan_tools

# The Responses API's sampling fields, and vLLM's extras that make sense here.
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "stop", "user", "min_tokens",
                    "ignore_eos")


def _response_format(body: dict) -> dict[str, Any] | None:
    """`text.format` as Chat Completions' `response_format`."""
    text = body.get("text")
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ApiError(400, "text.format of type json_schema needs schema, a JSON schema "
                           "object", "text")
        return {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}
    if kind in ("json_object", "text"):
        return {"type": kind}
    raise ApiError(400, "text.format.type must be 'text', 'json_object' or 'json_schema', got "
                   f"{kind!r:.40}", "text")


def responses_sampling_params(body: dict) -> SamplingParams:
    derived = {k: body[k] for k in _SAMPLING_FIELDS if k in body}
    fmt = _response_format(body)
    if fmt is not None:
        derived["response_format"] = fmt
    max_tokens = get_int(body, "max_output_tokens", None, lo=1)
    try:
        return build_sampling_params(derived, max_tokens, None)
    except ApiError as e:
        if e.param == "response_format":
            e.param = "text"
        raise


def responses_tool_plan(body: dict, ctx: ServingContext) -> ToolPlan | None:
    tools = parse_tools(body.get("tools"), flat=True)
    choice = parse_tool_choice(body.get("tool_choice"), tools, flat=True)
    parallel = get_bool(body, "parallel_tool_calls", True)
    return plan_tools(tools, choice, bool(parallel), ctx.tools)


def response_prompt(ctx: ServingContext, body: dict, history: list[dict[str, Any]],
                    instructions: str | None,
                    ) -> tuple[list[dict[str, Any]], ToolPlan | None, list[int]]:
    """The conversation (`history`, then `input`), the tool plan and the prompt ids, checked
    against the context (for a large body, off the loop)."""
    messages = history + input_messages(body["input"])
    plan = responses_tool_plan(body, ctx)
    system = [{"role": "system", "content": instructions}] if instructions else []
    prompt_ids = render_messages(ctx, system + messages, plan, param="input", check=True)
    return messages, plan, prompt_ids


@dataclass
class StoredResponse:
    state: ResponseState
    messages: list[dict[str, Any]]  # the conversation without instructions, output included
    task: asyncio.Task | None = None  # a background response while it runs


class ResponsesStore:
    """Responses by id, at most `max_entries`, the least recently stored dropped first."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        self._entries[stored.state.id] = stored
        self._entries.move_to_end(stored.state.id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        stored = self._entries.get(response_id)
        if stored is None:
            raise ApiError(404, f"Response with id {response_id!r:.80} not found.",
                           "response_id", type="not_found_error")
        return stored


def _echo(body: dict, instructions: str | None, params: SamplingParams,
          plan: ToolPlan | None) -> dict[str, Any]:
    """The request settings a Response object repeats."""
    return {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {},
            "parallel_tool_calls": plan.parallel if plan else
            bool(get_bool(body, "parallel_tool_calls", True)),
            "previous_response_id": body.get("previous_response_id"),
            "store": bool(get_bool(body, "store", True)),
            "background": bool(get_bool(body, "background", False)),
            "temperature": params.temperature, "top_p": params.top_p,
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice") or ("auto" if body.get("tools") else "none"),
            "tools": body.get("tools") or [], "truncation": "disabled",
            "user": body.get("user")}


_TAGGED_ID = re.compile(r"resp_([A-Za-z0-9]+)_[0-9a-f]+")


def new_response_id(id_tag: str = "") -> str:
    """resp_<hex>, or resp_<id_tag>_<hex> (id_tag: letters and digits)."""
    return new_item_id(f"resp_{id_tag}" if id_tag else "resp")


def response_id_tag(response_id: str) -> str:
    """The id_tag `new_response_id` made a response id with; "" for an untagged one."""
    tagged = _TAGGED_ID.fullmatch(response_id)
    return tagged.group(1) if tagged else ""


class ResponsesHandler:
    def __init__(self, ctx: ServingContext, max_stored: int = 1024, id_tag: str = "") -> None:
        """`id_tag`: put in every response id (new_response_id), so a router in front of
        several servers can send a follow-up to the server that stores the response."""
        self.ctx = ctx
        self.store = ResponsesStore(max_stored)
        self.id_tag = id_tag

    def _history(self, body: dict) -> list[dict[str, Any]]:
        """The previous response's conversation (output included); [] for none."""
        history: list[dict[str, Any]] = []
        previous_id = get_str(body, "previous_response_id", None)
        if previous_id is not None:
            try:
                previous = self.store.get(previous_id)
            except ApiError as e:
                e.param = "previous_response_id"
                raise
            if previous.state.status in ("queued", "in_progress"):
                raise ApiError(400, f"response {previous_id!r} is still in progress",
                               "previous_response_id")
            history = previous.messages
        if body.get("input") is None:
            raise ApiError(400, "input is required", "input")
        return history

    async def create(self, request: web.Request, body: dict) -> web.StreamResponse:
        ctx = self.ctx
        model, lora_request = ctx.resolve_model(body)
        stream = bool(get_bool(body, "stream", False))
        store = bool(get_bool(body, "store", True))
        background = bool(get_bool(body, "background", False))
        if background and not store:
            raise ApiError(400, "a background response must be stored (store: true)",
                           "background")
        if background and stream:
            raise ApiError(400, "background responses cannot be streamed here", "stream")
        instructions = get_str(body, "instructions", None)
        history = self._history(body)
        params = responses_sampling_params(body)
        messages, plan, prompt_ids = await ctx.work.run(request, response_prompt, ctx, body,
                                                        history, instructions)
        apply_tool_plan(plan, params, "text")
        prepared = await ctx.prepare([prompt_ids], params, lora_request, body,
                                     prompt_param="input",
                                     grammar_param="tools" if plan else "text")
        state = ResponseState(new_response_id(self.id_tag), model,
                              _echo(body, instructions, params, plan))
        stored = StoredResponse(state, messages)
        run = ResponseBuilder(state, plan)
        outputs = merged_outputs(ctx.engine, prepared, state.id, get_priority(body))
        usage = UsageTracker([len(prompt_ids)])
        if store:
            self.store.put(stored)
        if background:
            state.status = "queued"
            stored.task = asyncio.create_task(self._collect(run, outputs, usage, stored))
            return json_response(state.body())
        if stream:
            return await self._stream(request, run, outputs, usage, stored)
        error = await self._collect(run, outputs, usage, stored)
        if error is not None:
            status, error_body = failure_body(error)
            return json_response(error_body, status)
        return json_response(state.body())

    @staticmethod
    def _finish(run: ResponseBuilder, usage: UsageTracker, stored: StoredResponse) -> None:
        u = usage.body()
        run.state.set_usage(u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"],
                            u["completion_tokens"])
        stored.messages = stored.messages + output_messages(run.state.output)

    async def _collect(self, run: ResponseBuilder, outputs: Outputs, usage: UsageTracker,
                       stored: StoredResponse) -> BaseException | None:
        """Runs the response to its end; returns the engine's failure, if any. A background
        response that is cancelled ends with status "cancelled"."""
        try:
            async with aclosing(outputs):
                async for i, out in outputs:
                    run.state.status = "in_progress"
                    usage.update(i, out)
                    for c in out.outputs:
                        run.advance(c)
        except asyncio.CancelledError:
            if stored.task is None:
                raise  # the client went away: its request is aborted
            run.close("incomplete")
            run.state.status = "cancelled"
        except Exception as e:  # noqa: BLE001 - the engine's failure, not the caller's
            run.fail(e)
            return e
        finally:
            self._finish(run, usage, stored)
        return None

    async def _stream(self, request: web.Request, run: ResponseBuilder, outputs: Outputs,
                      usage: UsageTracker, stored: StoredResponse) -> web.StreamResponse:
        sse = SSEStream(request)
        await sse.start()

        async def send(ev: dict[str, Any]) -> None:
            await sse.send(ev, ev["type"])

        try:
            await send(run.lifecycle("response.created"))
            await send(run.lifecycle("response.in_progress"))
            async with aclosing(outputs):
                async for i, out in outputs:
                    usage.update(i, out)
                    for c in out.outputs:
                        for ev in run.advance(c):
                            await send(ev)
            self._finish(run, usage, stored)
            await send(run.final_event())
        except ConnectionError:  # the client left; closing `outputs` aborted its request
            return sse.response
        except Exception as e:  # noqa: BLE001 - sent as the stream's last event
            self._finish(run, usage, stored)
            try:
                await send(run.fail(e))
            except ConnectionError:
                return sse.response
        await sse.response.write_eof()
        return sse.response

    async def retrieve(self, request: web.Request) -> web.Response:
        return json_response(self.store.get(request.match_info["response_id"]).state.body())

    async def cancel(self, request: web.Request) -> web.Response:
        stored = self.store.get(request.match_info["response_id"])
        if stored.task is None:
            raise ApiError(400, "Cannot cancel a synchronous response.", "response_id")
        if not stored.task.done():
            stored.task.cancel()
            await asyncio.gather(stored.task, return_exceptions=True)
        return json_response(stored.state.body())
