"""The soak's slow clients (soak_mix.py mixes them into the traffic), over raw sockets so
that each stalls exactly where an attacker's client would:

- slow_head: half a request head, then nothing. The server must close the connection after
  its --keepalive-timeout without answering (there is no request to answer).
- slow_body: a whole head and half the body its Content-Length announces, then nothing.
  The server must answer 408 after its --body-read-timeout and close the connection.
- slow_reader: a streamed chat with `top_logprobs` 20 (about 2 KB a token), read through a
  4 KiB receive buffer one chunk every READ_PAUSE_S, with one stall of 1-3 s: slower than
  the server writes, so its socket's send queue grows (to ~400 KB in 14 s in a probe on an
  idle server). It disconnects when its reading time is up, unless [DONE] came first
  ("disconnected" / "completed"). Meanwhile the server must keep serving the others (the
  report's TTFT during slow readers) and, once it goes, free the request's KV blocks (the
  soak's idle check).

A stalled connection is given close_limit(the server's timeout); one still open then is
"held_open", which fails the soak.
"""
from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import Awaitable
from typing import Any

import orjson

from aioengine.bench.soak_traffic import (QUESTIONS, Outcome, Traffic, Verdict, chat_body,
                                          excerpt, status_verdict, timed)

RCVBUF_BYTES = 4096  # the slow reader's socket receive buffer (and its StreamReader limit)
READ_PAUSE_S = 0.5  # between the slow reader's chunks: slower than the server writes them
SLOW_READER_S = 12.0  # the most a slow reader reads for (its stall included), about


def close_limit(timeout_s: float) -> float:
    """How long a stalled connection waits for the server to close it: its timeout, plus
    room for a loop busy with a long step on a loaded machine."""
    return 1.5 * timeout_s + 10.0


def needed_s(t: Traffic, kind: str) -> float:
    """About how long a slow client of `kind` lasts (the mix starts none that would outlast
    the traffic)."""
    return {"slow_head": t.keepalive_timeout_s, "slow_body": t.body_read_timeout_s,
            "slow_reader": SLOW_READER_S}[kind] + 2.0


