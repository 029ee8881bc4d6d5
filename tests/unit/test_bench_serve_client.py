"""The serving benchmark's client side: arrival-time statistics, request payloads, and the
streaming client's timing and parsing against a small local SSE server. The real server is
driven in tests/e2e/test_bench_serve.py; this one produces the malformed and failing
streams a real server does not."""
from __future__ import annotations

import asyncio
import json
import math
import statistics

import aiohttp
import pytest
from aiohttp import web

from aioengine.bench.datasets import BenchRequest
from aioengine.bench.metrics import RequestResult
from aioengine.bench.serve import (ServeConfig, arrival_intervals, arrival_offsets,
                                   build_payload, send_request)

# ---- arrivals --------------------------------------------------------------------------


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrival_gaps_have_gamma_statistics(burstiness: float) -> None:
    rate, n = 8.0, 40_000
    gaps = arrival_intervals(n, rate, burstiness, seed=0)
    mean = statistics.fmean(gaps)
    cv = statistics.pstdev(gaps) / mean
    assert mean == pytest.approx(1 / rate, rel=0.03)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.04)
    assert min(gaps) >= 0


def test_poisson_counts_per_window() -> None:
    """Poisson arrivals: counts in 1 s windows have variance equal to their mean."""
    offsets = arrival_offsets(30_000, 10.0, 1.0, seed=5)
    counts = [0] * int(offsets[-1])
    for t in offsets:
        if int(t) < len(counts):
            counts[int(t)] += 1
    assert statistics.fmean(counts) == pytest.approx(10.0, rel=0.03)
    assert statistics.pvariance(counts) == pytest.approx(10.0, rel=0.1)


def test_arrival_offsets_shape_and_seed() -> None:
    offsets = arrival_offsets(100, 5.0, 1.0, seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets) and len(offsets) == 100
    assert offsets == arrival_offsets(100, 5.0, 1.0, seed=1)
    assert offsets != arrival_offsets(100, 5.0, 1.0, seed=2)
    assert arrival_offsets(3, math.inf, 1.0, seed=0) == [0.0, 0.0, 0.0]
    for rate, k in ((0.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError):
            arrival_intervals(3, rate, k, seed=0)


# ---- requests and the streaming client -------------------------------------------------


def test_payloads() -> None:
    ids_req, text_req = BenchRequest([5, 6, 7], None, 9), BenchRequest([1, 2], "Hi there?", 3)
    cfg = ServeConfig("http://h:1/v1/")
    assert cfg.root == "http://h:1"
    body = build_payload(ids_req, cfg, "m")
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 9
    assert body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert build_payload(text_req, cfg, "m")["prompt"] == "Hi there?"
    chat = ServeConfig("http://h:1", endpoint="chat", api_key="k")
    assert build_payload(text_req, chat, "m", 2)["messages"] == [
        {"role": "user", "content": "Hi there?"}]
    assert build_payload(text_req, chat, "m", 2)["max_tokens"] == 2
    assert chat.headers["Authorization"] == "Bearer k"
    with pytest.raises(ValueError):
        build_payload(ids_req, chat, "m")
    messages = ServeConfig("http://h:1", endpoint="messages", api_key="k")
    body = build_payload(text_req, messages, "m", 2)
    assert body["messages"] == [{"role": "user", "content": "Hi there?"}]
    assert "stream_options" not in body and body["max_tokens"] == 2
    assert messages.headers["x-api-key"] == "k"


def _sse(obj: dict | str) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n"


async def _fake_openai(request: web.Request) -> web.StreamResponse:
    """Streams 3 chunks 50 ms apart, an empty-text chunk, a usage chunk, then [DONE] —
    unless the prompt asks for a failure mode."""
    body = await request.json()
    mode = body.get("prompt") if isinstance(body.get("prompt"), str) else "ok"
    if mode == "status":
        return web.json_response({"error": {"message": "bad"}}, status=400)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    chat = request.path.endswith("chat/completions")
    for i in range(3):
        await asyncio.sleep(0.05)
        choice = {"delta": {"content": f"t{i}"}} if chat else {"text": f"t{i}"}
        await resp.write(_sse({"choices": [choice]}))
    await resp.write(_sse({"choices": [{"text": "", "delta": {}}]}))
    if mode != "nousage":
        await resp.write(_sse({"choices": [], "usage": {
            "prompt_tokens": 11, "completion_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 8}}}))
    if mode != "truncated":
        await resp.write(_sse("[DONE]"))
    return resp


async def _client_run(endpoint: str, prompt: str | None) -> RequestResult:
    app = web.Application()
    app.router.add_post("/v1/completions", _fake_openai)
    app.router.add_post("/v1/chat/completions", _fake_openai)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    cfg = ServeConfig(f"http://127.0.0.1:{port}", endpoint=endpoint)
    req = BenchRequest([1, 2, 3], prompt, 5)
    try:
        async with aiohttp.ClientSession() as session:
            return await send_request(session, cfg, build_payload(req, cfg, "m"), 3, 0.0)
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_client_times_content_chunks(endpoint: str) -> None:
    r = await _client_run(endpoint, "ok")
    assert r.success, r.error
    assert len(r.chunk_times_s) == 3  # the empty-text chunk is not a token arrival
    assert r.output_tokens == 5 and r.prompt_len == 11  # from usage
    assert r.cached_tokens == 8
    assert r.ttft_s == r.chunk_times_s[0] >= 0.04
    assert all(0.03 <= x for x in r.itls_s)
    assert r.ttft_s <= r.e2e_s


async def test_client_failure_modes() -> None:
    r = await _client_run("completions", "nousage")
    assert r.success and r.output_tokens == 3 and r.prompt_len == 3  # counted chunks
    assert r.cached_tokens == 0
    r = await _client_run("completions", "truncated")
    assert not r.success and "DONE" in r.error
    r = await _client_run("completions", "status")
    assert not r.success and r.error.startswith("HTTP 400")
    cfg = ServeConfig("http://127.0.0.1:9")  # nothing listens on the discard port
    async with aiohttp.ClientSession() as session:
        r = await send_request(session, cfg, {"prompt": [1]}, 1, 0.0)
    assert not r.success and "Connect" in r.error
