"""The two deployments: `OpenAIIngress` (behind Ray's HTTP proxy) and `EngineReplica`
(one AsyncEngine and the aioengine server's own aiohttp application per replica).

    client --HTTP--> Ray proxy --> OpenAIIngress --handle call--> EngineReplica (xN)
                                   reads the body,  the router     AsyncEngine + the aiohttp
                                   hashes the       (router.py)    app of `aioengine serve`
                                   prompt           picks one      on a private unix socket
    <-- StreamingResponse <-- ResponseHead, then body bytes as the app writes them <--

Why an ingress: Ray's proxy hands a replica the ASGI scope, and the body only afterwards,
so a router placed there sees no prompt. The ingress reads the body and makes a handle call
whose argument carries the prompt's prefix hashes, which the router reads.

Each replica's engine metrics also go to Ray's metrics export (metrics.py), and with
`--ray-max-adapters-per-replica` LoRA adapters are loaded per replica through Ray Serve's
model multiplexing (adapters.py).

Why a unix socket inside the replica: every route, validation rule, error body and SSE
stream is the aiohttp application `aioengine serve` runs (`build_server_app`), unchanged;
the replica relays each request to it over a socket only it knows and streams the bytes
back. A client that goes away cancels the handle call, which closes that connection, which
cancels the handler (handler_cancellation), which aborts its engine requests.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import aiohttp
import orjson
from aiohttp import web
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from aioengine.errors import InvalidRequestError, NotFoundError
from aioengine.ray_serve.adapters import ReplicaAdapters
from aioengine.ray_serve.metrics import RayMetricFactory
from aioengine.ray_serve.prefix import (DEFAULT_BLOCK_CHARS, DEFAULT_MAX_BLOCKS, prefix_hashes,
                                        prompt_text)
from aioengine.server.api_server import ServerConfig, app_runner, build_server_app
from aioengine.server.protocol import error_body
from aioengine.server.serving_responses import response_id_tag

logger = logging.getLogger("aioengine.ray_serve")

REPLICA_HEADER = "x-aioengine-replica"
# Seconds between refreshes of a replica's gauges and cumulative counters in Ray's export.
METRICS_UPDATE_INTERVAL_S = 2.0
# Hop-by-hop or recomputed headers: not relayed from the replica's app to the proxy, nor
# from the client to the app (the body it gets may be cut at the size limit).
_DROPPED_HEADERS = frozenset({"content-length", "transfer-encoding", "connection",
                              "keep-alive", "date", "server"})
# The client's Host is relayed: the app checks it (server/browser_safety.py, DNS rebinding).
_NOT_FORWARDED = _DROPPED_HEADERS | {"expect", "te", "upgrade"}


@dataclass(frozen=True)
class ReplicaRequest:
    """One HTTP request, as the ingress hands it to an engine replica."""
    method: str
    path: str  # with the query string
    headers: tuple[tuple[str, str], ...]
    body: bytes
    prefix_hashes: tuple[int, ...] = ()  # what PrefixAffinityRouter routes by
    # Replicas (unique ids) that PrefixAffinityRouter passes over: a retry after a dead
    # engine answered.
    avoid_replicas: tuple[str, ...] = ()
    # The replica that stores the response this request reads or continues ("": none).
    prefer_replica: str = ""


@dataclass(frozen=True)
class ResponseHead:
    """The first item of a replica's answer; body chunks (bytes) follow."""
    status: int
    headers: tuple[tuple[str, str], ...]
    # The replica's engine loop is dead and the request was not started: retry elsewhere.
    engine_dead: bool = False


@dataclass(frozen=True)
class EngineReplicaConfig:
    """What each replica builds: `AsyncEngine.create(model, **engine_kwargs)` and the
    server application of `aioengine serve` with `server`."""
    model: str | None
    served_model_names: tuple[str, ...]
    engine_kwargs: dict = field(default_factory=dict)
    server: ServerConfig = field(default_factory=ServerConfig)
    # > 0: the server's lora_modules are loaded on demand, at most this many per replica,
    # through Ray Serve's model multiplexing (adapters.py); 0: each replica loads them all.
    max_adapters_per_replica: int = 0


