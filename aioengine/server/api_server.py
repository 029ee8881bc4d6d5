"""The OpenAI-compatible HTTP server (aiohttp) in front of one AsyncEngine.

    client ──HTTP──> middleware (errors -> OpenAI error bodies, bearer auth on every route
                        │                but /health and the chat page's files at /)
                        └─> route handler ─> engine.generate(...) per prompt ─> JSON or SSE

Tokenizing, rendering and detokenizing of a large body run off the event loop (offload.py);
connection limits: connections.py.

`model` names the base model (a served name) or a LoRA adapter (serving_models.py, with
vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter).

Handlers run with `handler_cancellation=True`, so a client that disconnects cancels its
handler at once, which aborts its engine requests and frees their KV blocks.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import socket
from typing import Any, Awaitable, Callable

from aiohttp import web

import aioengine
from aioengine import envs
from aioengine.engine.async_engine import AsyncEngine
from aioengine.errors import EngineDeadError, InvalidRequestError, NotFoundError
from aioengine.metrics import CONTENT_TYPE
from aioengine.reasoning_parsers import get_reasoning_parser
from aioengine.server.browser_safety import BrowserSafety
from aioengine.server.chat_page import PAGE_PATHS, add_chat_page
from aioengine.server.connections import CappedSockSite, client_error_log
from aioengine.server.offload import (BODY_BYTES, PARSE_OFF_LOOP_BYTES, PromptWork,
                                      decode_ids, encode_text, parse_json_chunks)
from aioengine.server.protocol import (ApiError, error_body, get_bool, get_int, get_int_list,
                                       get_str, json_object, parse_json_object)
from aioengine.server.serving_chat import ChatHandler, render_messages
from aioengine.server.messages_protocol import (MESSAGES_PATH, anthropic_error_body,
                                                is_messages_path)
from aioengine.server.serving_completions import CompletionsHandler
from aioengine.server.serving_embedding import EmbeddingsHandler
from aioengine.server.serving_engine import (STREAM_WRITE_TIMEOUT, ServingContext, json_response,
                                             not_found_body)
from aioengine.server.serving_models import ServingModels
from aioengine.server.serving_messages import MessagesHandler
from aioengine.server.serving_responses import ResponsesHandler
from aioengine.server.serving_score import ScoreHandler
from aioengine.server.request_limits import RequestLimits, check_json_depth, check_request
from aioengine.server.server_config import ServerConfig
from aioengine.server.tools import ToolServingConfig, chat_tool_plan

logger = logging.getLogger("aioengine.server")

# A body over the limit is still read (and dropped) up to this much more, so that the client
# finishes sending and sees the 413 rather than a reset connection.
_DRAIN_BYTES = 64 << 20
_STATUS_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                 404: "not_found_error", 405: "invalid_request_error",
                 408: "invalid_request_error", 413: "invalid_request_error",
                 503: "service_unavailable_error"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
JsonHandler = Callable[[web.Request, dict], Awaitable[web.StreamResponse]]


def error_response(request: web.Request, body: dict, status: int,
                   headers: dict[str, str] | None = None) -> web.Response:
    """An error body written in OpenAI's shape, answered in the shape of the route's API:
    Anthropic's under /v1/messages (messages_protocol.py), else OpenAI's."""
    if is_messages_path(request.path):
        body = anthropic_error_body(status, body)
    return json_response(body, status, headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure as an error body of the route's API (`error_response`); only the
    server's own faults are 500s."""
    try:
        return await handler(request)
    except ApiError as e:
        response = error_response(request, e.body(), e.status, e.headers)
        if e.status == 408:  # sent, then closed: the rest of the body is not waited for
            await response.prepare(request)
            await response.write_eof()
            if request.transport is not None:
                request.transport.close()
        return response
    except web.HTTPException as e:  # unknown route, wrong method, ...
        if e.status < 400:
            raise
        kind = _STATUS_TYPES.get(e.status, "invalid_request_error")
        return error_response(request, error_body(e.status, e.reason, kind), e.status)
    except InvalidRequestError as e:
        return error_response(request, error_body(400, str(e), "invalid_request_error",
                                                  e.param), 400)
    except NotFoundError as e:
        return error_response(request, not_found_body(e), 404)
    except EngineDeadError as e:
        return error_response(request, error_body(503, f"the engine is not running: {e}",
                                                  "service_unavailable_error"), 503)
    except Exception as e:  # noqa: BLE001 - a bug of ours: log it, answer 500
        logger.exception("error handling %s %s", request.method, request.path)
        return error_response(request, error_body(500, f"{type(e).__name__}: {e}",
                                                  "internal_server_error"), 500)


