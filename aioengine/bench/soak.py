"""A soak test: mixed traffic against an aioengine server for a while, then a report.

    aioengine bench soak [--duration 20m] [--concurrency 8] [--seed 0] [--server-args "..."]
    aioengine bench soak --base-url http://HOST:PORT [--server-pid PID] [--kv-blocks N]

Without --base-url it starts `aioengine serve` on the bundled model on a free port with
DEFAULT_SERVER_ARGS (a small KV cache, so that the long prompts preempt, a context as long
as that cache, and tool calling) followed by --server-args (a repeated flag wins), and stops
it at the end. The workers (one asyncio loop, raw aiohttp and raw sockets) draw a seeded
mix of the kinds in soak_mix.KINDS: short requests, malformed bodies, long prompts, prompts
near and over the context, and slow clients (half a head, half a body, a slow reader of a
stream). The report (soak_report.py) counts requests by kind and outcome (and how each
slow-client and context case ended), compares the short streams' TTFT with and without long
prompts in flight, follows the server's resident memory, open file descriptors, threads
and CPU time over time (/proc/PID), and reads /metrics once the server is idle again: no
KV block may stay in use. Exit status 1 on any 5xx outside --expect-5xx, any other
unexpected outcome (a stalled connection the server did not close is one), KV blocks still
held, or (own server) a non-zero exit or an error in its log. A --server-args value
without a space must be written `--server-args=--flag` (argparse would take `--flag` for an
option of ours).
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

from aioengine.bench.soak_mix import KINDS, run_workers, ttft_alone
from aioengine.bench.soak_report import build_report, format_report, save_json
from aioengine.bench.soak_samples import GAUGES, proc_sample, sampler, scrape, wait_idle
from aioengine.bench.soak_traffic import Traffic
from aioengine.server.server_config import DEFAULT_BODY_READ_TIMEOUT, DEFAULT_KEEPALIVE_TIMEOUT

# The context is the KV cache's 4,096 tokens, so a near_context prompt (85% of it, several
# thousand tokens) takes most blocks while it runs and the rest of the traffic is preempted
# around it. On a CPU-starved server (1 core of 2) that stretched short streams and the
# prompt itself past the 120 s timeout; `--server-args "--max-model-len 2048"` halves it.
DEFAULT_SERVER_ARGS = ("--num-kv-blocks", "256", "--max-model-len", "4096", "--max-num-seqs",
                       "16", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
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
    near_context_tokens: int | None = None  # None: 85% of the context (or the KV cache)
    slow_client_interval_s: float = 5.0  # one more slow client this often (0: only drawn)
    # The server's --keepalive-timeout and --body-read-timeout; None: our own server's
    # flags, or the defaults.
    keepalive_timeout_s: float | None = None
    body_read_timeout_s: float | None = None


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


# ---- the run -------------------------------------------------------------------------------

@dataclass
class SoakPlan:
    """What the traffic needs to know of the server, from the flags or the defaults."""
    kv_blocks: int | None
    block_size: int
    long_prompt_tokens: int
    keepalive_timeout_s: float
    body_read_timeout_s: float

    def near_context_tokens(self, max_model_len: int) -> int:
        """85% of the context, or of the KV cache if that is smaller, less room for the
        answer: a prompt that fits, but only just."""
        room = min(max_model_len, self.kv_blocks * self.block_size if self.kv_blocks
                   else max_model_len)
        return max(1, int(0.85 * room) - 32)


async def run_soak(cfg: SoakConfig, url: str, pid: int | None,
                   plan: SoakPlan) -> dict[str, Any]:
    """Traffic for cfg.duration_s, sampling alongside; then waits for the server to idle."""
    headers = {"Content-Type": "application/json"}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    # Our pool drops an idle connection well before the server does, so that no request
    # goes out on a connection the server is closing at that moment.
    connector = aiohttp.TCPConnector(keepalive_timeout=min(15.0, plan.keepalive_timeout_s / 2))
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.get(url + "/v1/models", headers=headers) as r:
            card = (await r.json())["data"][0]
        model, max_model_len = card["id"], int(card["max_model_len"])
        before = await scrape(session, url, headers)
        t0 = time.monotonic()
        traffic = Traffic(session, url, model, headers, cfg.timeout_s, plan.long_prompt_tokens,
                          cfg.long_burst, t0, max_model_len=max_model_len,
                          near_context_tokens=(cfg.near_context_tokens
                                               or plan.near_context_tokens(max_model_len)),
                          keepalive_timeout_s=plan.keepalive_timeout_s,
                          body_read_timeout_s=plan.body_read_timeout_s)
        greedy_before = await greedy_text(session, url, model, headers)
        alone = await ttft_alone(traffic, 4, cfg.seed)
        traffic.t0 = t0 = time.monotonic()
        samples: list[dict] = []
        done = asyncio.Event()
        sampling = asyncio.create_task(sampler(traffic, pid, cfg.sample_interval_s, done,
                                               samples))
        results = await run_workers(traffic, cfg.kinds, cfg.concurrency, cfg.seed,
                                    t0 + cfg.duration_s, cfg.slow_client_interval_s)
        traffic_s = time.monotonic() - t0
        done.set()
        await sampling
        idle = await wait_idle(session, url, cfg.idle_timeout_s, headers)
        idle.update(proc_sample(pid))
        greedy_after = await greedy_text(session, url, model, headers)
    before_n = before.get(GAUGES["preemptions"], 0)
    preemptions = None if idle["preemptions"] is None else idle["preemptions"] - before_n
    return {"model": model, "traffic_s": round(traffic_s, 1), "results": alone + results,
            "samples": samples, "idle": idle, "preemptions": preemptions,
            "server_gone": traffic.stop.is_set(), "max_model_len": max_model_len,
            "greedy_unchanged": greedy_before is not None and greedy_before == greedy_after,

            "near_context_tokens": traffic.near_context_tokens}


async def greedy_text(session: aiohttp.ClientSession, url: str, model: str,
                      headers: dict[str, str]) -> str | None:
    """One greedy completion's text (None if it failed): the same before and after the
    traffic, or something the traffic did changed what the server computes."""
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 16,
            "temperature": 0}
    async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
        if r.status != 200:
            return None
        return (await r.json())["choices"][0]["text"]


def _plan(cfg: SoakConfig) -> SoakPlan:
    """The KV blocks if known; the long prompts at 40% of the cache, so that three at once
    cannot all fit (and under 80% of max_model_len, if set); the server's timeouts."""
    blocks = cfg.kv_blocks
    block_size, max_len = cfg.block_size, None
    keepalive, body_read = cfg.keepalive_timeout_s, cfg.body_read_timeout_s
    if cfg.base_url is None:
        args = [*DEFAULT_SERVER_ARGS, *cfg.server_args]
        blocks = blocks or int(_flag_value(args, "--num-kv-blocks") or 0) or None
        block_size = int(_flag_value(args, "--block-size") or block_size)
        max_len = _flag_value(args, "--max-model-len")
        keepalive = keepalive or float(_flag_value(args, "--keepalive-timeout") or 0) or None
        body_read = body_read or float(_flag_value(args, "--body-read-timeout") or 0) or None
    tokens = cfg.long_prompt_tokens or (int(0.4 * blocks * block_size) if blocks else 1600)
    if max_len and not cfg.long_prompt_tokens:
        tokens = min(tokens, int(0.8 * int(max_len)))
    return SoakPlan(blocks, block_size, tokens, keepalive or DEFAULT_KEEPALIVE_TIMEOUT,
                    body_read or DEFAULT_BODY_READ_TIMEOUT)


