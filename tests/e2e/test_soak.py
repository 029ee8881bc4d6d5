"""A short soak (`aioengine bench soak`, aioengine/bench/soak.py) with its own small server:
every kind of request once at the start and a seeded mix after, then no 5xx, no unexpected
outcome, preemptions (the long prompts do not fit the 64-block cache together) and no KV
block held once the server is idle.

Mixed in (issue 27): slow clients over raw sockets, which the server's short timeouts here
must end (half a head: closed after --keepalive-timeout; half a body: a 408 after
--body-read-timeout, then closed; a slow reader of a stream, whose KV blocks must be freed
when it goes), a prompt near the 512-token context that must complete while the short
requests run, and prompts over it that must get a 400; the short streams' TTFT during the
long prompts is reported."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

pytestmark = pytest.mark.slow

UNEXPECTED = ("unexpected_4xx", "5xx", "conn_error", "timeout", "bad_output", "held_open")
KINDS = {"long", "stream", "cancel", "malformed", "hostile", "tools", "structured",
         "completion", "chat_n", "slow_head", "slow_body", "slow_reader", "near_context",
         "over_context"}
ALONE = 4  # short streams on the idle server before the traffic (the TTFT baseline)
KEEPALIVE_S, BODY_READ_S = 2, 3
MAX_MODEL_LEN = 512


def _labels(report: dict, kind: str) -> dict[str, dict]:
    return report["cases"].get(kind, {})


def test_short_soak(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    # 8 workers: their first turns cover the 14 kinds (the slow clients run in the
    # background); 64 blocks of 16 tokens, so the burst of three long prompts (40% of the
    # cache each) must preempt; a context of half the cache, so that a prompt near it
    # leaves room for the others (a 15 s soak); timeouts of a few seconds, so that the
    # stalled connections end within the soak.
    server_args = (f"--num-kv-blocks 64 --max-model-len {MAX_MODEL_LEN} --keepalive-timeout "
                   f"{KEEPALIVE_S} --body-read-timeout {BODY_READ_S}")
    cmd = [sys.executable, "-m", "aioengine", "bench", "soak", "--duration", "15",
           "--concurrency", "8", "--sample-interval", "2", "--timeout", "240",
           f"--server-args={server_args}", "--save-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    report = orjson.loads(out.read_bytes())
    table = proc.stdout + proc.stderr[-3000:]
    counts = report["counts"]
    assert set(counts) == KINDS | {"alone"} and counts["alone"]["ok"] == ALONE, table
    assert report["num_5xx"] == 0, table
    assert report["greedy_unchanged"], table
    assert counts["hostile"]["expected_4xx"] > 0, table
    assert all(row[o] == 0 for row in counts.values() for o in UNEXPECTED), table
    assert counts["malformed"]["expected_4xx"] > 0 and counts["long"]["ok"] > 0, table
    assert report["preemptions"] > 0, table
    _check_slow_clients_and_context(report, table)
    idle = report["after_idle"]
    assert idle["idle"] and idle["kv_blocks_in_use"] == 0, table
    assert report["rss_mib"]["max"] > 0 and report["fds"]["max"] > 0, table
    assert report["server_exit"]["returncode"] == 0, table
    assert report["verdict"]["pass"] and proc.returncode == 0, table


def _check_slow_clients_and_context(report: dict, table: str) -> None:
    # Half a head: closed by the server (no answer) after its keep-alive timeout, not held.
    heads = _labels(report, "slow_head")
    assert set(heads) == {"closed_by_server"}, table
    assert KEEPALIVE_S / 2 <= heads["closed_by_server"]["min"], table
    # Half a body: a 408 after the body-read timeout, and the connection closed.
    bodies = _labels(report, "slow_body")
    assert set(bodies) == {"408_closed"}, table
    assert BODY_READ_S / 2 <= bodies["408_closed"]["min"], table
    # A slow reader read to [DONE] or went away; either way nothing went wrong for it.
    assert set(_labels(report, "slow_reader")) <= {"completed", "disconnected"}, table
    # A prompt near the context completed; one over it got a 400 (never a 500 or a stall).
    assert set(_labels(report, "near_context")) == {"completed"}, table
    assert report["config"]["near_context_tokens"] > 0.8 * MAX_MODEL_LEN - 64, table
    assert set(_labels(report, "over_context")) == {"400"}, table
    # Short streams got their first token alone and while long prompts were in flight.
    ttft = report["ttft_s"]
    assert ttft["alone"]["n"] == ALONE and ttft["during_long"]["n"] > 0, table
    assert ttft["p50_ratio_during_long_to_alone"] is not None, table
