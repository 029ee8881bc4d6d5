"""A short soak (aioengine/bench/soak.py) through scripts/soak.py with its own small server:
every kind of request once at the start and a seeded mix after, then no 5xx, no unexpected
outcome, preemptions (the long prompts do not fit the 64-block cache together) and no KV
block held once the server is idle."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
UNEXPECTED = ("unexpected_4xx", "5xx", "conn_error", "timeout", "bad_output")


def test_short_soak(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    # 8 workers, so each of the 8 kinds is sent at once; 64 blocks of 16 tokens, so the
    # burst of three long prompts (40% of the cache each) must preempt.
    cmd = [sys.executable, str(ROOT / "scripts" / "soak.py"), "--duration", "25",
           "--concurrency", "8", "--sample-interval", "2", "--timeout", "240",
           "--server-args=--num-kv-blocks 64", "--save-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    report = orjson.loads(out.read_bytes())
    table = proc.stdout + proc.stderr[-3000:]
    counts = report["counts"]
    assert set(counts) == {"long", "stream", "cancel", "malformed", "tools", "structured",
                           "completion", "chat_n"}, table
    assert report["num_5xx"] == 0, table
    assert all(row[o] == 0 for row in counts.values() for o in UNEXPECTED), table
    assert counts["malformed"]["expected_4xx"] > 0 and counts["long"]["ok"] > 0, table
    assert report["preemptions"] > 0, table
    idle = report["after_idle"]
    assert idle["idle"] and idle["kv_blocks_in_use"] == 0, table
    assert report["rss_mib"]["max"] > 0 and report["fds"]["max"] > 0, table
    assert report["server_exit"]["returncode"] == 0, table
    assert report["verdict"]["pass"] and proc.returncode == 0, table
