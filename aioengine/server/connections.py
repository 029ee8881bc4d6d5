"""Connection limits: what aiohttp offers, and a cap on open connections it does not.

- `keepalive_timeout` (aiohttp's): its timer starts when a connection opens and again after
  each response, and closes the connection if no whole request head has arrived by then,
  so it bounds both an idle keep-alive connection and one that sends half a header.
- A body is read under `--body-read-timeout` (api_server.read_json: 408, connection closed).
- `CappedSockSite`: beyond `max_connections` open connections, a new one is answered a 503
  with Retry-After and closed, instead of holding one more socket (and file) open.
- `ClientErrorLog`: a request aiohttp's parser rejects (an over-long header or URL, a bad
  request line) is answered 400 by aiohttp and logged here in one line, not a traceback.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

logger = logging.getLogger("aioengine.server")

# How long a refused connection is kept to read what the client sends, so that closing it
# does not reset the connection before the client has read the 503.
_REFUSED_LINGER_S = 1.0
_LOG_EVERY_S = 10.0


def _refusal(max_connections: int) -> bytes:
    body = orjson.dumps({"error": {
        "message": f"the server has {max_connections} open connections (--max-connections); "
                   "retry later", "type": "service_unavailable_error", "param": None,
        "code": "too_many_connections"}})
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class _RefusedConnection(asyncio.Protocol):
    """Answers the 503 at once, stops writing, drops what comes in, closes soon after."""

    def __init__(self, response: bytes) -> None:
        self.response = response
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(self.response)
        if transport.can_write_eof():
            transport.write_eof()
        self.timer = asyncio.get_running_loop().call_later(_REFUSED_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()


class CappedSockSite(web.SockSite):
    """SockSite whose server refuses connections beyond `max_connections` (0: no cap)."""

    def __init__(self, runner: web.BaseRunner, sock: Any, max_connections: int,
                 **kwargs: Any) -> None:
        super().__init__(runner, sock, **kwargs)
        self.max_connections = max_connections
        self._refusal = _refusal(max_connections)
        self._last_logged = 0.0

    def _protocol(self) -> asyncio.BaseProtocol:
        server = self._runner.server
        assert server is not None
        if self.max_connections and len(server.connections) >= self.max_connections:
            now = time.monotonic()
            if now - self._last_logged >= _LOG_EVERY_S:
                self._last_logged = now
                logger.warning("refusing new connections: %d are open (--max-connections)",
                               self.max_connections)
            return _RefusedConnection(self._refusal)
        return server()

    async def start(self) -> None:
        await web.BaseSite.start(self)  # SockSite.start would serve with runner.server
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol, sock=self._sock,
                                                ssl=self._ssl_context, backlog=self._backlog)


class ClientErrorLog(logging.LoggerAdapter):
    """aiohttp's server logger: a request its parser rejected is the client's mistake, so
    it is one line (status, peer, reason); anything else keeps its traceback."""

    def exception(self, msg: object, *args: object, exc_info: Any = True,
                  **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            reason = " ".join(str(exc_info.message).split())[:300]
            self.warning("%s: %s %s", str(msg) % args, exc_info.code, reason)
            return
        self.logger.exception(msg, *args, exc_info=exc_info, **kwargs)


def client_error_log() -> ClientErrorLog:
    return ClientErrorLog(logging.getLogger("aiohttp.server"), {})
