"""The server fuzzer, with a fixed seed, against a real `aioengine serve` (keyless, with tool
calling, as `make serve` runs): every mutated request (fuzz_corpus.py) gets a status below
500 and, when refused, an error body; /health keeps answering; no traceback reaches the log;
every KV block is free afterwards and greedy output is what it was before."""
from __future__ import annotations

import http.client
import time
from collections import Counter
from collections.abc import Iterator
from urllib.parse import urlparse

import orjson
import pytest
from fuzz_corpus import Case, generate
from server_process import MODEL, ServerProcess, serving

pytestmark = pytest.mark.slow

SEED, CASES = 48, 240
GREEDY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12,
          "temperature": 0}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from serving("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                       "--max-model-len", "1024")


def send(server: ServerProcess, case: Case) -> tuple[int, bytes]:
    url = urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    headers = {"Content-Type": "application/json", **case.headers}
    try:
        conn.request("POST", case.route, body=case.data(), headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _greedy(server: ServerProcess) -> str:
    status, raw = server.request("POST", "/v1/completions", GREEDY)
    assert status == 200, raw
    return orjson.loads(raw)["choices"][0]["text"]


def test_fuzzed_requests_never_get_a_5xx(server: ServerProcess) -> None:
    before = _greedy(server)
    statuses: Counter[int] = Counter()
    worst_health = 0.0
    for i, case in enumerate(generate(MODEL, CASES, SEED)):
        status, raw = send(server, case)
        statuses[status] += 1
        assert status < 500, (i, case.route, case.mutations, raw[:300])
        if status >= 400 and raw:
            assert "error" in orjson.loads(raw), (i, case.mutations, raw[:300])
        start = time.monotonic()
        assert server.request("GET", "/health")[0] == 200
        worst_health = max(worst_health, time.monotonic() - start)
    print(sorted(statuses.items()))
    assert statuses[200] > 0 and sum(n for s, n in statuses.items() if s >= 400) > 0, statuses
    assert worst_health < 1.0, worst_health
    idle = server.wait_idle()
    assert idle["aioengine:kv_cache_usage_perc"] == 0
    assert _greedy(server) == before
    log = "".join(server.log)
    assert "Traceback" not in log, log[-3000:]
