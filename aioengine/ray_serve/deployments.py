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

Why a unix socket inside the replica: every route, validation rule, error body and SSE
stream is the aiohttp application `aioengine serve` runs (`build_server_app`), unchanged;
the replica relays each request to it over a socket only it knows and streams the bytes
back. A client that goes away cancels the handle call, which closes that connection, which
cancels the handler (handler_cancellation), which aborts its engine requests.
"""
from __future__ import annotations

import logging
import os
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

from aioengine.ray_serve.prefix import (DEFAULT_BLOCK_CHARS, DEFAULT_MAX_BLOCKS, prefix_hashes,
                                        prompt_text)
from aioengine.server.api_server import ServerConfig, app_runner, build_server_app
from aioengine.server.protocol import error_body

logger = logging.getLogger("aioengine.ray_serve")

REPLICA_HEADER = "x-aioengine-replica"
# Hop-by-hop or recomputed headers: not relayed from the replica's app to the proxy, nor
# from the client to the app (the body it gets may be cut at the size limit).
_DROPPED_HEADERS = frozenset({"content-length", "transfer-encoding", "connection",
                              "keep-alive", "date", "server"})
_NOT_FORWARDED = _DROPPED_HEADERS | {"host", "expect", "te", "upgrade"}


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


class EngineReplica:
    """One engine replica: its own process, event loop and AsyncEngine (whose forward
    thread runs inside), serving the aioengine server application."""

    async def __init__(self, config: EngineReplicaConfig) -> None:
        from aioengine.engine.async_engine import AsyncEngine

        names = list(config.served_model_names)
        self.engine = await AsyncEngine.create(config.model, served_model_name=names[0],
                                               **config.engine_kwargs)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._socket_dir = tempfile.mkdtemp(prefix="aioengine-replica-")
        socket_path = os.path.join(self._socket_dir, "http.sock")
        try:
            app = await build_server_app(self.engine, names, config.server)
            self._runner = app_runner(app, config.server)
            await self._runner.setup()
            await web.UnixSite(self._runner, socket_path).start()
        except BaseException:
            await self.engine.shutdown()
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            raise
        self._session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=socket_path, limit=0),
            timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        logger.info("engine replica %s ready: serving %s", self.replica_id, names[0])

    async def handle(self, request: ReplicaRequest) -> AsyncIterator[ResponseHead | bytes]:
        """The request through the server application: its head, then its body as it is
        written (an SSE stream event by event)."""
        if not self.engine.is_running:  # dead: Ray's next health check replaces us
            yield ResponseHead(503, (("Content-Type", "application/json"),
                                     (REPLICA_HEADER, self.replica_id)), engine_dead=True)
            yield orjson.dumps(error_body(503, "the engine is not running",
                                          "service_unavailable_error"))
            return
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
        await self.engine.shutdown()
        await self._runner.cleanup()
        await self._session.close()
        shutil.rmtree(self._socket_dir, ignore_errors=True)


@dataclass(frozen=True)
class IngressConfig:
    max_request_body_bytes: int = 8 << 20
    prefix_block_chars: int = DEFAULT_BLOCK_CHARS
    prefix_max_blocks: int = DEFAULT_MAX_BLOCKS


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
        call = ReplicaRequest(request.method, path, headers, body, self._prefix_hashes(body))
        head, responses = await self._start(call)
        if head is None or head.engine_dead:  # nothing was started: once more, elsewhere
            avoid = () if head is None else (_replica_of(head),)
            head, responses = await self._start(replace(call, avoid_replicas=avoid))
        if head is None:
            return _json_error(503, "the engine replica failed before answering",
                               "service_unavailable_error")
        headers = dict(head.headers)
        event_stream = any(k.lower() == "content-type" and v.startswith("text/event-stream")
                           for k, v in head.headers)
        return StreamingResponse(_body(responses, request.url.path, event_stream),
                                 status_code=head.status, headers=headers)

    async def _start(self, call: ReplicaRequest,
                     ) -> tuple[ResponseHead | None, DeploymentResponseGenerator]:
        """The handle call and the head of its answer (None: the replica failed first)."""
        responses: DeploymentResponseGenerator = self._engine.remote(call)
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

    def _prefix_hashes(self, body: bytes) -> tuple[int, ...]:
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            return ()
        if not isinstance(parsed, dict):
            return ()
        return prefix_hashes(prompt_text(parsed), self.config.prefix_block_chars,
                             self.config.prefix_max_blocks)


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