def auth_middleware(api_key: str | None, metrics_without_api_key: bool = False) -> Callable:
    """With a key, every route but /health, the chat page's static files (it asks for the
    key itself) and /metrics if told needs `Authorization: Bearer KEY` or `x-api-key: KEY`
    (Anthropic's header): /tokenize, /version and /debug/faults too, and an unknown route
    is a 401 rather than a 404, so nothing about the server is told without the key."""
    open_paths = {"/health", *PAGE_PATHS}
    key = api_key.encode() if api_key is not None else b""
    if metrics_without_api_key:
        open_paths.add("/metrics")

    @web.middleware
    async def check_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if api_key is not None and request.path not in open_paths:
            header = request.headers.get("Authorization", "")
            token = header[len("Bearer "):] if header.startswith("Bearer ") else ""
            x_api_key = request.headers.get("x-api-key", "")
            # Both compared, timing-safe, whichever the client sent.
            bearer_ok = hmac.compare_digest(_header_bytes(token), key)
            x_api_key_ok = hmac.compare_digest(_header_bytes(x_api_key), key)
            if not (bearer_ok or x_api_key_ok):
                raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return await handler(request)
    return check_api_key


def _header_bytes(value: str) -> bytes:
    """A header's value as the bytes the client sent (aiohttp decodes them as UTF-8 with
    surrogate escapes), so that any bytes compare, timing-safe, as bytes."""
    return value.encode("utf-8", "surrogateescape")


def _parse_large_body(chunks: list[bytes], limits: RequestLimits) -> Any:
    """A large body's JSON value, on a prompt thread: its depth is checked before the
    parser builds anything (ijson has no depth limit of its own)."""
    check_json_depth(b"".join(chunks), limits)
    return parse_json_chunks(chunks)


async def read_json(request: web.Request, limit: int, timeout: float | None = None,
                    work: PromptWork | None = None,
                    limits: RequestLimits = RequestLimits()) -> dict:
    """The body as a JSON object; 413 past `limit` bytes (the excess is drained first), 408
    if it has not all come within `timeout` seconds (a slow-loris body), 400 if it nests
    deeper than `limits.max_json_depth` (checked before parsing, on every path). Its size
    is kept for the handler (offload.body_bytes). A body of PARSE_OFF_LOOP_BYTES or more is
    checked and parsed on one of `work`'s threads."""
    chunks: list[bytes] = []
    total = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.content.iter_chunked(1 << 16):
                total += len(chunk)
                if total <= limit:
                    chunks.append(chunk)
                elif total > limit + _DRAIN_BYTES:
                    break
    except TimeoutError:
        raise ApiError(408, f"the request body was not received within {timeout:g} s "
                       "(--body-read-timeout)", code="request_timeout") from None
    request[BODY_BYTES] = total
    if total > limit:
        raise ApiError(413, f"the request body is larger than the limit of {limit} bytes",
                       code="request_too_large")
    if work is None or total < PARSE_OFF_LOOP_BYTES:
        raw = b"".join(chunks)
        check_json_depth(raw, limits)
        return parse_json_object(raw)
    try:
        return json_object(await work.run_off_loop(_parse_large_body, chunks, limits))
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None