async def _connect(t: Traffic, rcvbuf: int | None = None,
                   ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw connection to the server; with `rcvbuf`, a receive buffer that small (set
    before connecting, so the TCP window is small from the start)."""
    host, port = t.address
    if rcvbuf is None:
        return await asyncio.open_connection(host, port)
    loop = asyncio.get_running_loop()
    family, kind, proto, _, addr = (await loop.getaddrinfo(host, port,
                                                           type=socket.SOCK_STREAM))[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await loop.sock_connect(sock, addr)
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock, limit=rcvbuf)


def _head(t: Traffic, path: str, content_length: int) -> bytes:
    host, port = t.address
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}",
             f"Content-Length: {content_length}"]
    lines += [f"{k}: {v}" for k, v in t.headers.items() if k.lower() != "content-length"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _status(data: bytes) -> int | None:
    """The status of an HTTP/1.x answer, or None."""
    parts = data.split(b" ", 2)
    if len(parts) > 1 and parts[0].startswith(b"HTTP/1.") and parts[1].isdigit():
        return int(parts[1])
    return None


async def _until_closed(reader: asyncio.StreamReader,
                        limit_s: float) -> tuple[bytes, float | None]:
    """What the server sends until it closes the connection, and after how many seconds
    (None: still open after `limit_s`)."""
    start, data = time.monotonic(), b""
    try:
        async with asyncio.timeout(limit_s):
            while chunk := await reader.read(65536):
                data += chunk
    except TimeoutError:
        return data, None
    except ConnectionError:
        pass  # a reset is a close too
    return data, time.monotonic() - start


async def _stall(t: Traffic, sent: bytes, limit_s: float) -> tuple[bytes, float | None]:
    """Connects, sends `sent` and stalls: (what came back, when the server closed)."""
    reader, writer = await _connect(t)
    try:
        writer.write(sent)
        await writer.drain()
        return await _until_closed(reader, limit_s)
    finally:
        writer.close()


def _answered(data: bytes, info: dict[str, Any]) -> Verdict:
    """An answer where none (or another) was due."""
    status = _status(data)
    info["label"] = f"answered_{status}"
    outcome = ("5xx" if status and status >= 500 else "unexpected_4xx" if status
               else "bad_output")
    return outcome, status, f"unexpected answer: {excerpt(data, 300)}"


async def _slow_head(t: Traffic, sent: bytes, info: dict[str, Any]) -> Verdict:
    limit = close_limit(t.keepalive_timeout_s)
    data, closed_s = await _stall(t, sent, limit)
    timeout = f"--keepalive-timeout {t.keepalive_timeout_s:g}"
    if data:
        return _answered(data, info)
    if closed_s is None:
        info["label"] = "held_open"
        return "held_open", None, f"half a head, still open after {limit:g} s ({timeout})"
    info["label"] = "closed_by_server"
    return "ok", None, f"closed after {closed_s:.2f} s ({timeout})"


async def _slow_body(t: Traffic, sent: bytes, info: dict[str, Any]) -> Verdict:
    limit = close_limit(t.body_read_timeout_s)
    data, closed_s = await _stall(t, sent, limit)
    timeout = f"--body-read-timeout {t.body_read_timeout_s:g}"
    status = _status(data)
    if status == 408 and b"--body-read-timeout" in data:
        if closed_s is None:
            info["label"] = "408_held_open"
            return "held_open", 408, f"408, then still open after {limit:g} s ({timeout})"
        info["label"] = "408_closed"
        return "expected_4xx", 408, f"408 and closed after {closed_s:.2f} s ({timeout})"
    if data:
        return _answered(data, info)
    if closed_s is None:
        info["label"] = "held_open"
        return "held_open", None, f"half a body, still open after {limit:g} s ({timeout})"
    info["label"] = "closed_without_408"
    return "bad_output", None, f"closed after {closed_s:.2f} s without a 408 ({timeout})"


async def slow_head(t: Traffic, rng: random.Random) -> list[Outcome]:
    head = _head(t, "/v1/completions", 64)
    sent = head[:rng.randint(5, len(head) - 3)]  # never the blank line that ends a head
    info: dict[str, Any] = {}
    limit = close_limit(t.keepalive_timeout_s) + 30
    return [await _timed_raw(t, "slow_head", sent, _slow_head(t, sent, info), info, limit)]


async def slow_body(t: Traffic, rng: random.Random) -> list[Outcome]:
    body = orjson.dumps({"model": t.model, "prompt": rng.choice(QUESTIONS), "max_tokens": 8})
    sent = _head(t, "/v1/completions", len(body)) + body[:rng.randint(1, len(body) - 1)]
    info: dict[str, Any] = {}
    limit = close_limit(t.body_read_timeout_s) + 30
    return [await _timed_raw(t, "slow_body", sent, _slow_body(t, sent, info), info, limit)]


async def _timed_raw(t: Traffic, kind: str, sent: bytes, work: Awaitable[Verdict],
                     info: dict[str, Any], timeout_s: float) -> Outcome:
    outcome = await timed(t, kind, sent, work, info, timeout_s)
    outcome.label = outcome.label or outcome.outcome  # a timeout or a connection error
    return outcome


# ---- the slow reader ------------------------------------------------------------------------

async def _next_piece(reader: asyncio.StreamReader, chunked: bool) -> bytes:
    """One HTTP chunk of the body (b"" at its end), or what arrives without chunking."""
    if not chunked:
        return await reader.read(RCVBUF_BYTES)
    size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
    if size == 0:
        return b""
    return (await reader.readexactly(size + 2))[:-2]


class _SSE:
    """Splits an SSE byte stream into its `data:` payloads."""

    def __init__(self) -> None:
        self.buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        self.buffer += data
        *events, self.buffer = self.buffer.split(b"\n\n")
        return [line[5:].strip() for event in events for line in event.split(b"\n")
                if line.startswith(b"data:")]


async def _read_slowly(reader: asyncio.StreamReader, chunked: bool, rng: random.Random,
                       info: dict[str, Any]) -> Verdict:
    """Reads the stream a chunk at a time with pauses and one stall, until [DONE] or its
    reading time is up (then the caller disconnects)."""
    read_for = rng.uniform(0.4, 1.0) * SLOW_READER_S
    stall_at, stall_s = rng.randint(2, 8), rng.uniform(1.0, 3.0)
    start, sse, chunks, stalled = time.monotonic(), _SSE(), 0, False
    try:
        while piece := await _next_piece(reader, chunked):
            for data in sse.feed(piece):
                if data == b"[DONE]":
                    info["label"] = "completed"
                    return "ok", 200, f"[DONE] after {chunks} chunks, read slowly"
                try:
                    chunk = orjson.loads(data)
                except orjson.JSONDecodeError:
                    return "bad_output", 200, f"chunk {chunks + 1} not JSON: {excerpt(data)}"
                if "error" in chunk:
                    return "bad_output", 200, f"error after {chunks} chunks: {excerpt(data)}"
                chunks += 1
            pause = READ_PAUSE_S
            if not stalled and chunks >= stall_at:
                pause, stalled = stall_s, True  # stops reading for a while
            await asyncio.sleep(pause)
            if time.monotonic() - start > read_for:
                info["label"] = "disconnected"
                return "ok", 200, f"disconnected after {chunks} chunks, {read_for:.1f} s"
    except (asyncio.IncompleteReadError, ValueError) as e:
        return "bad_output", 200, f"a broken stream after {chunks} chunks: {e!r}"
    return "bad_output", 200, f"the stream ended without [DONE] after {chunks} chunks"


async def _slow_read(t: Traffic, sent: bytes, rng: random.Random,
                     info: dict[str, Any]) -> Verdict:
    reader, writer = await _connect(t, RCVBUF_BYTES)
    try:
        writer.write(sent)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status = _status(head)
        if status != 200:
            info["label"] = f"answered_{status}"
            rest = await asyncio.wait_for(reader.read(65536), 10)
            return status_verdict(status or 0, head + rest)
        return await _read_slowly(reader, b"chunked" in head.lower(), rng, info)
    finally:
        writer.close()  # mid-stream, with unread data: the server sees a reset


async def slow_reader(t: Traffic, rng: random.Random) -> list[Outcome]:
    body = chat_body(t, rng.choice(QUESTIONS), stream=True, logprobs=True, top_logprobs=20,
                     max_tokens=rng.choice((12, 24, 96, 160)), temperature=0.8,
                     seed=rng.randint(0, 1 << 30))
    data = orjson.dumps(body)
    sent = _head(t, "/v1/chat/completions", len(data)) + data
    info: dict[str, Any] = {}
    with t.running("slow_reader"):
        return [await _timed_raw(t, "slow_reader", sent, _slow_read(t, sent, rng, info), info,
                                 t.timeout_s)]
