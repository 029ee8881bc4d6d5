"""A soak test: mixed traffic against an aioengine server for a while, then a report.

    aioengine bench soak [--duration 20m] [--concurrency 8] [--seed 0] [--server-args "..."]
    aioengine bench soak --base-url http://HOST:PORT [--server-pid PID] [--kv-blocks N]

Without --base-url it starts `aioengine serve` on the bundled model on a free port with
DEFAULT_SERVER_ARGS (a small KV cache, so that the long prompts preempt, and tool calling)
followed by --server-args (a repeated flag wins), and stops it at the end. The workers (one
asyncio loop, raw aiohttp) draw a seeded mix of the kinds in soak_traffic.KINDS. The report
(soak_report.py) counts requests by kind and outcome, follows the server's resident memory,
open file descriptors, threads and CPU time over time (/proc/PID), and reads /metrics once
the server is idle again: no KV block may stay in use. Exit status 1 on any 5xx outside
--expect-5xx, any other unexpected outcome, KV blocks still held, or (own server) a
non-zero exit or an error in its log. A --server-args value without a space must be
written `--server-args=--flag` (argparse would take `--flag` for an option of ours).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from aioengine.bench.soak_report import build_report, format_report, save_json
from aioengine.bench.soak_traffic import KINDS, Traffic, run_workers

DEFAULT_SERVER_ARGS = ("--num-kv-blocks", "256", "--max-num-seqs", "16",
                       "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
_READY = re.compile(r"ready: serving (\S+) at (http://\S+)")


@dataclass
class SoakConfig:
    duration_s: float
    concurrency: int = 8
    seed: int = 0
    base_url: str | None = None  # None: start our own server
    server_pid: int | None = None
    server_args: list[str] = field(default_factory=list)
    api_key: str | None = None
    kinds: list[str] = field(default_factory=lambda: list(KINDS))
    expect_5xx: str = "0"  # a count, or comma-separated kinds whose 5xx are allowed
    sample_interval_s: float = 5.0
    timeout_s: float = 120.0
    idle_timeout_s: float = 60.0
    kv_blocks: int | None = None
    block_size: int = 16
    long_prompt_tokens: int | None = None
    long_burst: int = 3


# ---- our own server ----------------------------------------------------------------------

@dataclass
class ManagedServer:
    proc: subprocess.Popen
    url: str
    # Only the tail of the log is kept (a 20-minute soak must not grow our own memory);
    # error lines are counted as they pass.
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=200))
    error_lines: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, args: list[str], timeout_s: float = 300) -> ManagedServer:
        cmd = [sys.executable, "-m", "aioengine.cli", "serve", "--port", "0", *args]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        server = cls(proc, "")
        ready = threading.Event()
        threading.Thread(target=server._drain, args=(ready,), daemon=True).start()
        if not ready.wait(timeout_s) or not server.url:
            proc.kill()
            raise RuntimeError("server did not start:\n" + "".join(server.tail))
        return server

    def _drain(self, ready: threading.Event) -> None:
        # Keeps reading so the server never blocks on a full pipe.
        for line in self.proc.stderr:
            self.tail.append(line)
            if "Traceback" in line or " ERROR " in line:
                self.error_lines.append(line.rstrip()[:500])
            match = _READY.search(line)
            if match and not self.url:
                self.url = match.group(2)
                ready.set()
        ready.set()

    def stop(self, timeout_s: float = 60) -> dict[str, Any]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        return {"returncode": rc, "error_lines": self.error_lines[:20],
                "num_error_lines": len(self.error_lines), "log_tail": list(self.tail)[-30:]}


def _flag_value(args: list[str], flag: str) -> str | None:
    """The last value of `flag` in a command line (argparse's last-wins)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


# ---- sampling the server -------------------------------------------------------------------

def proc_sample(pid: int | None) -> dict[str, Any]:
    """VmRSS (KiB), open file descriptors, threads and CPU seconds (user + system) of
    `pid`; Nones when there is none or it is gone."""
    sample: dict[str, Any] = dict.fromkeys(("rss_kib", "fds", "threads", "cpu_s"))
    if not pid:
        return sample
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        sample["rss_kib"] = int(fields["VmRSS"].split()[0])
        sample["threads"] = int(fields["Threads"])
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            # Fields after the parenthesised name; utime and stime are the 12th and 13th.
            stat = f.read().rsplit(")", 1)[1].split()
        sample["cpu_s"] = round((int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK"), 2)
        sample["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, KeyError, ValueError, IndexError):
        pass
    return sample


async def scrape(session: aiohttp.ClientSession, url: str,
                 headers: dict[str, str] | None = None) -> dict[str, float]:
    """/metrics as {"name": value summed over label sets} (and the labelled keys);
    `headers` carry the API key where the server has one (it guards /metrics too)."""
    async with session.get(url + "/metrics", headers=headers,
                           timeout=aiohttp.ClientTimeout(total=30)) as r:
        text = await r.text()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        values[key] = float(value)
        name = key.split("{", 1)[0]
        if name != key:
            values[name] = values.get(name, 0.0) + float(value)
    return values


_GAUGES = {"kv_usage": "aioengine:kv_cache_usage_perc",
           "running": "aioengine:num_requests_running",
           "waiting": "aioengine:num_requests_waiting",
           "preemptions": "aioengine:num_preemptions_total"}


async def _sampler(t: Traffic, pid: int | None, interval_s: float, done: asyncio.Event,
                   samples: list[dict]) -> None:
    """Samples until `done`; ends the traffic (t.stop) if the server process is gone."""
    while True:
        sample = {"t": round(time.monotonic() - t.t0, 2), **proc_sample(pid)}
        try:
            m = await scrape(t.session, t.url, t.headers)
            sample.update({k: m.get(name) for k, name in _GAUGES.items()})
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            sample["scrape_error"] = f"{type(e).__name__}: {e}"
        samples.append(sample)
        if pid and sample["rss_kib"] is None:
            sample["server_gone"] = True
            t.stop.set()
            return
        try:
            await asyncio.wait_for(done.wait(), interval_s)
            return
        except asyncio.TimeoutError:
            pass


async def _wait_idle(session: aiohttp.ClientSession, url: str, timeout_s: float,
                     headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Polls /metrics until nothing runs or waits and no KV block is in use."""
    start = time.monotonic()
    idle: dict[str, Any] = dict.fromkeys(_GAUGES)
    while True:
        try:
            m = await scrape(session, url, headers)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return {**idle, "idle": False, "waited_s": round(time.monotonic() - start, 2),
                    "error": f"{type(e).__name__}: {e}"}
        idle = {k: m.get(name) for k, name in _GAUGES.items()}
        quiet = idle["running"] == 0 and idle["waiting"] == 0 and idle["kv_usage"] == 0
        if quiet or time.monotonic() - start > timeout_s:
            return {**idle, "idle": quiet, "waited_s": round(time.monotonic() - start, 2)}
        await asyncio.sleep(0.2)


# ---- the run -------------------------------------------------------------------------------

async def run_soak(cfg: SoakConfig, url: str, pid: int | None,
                   long_tokens: int) -> dict[str, Any]:
    """Traffic for cfg.duration_s, sampling alongside; then waits for the server to idle."""
    headers = {"Content-Type": "application/json"}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.get(url + "/v1/models", headers=headers) as r:
            model = (await r.json())["data"][0]["id"]
        before = await scrape(session, url, headers)
        t0 = time.monotonic()
        traffic = Traffic(session, url, model, headers, cfg.timeout_s, long_tokens,
                          cfg.long_burst, t0)
        samples: list[dict] = []
        done = asyncio.Event()
        sampler = asyncio.create_task(_sampler(traffic, pid, cfg.sample_interval_s, done,
                                               samples))
        results = await run_workers(traffic, cfg.kinds, cfg.concurrency, cfg.seed,
                                    t0 + cfg.duration_s)
        traffic_s = time.monotonic() - t0
        done.set()
        await sampler
        idle = await _wait_idle(session, url, cfg.idle_timeout_s, headers)
        idle.update(proc_sample(pid))
    before_n = before.get(_GAUGES["preemptions"], 0)
    preemptions = None if idle["preemptions"] is None else idle["preemptions"] - before_n
    return {"model": model, "traffic_s": round(traffic_s, 1), "results": results,
            "samples": samples, "idle": idle, "preemptions": preemptions,
            "server_gone": traffic.stop.is_set()}


def _defaults(cfg: SoakConfig) -> tuple[int | None, int]:
    """(KV blocks if known, long prompt tokens): the long prompts are 40% of the cache, so
    that three at once cannot all fit (and under 80% of max_model_len, if set)."""
    blocks = cfg.kv_blocks
    block_size, max_len = cfg.block_size, None
    if cfg.base_url is None:
        args = [*DEFAULT_SERVER_ARGS, *cfg.server_args]
        blocks = blocks or int(_flag_value(args, "--num-kv-blocks") or 0) or None
        block_size = int(_flag_value(args, "--block-size") or block_size)
        max_len = _flag_value(args, "--max-model-len")
    tokens = cfg.long_prompt_tokens or (int(0.4 * blocks * block_size) if blocks else 1600)
    if max_len and not cfg.long_prompt_tokens:
        tokens = min(tokens, int(0.8 * int(max_len)))
    return blocks, tokens


def soak(cfg: SoakConfig) -> dict[str, Any]:
    """Runs the whole soak (our own server unless cfg.base_url) and returns the report."""
    blocks, long_tokens = _defaults(cfg)
    server = None
    if cfg.base_url is None:
        server = ManagedServer.start([*DEFAULT_SERVER_ARGS, *cfg.server_args])
        url, pid = server.url, server.proc.pid
    else:
        url, pid = cfg.base_url.rstrip("/").removesuffix("/v1"), cfg.server_pid
    try:
        run = asyncio.run(run_soak(cfg, url, pid, long_tokens))
    finally:
        server_exit = server.stop() if server else None
    config = {**vars(cfg), "api_key": None,  # the key stays out of saved results
              "kv_blocks": blocks, "long_prompt_tokens": long_tokens}
    return build_report(config, run, url, server_exit)


# ---- the command line ----------------------------------------------------------------------

def parse_duration(text: str) -> float:
    """Seconds from "90", "90s", "20m", "1h" or "1m30s"."""
    parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?",
                         text.strip())
    if not parts or not any(parts.groups()):
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (90, 90s, 20m, 1h)")
    h, m, s = (float(g or 0) for g in parts.groups())
    return 3600 * h + 60 * m + s


def _kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"unknown kinds {sorted(unknown)}; from {list(KINDS)}")
    return kinds


def add_soak_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=parse_duration, default=1200.0,
                   help="how long the traffic runs: 90, 90s, 20m, 1h (default 20m)")
    p.add_argument("--concurrency", type=int, default=8, help="workers (default 8)")
    p.add_argument("--seed", type=int, default=0, help="the mix and every request's choices")
    p.add_argument("--base-url", default=None,
                   help="an already running server (default: start our own)")
    p.add_argument("--server-pid", type=int, default=None,
                   help="with --base-url: its process, for memory and fds")
    p.add_argument("--server-args", default="", metavar='"FLAGS"',
                   help="extra flags of our own server, after "
                        f"'{' '.join(DEFAULT_SERVER_ARGS)}' (a repeated flag wins)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="Bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--kinds", type=_kinds, default=list(KINDS),
                   help=f"comma-separated request kinds (default all: {','.join(KINDS)})")
    p.add_argument("--expect-5xx", default="0", metavar="N|KIND,...",
                   help="5xx that do not fail the run: a count, or those of these kinds")
    p.add_argument("--sample-interval", type=float, default=5.0,
                   help="seconds between samples of memory, fds and /metrics")
    p.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    p.add_argument("--idle-timeout", type=float, default=60.0,
                   help="how long the server may take to go idle after the traffic")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="the server's KV cache in blocks (default: from the server flags "
                        "when it is our own), for the long prompts and the blocks held")
    p.add_argument("--block-size", type=int, default=16, help="with --kv-blocks")
    p.add_argument("--long-prompt-tokens", type=int, default=None,
                   help="default: 40%% of the KV cache (1600 if unknown)")
    p.add_argument("--long-burst", type=int, default=3,
                   help="long prompts sent at once (default 3)")
    p.add_argument("--save-json", default=None, metavar="PATH",
                   help="the whole report, with every sample")


def add_soak_parser(sub: Any) -> None:
    p = sub.add_parser("soak", help="mixed traffic for a while: errors, memory, fds, KV leaks")
    add_soak_args(p)
    p.set_defaults(func=soak_main)


def soak_main(args: argparse.Namespace) -> int:
    import shlex

    if args.base_url and args.server_args:
        raise SystemExit("--server-args is for our own server, not with --base-url")
    cfg = SoakConfig(
        duration_s=args.duration, concurrency=args.concurrency, seed=args.seed,
        base_url=args.base_url, server_pid=args.server_pid,
        server_args=shlex.split(args.server_args), api_key=args.api_key, kinds=args.kinds,
        expect_5xx=args.expect_5xx, sample_interval_s=args.sample_interval,
        timeout_s=args.timeout, idle_timeout_s=args.idle_timeout, kv_blocks=args.kv_blocks,
        block_size=args.block_size, long_prompt_tokens=args.long_prompt_tokens,
        long_burst=args.long_burst)
    report = soak(cfg)
    print(format_report(report))
    if args.save_json:
        save_json(args.save_json, report)
        print(f"saved {args.save_json}", file=sys.stderr)
    return 0 if report["verdict"]["pass"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_soak_args(parser)
    return soak_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
