"""One GGUF file served by aioengine and by llama-server, one server at a time.

    aioengine bench gguf FILE.gguf [--llama-server PATH] [--runs 2] [--threads 2]
                         [--save-json PATH]

Each run starts our server (`python -m aioengine serve FILE`), measures it and stops it, then
does the same with llama-server (`-t T -np 8 -c CTX`): A B A B, never both at once, so each
has the cores and memory to itself and drifts in the machine's speed hit both. Per start:
ready time (spawn to the first /health 200: run 0 is the first start, later runs find the
file and our start-up cache warm), single-stream TPOT (a 128-token prompt, 64 tokens out,
EOS ignored, greedy, streamed: (last token - first token) / 63; the median of three such
streams in turn), total generated tok/s of 8
concurrent such streams, prefill tok/s (a 512-token prompt, max_tokens 1, not streamed:
prompt tokens / time to the answer), and at the end RSS and peak RSS (VmRSS, VmHWM of the
server and its children). Prompts are token ids (both servers take them), drawn afresh for
every request so no prefix cache helps. The report has every run's numbers, the medians,
and ours / llama-server's ratios; the CPU model and flags are recorded with it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

DEFAULT_LLAMA_SERVER = ("/work/peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/"
                        "llama-server")
PROMPT_LEN, OUTPUT_LEN, CONCURRENCY, PREFILL_LEN = 128, 64, 8, 512
# Single streams per start, one after another: TPOT is their median (one 64-token stream
# varied +-10% from start to start on a 2-core VM).
SINGLE_STREAMS = 3
TOKEN_RANGE = (1000, 40000)  # ordinary tokens of the SmolLM2 vocabulary every shape keeps
# Higher is better for these; lower for the rest (seconds, bytes).
HIGHER_IS_BETTER = ("concurrent_tok_s", "prefill_tok_s")


@dataclass
class BenchConfig:
    model: str
    llama_server: str | None
    runs: int = 2
    threads: int = 2
    seed: int = 0
    ctx: int = CONCURRENCY * 1024  # llama-server splits -c over its 8 slots
    ready_timeout_s: float = 900.0
    request_timeout_s: float = 900.0
    our_args: list[str] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def our_command(cfg: BenchConfig, port: int) -> list[str]:
    """Our server without speculation unless --our-args names it: llama-server drafts
    nothing, and a random-weight model's greedy text repeats, which suffix decoding (on
    by default) would turn into TPOT that no kernel earned."""
    given = any(a.split("=")[0] == "--speculative-config" for a in cfg.our_args)
    spec = [] if given else ["--speculative-config", "none"]
    return [sys.executable, "-m", "aioengine", "serve", cfg.model, "--port", str(port),
            "--max-model-len", str(cfg.ctx // CONCURRENCY), *spec, *cfg.our_args]


def llama_command(cfg: BenchConfig, port: int) -> list[str]:
    assert cfg.llama_server is not None
    return [cfg.llama_server, "-m", cfg.model, "-t", str(cfg.threads), "-tb", str(cfg.threads),
            "-np", str(CONCURRENCY), "-c", str(cfg.ctx), "--port", str(port),
            "--host", "127.0.0.1"]


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (from /proc/PID/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) summed over the process tree, in KiB."""
    total = {"VmRSS": 0, "VmHWM": 0}
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                key = line.split(":", 1)[0]
                if key in total:
                    total[key] += int(line.split()[1])
        except OSError:
            pass
    return total


async def wait_ready(base: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before ready")
            try:
                async with session.get(base + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise TimeoutError(f"{base} not ready in {timeout} s")


def prompt_ids(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(*TOKEN_RANGE, size=n)]


async def stream_completion(session: aiohttp.ClientSession, base: str, prompt: list[int],
                            max_tokens: int) -> dict[str, float]:
    """One streamed greedy completion with EOS ignored: times of the first and last token
    chunks, and the tokens the server reports (usage) or, without usage, max_tokens."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    tokens = max_tokens
    async with session.post(base + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{base}: {r.status} {await r.text()}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = int(chunk["usage"].get("completion_tokens", tokens))
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                last = time.perf_counter()
                first = first or last
    if first is None or last is None:
        raise RuntimeError(f"{base}: no tokens streamed")
    return {"ttft_s": first - start, "decode_s": last - first, "tokens": tokens,
            "total_s": last - start}


async def measure(base: str, rng: np.random.Generator, timeout: float) -> dict[str, Any]:
    """The three workloads on a ready server (one warm-up request first, not timed): single
    streams in turn (TPOT their median, each in tpot_runs_ms), CONCURRENCY streams at once,
    one long prompt's prefill."""
    t = aiohttp.ClientTimeout(total=timeout)
    # A new connection per request: llama-server closes a streamed answer's connection,
    # and a pooled one it closed fails the next request.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=t, connector=connector) as session:
        await stream_completion(session, base, prompt_ids(rng, PROMPT_LEN), 8)
        singles = [await stream_completion(session, base, prompt_ids(rng, PROMPT_LEN),
                                           OUTPUT_LEN) for _ in range(SINGLE_STREAMS)]
        start = time.perf_counter()
        many = await asyncio.gather(*(stream_completion(
            session, base, prompt_ids(rng, PROMPT_LEN), OUTPUT_LEN) for _ in range(CONCURRENCY)))
        wall = time.perf_counter() - start
        prompt = prompt_ids(rng, PREFILL_LEN)
        start = time.perf_counter()
        async with session.post(base + "/v1/completions", json={
                "prompt": prompt, "max_tokens": 1, "temperature": 0.0}) as r:
            answer = await r.json()
        prefill_s = time.perf_counter() - start
    prompt_tokens = int((answer.get("usage") or {}).get("prompt_tokens", PREFILL_LEN))
    tpots = [1000 * s["decode_s"] / max(1, s["tokens"] - 1) for s in singles]
    one = singles[0]
    return {"tpot_ms": statistics.median(tpots), "tpot_runs_ms": tpots,
            "ttft_128_ms": statistics.median(1000 * s["ttft_s"] for s in singles),
            "concurrent_tok_s": sum(m["tokens"] for m in many) / wall,
            "prefill_tok_s": prompt_tokens / prefill_s,
            "single_tokens": one["tokens"], "prefill_prompt_tokens": prompt_tokens}


def run_server(command: list[str], port: int, cfg: BenchConfig, rng: np.random.Generator,
               log: Path) -> dict[str, Any]:
    """Starts `command`, measures it, reads its memory, stops it; its output goes to `log`."""
    base = f"http://127.0.0.1:{port}"
    with open(log, "ab") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            asyncio.run(wait_ready(base, proc, cfg.ready_timeout_s))
            result: dict[str, Any] = {"ready_s": time.perf_counter() - start}
            result.update(asyncio.run(measure(base, rng, cfg.request_timeout_s)))
            mem = memory_kib(proc.pid)
            result.update(rss_mib=mem["VmRSS"] / 1024, peak_rss_mib=mem["VmHWM"] / 1024)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return result


def run_bench(cfg: BenchConfig, log_dir: Path) -> dict[str, Any]:
    servers = {"aioengine": our_command}
    if cfg.llama_server:
        servers["llama-server"] = llama_command
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
    for i in range(cfg.runs):
        for name, command in servers.items():
            port = free_port()
            rng = np.random.default_rng([cfg.seed, i])  # the same prompts for both servers
            print(f"run {i}: {name}", file=sys.stderr, flush=True)
            runs[name].append(run_server(command(cfg, port), port, cfg, rng,
                                         log_dir / f"{name}.log"))
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]
                      if not isinstance(rs[0][k], list)}
               for name, rs in runs.items()}
    return {"runs": runs, "median": medians}