class EngineReplica:
    """One engine replica: its own process, event loop and AsyncEngine (whose forward
    thread runs inside), serving the aioengine server application."""

    async def __init__(self, config: EngineReplicaConfig) -> None:
        from aioengine.engine.async_engine import AsyncEngine

        names = list(config.served_model_names)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine = await AsyncEngine.create(config.model, served_model_name=names[0],
                                               metrics_factory=RayMetricFactory(self.replica_id),
                                               **config.engine_kwargs)
        self._metrics_task = asyncio.get_running_loop().create_task(self._update_metrics())
        server = config.server
        self.adapters: ReplicaAdapters | None = None
        if config.max_adapters_per_replica > 0:
            self.adapters = ReplicaAdapters(self.engine,
                                            {m.name: m for m in server.lora_modules},
                                            config.max_adapters_per_replica)
            server = replace(server, load_lora_modules_on_demand=True)
        # Response ids name this replica: the ingress sends their follow-ups here.
        server = replace(server, response_id_tag=self.replica_id)
        self._socket_dir = tempfile.mkdtemp(prefix="aioengine-replica-")
        socket_path = os.path.join(self._socket_dir, "http.sock")
        try:
            app = await build_server_app(self.engine, names, server)
            self._runner = app_runner(app, config.server)
            await self._runner.setup()
            await web.UnixSite(self._runner, socket_path).start()
        except BaseException:
            self._metrics_task.cancel()
            await self.engine.shutdown()
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            raise
        self._session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=socket_path, limit=0),
            timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        logger.info("engine replica %s ready: serving %s", self.replica_id, names[0])

    async def _update_metrics(self) -> None:
        """Nobody scrapes a replica's own /metrics: its gauges and cumulative counters are
        refreshed here, for Ray's export."""
        while True:
            await asyncio.sleep(METRICS_UPDATE_INTERVAL_S)
            try:
                self.engine.metrics.update()
            except Exception:  # noqa: BLE001 - metrics must not end the replica
                logger.exception("engine replica %s: metrics update failed", self.replica_id)

    def _error(self, status: int, message: str, kind: str, param: str | None = None,
               engine_dead: bool = False) -> tuple[ResponseHead, bytes]:
        head = ResponseHead(status, (("Content-Type", "application/json"),
                                     (REPLICA_HEADER, self.replica_id)), engine_dead)
        return head, orjson.dumps(error_body(status, message, kind, param))

    async def handle(self, request: ReplicaRequest) -> AsyncIterator[ResponseHead | bytes]:
        """The request through the server application: its head, then its body as it is
        written (an SSE stream event by event). A request for a multiplexed adapter holds
        it in the engine until its answer has ended."""
        if not self.engine.is_running:  # dead: Ray's next health check replaces us
            for item in self._error(503, "the engine is not running",
                                    "service_unavailable_error", engine_dead=True):
                yield item
            return
        adapter = serve.get_multiplexed_model_id() if self.adapters is not None else ""
        if adapter:
            try:
                await self.adapters.acquire(adapter)
            except NotFoundError as e:
                for item in self._error(404, str(e), "NotFoundError", "model"):
                    yield item
                return
            except InvalidRequestError as e:
                for item in self._error(400, str(e), "BadRequestError", "model"):
                    yield item
                return
        try:
            async for item in self._relay(request):
                yield item
        finally:
            if adapter:
                self.adapters.release(adapter)

    async def _relay(self, request: ReplicaRequest) -> AsyncIterator[ResponseHead | bytes]:
        async with self._session.request(request.method, "http://replica" + request.path,
                                         headers=list(request.headers), data=request.body,
                                         allow_redirects=False) as response:
            headers = [(k, v) for k, v in response.headers.items()
                       if k.lower() not in _DROPPED_HEADERS]
            yield ResponseHead(response.status, (*headers, (REPLICA_HEADER, self.replica_id)))
            async for chunk in response.content.iter_any():
                yield chunk

    async def check_health(self) -> None:
        """Ray calls this every health_check_period_s: a dead engine loop fails it, and
        Ray replaces the replica."""
        if not self.engine.is_running:
            raise RuntimeError("the engine loop is not running")

    async def __del__(self) -> None:
        """Ray calls this once its drain is over: no request is in flight any more (Ray
        kills a replica whose requests outlive graceful_shutdown_timeout_s instead, and
        the ingress ends their streams with an error event). Anything that raced in is
        aborted by the engine's shutdown."""
        self._metrics_task.cancel()
        await self.engine.shutdown()
        await self._runner.cleanup()
        await self._session.close()
        shutil.rmtree(self._socket_dir, ignore_errors=True)


@dataclass(frozen=True)
class IngressConfig:
    max_request_body_bytes: int = 8 << 20
    prefix_block_chars: int = DEFAULT_BLOCK_CHARS
    prefix_max_blocks: int = DEFAULT_MAX_BLOCKS
    # The --lora-modules names: their prompts' prefix hashes are salted with the name;
    # with `multiplexed`, their requests go out with `multiplexed_model_id` (adapters.py).
    lora_adapters: frozenset[str] = frozenset()
    multiplexed: bool = False


