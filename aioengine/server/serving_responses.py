"""POST /v1/responses (OpenAI's Responses API), GET /v1/responses/{id} and
POST /v1/responses/{id}/cancel.

A response is one chat request underneath: `instructions` + the previous response's
conversation + `input` become chat messages (`responses_items.py`), rendered and generated
as in /v1/chat/completions, with the same tool plan. The output text always goes through
the same incremental path (the tool-call parser's stream when tools are offered), which
both builds the output items and, when streaming, sends the Responses events:

    response.created, response.in_progress,
    per reasoning (--reasoning-parser): output_item.added, content_part.added,
                  reasoning_text.delta..., then reasoning_text.done, content_part.done,
                  output_item.done
    per message:  output_item.added, content_part.added, output_text.delta..., then
                  output_text.done, content_part.done, output_item.done
    per call:     output_item.added, function_call_arguments.delta..., then
                  function_call_arguments.done, output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

As in chat, `chat_template_kwargs` and `enable_thinking` (vLLM's extensions) reach the
template.

Stored responses (`store`, default true) live in `responses_store.ResponsesStore` (its rules
are there); `background: true` runs the response as a task that GET polls and cancel stops.
"""
from __future__ import annotations

import asyncio
import re
from contextlib import aclosing
from typing import Any, Mapping

import orjson
from aiohttp import web

from aioengine.sampling_params import SamplingParams
from aioengine.server.protocol import (ApiError, build_sampling_params, get_bool, get_int,
                                       get_priority, get_str)
from aioengine.server.responses_items import (ResponseBuilder, ResponseState, check_metadata,
                                              input_messages, new_item_id, output_messages)
from aioengine.server.responses_store import (ENTRY_OVERHEAD_BYTES, ResponsesStore,
                                              StoredResponse)
from aioengine.server.serving_chat import (apply_reasoning, apply_tool_plan,
                                           chat_template_kwargs, render_messages)
from aioengine.server.serving_engine import (Outputs, SSEStream, ServingContext, UsageTracker,
                                             failure_body, json_response, merged_outputs,
                                             trace_headers)
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


def responses_sampling_params(body: dict, defaults: Mapping[str, Any] | None = None
                              ) -> SamplingParams:
    """SamplingParams of a /v1/responses body (`defaults`: the model's)."""
    derived = {k: body[k] for k in _SAMPLING_FIELDS if k in body}
    fmt = _response_format(body)
    if fmt is not None:
        derived["response_format"] = fmt
    max_tokens = get_int(body, "max_output_tokens", None, lo=1)
    if max_tokens is None:
        max_tokens = (defaults or {}).get("max_tokens")
    try:
        return build_sampling_params(derived, max_tokens, None, defaults=defaults)
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
    prompt_ids = render_messages(ctx, system + messages, plan, param="input", check=True,
                                 template_kwargs=chat_template_kwargs(body))
    return messages, plan, prompt_ids


_FORMAT_KEYS = ("type", "name", "description", "schema", "strict")


def _echo_text(body: dict) -> dict[str, Any]:
    """`text` as a Response repeats it: its format's own fields (validated by
    _response_format; a schema is bounded by --max-schema-bytes), nothing else."""
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict):
        return {"format": {"type": "text"}}
    return {"format": {k: fmt[k] for k in _FORMAT_KEYS if k in fmt}}


