"""What the completions and chat handlers share: the served model, requests prepared by
the engine (validated once, with the server's error mapping), one engine request per
prompt with their outputs merged, usage, and SSE framing."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Iterator, Mapping
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from aioengine.engine.async_engine import AsyncEngine
from aioengine.engine.client import PreparedRequest
from aioengine.errors import EngineDeadError, InvalidRequestError, NotFoundError
from aioengine.lora.request import LoRARequest
from aioengine.outputs import CompletionOutput, RequestOutput
from aioengine.reasoning_parsers import ReasoningParser
from aioengine.sampling_params import SamplingParams
from aioengine.server.offload import PromptWork, encode_text
from aioengine.server.protocol import ApiError, StreamSpec, error_body, structured_outputs_field
from aioengine.server.request_limits import RequestLimits
from aioengine.server.server_config import DEFAULT_STREAM_WRITE_TIMEOUT
from aioengine.server.serving_models import ServingModels
from aioengine.server.tools import ToolServingConfig
from aioengine.structured import GrammarCompileError
from aioengine.tracing import TRACE_HEADERS

logger = logging.getLogger("aioengine.server")

# (prompt index, output) of every engine request of one API call, as they come.
Outputs = AsyncGenerator[tuple[int, RequestOutput], None]

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


def trace_headers(request: web.Request) -> dict[str, str] | None:
    """The W3C trace context a client sent (traceparent, tracestate), which the request's
    span continues when tracing is on; None without one. Not parsed here: a malformed
    traceparent is ignored by the tracer (a new root span), never a 400."""
    headers = {name: value for name in TRACE_HEADERS
               if (value := request.headers.get(name)) is not None}
    return headers or None


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def json_response(body: Any, status: int = 200,
                  headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json",
                        headers=headers)


@dataclass
class ServingContext:
    """The engine and how it is served; one per server."""

    engine: AsyncEngine
    models: ServingModels
    tools: ToolServingConfig = field(default_factory=ToolServingConfig)
    chat_template: str | None = None  # --chat-template (None: the model's)
    # --max-queued-requests: beyond this many waiting requests new ones get a 503.
    max_queued_requests: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    # Tokenizing, rendering and detokenizing of large bodies, off the event loop.
    work: PromptWork = field(default_factory=PromptWork)
    # --pooling: the embedding routes' pooling unless a request names one.
    pooling: str = "last"
    # The work budget of one request (--max-json-depth, --max-pooling-inputs, ...).
    limits: RequestLimits = field(default_factory=RequestLimits)
    # --trust-message-special-tokens: message content may hold control tokens, any role.
    trust_message_special_tokens: bool = False
    # --reasoning-parser, built against the engine's tokenizer (None: output is all answer).
    reasoning_parser: ReasoningParser | None = None

    @property
    def served_model_names(self) -> list[str]:
        return self.models.base_model_names

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def resolve_model(self, body: dict) -> tuple[str, LoRARequest | None]:
        """The model a request names (absent = the first served name) and its LoRA adapter
        (None = the base model); 404 for any other name."""
        return self.models.resolve(body)

    def check_model(self, body: dict) -> str:
        """The model a request names (tokenize, detokenize: an adapter's is the base's)."""
        return self.resolve_model(body)[0]

    def check_running(self) -> None:
        """503 when the engine is gone, or too many requests wait (then with Retry-After:
        what is admitted already is never disturbed)."""
        if not self.engine.is_running:
            raise ApiError(503, "the engine is not running", type="service_unavailable_error")
        limit = self.max_queued_requests
        if limit is not None and self.engine.num_waiting_requests() >= limit:
            raise ApiError(503, f"the server is overloaded: {limit} requests are already "
                           "waiting; retry later", type="service_unavailable_error",
                           code="overloaded", headers={"Retry-After": "1"})

    def encode(self, prompt: str | list[int]) -> list[int]:
        """The token ids of a completions prompt, checked as `prepare` would check them (a
        400 for one that could never run): right after tokenizing, on the thread that
        tokenized a large body, and a text far over the context from its token count."""
        with self.prompt_errors("prompt"):
            if isinstance(prompt, str):
                ids = encode_text(self.engine.tokenizer, prompt, True,
                                  self.engine.check_prompt_length)
            else:
                ids = list(prompt)
            self.engine.check_prompt(ids)
        return ids

    @contextmanager
    def prompt_errors(self, param: str) -> Iterator[None]:
        """The engine's InvalidRequestError for a prompt as a 400 naming `param`."""
        try:
            yield
        except InvalidRequestError as e:
            raise ApiError.invalid(e, param if e.param == "prompt" else None) from None

    def prompt_text(self, prompt: str | list[int], need_text: bool) -> str:
        """A completions prompt's text; that of token ids (prepared: in the vocabulary) is
        only decoded when `need_text` (echo)."""
        if isinstance(prompt, str):
            return prompt
        return (self.engine.tokenizer.decode(prompt, skip_special_tokens=False)
                if need_text else "")

    async def prepare(self, prompts: list[list[int]], params: SamplingParams,
                      lora_request: LoRARequest | None, body: dict,
                      prompt_param: str = "prompt",
                      grammar_param: str | None = None,
                      trace_headers: Mapping[str, str] | None = None,
                      operation: str = "text_completion") -> list[PreparedRequest]:
        """One engine request per prompt, prepared once by the engine: each validated
        against its prompt with its own params (max_tokens unset: what fits the KV cache,
        `default_max_tokens`), the adapter resolved, then `check_running` (503s only for
        valid requests), then the grammar compiled (thread pool, cached) before any
        response starts, so an invalid schema, regex or grammar is a 400, never a failed
        stream. `grammar_param` names the field the constraint came from (default: the
        structured-output field). `trace_headers` (the client's trace context) and
        `operation` (GenAI's name of the call: "chat" or "text_completion") go to the
        requests' traces."""
        try:
            prepared = await self.engine.prepare_batch(
                prompts, params, lora_request, fit_kv_cache=True, admit=self.check_running,
                trace_headers=trace_headers)
        except GrammarCompileError as e:
            raise ApiError(400, str(e), grammar_param or structured_outputs_field(body)
                           or e.param) from None
        except InvalidRequestError as e:
            raise ApiError.invalid(e, prompt_param if e.param == "prompt" else None) from None
        for request in prepared:  # the engine sees token ids: the route knows what it is
            request.operation = operation
        return prepared


