"""Sampling the soak's server (aioengine/bench/soak.py): its process from /proc (resident
memory, open file descriptors, threads, CPU time) and its /metrics gauges, every few
seconds during the traffic and until it is idle after."""
from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import aiohttp

from aioengine.bench.soak_traffic import Traffic


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


GAUGES = {"kv_usage": "aioengine:kv_cache_usage_perc",
           "running": "aioengine:num_requests_running",
           "waiting": "aioengine:num_requests_waiting",
           "preemptions": "aioengine:num_preemptions_total"}


async def sampler(t: Traffic, pid: int | None, interval_s: float, done: asyncio.Event,
                   samples: list[dict]) -> None:
    """Samples until `done`; ends the traffic (t.stop) if the server process is gone."""
    while True:
        sample = {"t": round(time.monotonic() - t.t0, 2), **proc_sample(pid)}
        try:
            m = await scrape(t.session, t.url, t.headers)
            sample.update({k: m.get(name) for k, name in GAUGES.items()})
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


async def wait_idle(session: aiohttp.ClientSession, url: str, timeout_s: float,
                     headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Polls /metrics until nothing runs or waits and no KV block is in use."""
    start = time.monotonic()
    idle: dict[str, Any] = dict.fromkeys(GAUGES)
    while True:
        try:
            m = await scrape(session, url, headers)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return {**idle, "idle": False, "waited_s": round(time.monotonic() - start, 2),
                    "error": f"{type(e).__name__}: {e}"}
        idle = {k: m.get(name) for k, name in GAUGES.items()}
        quiet = idle["running"] == 0 and idle["waiting"] == 0 and idle["kv_usage"] == 0
        if quiet or time.monotonic() - start > timeout_s:
            return {**idle, "idle": quiet, "waited_s": round(time.monotonic() - start, 2)}
        await asyncio.sleep(0.2)