def _replica_of(head: ResponseHead) -> str:
    return next(v for k, v in head.headers if k == REPLICA_HEADER)


def _json_error(status: int, message: str, kind: str) -> Response:
    return Response(orjson.dumps(error_body(status, message, kind)), status_code=status,
                    media_type="application/json")


class OpenAIIngress:
    """Receives every HTTP request from Ray's proxy and relays it to an engine replica."""

    def __init__(self, engine: DeploymentHandle, config: IngressConfig) -> None:
        self._engine = engine.options(method_name="handle", stream=True)
        self.config = config

    async def __call__(self, request: Request) -> Response:
        # One byte past the limit is enough for the replica's app to answer the 413.
        body = await _read_body(request, self.config.max_request_body_bytes + 1)
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = tuple((k, v) for k, v in request.headers.items()
                        if k.lower() not in _NOT_FORWARDED)
        parsed = _json_object(body) or {}
        model = parsed.get("model")
        adapter = model if isinstance(model, str) and model in self.config.lora_adapters else ""
        hashes = prefix_hashes(prompt_text(parsed), self.config.prefix_block_chars,
                               self.config.prefix_max_blocks, salt=adapter)
        call = ReplicaRequest(request.method, path, headers, body, hashes,
                              prefer_replica=_stored_on(request.url.path, parsed))
        multiplexed = adapter if self.config.multiplexed else ""
        head, responses = await self._start(call, multiplexed)
        if head is None or head.engine_dead:  # nothing was started: once more, elsewhere
            avoid = () if head is None else (_replica_of(head),)
            head, responses = await self._start(replace(call, avoid_replicas=avoid),
                                                multiplexed)
        if head is None:
            return _json_error(503, "the engine replica failed before answering",
                               "service_unavailable_error")
        headers = dict(head.headers)
        event_stream = any(k.lower() == "content-type" and v.startswith("text/event-stream")
                           for k, v in head.headers)
        return StreamingResponse(_body(responses, request.url.path, event_stream),
                                 status_code=head.status, headers=headers)

    async def _start(self, call: ReplicaRequest, adapter: str,
                     ) -> tuple[ResponseHead | None, DeploymentResponseGenerator]:
        """The handle call (for a multiplexed `adapter`, if not "") and the head of its
        answer (None: the replica failed first)."""
        engine = self._engine.options(multiplexed_model_id=adapter) if adapter else self._engine
        responses: DeploymentResponseGenerator = engine.remote(call)
        try:
            head = await responses.__anext__()
        except Exception as e:  # noqa: BLE001 - the replica died or could not be reached
            logger.warning("engine replica failed before answering %s %s: %r",
                           call.method, call.path, e)
            return None, responses
        assert isinstance(head, ResponseHead)
        if head.engine_dead:
            responses.cancel()
        return head, responses


_RESPONSE_PATH = re.compile(r"/v1/responses/([^/]+)(?:/cancel)?")


def _stored_on(path: str, body: dict) -> str:
    """The replica whose Responses store holds the response a request reads, cancels or
    continues (`previous_response_id`), from the response id's tag; "" if none."""
    match = _RESPONSE_PATH.fullmatch(path)
    response_id = match.group(1) if match else body.get("previous_response_id")
    return response_id_tag(response_id) if isinstance(response_id, str) else ""


def _json_object(body: bytes) -> dict | None:
    """The body as a JSON object, or None (the replica's app answers the 400)."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


async def _read_body(request: Request, limit: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        chunks.append(chunk)
        total += len(chunk)
        if total >= limit:
            break
    return b"".join(chunks)


async def _body(responses: DeploymentResponseGenerator, path: str,
                event_stream: bool) -> AsyncIterator[bytes]:
    """The replica's body chunks. If the replica dies mid-answer, an SSE stream ends with
    an OpenAI error event (clients raise it), any other body is cut short: the client
    sees a failed request, never a hang. A client that goes away cancels the call."""
    done = False
    try:
        async for chunk in responses:
            yield chunk
        done = True
    except Exception as e:  # noqa: BLE001 - the replica died mid-answer
        logger.warning("engine replica failed while answering %s: %r", path, e)
        if not event_stream:
            raise
        error = error_body(503, f"the engine replica failed: {type(e).__name__}",
                           "service_unavailable_error")
        yield b"data: " + orjson.dumps(error) + b"\n\n"
    finally:
        if not done:
            responses.cancel()
