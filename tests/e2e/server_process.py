"""A real `aioengine serve` subprocess on a free port, for the server tests."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import openai
import orjson

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "test-key"
_READY = re.compile(r"ready: serving (\S+) at (http://\S+)")


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    model: str
    log: list[str] = field(default_factory=list)
    # The key it was started with (--api-key): metrics() and wait_idle() send it.
    api_key: str | None = None

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def request(self, method: str, path: str, body: bytes | dict | None = None,
                headers: dict[str, str] | None = None,
                timeout: float = 60) -> tuple[int, bytes]:
        """Raw HTTP: (status, body), for what the openai client cannot express."""
        data = orjson.dumps(body) if isinstance(body, dict) else body
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def post_polling_health(self, path: str, body: bytes | dict,
                            headers: dict[str, str] | None = None, timeout: float = 600,
                            interval: float = 0.05) -> tuple[int, bytes, list[float]]:
        """POSTs `body` on a thread while polling /health every `interval` seconds: (status,
        raw answer, the sorted /health latencies). Every poll must answer 200."""
        result: list[tuple[int, bytes]] = []
        worker = threading.Thread(target=lambda: result.append(
            self.request("POST", path, body, headers=headers, timeout=timeout)))
        worker.start()
        latencies = []
        while worker.is_alive():
            start = time.monotonic()
            assert self.request("GET", "/health", timeout=30)[0] == 200
            latencies.append(time.monotonic() - start)
            time.sleep(interval)
        worker.join()
        return *result[0], sorted(latencies)

    def metrics(self) -> dict[str, float]:
        """/metrics as {"name{labels}": value}; also {"name": sum over label sets}."""
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        status, text = self.request("GET", "/metrics", headers=auth)
        assert status == 200
        values: dict[str, float] = {}
        for line in text.decode().splitlines():
            if not line or line.startswith("#"):
                continue
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
            name = key.split("{", 1)[0]
            if "{" in key and name != key:
                values[name] = values.get(name, 0.0) + float(value)
        return values

    def wait_idle(self, timeout: float = 20) -> dict[str, float]:
        """Metrics once no request runs or waits and every KV block is free."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["aioengine:num_requests_running"] == 0
                    and m["aioengine:num_requests_waiting"] == 0
                    and m["aioengine:kv_cache_usage_perc"] == 0):
                return m
            if time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    def stop_cleanly(self) -> None:
        """SIGTERM; asserts exit 0 and no traceback or error in the server's log."""
        rc = self.stop()
        log = "".join(self.log)
        assert rc == 0, log
        assert "Traceback" not in log and " ERROR " not in log, log


def start_server(*extra_args: str, timeout: float = 240,
                 env: dict[str, str] | None = None) -> ServerProcess:
    """Starts `aioengine serve` on the bundled model and waits for its ready line; `env`
    adds to (or overrides) this process's environment."""
    cmd = [sys.executable, "-m", "aioengine.cli", "serve", "--port", "0",
           "--num-kv-blocks", "512", *extra_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env} if env else None)
    log: list[str] = []
    ready: list[re.Match] = []
    got_ready = threading.Event()

    def drain() -> None:  # keeps reading so the server never blocks on a full pipe
        for line in proc.stderr:
            log.append(line)
            match = _READY.search(line)
            if match and not ready:
                ready.append(match)
                got_ready.set()
        got_ready.set()

    threading.Thread(target=drain, daemon=True).start()
    if not got_ready.wait(timeout) or not ready:
        proc.kill()
        raise RuntimeError("server did not start:\n" + "".join(log))
    key = extra_args[extra_args.index("--api-key") + 1] if "--api-key" in extra_args else None
    return ServerProcess(proc, ready[0].group(2), ready[0].group(1), log, key)


def serving(*extra_args: str, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """Body of a module-scoped `server` fixture: `yield from serving(...)` starts the server,
    hands it to the tests and stops it cleanly afterwards."""
    srv = start_server(*extra_args, env=env)
    yield srv
    srv.stop_cleanly()


def openai_client(server: ServerProcess, api_key: str = "unused") -> openai.OpenAI:
    """The real `openai` client on the server, without retries (a failure must show)."""
    return openai.OpenAI(base_url=server.base_url, api_key=api_key, max_retries=0, timeout=120)