async def merged_outputs(engine: AsyncEngine, prepared: list[PreparedRequest],
                         request_id: str, priority: int = 0) -> Outputs:
    """Runs the prepared requests (one per prompt) and yields (prompt index, output) as
    each comes.

    Use under `contextlib.aclosing`: closing (a disconnect cancels the handler) cancels the
    pumps, and each `engine.generate` aborts its request and frees its KV blocks at once.
    """
    merged: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for out in engine.generate(prepared[i], request_id=f"{request_id}-{i}",
                                             priority=priority):
                merged.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            merged.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(prepared))]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await merged.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                remaining -= 1
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def not_found_body(e: NotFoundError) -> dict[str, Any]:
    return error_body(404, str(e), "NotFoundError", code=404)


class SampleFailed(Exception):
    """A sample ended with finish_reason "error" (the engine's fault, not the caller's)."""


def check_failed(finish_reason: str | None, error: str | None) -> None:
    if finish_reason == "error":
        raise SampleFailed(error or "generation failed")


def failure_body(e: BaseException) -> tuple[int, dict]:
    """Status and error body for a failure after the request was accepted (or, for
    run-batch, of any failure of one request)."""
    if isinstance(e, ApiError):
        return e.status, e.body()
    if isinstance(e, EngineDeadError):
        return 503, error_body(503, f"the engine is not running: {e}",
                               "service_unavailable_error")
    if isinstance(e, SampleFailed):
        return 500, error_body(500, str(e), "internal_server_error")
    if isinstance(e, InvalidRequestError):
        return 400, error_body(400, str(e), "invalid_request_error", e.param)
    if isinstance(e, NotFoundError):  # e.g. its adapter was unloaded before it started
        return 404, not_found_body(e)
    return 500, error_body(500, f"{type(e).__name__}: {e}", "internal_server_error")


@dataclass
class UsageTracker:
    """Token counts of one API call: prompts counted once each, samples all."""

    prompt_tokens: list[int]
    cached_tokens: list[int] = field(default_factory=list)
    completion_tokens: int = 0

    def __post_init__(self) -> None:
        self.cached_tokens = [0] * len(self.prompt_tokens)

    def update(self, prompt_index: int, out: RequestOutput) -> None:
        self.cached_tokens[prompt_index] = out.num_cached_tokens
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)

    def body(self) -> dict[str, Any]:
        prompt = sum(self.prompt_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)}}


