"""Faults and overload against a real server process, with in-process fault injection
(AIOENGINE_FAULT_INJECTION=1: POST /debug/faults arms the engine's real failure paths):
a failing forward, the engine loop dying, --max-queued-requests, a client that stops
reading. Every scenario ends with no KV block held."""
from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator

import aiohttp
import openai
import pytest
from server_process import MODEL, ServerProcess, openai_client, start_server

pytestmark = pytest.mark.slow

FAULTS = {"AIOENGINE_FAULT_INJECTION": "1"}
ASK = [{"role": "user", "content": "Write a long story about the sea."}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # Not `serving()`: injected failures are logged as errors, on purpose.
    srv = start_server("--max-queued-requests", "4", "--max-num-seqs", "2", env=FAULTS)
    yield srv
    assert srv.stop() == 0


def arm(server: ServerProcess, kind: str, count: int = 1) -> None:
    status, body = server.request("POST", "/debug/faults", {"kind": kind, "count": count})
    assert status == 200, body


def wait_no_blocks(server: ServerProcess) -> None:
    m = server.wait_idle()
    assert m["aioengine:num_requests_running"] == 0, m
    assert m["aioengine:kv_cache_usage_perc"] == 0, m


def test_a_failing_forward_fails_its_requests_and_serving_goes_on(server) -> None:
    client = openai_client(server)
    stream = client.chat.completions.create(model=MODEL, messages=ASK, stream=True,
                                            max_tokens=200, temperature=0)
    first = next(iter(stream))  # the stream has begun
    assert first.choices[0].delta.role == "assistant"
    arm(server, "forward")
    with pytest.raises(openai.APIError, match="injected forward failure"):
        for _ in stream:  # the error event, then [DONE]
            pass
    arm(server, "forward")
    with pytest.raises(openai.InternalServerError, match="injected forward failure") as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20)
    assert e.value.status_code == 500
    wait_no_blocks(server)
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                        temperature=0)
    assert ok.choices[0].finish_reason == "length"
    wait_no_blocks(server)


async def test_overload_is_a_503_with_retry_after_and_admitted_requests_finish(
        server) -> None:
    """2 run (--max-num-seqs 2), 4 may wait (--max-queued-requests 4); more get a 503 at
    once, and none of the admitted ones is disturbed."""
    url = server.base_url + "/chat/completions"
    body = {"model": MODEL, "messages": ASK, "max_tokens": 80, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        async def call() -> tuple[int, dict, dict]:
            async with session.post(url, json=body) as r:
                return r.status, dict(r.headers), await r.json()

        admitted = [asyncio.create_task(call()) for _ in range(6)]
        while server.metrics()["aioengine:num_requests_waiting"] < 4:  # two run, four wait
            await asyncio.sleep(0.05)
        status, headers, err = await call()
        assert status == 503 and headers["Retry-After"] == "1", err
        assert err["error"]["type"] == "service_unavailable_error"
        results = await asyncio.gather(*admitted)
    assert [r[0] for r in results] == [200] * 6
    assert all(r[2]["usage"]["completion_tokens"] == 80 for r in results)
    wait_no_blocks(server)


async def test_a_client_that_stops_reading_does_not_stall_others(server) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a tiny TCP window
    stalled.connect((host, int(port)))
    payload = json.dumps({"model": MODEL, "messages": ASK, "stream": True,
                          "max_tokens": 2000, "ignore_eos": True}).encode()
    stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                    b"Content-Type: application/json\r\nContent-Length: "
                    + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    try:  # never read: the server's writes to it block once the buffers are full
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        start = time.monotonic()
        for _ in range(3):
            stream = await client.chat.completions.create(
                model=MODEL, messages=ASK, stream=True, max_tokens=30,
                extra_body={"ignore_eos": True})
            chunks = [c async for c in stream]
            assert chunks[-1].choices[0].finish_reason == "length"
        assert time.monotonic() - start < 60
        await client.close()
    finally:
        stalled.close()  # the server sees the reset and aborts that request
    wait_no_blocks(server)


def test_the_engine_loop_dying_is_503s_and_a_clean_stop() -> None:
    srv = start_server(env=FAULTS)
    try:
        client = openai_client(srv)
        stream = client.chat.completions.create(model=MODEL, messages=ASK, stream=True,
                                                max_tokens=500, extra_body={"ignore_eos": True})
        next(iter(stream))
        arm(srv, "loop")
        with pytest.raises(openai.APIError, match="engine"):
            for _ in stream:
                pass
        status, _ = srv.request("GET", "/health")
        assert status == 503
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5)
        assert e.value.status_code == 503
    finally:
        assert srv.stop() == 0  # SIGTERM: a clean exit even with the engine dead
