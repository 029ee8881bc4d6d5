"""The weight-streaming floor of single-request decode (`latency` mode):

    floor_ms = weight bytes read per token / memory read bandwidth

`weight_bytes_per_token` counts the bytes, `measure_read_bandwidth` measures the bandwidth
in a child process, and `BandwidthProbe` gives each timed run the higher of the
bandwidths measured before and after it (latency.py's docstring says why).
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import time

import torch

from aioengine.model import hugepages


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one decoded token reads, from the loaded model's parameters
    (`parameters()` yields a tied embedding / LM head once)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens
    if model.lm_head is not embed:
        # Untied: the embedding lookup reads one row, not the whole table.
        total -= embed.numel() * embed.element_size()
        total += embed.shape[1] * embed.element_size()
    return total


BANDWIDTH_REPEATS = 5


def measure_read_bandwidth(num_bytes: int = 1 << 30, repeats: int = BANDWIDTH_REPEATS) -> float:
    """Memory read bandwidth in bytes/s: the median of `repeats` sums of a float32 buffer
    of `num_bytes`, with torch's current thread count, in a child process.

    The median, not the fastest single pass, which catches transients. The buffer is in huge
    pages, as the model's weights are. On the 2-core VMs this was written on the rate has
    phases: ~33 GB/s usually, 50-64 GB/s for seconds to minutes at a time.

    A child process, because OpenMP work started in this one costs the engine: a thread that
    has run torch ops keeps an OpenMP thread team, and with a second team next to the
    engine's forward thread, libgomp throttles its spin-waits. Measuring on a thread of this
    process between runs (the thread then exits) still made our TPOT 15% slower
    (21.5 -> 24.8 ms).
    """
    code = ("import sys; from aioengine.bench.floor import _bandwidth_here; "
            "print(_bandwidth_here(*map(int, sys.argv[1:])))")
    proc = subprocess.run([sys.executable, "-c", code, str(num_bytes), str(repeats),
                           str(torch.get_num_threads())],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"memory bandwidth measurement failed: {proc.stderr.strip()[-2000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def _bandwidth_here(num_bytes: int, repeats: int, threads: int) -> float:
    """The measurement itself (run by `measure_read_bandwidth` in a child). The buffer is in
    huge pages, as the model's weights are (hugepages.py: a 4 KB-paged buffer reads ~10%
    slower here), and filled first, so no timed pass pays for page faults."""
    torch.set_num_threads(threads)
    buf = hugepages.empty((max(num_bytes // 4, 1),), torch.float32, torch.device("cpu"))
    buf.fill_(1.0)
    buf.sum()  # one untimed pass: threads up, buffer resident
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - start)
    return buf.numel() * buf.element_size() / statistics.median(times)


class BandwidthProbe:
    """The bandwidth for each timed run: the higher of the measurements just before and just
    after it, the one between two runs serving both."""

    def __init__(self, num_bytes: int) -> None:
        self.num_bytes = num_bytes
        self._last: float | None = None

    def before_run(self) -> None:
        if self._last is None:
            self._last = measure_read_bandwidth(self.num_bytes)

    def after_run(self) -> float:
        before = self._last
        if before is None:
            raise RuntimeError("BandwidthProbe.after_run without before_run")
        self._last = measure_read_bandwidth(self.num_bytes)
        return max(before, self._last)