def _echo(body: dict, instructions: str | None, metadata: dict[str, str],
          params: SamplingParams, plan: ToolPlan | None) -> tuple[dict[str, Any], int]:
    """The request settings a Response object repeats, and their size as JSON. The ones of
    unbounded shape (tools, text, tool_choice, metadata) are kept as their JSON
    (orjson.Fragment): serialized once here, a single object for the garbage collector."""
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "metadata": metadata,
            "parallel_tool_calls": plan.parallel if plan else
            bool(get_bool(body, "parallel_tool_calls", True)),
            "previous_response_id": body.get("previous_response_id"),
            "store": bool(get_bool(body, "store", True)),
            "background": bool(get_bool(body, "background", False)),
            "temperature": params.temperature, "top_p": params.top_p,
            "text": _echo_text(body),
            "tool_choice": body.get("tool_choice") or ("auto" if body.get("tools") else "none"),
            "tools": body.get("tools") or [], "truncation": "disabled",
            "user": get_str(body, "user", None)}
    nbytes = 0
    for key in ("metadata", "text", "tool_choice", "tools"):
        raw = orjson.dumps(echo[key])
        echo[key] = orjson.Fragment(raw)
        nbytes += len(raw)
    for key in ("instructions", "previous_response_id", "user"):
        nbytes += len((echo[key] or "").encode("utf-8", "surrogatepass"))
    return echo, nbytes


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
        self.store = ResponsesStore(max_stored, ctx.limits.max_stored_response_bytes)
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
            if not previous.ended:
                raise ApiError(400, f"response {previous_id!r} is still in progress",
                               "previous_response_id")
            history = previous.conversation()
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
        metadata = check_metadata(body.get("metadata"))
        instructions = get_str(body, "instructions", None)
        history = self._history(body)
        params = responses_sampling_params(body, ctx.engine.default_sampling)
        messages, plan, prompt_ids = await ctx.work.run(request, response_prompt, ctx, body,
                                                        history, instructions)
        apply_tool_plan(plan, params, "text")
        in_reasoning = apply_reasoning(ctx.reasoning_parser, params, prompt_ids)
        prepared = await ctx.prepare([prompt_ids], params, lora_request, body,
                                     prompt_param="input",
                                     grammar_param="tools" if plan else "text",
                                     trace_headers=trace_headers(request), operation="chat")
        echo, echo_bytes = _echo(body, instructions, metadata, params, plan)
        state = ResponseState(new_response_id(self.id_tag), model, echo)
        stored = StoredResponse(state, messages, background, echo_bytes)
        if store:
            self._admit(stored)  # before the engine request starts: a refusal costs nothing
        run = ResponseBuilder(state, plan, ctx.reasoning_parser.stream(in_reasoning)
                              if ctx.reasoning_parser else None)
        outputs = merged_outputs(ctx.engine, prepared, state.id, get_priority(body))
        usage = UsageTracker([len(prompt_ids)])
        if background:
            state.status = "queued"
            stored.task = asyncio.create_task(self._collect(run, outputs, usage, stored))
            # A task cancelled before its first step never runs _collect's `finally`.
            stored.task.add_done_callback(lambda _: self._end(run, usage, stored))
            return json_response(state.body())
        if stream:
            return await self._stream(request, run, outputs, usage, stored)
        error = await self._collect(run, outputs, usage, stored)
        if error is not None:
            status, error_body = failure_body(error)
            return json_response(error_body, status)
        return json_response(state.body())

    def _admit(self, stored: StoredResponse) -> None:
        """Stores a new response, counted as its request while it runs. One that does not
        fit is answered unstored (`store` reads false), but a background one must be
        stored: 400 if it never could be, 429 while running background ones fill the
        store."""
        nbytes = (ENTRY_OVERHEAD_BYTES + stored.request_bytes
                  + len(orjson.dumps(stored.messages)))  # bounded by the context length
        if self.store.admit(stored, nbytes):
            return
        limits = (f"--max-stored-responses {self.store.max_entries}, "
                  f"--max-stored-response-bytes {self.store.max_bytes}")
        if stored.background and not self.store.fits(nbytes):
            raise ApiError(400, f"a background response must be stored, and this one "
                           f"({nbytes} bytes) cannot be ({limits})", "background")
        if stored.background:
            raise ApiError(429, "the Responses store is full of running background "
                           f"responses ({limits}); retry when one has ended or cancel one",
                           "background", type="rate_limit_error")
        stored.state.request["store"] = False

    def _finish(self, run: ResponseBuilder, usage: UsageTracker,
                stored: StoredResponse) -> None:
        """The response has ended (once; later calls do nothing): its usage set, its
        conversation and output kept as JSON, and the store told its final size (it may
        drop it: then `store` reads false)."""
        if stored.ended:
            return
        state = run.state
        u = usage.body()
        state.set_usage(u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"],
                        u["completion_tokens"], run.num_reasoning_tokens)
        stored.messages_json = orjson.dumps(stored.messages + output_messages(state.output))
        stored.messages = []
        nbytes = (ENTRY_OVERHEAD_BYTES + stored.request_bytes + len(stored.messages_json)
                  + state.freeze())
        stored.ended = True
        if state.request["store"] and not self.store.update(stored, nbytes):
            state.request["store"] = False

    def _end(self, run: ResponseBuilder, usage: UsageTracker, stored: StoredResponse) -> None:
        """Ends a response that stopped before it finished (cancelled, or its client left)
        as "cancelled"; one that has ended already is left as it is."""
        if stored.ended:
            return
        run.close("incomplete")
        run.state.status = "cancelled"
        self._finish(run, usage, stored)

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
            # Cancelled (POST .../cancel), or its client went away: closing `outputs` has
            # aborted its engine request (KV blocks freed) either way.
            self._end(run, usage, stored)
            if stored.task is None:
                raise
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
            self._end(run, usage, stored)
            return sse.response
        except asyncio.CancelledError:
            self._end(run, usage, stored)
            raise
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
