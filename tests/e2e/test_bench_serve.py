"""`aioengine bench serve` against a real `aioengine serve` process: a handful of short
streamed requests through both endpoints, checked through the saved JSON and PNG."""
from __future__ import annotations

from collections.abc import Iterator

import json

import pytest

from aioengine.bench import main as bench_main
from server_process import API_KEY, MODEL, ServerProcess, serving

OUTPUT_LEN = 6


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from serving("--api-key", API_KEY)


def _bench(server: ServerProcess, tmp_path, *extra: str) -> tuple[int, dict]:
    path = tmp_path / "result.json"
    rc = bench_main(["serve", "--base-url", server.base_url, "--api-key", API_KEY,
                     "--num-prompts", "4", "--output-len", str(OUTPUT_LEN),
                     "--max-concurrency", "4", "--no-progress", "--seed", "1",
                     "--save-json", str(path), *extra])
    return rc, json.loads(path.read_text())


def _check_requests(report: dict) -> None:
    assert report["model"] == MODEL
    summary, requests = report["summary"], report["requests"]
    assert summary["successful_requests"] == 4 and summary["failed_requests"] == 0
    assert summary["total_output_tokens"] == 4 * OUTPUT_LEN
    for r in requests:
        assert r["success"] and r["error"] == ""
        assert r["output_tokens"] == OUTPUT_LEN  # ignore_eos + max_tokens: exact
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert r["chunk_times_s"] == sorted(r["chunk_times_s"])
        assert r["chunk_times_s"][0] == r["ttft_s"] and r["chunk_times_s"][-1] <= r["e2e_s"]
        assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / (OUTPUT_LEN - 1))
    assert summary["ttft"]["p50_ms"] <= summary["e2el"]["p99_ms"]


def test_completions_token_ids_with_plot(server: ServerProcess, tmp_path) -> None:
    png = tmp_path / "latency.png"
    rc, report = _bench(server, tmp_path, "--input-len-min", "8", "--input-len-max", "40",
                        "--slo", "ttft:60000,tpot:60000", "--plot", str(png))
    assert rc == 0
    _check_requests(report)
    # Token-id prompts reach the model unchanged: the server's prompt count is exact.
    assert report["summary"]["total_input_tokens"] == report["workload"]["num_prompt_tokens"]
    assert report["summary"]["goodput_requests"] == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "api_key" not in report["config"]
    server.wait_idle()


def test_chat_text_dataset(server: ServerProcess, tmp_path) -> None:
    rc, report = _bench(server, tmp_path, "--endpoint", "chat", "--dataset", "text",
                        "--request-rate", "20")
    assert rc == 0
    _check_requests(report)
    # The chat template wraps each prompt, so the server counts more tokens than the text.
    assert report["summary"]["total_input_tokens"] > report["workload"]["num_prompt_tokens"]
    server.wait_idle()


def test_messages_endpoint(server: ServerProcess, tmp_path) -> None:
    """Anthropic's /v1/messages: its SSE events timed as chat's chunks, its usage read."""
    rc, report = _bench(server, tmp_path, "--endpoint", "messages", "--dataset", "text")
    assert rc == 0
    _check_requests(report)
    assert report["summary"]["total_input_tokens"] > report["workload"]["num_prompt_tokens"]
    server.wait_idle()
