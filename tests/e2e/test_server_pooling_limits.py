"""Issue 48 on a real `aioengine serve` of the bundled model (576-dim vectors: a 2,048-input
float answer is 25 MB): a pooling call's inputs are counted before any work, so more than
--max-pooling-inputs (2,048) inputs or documents is a 400 naming the field at once (20,000
short inputs to /v1/embeddings ran 392 s and stalled /health 10 s before), and a call AT
the limit completes while /health keeps answering and the server's memory comes back.
One server for the module."""
from __future__ import annotations

import time
from collections.abc import Iterator

import orjson
import pytest
from server_process import ServerProcess, serving

pytestmark = pytest.mark.slow

LIMIT = 2048  # --max-pooling-inputs' default
TEXTS = [f"short input number {i}" for i in range(20_000)]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from serving()


@pytest.fixture(scope="module")
def warm(server: ServerProcess) -> None:
    """One 256-input call first: the first call that tokenizes on the prompt threads and
    runs 64 sequences a step grows a fresh server's RSS ~90 MB once (the threads' malloc
    arenas, the forward's first full batch), whatever follows."""
    status, raw = server.request("POST", "/v1/embeddings", {"input": TEXTS[:256]})
    assert status == 200, raw[:300]


def rss_mb(server: ServerProcess) -> float:
    with open(f"/proc/{server.proc.pid}/status") as status:
        kb = next(line for line in status if line.startswith("VmRSS")).split()[1]
    return int(kb) / 1024


@pytest.mark.parametrize("path,body,param", [
    ("/v1/embeddings", {"input": TEXTS[:LIMIT + 1]}, "input"),
    ("/v1/embeddings", {"input": TEXTS}, "input"),
    ("/pooling", {"input": [[1, 2, 3]] * (LIMIT + 1)}, "input"),
    ("/score", {"text_1": "a query", "text_2": TEXTS[:LIMIT + 1]}, "text_2"),
    ("/v1/score", {"text_1": TEXTS[:LIMIT + 1], "text_2": TEXTS[:LIMIT + 1]}, "text_1"),
    ("/rerank", {"query": "a query", "documents": TEXTS[:LIMIT + 1]}, "documents"),
    ("/v1/rerank", {"query": "a query", "documents": [{"text": t} for t in TEXTS]},
     "documents"),
])
def test_over_the_limit_is_a_400_before_any_work(server: ServerProcess, path: str,
                                                 body: dict, param: str) -> None:
    start = time.monotonic()
    status, raw = server.request("POST", path, body)
    elapsed = time.monotonic() - start
    assert status == 400, raw[:300]
    err = orjson.loads(raw)["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert f"at most {LIMIT}" in err["message"] and "--max-pooling-inputs" in err["message"]
    # Tokenizing and embedding 2,049 texts takes tens of seconds here; counting them none.
    assert elapsed < 5, elapsed
    assert server.metrics()["aioengine:num_requests_running"] == 0


def _check_answer(path: str, answer: dict) -> None:
    if path == "/v1/embeddings":
        assert [d["index"] for d in answer["data"]] == list(range(LIMIT))
        assert {len(d["embedding"]) for d in answer["data"]} == {576}
    elif path == "/score":
        assert len(answer["data"]) == LIMIT
        assert all(-1.0 <= d["score"] <= 1.0 for d in answer["data"])
    else:
        assert sorted(r["index"] for r in answer["results"]) == list(range(LIMIT))
        scores = [r["relevance_score"] for r in answer["results"]]
        assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize("path,body", [
    ("/v1/embeddings", {"input": TEXTS[:LIMIT], "encoding_format": "float"}),
    ("/score", {"text_1": "a query", "text_2": TEXTS[:LIMIT]}),
    ("/rerank", {"query": "a query", "documents": TEXTS[:LIMIT]}),
])
def test_a_call_at_the_limit_keeps_health_answering(server: ServerProcess, warm: None,
                                                    path: str, body: dict) -> None:
    rss_before = rss_mb(server)
    status, raw, latencies = server.post_polling_health(path, body)
    assert status == 200, raw[:300]
    _check_answer(path, orjson.loads(raw))
    del raw
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    assert p99 < 0.1, (len(latencies), p99, latencies[-5:])
    server.wait_idle()
    time.sleep(1)
    # The answer (25 MB of JSON for the embeddings) is not kept.
    assert rss_mb(server) - rss_before < 100, (rss_before, rss_mb(server))
