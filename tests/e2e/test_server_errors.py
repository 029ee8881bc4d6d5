"""Errors (status, OpenAI error body, `param`), auth, body limit, and client disconnects
through a real `aioengine serve` process."""
from __future__ import annotations

from collections.abc import Iterator

import asyncio
import time

import openai
import orjson
import pytest
from server_process import API_KEY, MODEL, ServerProcess, openai_client, serving

MAX_MODEL_LEN = 256
BODY_LIMIT = 65536
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG_PROMPT = " ".join(["hello"] * 300)  # 300 tokens > MAX_MODEL_LEN
VOCAB = 49152


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from serving("--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN),
                       "--max-request-body-bytes", str(BODY_LIMIT))


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server, API_KEY)


def post(server: ServerProcess, path: str, body: bytes | dict,
         headers: dict[str, str] | None = None) -> tuple[int, dict]:
    status, raw = server.request("POST", path, body, headers=AUTH if headers is None else headers)
    return status, orjson.loads(raw)


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            **fields}


BAD_REQUESTS = [
    # (route, body, status, param, words the message must contain)
    ("completions", completion(temperature="hot"), 400, "temperature", ["number"]),
    ("completions", completion(temperature=-0.5), 400, "temperature", [">= 0"]),
    ("completions", completion(top_p=1.5), 400, "top_p", ["1.5"]),
    ("completions", completion(n=0), 400, "n", []),
    ("completions", completion(logprobs=21), 400, "logprobs", ["20"]),
    ("completions", completion(max_tokens=0), 400, "max_tokens", []),
    ("completions", completion(max_tokens="many"), 400, "max_tokens", ["integer"]),
    ("completions", completion(presence_penalty=3), 400, "presence_penalty", []),
    ("completions", completion(stop=[1, 2]), 400, "stop", []),
    ("completions", completion(seed=1.5), 400, "seed", ["integer"]),
    ("completions", b'{"prompt": "Hi", "seed": 1180591620717411303424}', 400, "seed", []),
    ("completions", completion(stop_token_ids=[VOCAB]), 400, "stop_token_ids", [str(VOCAB)]),
    ("completions", completion(n=64, max_tokens=200), 400, "max_tokens", ["KV blocks"]),
    ("completions", completion(prompt=""), 400, "prompt", ["empty"]),
    ("completions", completion(prompt=[]), 400, "prompt", ["empty"]),
    ("completions", completion(prompt=None), 400, "prompt", []),
    ("completions", completion(prompt=[1, VOCAB]), 400, "prompt", [str(VOCAB)]),
    ("completions", completion(prompt=[[1, 2], [-1]]), 400, "prompt", ["-1"]),
    ("completions", completion(logit_bias={str(VOCAB + 5): 1}), 400, "logit_bias",
     [str(VOCAB + 5)]),
    ("completions", completion(logit_bias={"abc": 1}), 400, "logit_bias", ["abc"]),
    ("completions", completion(prompt=LONG_PROMPT), 400, "prompt",
     ["300 tokens", str(MAX_MODEL_LEN)]),
    ("completions", completion(max_tokens=300), 400, "max_tokens",
     ["300", str(MAX_MODEL_LEN), "1 tokens"]),
    ("completions", completion(stream_options={"include_usage": True}), 400, "stream_options",
     ["stream"]),
    ("completions", completion(stream=False, stream_options={"include_usage": True}), 400,
     "stream_options", []),
    ("completions", completion(stream=True, stream_options={"include_usage": "yes"}), 400,
     "stream_options", ["include_usage"]),
    ("completions", completion(stream=True, stream_options={"include_usage": True},
                               top_k=-2), 400, "top_k", []),
    ("chat/completions", chat(messages="hi"), 400, "messages", []),
    ("chat/completions", chat(messages=[]), 400, "messages", []),
    ("chat/completions", chat(messages=[{"content": "no role"}]), 400, "messages", ["role"]),
    ("chat/completions", chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     400, "messages", ["image_url"]),
    ("chat/completions", chat(top_logprobs=2), 400, "top_logprobs", ["logprobs"]),
    ("chat/completions", chat(max_completion_tokens=MAX_MODEL_LEN), 400, "max_tokens",
     [str(MAX_MODEL_LEN)]),
    ("chat/completions", chat(messages=[{"role": "user", "content": LONG_PROMPT}]), 400,
     "messages", [str(MAX_MODEL_LEN)]),
    ("chat/completions", chat(stream_options={"include_usage": True}), 400, "stream_options",
     []),
    ("completions", completion(model="gpt-4"), 404, "model", ["gpt-4"]),
    ("chat/completions", chat(model="other"), 404, "model", ["other"]),
]