class ApiCall:
    """What every in-flight /v1 call has: its id, model, creation time and usage. The
    response `object` names differ per endpoint (`object_name`, `chunk_object_name`)."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, call_id: str, model: str, prompt_tokens: list[int]) -> None:
        self.id, self.model = call_id, model
        self.created = int(time.time())
        self.usage = UsageTracker(prompt_tokens)

    def body(self, choices: list[dict]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object_name, "created": self.created,
                "model": self.model, "choices": choices, "usage": self.usage.body()}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict[str, Any]:
        chunk = {"id": self.id, "object": self.chunk_object_name, "created": self.created,
                 "model": self.model, "choices": choices}
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    def collect_output(self, prompt_index: int, out: RequestOutput, c: CompletionOutput) -> None:
        """Folds one sample's new output into the call (a non-streamed call)."""
        raise NotImplementedError

    def final_choices(self) -> list[dict[str, Any]]:
        """The response's choices once every sample has finished."""
        raise NotImplementedError

    async def collect(self, outputs: Outputs) -> web.Response:
        """Waits for every sample, then answers with the whole response (or the engine's
        failure as an error response)."""
        status, body = await self.collect_body(outputs)
        return json_response(body, status)

    async def collect_body(self, outputs: Outputs) -> tuple[int, dict[str, Any]]:
        """`collect`'s status and body (run-batch writes them into its results file)."""
        try:
            async with aclosing(outputs):
                async for i, out in outputs:
                    self.usage.update(i, out)
                    for c in out.outputs:
                        self.collect_output(i, out, c)
        except Exception as e:  # noqa: BLE001 - the engine's failure, not the caller's
            return failure_body(e)
        return 200, self.body(self.final_choices())

    async def stream_start(self, sse: SSEStream) -> None:
        """Chunks sent before any output (chat sends each choice's role)."""

    def stream_choice(self, prompt_index: int, out: RequestOutput,
                      c: CompletionOutput) -> dict[str, Any] | None:
        """The chunk choice for one sample's new output, or None if there is nothing new."""
        raise NotImplementedError

    def stream_choices(self, prompt_index: int, out: RequestOutput,
                       c: CompletionOutput) -> list[dict[str, Any]]:
        """The chunk choices (one chunk each, in order) for one sample's new output."""
        choice = self.stream_choice(prompt_index, out, c)
        return [] if choice is None else [choice]

    async def stream(self, request: web.Request, outputs: Outputs,
                     include_usage: bool) -> web.StreamResponse:
        """Streams the call as SSE: one chunk per sample update as it comes, usage last
        if asked, then [DONE]; an error after the start becomes the last event."""
        sse = SSEStream(request)
        await sse.start()
        error: BaseException | None = None
        try:
            async with aclosing(outputs):
                await self.stream_start(sse)
                async for i, out in outputs:
                    self.usage.update(i, out)
                    for c in out.outputs:
                        for choice in self.stream_choices(i, out, c):
                            await sse.send(self.chunk([choice]))
            if include_usage:
                await sse.send(self.chunk([], self.usage.body()))
        except ConnectionError:  # the client left; closing `outputs` aborted its requests
            return sse.response
        except Exception as e:  # noqa: BLE001 - sent as the stream's last event
            error = e
        try:
            return await sse.finish(error)
        except ConnectionError:  # the client left (or stalled) at the very end
            return sse.response


@dataclass
class PreparedCall:
    """An API call validated and prepared (nothing runs until `outputs` is iterated):
    answered over HTTP by `respond`, or collected into a body by run-batch."""

    call: ApiCall
    outputs: Outputs
    stream: StreamSpec

    async def respond(self, request: web.Request) -> web.StreamResponse:
        if self.stream.stream:
            return await self.call.stream(request, self.outputs, self.stream.include_usage)
        return await self.call.collect(self.outputs)


# The app's --stream-write-timeout (OpenAIServer.build_app sets it).
STREAM_WRITE_TIMEOUT = web.AppKey("stream_write_timeout", float)


class SSEStream:
    """A Server-Sent Events response: one `data:` line per chunk, written at once.

    A write waits while the client's socket buffer is full; one that waits past the app's
    STREAM_WRITE_TIMEOUT (the client stopped reading but kept the connection) aborts the
    connection and raises ConnectionResetError, as a client that left does, so the caller
    aborts its requests instead of holding them and their queued outputs forever."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(headers=SSE_HEADERS)
        self.write_timeout = request.config_dict.get(STREAM_WRITE_TIMEOUT,
                                                     DEFAULT_STREAM_WRITE_TIMEOUT)

    async def start(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, payload: dict[str, Any], event: str | None = None) -> None:
        head = b"event: " + event.encode() + b"\n" if event else b""
        await self.write(head + b"data: " + orjson.dumps(payload) + b"\n\n")

    async def write(self, data: bytes) -> None:
        try:
            await asyncio.wait_for(self.response.write(data), self.write_timeout)
        except TimeoutError:
            if self.request.transport is not None:
                self.request.transport.abort()
            logger.info("stream to %s dropped: no data accepted for %g s",
                        self.request.remote, self.write_timeout)
            raise ConnectionResetError("the client accepted no data for "
                                       f"{self.write_timeout:g} s") from None

    async def finish(self, error: BaseException | None = None) -> web.StreamResponse:
        """Ends the stream: the error as a last event if there was one, then [DONE]."""
        if error is not None:
            await self.send(failure_body(error)[1])
        await self.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response