class OpenAIServer:
    """Routes and their handlers; `build_app()` makes the aiohttp application."""

    def __init__(self, ctx: ServingContext, config: ServerConfig) -> None:
        self.ctx = ctx
        self.config = config
        self.completions = CompletionsHandler(ctx)
        self.chat = ChatHandler(ctx)
        self.messages = MessagesHandler(ctx, self.chat)
        self.responses = ResponsesHandler(ctx, config.max_stored_responses,
                                          config.response_id_tag)
        self.embeddings = EmbeddingsHandler(ctx)
        self.scores = ScoreHandler(ctx)

    def build_app(self) -> web.Application:
        auth = auth_middleware(self.config.api_key, self.config.metrics_without_api_key)
        # The Host check, CORS preflights and JSON-only POSTs come before the key's check
        # (browser_safety.py); the bound address picks the default Host names.
        safety = BrowserSafety.from_config(self.config.allowed_hosts,
                                           self.config.allowed_origins, self.config.host)
        app = web.Application(middlewares=[error_middleware, safety.middleware(), auth])
        safety.install(app)
        app[STREAM_WRITE_TIMEOUT] = self.config.stream_write_timeout
        add_chat_page(app)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self._json(self.tokenize))
        app.router.add_post("/detokenize", self._json(self.detokenize))
        app.router.add_post("/v1/completions", self._json(self.completions))
        app.router.add_post("/v1/chat/completions", self._json(self.chat))
        app.router.add_post("/v1/responses", self._json(self.responses.create))
        app.router.add_post(MESSAGES_PATH, self._json(self.messages.create))
        app.router.add_post(MESSAGES_PATH + "/count_tokens",
                            self._json(self.messages.count_tokens))
        app.router.add_post("/v1/embeddings", self._json(self.embeddings.embeddings))
        app.router.add_post("/pooling", self._json(self.embeddings.pooling))
        for prefix in ("", "/v1"):  # vLLM serves both
            app.router.add_post(prefix + "/score", self._json(self.scores.score))
            app.router.add_post(prefix + "/rerank", self._json(self.scores.rerank))
        app.router.add_get("/v1/responses/{response_id}", self.responses.retrieve)
        app.router.add_post("/v1/responses/{response_id}/cancel", self.responses.cancel)
        if envs.AIOENGINE_FAULT_INJECTION:
            app.router.add_post("/debug/faults", self._json(self.inject_fault))
        if self.config.allow_runtime_lora_updating:
            app.router.add_post("/v1/load_lora_adapter", self._json(self.load_lora_adapter))
            app.router.add_post("/v1/unload_lora_adapter",
                                self._json(self.unload_lora_adapter))

        async def stop_prompt_threads(app: web.Application) -> None:
            self.ctx.work.shutdown()
        app.on_cleanup.append(stop_prompt_threads)
        return app

    def _json(self, handler: JsonHandler) -> Handler:
        async def route(request: web.Request) -> web.StreamResponse:
            body = await read_json(request, self.config.max_request_body_bytes,
                                   self.config.body_read_timeout, self.ctx.work,
                                   self.config.limits)
            check_request(body, self.config.limits)
            return await handler(request, body)
        return route

    async def health(self, request: web.Request) -> web.Response:
        if not self.ctx.engine.is_running:
            return json_response(error_body(503, "the engine is not running",
                                            "service_unavailable_error"), 503)
        return json_response({"status": "ok"})

    async def version(self, request: web.Request) -> web.Response:
        # The dtype choice and the CPU it was based on (dtype="auto" depends on the machine).
        return json_response({"version": aioengine.__version__,
                              **self.ctx.engine.dtype_info()})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.ctx.engine.metrics.render(),
                            headers={"Content-Type": CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        """The base model under each served name, then each LoRA adapter (vLLM's cards:
        `root` its path, `parent` the served name of its base model; `generation_config`
        the sampling defaults a request's omitted fields get)."""
        ctx = self.ctx
        info = ctx.engine.dtype_info()

        def card(name: str, root: str, parent: str | None) -> dict:
            return {"id": name, "object": "model", "created": ctx.created,
                    "owned_by": "aioengine", "root": root, "parent": parent,
                    "max_model_len": ctx.max_model_len, "dtype": info["dtype"],
                    "quantization": info["quantization"],
                    "kv_cache_dtype": info["kv_cache_dtype"],
                    "generation_config": ctx.engine.default_sampling, "permission": []}

        root = ctx.engine.model_path
        data = [card(name, root, None) for name in ctx.served_model_names]
        data += [card(lora.lora_name, lora.lora_path, parent)
                 for lora, parent in ctx.models.lora_cards()]
        return json_response({"object": "list", "data": data})

    async def load_lora_adapter(self, request: web.Request, body: dict) -> web.Response:
        return web.Response(text=await self.ctx.models.load_lora_adapter(body))

    async def unload_lora_adapter(self, request: web.Request, body: dict) -> web.Response:
        return web.Response(text=await self.ctx.models.unload_lora_adapter(body))

    async def inject_fault(self, request: web.Request, body: dict) -> web.Response:
        """AIOENGINE_FAULT_INJECTION=1 only: arms an in-process fault (engine/faults.py)."""
        kind = get_str(body, "kind", None)
        try:
            self.ctx.engine.inject_fault(kind or "", get_int(body, "count", 1, lo=1) or 1)
        except ValueError as e:
            raise ApiError(400, str(e), "kind") from None
        logger.warning("fault injected: %s", kind)
        return json_response({"armed": kind})

    async def tokenize(self, request: web.Request, body: dict) -> web.Response:
        self.ctx.check_model(body)
        tokens = await self.ctx.work.run(request, self._tokens, body)
        return json_response({"count": len(tokens), "max_model_len": self.ctx.max_model_len,
                              "tokens": tokens})

    def _tokens(self, body: dict) -> list[int]:
        """/tokenize's ids (off the loop for a large body)."""
        if body.get("messages") is not None:  # rendered as chat would (tools, template)
            plan = chat_tool_plan(body, self.ctx.tools)
            add_generation_prompt = get_bool(body, "add_generation_prompt", True)
            return render_messages(self.ctx, body["messages"], plan,
                                   bool(add_generation_prompt))
        prompt = get_str(body, "prompt", None)
        if prompt is None:
            raise ApiError(400, "prompt (a string) or messages is required", "prompt")
        return encode_text(self.ctx.engine.tokenizer, prompt,
                           bool(get_bool(body, "add_special_tokens", True)))

    async def detokenize(self, request: web.Request, body: dict) -> web.Response:
        self.ctx.check_model(body)
        return json_response({"prompt": await self.ctx.work.run(request, self._text, body)})

    def _text(self, body: dict) -> str:
        """/detokenize's text (off the loop for a large body)."""
        tokens = get_int_list(body, "tokens")
        if tokens is None:
            raise ApiError(400, "tokens (a list of token ids) is required", "tokens")
        try:
            self.ctx.engine.check_token_ids(tokens, "tokens")
        except InvalidRequestError as e:
            raise ApiError.invalid(e) from None
        return decode_ids(self.ctx.engine.tokenizer, tokens)


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a taken port fails at once, and
    clients that connect during the load wait in the backlog. Raises OSError."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=1024)


async def build_serving_context(engine: AsyncEngine, served_model_names: list[str],
                                config: ServerConfig) -> ServingContext:
    """How the engine is served (`serve` and `run-batch`): loads the `--lora-modules`
    adapters first (LoRAModuleError: none is served), unless they are loaded on demand.
    ConfigError: a --reasoning-parser whose think tokens the tokenizer lacks, or
    --tool-call-parser auto with a chat template that writes no known call format."""
    tools = ToolServingConfig.resolve(
        config.enable_auto_tool_choice, config.tool_call_parser,
        config.chat_template or getattr(engine.tokenizer, "chat_template", None))
    reasoning = (None if config.reasoning_parser is None
                 else get_reasoning_parser(config.reasoning_parser, engine.tokenizer))
    on_demand = config.lora_modules if config.load_lora_modules_on_demand else ()
    ctx = ServingContext(engine, ServingModels(engine, served_model_names, on_demand), tools,
                         config.chat_template, config.max_queued_requests,
                         pooling=config.pooling, limits=config.limits,
                         trust_message_special_tokens=config.trust_message_special_tokens,
                         reasoning_parser=reasoning)
    if not on_demand:
        await ctx.models.init_static_loras(list(config.lora_modules))
    return ctx


async def build_server_app(engine: AsyncEngine, served_model_names: list[str],
                           config: ServerConfig) -> web.Application:
    """The application `serve` runs (and each Ray Serve replica, aioengine/ray_serve/)."""
    ctx = await build_serving_context(engine, served_model_names, config)
    if config.allow_runtime_lora_updating:
        logger.warning("LoRA dynamic loading & unloading is enabled in the API server "
                       "(POST /v1/load_lora_adapter, /v1/unload_lora_adapter). This should "
                       "ONLY be used for local development!")
    return OpenAIServer(ctx, config).build_app()


def app_runner(app: web.Application, config: ServerConfig) -> web.AppRunner:
    """Handlers are cancelled when their client goes away (that aborts its requests); idle
    and half-sent connections close after `keepalive_timeout` (connections.py)."""
    return web.AppRunner(app, handler_cancellation=True, access_log=None,
                         shutdown_timeout=config.shutdown_timeout,
                         keepalive_timeout=config.keepalive_timeout, logger=client_error_log())


async def serve(engine: AsyncEngine, served_model_names: list[str], config: ServerConfig,
                sock: socket.socket | None = None) -> None:
    """Loads the `--lora-modules` adapters (LoRAModuleError: none is served), then serves
    on `sock` (default: bound from `config`) until SIGINT/SIGTERM, then stops accepting,
    aborts in-flight requests (their streams end with finish_reason "abort"), and closes
    the connections. The engine is shut down in every case."""
    try:
        app = await build_server_app(engine, served_model_names, config)
    except BaseException:
        await engine.shutdown()
        raise
    runner = app_runner(app, config)
    await runner.setup()
    try:
        site = CappedSockSite(runner, sock or bind_socket(config.host, config.port),
                              config.max_connections, backlog=1024)
        await site.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):  # before the ready line: clients act on it
            loop.add_signal_handler(sig, stop.set)
        host, port = runner.addresses[0][:2]
        url_host = f"[{host}]" if ":" in host else host
        logger.info("aioengine %s ready: serving %s at http://%s:%d (OpenAI API under /v1)",
                    aioengine.__version__, served_model_names[0], url_host, port)
        await stop.wait()
        logger.info("shutting down: no new connections, aborting in-flight requests")
        await site.stop()
        await engine.shutdown()
    finally:
        await engine.shutdown()
        await runner.cleanup()
    logger.info("server stopped")