@pytest.mark.parametrize("route,body,status,param,words", BAD_REQUESTS,
                         ids=[f"{r[0]}-{r[3]}-{i}" for i, r in enumerate(BAD_REQUESTS)])
def test_bad_requests(server: ServerProcess, route: str, body: dict | bytes, status: int,
                      param: str, words: list[str]) -> None:
    got_status, got = post(server, f"/v1/{route}", body)
    assert got_status == status, got
    error = got["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert all(w in error["message"] for w in words), error["message"]


def test_invalid_json_and_non_object(server: ServerProcess) -> None:
    for raw in (b"{not json", b"[1, 2]", b"", b'"text"'):
        status, body = post(server, "/v1/completions", raw)
        assert status == 400 and body["error"]["type"] == "invalid_request_error", raw


def test_errors_through_the_openai_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", top_p=0)
    assert e.value.status_code == 400 and e.value.param == "top_p"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", stream=True, max_tokens=999)
    assert e.value.param == "max_tokens"  # a 400 before any stream header


def test_api_key(server: ServerProcess) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        status, body = post(server, "/v1/completions", completion(), headers=headers)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _ = server.request("GET", "/v1/models")
    assert status == 401
    for path in ("/metrics", "/version"):  # every route but /health needs the key
        assert server.request("GET", path)[0] == 401
        assert server.request("GET", path, headers=AUTH)[0] == 200
    bad = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert server.request("GET", "/health")[0] == 200


def test_body_over_the_limit_is_413(server: ServerProcess) -> None:
    status, body = post(server, "/v1/completions", completion(prompt="a" * BODY_LIMIT))
    assert status == 413 and str(BODY_LIMIT) in body["error"]["message"]
    status, _ = post(server, "/v1/completions", completion(prompt="a " * 100))
    assert status == 200  # under the limit


def test_unknown_fields_and_routes(server: ServerProcess) -> None:
    status, body = post(server, "/v1/completions", completion(
        user="me", foo={"bar": [1]}, best_of=None, suffix=None, stream_options=None))
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    status, raw = server.request("GET", "/v1/nothing", headers=AUTH)
    assert status == 404 and orjson.loads(raw)["error"]["type"] == "not_found_error"
    status, raw = server.request("GET", "/v1/completions", headers=AUTH)
    assert status == 405 and "error" in orjson.loads(raw)


async def test_100_requests_cancelled_by_client_timeout_free_every_block(
        server: ServerProcess, client: openai.OpenAI) -> None:
    before = server.wait_idle()
    impatient = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0,
                                   timeout=0.5)
    calls = [impatient.completions.create(model=MODEL, prompt=f"Count to {i}:", max_tokens=200,
                                          extra_body={"ignore_eos": True})
             for i in range(90)]
    results = await asyncio.gather(*calls, *(_stream_then_leave(impatient) for _ in range(10)),
                                   return_exceptions=True)
    await impatient.close()
    assert all(isinstance(r, openai.APITimeoutError) for r in results[:90]), results[:3]
    assert all(r == 2 for r in results[90:]), results[90:]
    start = time.monotonic()
    after = server.wait_idle(timeout=15)
    assert after["aioengine:num_requests_running"] == 0
    assert after["aioengine:num_requests_waiting"] == 0
    assert after["aioengine:kv_cache_usage_perc"] == 0
    assert time.monotonic() - start < 15
    def finished(reason: str, m: dict[str, float]) -> float:
        return m.get('aioengine:request_success_total{finished_reason="%s",model_name="%s"}'
                     % (reason, MODEL), 0.0)

    # A request the client gave up on before the server admitted it never reaches the engine.
    assert 0 < finished("abort", after) - finished("abort", before) <= 100
    assert finished("length", after) == finished("length", before)
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    assert out.usage.completion_tokens == 3  # still serving


async def _stream_then_leave(client: openai.AsyncOpenAI) -> int:
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a long poem."}],
        max_tokens=200, stream=True, timeout=60, extra_body={"ignore_eos": True})
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 2:
            break
    await stream.close()
    return seen
