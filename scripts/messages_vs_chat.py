"""TTFT and TPOT of streamed /v1/messages against the same requests through
/v1/chat/completions, on one server, interleaved (A = chat, B = messages): A B A B, or
with --abba A B B A A B ... (each first in every other round, so that what comes first
after a pause, or a drift of the machine's load, weighs on both alike).

    .venv/bin/python scripts/messages_vs_chat.py --rounds 4 --num-prompts 16 --output-len 64

Starts `aioengine serve` on the bundled model (prefix caching off, so a run never reuses
the KV of the run before it), then per round runs `aioengine bench serve --endpoint chat`
and `--endpoint messages` with the same seed (the same prompts, ignore_eos: the same
output lengths), and prints each run's p50 TTFT and TPOT and messages / chat over all runs.
It also prints the server process's CPU time per output token in each run (user + system,
all threads, from /proc): on a machine shared with other work, wall-clock TPOT moves with
the other work, while the CPU time a token costs the server shows what the path costs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PY = sys.executable


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen([PY, "-m", "aioengine", "serve", "--port", str(port),
                             "--no-enable-prefix-caching", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench(port: int, endpoint: str, args: argparse.Namespace, out: Path,
          server_pid: int) -> dict:
    cpu_before = cpu_seconds(server_pid)
    subprocess.run([PY, "-m", "aioengine", "bench", "serve",
                    "--base-url", f"http://127.0.0.1:{port}", "--endpoint", endpoint,
                    "--dataset", "text", "--num-prompts", str(args.num_prompts),
                    "--output-len", str(args.output_len),
                    "--max-concurrency", str(args.max_concurrency),
                    "--seed", str(args.seed), "--no-progress", "--save-json", str(out)],
                   check=True, stdout=subprocess.DEVNULL)
    cpu = cpu_seconds(server_pid) - cpu_before
    summary = json.loads(out.read_text())["summary"]
    assert summary["failed_requests"] == 0, summary
    return {"ttft": summary["ttft"]["p50_ms"], "tpot": summary["tpot"]["p50_ms"],
            "cpu": 1000.0 * cpu / summary["total_output_tokens"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8199)
    p.add_argument("--abba", action="store_true", help="alternate which endpoint runs first")
    p.add_argument("server_args", nargs="*", help="more `aioengine serve` flags (after --)")
    args = p.parse_args()
    proc = start_server(args.port, args.server_args)
    runs: dict[str, list[dict]] = {"chat": [], "messages": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                order = ("chat", "messages")
                for endpoint in order[::-1] if args.abba and r % 2 else order:
                    m = bench(args.port, endpoint, args, Path(tmp) / f"{endpoint}-{r}.json",
                              proc.pid)
                    runs[endpoint].append(m)
                    print(f"round {r + 1} {endpoint:9s} p50 TTFT {m['ttft']:8.2f} ms   "
                          f"p50 TPOT {m['tpot']:7.2f} ms   server CPU {m['cpu']:6.2f} ms/token",
                          flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    for key, what in (("ttft", "TTFT p50"), ("tpot", "TPOT p50"),
                      ("cpu", "server CPU per token")):
        chat = statistics.median(m[key] for m in runs["chat"])
        messages = statistics.median(m[key] for m in runs["messages"])
        print(f"{what}: chat {chat:.2f} ms, messages {messages:.2f} ms (median over runs): "
              f"messages / chat = {messages / chat:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
