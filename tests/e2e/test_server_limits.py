"""The work budget of one request (issue 48) against a real `aioengine serve`: a body nested
deep, stop strings, `logit_bias`, tools and schemas past their limits are 400s naming the
field, answered before any work, with the server's memory and /health untouched; header bytes
that are not UTF-8 in the key are a 401, never a 500."""
from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import orjson
import psutil
import pytest
from server_process import API_KEY, MODEL, ServerProcess, serving

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from serving("--api-key", API_KEY)


def post(server: ServerProcess, path: str, body: bytes | dict,
         timeout: float = 60) -> tuple[int, dict]:
    status, raw = server.request("POST", path, body, headers=AUTH, timeout=timeout)
    return status, orjson.loads(raw)


def _rss_mb(server: ServerProcess) -> float:
    return psutil.Process(server.proc.pid).memory_info().rss / 2**20


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("pad", [0, 1 << 20], ids=["small-body", "large-body"])
def test_deep_nesting_is_a_400_before_parsing(server: ServerProcess, pad: int) -> None:
    """Depth 20,000 in a body over 1 MiB took +650 MB of RSS that never came back (ijson
    has no depth limit); the same limit holds for small bodies parsed by orjson."""
    head = orjson.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2, "pad": "p" * pad})
    body = head[:-1] + b', "junk": ' + _nested(20_000) + b"}"
    before = _rss_mb(server)
    start = time.monotonic()
    status, raw, latencies = server.post_polling_health("/v1/completions", body, AUTH)
    answer = orjson.loads(raw)
    assert status == 400, answer
    assert "--max-json-depth" in answer["error"]["message"]
    assert time.monotonic() - start < 1.0
    assert _rss_mb(server) - before < 100
    assert not latencies or latencies[-1] < 0.1


def test_nesting_within_the_limit_is_served(server: ServerProcess) -> None:
    head = orjson.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2})
    status, answer = post(server, "/v1/completions", head[:-1] + b', "junk": ' + _nested(60)
                          + b"}")
    assert status == 200, answer


def _deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _chat(**fields: object) -> dict:
    return {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}], **fields}


def _tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters
                                             or {"type": "object", "properties": {}}}}


OVER_LIMITS = {
    # A schema 400+ deep was a 500 (RecursionError in deepcopy and in jsonschema).
    "deep-response-format": (_chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": _deep_schema(450)}}), "--max-json-depth", None),
    "deep-guided-json": (_chat(guided_json=_deep_schema(450)), "--max-json-depth", None),
    "deep-tool-parameters": (_chat(tools=[_tool("f", _deep_schema(450))]), "--max-json-depth",
                             None),
    "stop-strings": (_chat(stop=[f"never-{i}" for i in range(1025)]), "--max-stop-strings",
                     "stop"),
    "stop-chars": (_chat(stop=["a" * 40_000, "b" * 40_000]), "--max-stop-chars", "stop"),
    # A full-vocabulary bias cost 7x per sample (n=128: 48.7 s instead of 6.8 s).
    "logit-bias": (_chat(logit_bias={str(i): 1 for i in range(49_152)}), "--max-logit-bias",
                   "logit_bias"),
    # 5,000 tools took 32 s of CPU for a 4-token answer.
    "tools": (_chat(tools=[_tool(f"f{i}") for i in range(5000)]), "--max-tools", "tools"),
    "schema-bytes": (_chat(guided_choice=["c" * 1000] * 300), "--max-schema-bytes",
                     "guided_choice"),
}


@pytest.mark.parametrize("name", OVER_LIMITS)
def test_over_a_limit_is_a_fast_400_naming_it(server: ServerProcess, name: str) -> None:
    body, flag, param = OVER_LIMITS[name]
    start = time.monotonic()
    # json, not orjson: orjson writes at most 255 levels.
    status, answer = post(server, "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400, answer
    assert flag in answer["error"]["message"] and answer["error"]["param"] == param
    assert time.monotonic() - start < 1.0


def test_at_the_limits_requests_are_served(server: ServerProcess) -> None:
    status, answer = post(server, "/v1/chat/completions", _chat(
        logit_bias={str(i): 0.5 for i in range(300)}, stop=[f"never-{i}" for i in range(1024)],
        n=2, temperature=1.0, seed=1))
    assert status == 200, answer
    assert len(answer["choices"]) == 2


def _raw_status(server: ServerProcess, head: bytes) -> int:
    url = urlparse(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(head)
        reply = sock.recv(1 << 16)
    return int(reply.split(b" ", 2)[1])


# (key bytes, status): a NUL is refused by aiohttp's header parser itself.
KEYS = [(b"\xff\xfe", 401), (b"\xc3\x28", 401), (b"test-key\x80", 401), (b"\x00", 400)]


@pytest.mark.parametrize("key,expected", KEYS)
def test_a_key_of_any_bytes_is_a_4xx(server: ServerProcess, key: bytes, expected: int) -> None:
    """`Bearer \\xff\\xfe` was a 500 (UnicodeEncodeError in the key comparison)."""
    head = (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + key
            + b"\r\nConnection: close\r\n\r\n")
    assert _raw_status(server, head) == expected
    assert server.request("GET", "/v1/models", headers=AUTH)[0] == 200
