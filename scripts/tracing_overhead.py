"""Served W1 at 32 streams with request tracing on against off (issue 54), interleaved:
A B, B A, ... (A = `aioengine serve`, B = the same with `--otlp-traces-endpoint`).

    .venv/bin/python scripts/tracing_overhead.py --rounds 2

Needs the `tracing` extra. Starts a local OTLP/HTTP receiver (aiohttp, on a thread of this
process) that reads and discards each export, and both servers at once (each idle while
the other runs); per round runs `aioengine bench serve` (W1: 32 random prompts of 32-256
tokens, 64 output tokens, all at once) against A and then B with the same fresh seed, so
the prompts match within a round and neither server's prefix cache ever hits. Prints each
run's total and output tok/s, the on / off ratio per round, and what the receiver got.

    .venv/bin/python scripts/tracing_overhead.py --per-request

What tracing costs in CPU time, without a model (a figure a loaded machine does not
blur): requests shaped as W1 runs them (32 at a time: a prefill chunk each, then 63
decode steps of all 32) observed step by step, their spans built and exported to the
receiver; all threads' CPU time per request, less the same loop untraced.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from aiohttp import web

PY = sys.executable


class DiscardingReceiver:
    """POST /v1/traces: the body read and dropped (counted), an empty OTLP answer."""

    def __init__(self) -> None:
        self.exports = self.bytes = 0
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.port = asyncio.run_coroutine_threadsafe(self._serve(), self.loop).result(10)

    async def _serve(self) -> int:
        async def export(request: web.Request) -> web.Response:
            self.bytes += len(await request.read())
            self.exports += 1
            return web.Response(body=b"", content_type="application/x-protobuf")

        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/traces", export)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner.addresses[0][1]


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen([PY, "-m", "aioengine", "serve", "--port", str(port), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start")


def bench(port: int, seed: int, out: Path) -> dict:
    subprocess.run([PY, "-m", "aioengine", "bench", "serve",
                    "--base-url", f"http://127.0.0.1:{port}", "--max-concurrency", "32",
                    "--num-prompts", "32", "--input-len-min", "32", "--input-len-max", "256",
                    "--output-len", "64", "--seed", str(seed), "--no-progress",
                    "--save-json", str(out)], check=True, stdout=subprocess.DEVNULL)
    summary = json.loads(out.read_text())["summary"]
    assert summary["failed_requests"] == 0, summary
    return summary


def per_request_cost(endpoint: str, n: int = 2048) -> None:
    """CPU time (all threads: the SDK's export thread and this process's receiver too) per
    traced request, less the same loop without the tracer's calls (its steps' objects)."""
    untraced = _request_loop(None, n)
    traced = _request_loop(endpoint, n)
    print(f"{n} requests as W1 runs them (32 at a time: 4 prefill steps of 8 chunks, 63 "
          f"decode steps of 32 rows; 3 spans each): {1e6 * (traced - untraced) / n:.0f} us "
          f"CPU per request for tracing, all threads (the loop alone: "
          f"{1e6 * untraced / n:.0f} us per request)")


def _request_loop(endpoint: str | None, n: int) -> float:
    """CPU seconds of `n` W1-shaped requests' steps, traced to `endpoint` (None: not)."""
    from aioengine.engine.prepared_request import PreparedRequest
    from aioengine.request import Request
    from aioengine.sampling_params import SamplingParams
    from aioengine.sched.scheduler_output import ScheduledRequest, SchedulerOutput
    from aioengine.tracing import RequestOutcome, RequestTracer

    tracer = RequestTracer(endpoint) if endpoint is not None else None
    params = SamplingParams(max_tokens=64, temperature=0.0)
    start_cpu, step_id = time.process_time(), 0
    for batch in range(n // 32):
        requests = [Request(f"r{batch}-{i}", [1] * 128, params, parent_id=f"r{batch}-{i}")
                    for i in range(32)]
        for r in requests:
            if tracer is not None:
                tracer.begin(r.request_id, PreparedRequest(r.prompt_token_ids, params,
                                                           received_time=time.monotonic()),
                             "model")
        steps = [[ScheduledRequest(r, 0, [1] * 128, [], 1) for r in requests[k:k + 8]]
                 for k in range(0, 32, 8)]
        steps += [[ScheduledRequest(r, 128 + d, [1], [], 1) for r in requests]
                  for d in range(63)]
        for items in steps:
            out = SchedulerOutput(items, sum(i.num_new_tokens for i in items), step_id=step_id)
            step_id += 1
            if tracer is not None:
                tracer.observe_step(out, _NoSamples, time.monotonic(), time.monotonic())
        for r in requests:
            now = time.monotonic()
            if tracer is not None:
                tracer.finish(r.request_id, RequestOutcome(now, now - 1, now - 0.9, now - 0.5,
                                                           now, 64, 0, 0, ["length"]))
    if tracer is not None:
        tracer.shutdown()  # every span exported
    return time.process_time() - start_cpu


class _NoSamples:
    sampled_token_ids: dict[str, list[int]] = {}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--port", type=int, default=8211)
    p.add_argument("--seed", type=int, default=100, help="round r uses seed + r")
    p.add_argument("--per-request", action="store_true",
                   help="only the CPU time one traced request costs (no model)")
    p.add_argument("server_args", nargs="*", help="more `aioengine serve` flags (after --)")
    args = p.parse_args()
    receiver = DiscardingReceiver()
    endpoint = f"http://127.0.0.1:{receiver.port}/v1/traces"
    if args.per_request:
        per_request_cost(endpoint)
        print(f"the receiver got {receiver.exports} exports, {receiver.bytes} bytes")
        return 0
    servers = {"off": (args.port, start_server(args.port, args.server_args)),
               "on": (args.port + 1, start_server(
                   args.port + 1, [*args.server_args, "--otlp-traces-endpoint", endpoint]))}
    ratios = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                tok_s = {}
                # A B, then B A: the second run of a pair is not always the same server.
                order = list(servers.items())
                for name, (port, _) in order if r % 2 == 0 else order[::-1]:
                    s = bench(port, args.seed + r, Path(tmp) / f"{name}-{r}.json")
                    tok_s[name] = s["total_token_throughput"]
                    print(f"round {r + 1} tracing {name:3s}  total {tok_s[name]:8.1f} tok/s   "
                          f"output {s['output_throughput']:7.1f} tok/s", flush=True)
                ratios.append(tok_s["on"] / tok_s["off"])
                print(f"round {r + 1} on / off = {ratios[-1]:.3f}", flush=True)
    finally:
        for _, proc in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    print(f"on / off per round: {', '.join(f'{x:.3f}' for x in ratios)}; the receiver got "
          f"{receiver.exports} exports, {receiver.bytes} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
