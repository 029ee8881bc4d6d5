"""`aioengine run-batch` as a user runs it: the real CLI in a subprocess on the bundled model.

A file mixing chat and completions lines with bad lines of every kind: the output parses as
the OpenAI Batch format, one record per line, each answer equal to what the HTTP server
answers for the same body (greedy output does not depend on how steps are batched: issue
29), each error the server's error body or a line error. Resume: a run killed mid-way
and a last line cut short, then the same command again completes the file with every
custom_id exactly once, the records written before the kill untouched."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from server_process import ServerProcess, serving

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "aioengine.cli", "run-batch", "--num-kv-blocks", "512"]

CHAT = [
    {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 12,
     "temperature": 0},
    {"messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 10,
     "temperature": 0},
    {"messages": [{"role": "user", "content": "Write a haiku about the sea."}],
     "max_tokens": 16, "logprobs": True, "top_logprobs": 2, "temperature": 0},
]
COMPLETIONS = [
    {"prompt": "The capital of France is", "max_tokens": 10, "temperature": 0},
    {"prompt": ["Once upon a time", "def fib(n):"], "max_tokens": 8, "n": 2,
     "temperature": 0},
    {"prompt": [504, 3458, 282, 4457, 314], "max_tokens": 6, "echo": True,
     "temperature": 0, "logprobs": 1},
]


def request_line(custom_id: str, url: str, body: dict) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def check_batch_record(rec: Any) -> None:
    """One line of OpenAI's Batch output format, as the fields' types say."""
    assert isinstance(rec, dict) and set(rec) == {"id", "custom_id", "response", "error"}
    assert isinstance(rec["id"], str) and rec["id"]
    assert rec["custom_id"] is None or isinstance(rec["custom_id"], str)
    response = rec["response"]
    assert set(response) == {"status_code", "request_id", "body"}
    assert isinstance(response["status_code"], int)
    assert isinstance(response["request_id"], str) and isinstance(response["body"], dict)
    if response["status_code"] == 200:
        assert rec["error"] is None and "error" not in response["body"]
    else:
        assert set(response["body"]["error"]) == {"message", "type", "param", "code"}
    if rec["error"] is not None:
        assert set(rec["error"]) == {"code", "message"} and response["status_code"] == 400


def read_records(path: Path) -> list[dict]:
    records = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    for rec in records:
        check_batch_record(rec)
    return records


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from serving()


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess,
                                                                 dict[str, dict], Path]:
    """One CLI run over the mixed file: (the process, records by custom_id, output path)."""
    folder = tmp_path_factory.mktemp("batch")
    lines = [request_line(f"chat-{i}", "/v1/chat/completions", b) for i, b in enumerate(CHAT)]
    lines += [request_line(f"cmpl-{i}", "/v1/completions", b)
              for i, b in enumerate(COMPLETIONS)]
    lines += [
        b'{"custom_id": "broken", "method": "POST", "url": ',  # not JSON
        b"",  # blank: ignored
        request_line("unknown-url", "/v1/images/generations", {"prompt": "x"}),
        request_line("embed", "/v1/embeddings", {"input": ["hello", "world"]}),
        request_line("bad-embed", "/v1/embeddings", {"input": []}),
        request_line("bad-body", "/v1/completions", {"prompt": "x", "max_tokens": -1}),
        request_line("bad-chat", "/v1/chat/completions", {"messages": "hi"}),
        request_line("streamed", "/v1/chat/completions",
                     {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
        request_line("chat-0", "/v1/completions", {"prompt": "duplicate id"}),
        b'["a", "list"]',
        orjson.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
    ]
    input_file, output = folder / "requests.jsonl", folder / "results.jsonl"
    input_file.write_bytes(b"\n".join(lines) + b"\n")
    proc = run_cli("-i", str(input_file), "-o", str(output))
    records = read_records(output) if output.exists() else []
    named = [r for r in records if r["custom_id"] is not None
             and (r["error"] or {}).get("code") != "duplicate_custom_id"]
    by_id = {rec["custom_id"]: rec for rec in named}
    assert len(by_id) == len(named)
    return proc, by_id, output


def _comparable(body: dict) -> dict:
    """A response body without what differs per call (ids, creation time)."""
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def test_mixed_file_runs_every_good_line_as_the_server_answers_it(
        mixed_run: tuple, server: ServerProcess) -> None:
    proc, by_id, output = mixed_run
    assert proc.returncode == 0, proc.stderr
    assert "run-batch: 7 ok, 9 failed, 0 skipped" in proc.stderr, proc.stderr
    assert "req/s" in proc.stderr or "it/s" in proc.stderr  # the progress bar
    bodies = ([(f"chat-{i}", "/v1/chat/completions", b) for i, b in enumerate(CHAT)]
              + [(f"cmpl-{i}", "/v1/completions", b) for i, b in enumerate(COMPLETIONS)]
              + [("embed", "/v1/embeddings", {"input": ["hello", "world"]})])
    for custom_id, url, body in bodies:
        rec = by_id[custom_id]
        assert rec["response"]["status_code"] == 200, rec
        status, raw = server.request("POST", url, body)
        assert status == 200
        assert _comparable(rec["response"]["body"]) == _comparable(orjson.loads(raw)), custom_id
    assert by_id["cmpl-1"]["response"]["body"]["object"] == "text_completion"
    assert len(by_id["cmpl-1"]["response"]["body"]["choices"]) == 4
    assert by_id["chat-2"]["response"]["body"]["choices"][0]["logprobs"]["content"]


def test_bad_lines_get_error_records_and_do_not_stop_the_others(
        mixed_run: tuple, server: ServerProcess) -> None:
    proc, by_id, output = mixed_run
    records = read_records(output)
    assert len(records) == 16  # every non-blank line once (the duplicate id too)
    anonymous = [r for r in records if r["custom_id"] is None]
    assert [r["error"]["code"] for r in anonymous] == ["invalid_batch_line"] * 3
    assert "line 7 is not valid JSON" in anonymous[0]["error"]["message"]
    assert "must be a JSON object" in anonymous[1]["error"]["message"]
    assert "custom_id must be a non-empty string" in anonymous[2]["error"]["message"]
    for custom_id, code, words in [("unknown-url", "unsupported_url", "not a Batch API url"),
                                   ("streamed", "invalid_batch_line", "stream is not supported")]:
        rec = by_id[custom_id]
        assert rec["response"]["status_code"] == 400 and rec["error"]["code"] == code
        assert words in rec["error"]["message"]
        assert rec["response"]["body"]["error"]["message"] == rec["error"]["message"]
    # A body the route refuses: the route's own 400, word for word.
    for custom_id, url, body in [("bad-body", "/v1/completions",
                                  {"prompt": "x", "max_tokens": -1}),
                                 ("bad-chat", "/v1/chat/completions", {"messages": "hi"}),
                                 ("bad-embed", "/v1/embeddings", {"input": []})]:
        status, raw = server.request("POST", url, body)
        assert status == 400
        rec = by_id[custom_id]
        assert rec["error"] is None
        assert (rec["response"]["status_code"], rec["response"]["body"]) == (400,
                                                                             orjson.loads(raw))
    # A custom_id used twice: the first line runs, the second gets an error record.
    reused = [r for r in records if r["custom_id"] == "chat-0"]
    assert sorted(r["response"]["status_code"] for r in reused) == [200, 400]
    assert [r["error"]["code"] for r in reused if r["error"]] == ["duplicate_custom_id"]


def test_resume_after_a_killed_run_completes_each_custom_id_once(tmp_path: Path) -> None:
    n = 24
    input_file, output = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    input_file.write_bytes(b"\n".join(
        request_line(f"r{i}", "/v1/completions",
                     {"prompt": f"Story number {i}:", "max_tokens": 32, "ignore_eos": True,
                      "temperature": 0})
        for i in range(n)) + b"\n")
    args = ["-i", str(input_file), "-o", str(output), "--max-concurrent-requests", "4",
            "--no-progress"]
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not (output.exists() and output.read_bytes().count(b"\n") >= 4):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stderr.close()
    before = output.read_bytes()
    finished = [orjson.loads(line)["custom_id"] for line in before.splitlines()]
    assert 4 <= len(finished) < n, "the run was not interrupted mid-way"
    with open(output, "ab") as f:  # as if killed while writing a line
        f.write(b'{"id": "batch_req-cut", "custom_id": "r')
    resumed = run_cli(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{n - len(finished)} ok, 0 failed, {len(finished)} skipped" in resumed.stderr
    after = output.read_bytes()
    assert after.startswith(before)  # what finished was kept as it was
    records = read_records(output)
    ids = [r["custom_id"] for r in records]
    assert sorted(ids) == sorted(f"r{i}" for i in range(n))
    assert all(r["response"]["status_code"] == 200 for r in records)
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 32 for r in records)
    # A second resume has nothing left to do.
    again = run_cli(*args)
    assert f"0 ok, 0 failed, {n} skipped" in again.stderr and output.read_bytes() == after


def test_bad_command_lines_are_refused(tmp_path: Path) -> None:
    missing = run_cli("-i", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o.jsonl"))
    assert missing.returncode == 2 and "no such file" in missing.stderr
    (tmp_path / "in.jsonl").write_text("")
    zero = run_cli("-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "o.jsonl"),
                   "--max-concurrent-requests", "0")
    assert zero.returncode == 2 and "must be >= 1" in zero.stderr
    assert not os.path.exists(tmp_path / "o.jsonl")