def soak(cfg: SoakConfig) -> dict[str, Any]:
    """Runs the whole soak (our own server unless cfg.base_url) and returns the report."""
    plan = _plan(cfg)
    server = None
    if cfg.base_url is None:
        server = ManagedServer.start([*DEFAULT_SERVER_ARGS, *cfg.server_args])
        url, pid = server.url, server.proc.pid
    else:
        url, pid = cfg.base_url.rstrip("/").removesuffix("/v1"), cfg.server_pid
    try:
        run = asyncio.run(run_soak(cfg, url, pid, plan))
    finally:
        server_exit = server.stop() if server else None
    config = {**vars(cfg), "api_key": None,  # the key stays out of saved results
              "kv_blocks": plan.kv_blocks, "long_prompt_tokens": plan.long_prompt_tokens,
              "keepalive_timeout_s": plan.keepalive_timeout_s,
              "body_read_timeout_s": plan.body_read_timeout_s,
              "max_model_len": run["max_model_len"],
              "near_context_tokens": run["near_context_tokens"]}
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
    p.add_argument("--near-context-tokens", type=int, default=None,
                   help="the near_context prompts (default: 85%% of the context or the KV "
                        "cache, whichever is smaller)")
    p.add_argument("--slow-client-interval", type=float, default=5.0, metavar="SECONDS",
                   help="start one more slow client (of the kinds in the mix) this often, "
                        "besides the workers' draws (default 5; 0: only those)")
    p.add_argument("--keepalive-timeout", type=float, default=None,
                   help="with --base-url: the server's (for the slow clients); our own "
                        "server's comes from --server-args (default 20)")
    p.add_argument("--body-read-timeout", type=float, default=None,
                   help="with --base-url: the server's; our own server's comes from "
                        "--server-args (default 60)")
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
        long_burst=args.long_burst, near_context_tokens=args.near_context_tokens,
        slow_client_interval_s=args.slow_client_interval,
        keepalive_timeout_s=args.keepalive_timeout, body_read_timeout_s=args.body_read_timeout)
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
