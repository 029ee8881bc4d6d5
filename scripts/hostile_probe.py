"""Issue 48's measurement: each hostile request against a fresh `aioengine serve`, one at a
time, with /health polled every 50 ms and the server's RSS sampled alongside.

For each case: the status (and whether it is the one it must get), the wall time, /health
p50 / p99 / max while the request ran, and the server's RSS before, at its peak and 2 s
after. The cases are the soak's hostile kind (aioengine/bench/soak_hostile.py: each past a
limit, so a 4xx) and requests at the limits that must complete without stalling the loop.

    .venv/bin/python scripts/hostile_probe.py [--server-args "..."] [--only NAME ...]
        [--save-json FILE]

The targets (docs/benchmarks.md): a 4xx in under a second, or completion with /health p99
under 100 ms and RSS growth under 100 MB that is returned after.
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from aioengine.bench.soak import ManagedServer  # noqa: E402
from aioengine.bench.soak_hostile import Hostile, hostile_requests  # noqa: E402

HEALTH_INTERVAL_S = 0.05


def at_the_limits(model: str) -> list[Hostile]:
    """Requests at a limit: they must complete, with the loop answering meanwhile."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Tell me a story."}]}
    docs = [f"document number {i} about apples" for i in range(2048)]
    return [
        ("embeddings_2048", "/v1/embeddings",
         {"model": model, "input": [f"input {i}" for i in range(2048)]}, {}, 200, None),
        ("rerank_2048", "/rerank", {"model": model, "query": "apples", "documents": docs}, {},
         200, None),
        ("score_2048", "/score", {"model": model, "text_1": "apples", "text_2": docs}, {}, 200,
         None),
        ("stop_1000_n8", "/v1/chat/completions", {**chat, "n": 8, "max_tokens": 64,
                                                  "temperature": 1.0, "stop": [
             f"never-{i}-zq" for i in range(1000)]}, {}, 200, None),
        ("logit_bias_300_n128", "/v1/chat/completions", {**chat, "n": 128, "max_tokens": 16,
                                                         "temperature": 1.0, "logit_bias": {
             str(i): 2.0 for i in range(300)}}, {}, 200, None),
    ]


def _post(url: str, case: Hostile) -> tuple[int, bytes]:
    _, path, body, headers, _, _ = case
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    req = urllib.request.Request(url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=900) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def probe(url: str, pid: int, case: Hostile) -> dict[str, Any]:
    proc = psutil.Process(pid)
    rss_before = proc.memory_info().rss
    result: list[tuple[int, bytes]] = []
    start = time.monotonic()
    worker = threading.Thread(target=lambda: result.append(_post(url, case)))
    worker.start()
    health, peak = [], rss_before
    while worker.is_alive():
        t = time.monotonic()
        urllib.request.urlopen(url + "/health", timeout=60).read()
        health.append(time.monotonic() - t)
        peak = max(peak, proc.memory_info().rss)
        time.sleep(HEALTH_INTERVAL_S)
    worker.join()
    elapsed = time.monotonic() - start
    time.sleep(2)
    status, raw = result[0]
    ms = [h * 1000 for h in health]
    mb = 1 / 2**20
    return {"case": case[0], "status": status, "expected": case[4], "ok": status == case[4],
            "wall_s": round(elapsed, 3), "health_polls": len(ms),
            "health_p50_ms": _round(_percentile(ms, 0.5)),
            "health_p99_ms": _round(_percentile(ms, 0.99)),
            "health_max_ms": _round(max(ms) if ms else None),
            "rss_before_mb": round(rss_before * mb), "rss_peak_growth_mb": round(
                (peak - rss_before) * mb), "rss_after_growth_mb": round(
                (proc.memory_info().rss - rss_before) * mb),
            "answer": raw[:160].decode(errors="replace") if status >= 400 else ""}


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


def _cpu() -> dict[str, str]:
    info = Path("/proc/cpuinfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                  if ln.startswith("model name")), platform.processor())
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines()
                  if ln.startswith("flags")), [])
    wanted = [f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma")]
    return {"cpu": model, "flags": " ".join(wanted), "cores": str(psutil.cpu_count())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server-args", default="", help="extra `aioengine serve` flags")
    p.add_argument("--only", nargs="+", help="case names to run (default: all)")
    p.add_argument("--save-json", help="write the records here")
    args = p.parse_args()
    server = ManagedServer.start(shlex.split(args.server_args))
    try:
        with urllib.request.urlopen(server.url + "/v1/models") as r:
            model = json.load(r)["data"][0]["id"]
        cases = hostile_requests(model) + at_the_limits(model)
        records = [probe(server.url, server.proc.pid, case) for case in cases
                   if not args.only or case[0] in args.only]
    finally:
        exit_info = server.stop()
    print(f"{'case':28} {'status':>9} {'wall s':>8} {'/health p50/p99/max ms':>24} "
          f"{'RSS peak/after MB':>18}")
    for r in records:
        print(f"{r['case']:28} {r['status']:>5}{'' if r['ok'] else ' (!)':>4} "
              f"{r['wall_s']:>8.2f} {str(r['health_p50_ms']):>8}/{str(r['health_p99_ms']):>7}"
              f"/{str(r['health_max_ms']):>7} {r['rss_peak_growth_mb']:>+9}/"
              f"{r['rss_after_growth_mb']:>+7}")
    print(f"server exit {exit_info['returncode']}, {exit_info['num_error_lines']} error lines")
    if args.save_json:
        Path(args.save_json).write_bytes(orjson.dumps(
            {"machine": _cpu(), "date": time.strftime("%Y-%m-%d"), "records": records,
             "server_exit": exit_info}, option=orjson.OPT_INDENT_2))
    return 0 if all(r["ok"] for r in records) and not exit_info["num_error_lines"] else 1


if __name__ == "__main__":
    sys.exit(main())