ROWS = (("ready_s", "ready, first start (s)", "first"), ("ready_s", "ready, later starts (s)",
        "later"), ("tpot_ms", "TPOT, 1 stream (ms)", "median"),
        ("concurrent_tok_s", "8 streams (tok/s)", "median"),
        ("prefill_tok_s", "prefill, 512 tokens (tok/s)", "median"),
        ("rss_mib", "RSS after the runs (MiB)", "median"),
        ("peak_rss_mib", "peak RSS (MiB)", "median"))


def _pick(report: dict[str, Any], name: str, key: str, which: str) -> float | None:
    runs = report["runs"][name]
    if which == "first":
        return runs[0][key]
    if which == "later":
        return statistics.median(r[key] for r in runs[1:]) if len(runs) > 1 else None
    return report["median"][name][key]


def format_table(report: dict[str, Any]) -> str:
    """Markdown: each metric for both servers and ours / theirs (the ratio's direction is
    named per row: above 1 is better for us where the row says 'higher')."""
    names = list(report["runs"])
    head = "| metric | " + " | ".join(names) + (" | ours / llama-server |" if len(names) > 1
                                                 else " |")
    lines = [head, "|" + "---|" * (len(names) + 1 + (len(names) > 1))]
    for key, label, which in ROWS:
        values = [_pick(report, n, key, which) for n in names]
        if values[0] is None:
            continue
        cells = [f"{v:.1f}" if v is not None else "-" for v in values]
        if len(names) > 1 and values[1]:
            better = "higher" if key in HIGHER_IS_BETTER else "lower"
            cells.append(f"{values[0] / values[1]:.2f} ({better} is better)")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_gguf_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("gguf", help="one GGUF file: aioengine vs llama-server, interleaved")
    p.add_argument("model", help=".gguf file (e.g. from python -m aioengine.bench.real_shapes)")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help=f"llama-server binary (default: {DEFAULT_LLAMA_SERVER} if present; "
                        "'none': ours only)")
    p.add_argument("--runs", type=int, default=2, help="starts of each server (A B A B)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                   help="llama-server's -t and -tb (ours uses every core)")
    p.add_argument("--seed", type=int, default=0, help="prompt token ids")
    p.add_argument("--our-args", default="", help="more flags for `aioengine serve`, "
                   "one string (e.g. '--quantization gguf'); speculation is off unless "
                   "they give --speculative-config")
    p.add_argument("--log-dir", default=None, help="servers' output (default: a temp dir)")
    p.add_argument("--save-json", default=None, metavar="PATH")
    p.set_defaults(func=gguf_main)


def gguf_main(args: argparse.Namespace) -> int:
    import tempfile

    import aioengine.bench.report as rep
    from aioengine.bench.common import emit

    llama = args.llama_server
    if llama is None and Path(DEFAULT_LLAMA_SERVER).exists():
        llama = DEFAULT_LLAMA_SERVER
    cfg = BenchConfig(model=args.model, llama_server=None if llama == "none" else llama,
                      runs=args.runs, threads=args.threads, seed=args.seed,
                      our_args=args.our_args.split())
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="gguf-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    env = rep.environment_info()
    report = {"mode": "gguf", "environment": env, "model": args.model,
              "file_bytes": os.path.getsize(args.model), "config": vars(cfg),
              "log_dir": str(log_dir), **run_bench(cfg, log_dir)}
    text = "\n".join([rep.cpu_line(env), f"load avg (1 min) at start: {env['load_avg_1m']}",
                      f"model: {args.model} ({report['file_bytes'] / 2**20:.0f} MiB)",
                      format_table(report)])
    emit(report, text, args.save_json)
    return 0
