"""Graceful shutdown of a real `aioengine serve` process on SIGTERM and SIGINT."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from server_process import MODEL, start_server

STORY = [{"role": "user", "content": "Write a long story about the sea."}]


def test_sigterm_aborts_in_flight_requests_and_exits_0() -> None:
    srv = start_server()
    client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=2000,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = [next(chunks), next(chunks)]
    result: dict = {}

    def wait_for_completion() -> None:
        result["out"] = client.completions.create(model=MODEL, prompt="Once", max_tokens=2000,
                                                  extra_body={"ignore_eos": True})

    waiter = threading.Thread(target=wait_for_completion)
    waiter.start()
    deadline = time.monotonic() + 30
    while srv.metrics()["aioengine:num_requests_running"] < 2:  # both in the batch
        assert time.monotonic() < deadline, "".join(srv.log)
        time.sleep(0.05)
    srv.proc.send_signal(signal.SIGTERM)
    rest = list(chunks)  # the stream ends (with [DONE]) instead of hanging
    waiter.join(timeout=60)
    assert srv.proc.wait(timeout=60) == 0, "".join(srv.log)
    assert first[0].choices[0].delta.role == "assistant"
    assert rest[-1].choices[0].finish_reason == "abort"
    assert result["out"].choices[0].finish_reason == "abort"
    assert result["out"].usage.completion_tokens < 2000
    with pytest.raises(urllib.error.URLError):  # no longer accepting
        urllib.request.urlopen(srv.url + "/health", timeout=5)
    assert not any("Traceback" in line for line in srv.log), "".join(srv.log)


def test_flags_and_sigint_exits_0() -> None:
    srv = start_server("--served-model-name", "small", "smol", "--max-model-len", "128")
    assert srv.model == "small"
    client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
    models = client.models.list().data
    assert [m.id for m in models] == ["small", "smol"]
    assert models[0].model_extra["max_model_len"] == 128
    out = client.completions.create(model="smol", prompt="Hi", max_tokens=2)
    assert out.model == "smol"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert srv.stop(signal.SIGINT) == 0
    assert any("server stopped" in line for line in srv.log)


def _serve_fails(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aioengine.cli", "serve", *args],
                          capture_output=True, text=True, timeout=120)


def test_taken_port_and_missing_model_fail_fast() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _serve_fails("--port", str(port))  # fails before loading the model
    assert proc.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in proc.stderr
    proc = _serve_fails("/nonexistent/model.gguf", "--port", "0")
    assert proc.returncode == 2 and "does not exist" in proc.stderr
