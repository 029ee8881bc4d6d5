"""The weight-streaming floor of single-request decode (`latency` mode):

    floor_ms = weight bytes read per token / memory read bandwidth

`weight_bytes_per_token` counts the bytes; `BandwidthProbe` measures the bandwidth in a
child process and gives each timed run the higher of the bandwidths measured before and
after it (latency.py's docstring says why).
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import time

import torch

from aioengine.model import hugepages


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one decoded token reads, from the loaded model's parameters in their
    storage format (`parameters()` yields a tied embedding / LM head once) and the int8
    scales; oneDNN-packed copies are not read by a single-stream step."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(lin.scales.numel() * lin.scales.element_size()
                 for lin in model.linears() if lin.scales is not None)
    embed = model.embed_tokens.weight
    if model.lm_head is not model.embed_tokens:
        embed = model.embed_tokens.dense_weight()
        # Untied: the embedding lookup reads one row, not the whole table.
        total -= embed.numel() * embed.element_size()
        total += embed.shape[1] * embed.element_size()
    return total


BANDWIDTH_REPEATS = 5


def close_child(proc: subprocess.Popen) -> None:
    """Ends a benchmark child that reads its stdin until EOF: its pipes closed (a child
    already gone is fine), then a minute to exit before it is killed."""
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            try:
                stream.close()
            except BrokenPipeError:
                pass
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def measure_read_bandwidth(num_bytes: int = 1 << 30, repeats: int = BANDWIDTH_REPEATS) -> float:
    """Memory read bandwidth in bytes/s, measured once by a BandwidthProbe."""
    with BandwidthProbe(num_bytes, repeats) as probe:
        return probe.measure()


class BandwidthProbe:
    """Measures memory read bandwidth: the median of `repeats` sums of a float32 buffer of
    `num_bytes`, with torch's current thread count, in a child process. For timed runs,
    `before_run()` / `after_run()` give each run the higher of the measurements just before
    and just after it, the one between two runs serving both.

    The median, not the fastest single pass, which catches transients. The buffer is in huge
    pages, as the model's weights are. On the 2-core VMs this was written on the rate has
    phases: ~33 GB/s usually, 50-64 GB/s for seconds to minutes at a time.

    A child process, because OpenMP work started in this one costs the engine: a thread that
    has run torch ops keeps an OpenMP thread team, and with a second team next to the
    engine's forward thread, libgomp throttles its spin-waits. Measuring on a thread of this
    process between runs (the thread then exits) made our TPOT 15% slower (21.5 -> 24.8 ms).

    One child for the probe's life, which keeps its buffer: a child per measurement freed
    1 GiB each time, the VM reported those free pages to its host (virtio free page
    reporting, 2 MiB at a time), and in the next run the engine's forward stalled for
    30-50 ms several times (a 12-19 ms step; 1-2 such steps per run without the probe).
    Close it (or use it as a context manager) to end the child.

    Each measurement waits `settle_s` first: after a run, the caller's OpenMP threads keep
    spin-waiting for a while and take CPU from the child. Measured right after a run the
    rate came out 15-20% low (22-27 GB/s, 27-33 after 0.3 s or more).
    """

    def __init__(self, num_bytes: int, repeats: int = BANDWIDTH_REPEATS,
                 settle_s: float = 0.5) -> None:
        self.num_bytes = num_bytes
        self.repeats = repeats
        self.settle_s = settle_s
        self._last: float | None = None
        self._proc: subprocess.Popen[str] | None = None

    def measure(self) -> float:
        if self._proc is None:
            code = ("import sys; from aioengine.bench.floor import _serve_measurements; "
                    "_serve_measurements(*map(int, sys.argv[1:]))")
            self._proc = subprocess.Popen(
                [sys.executable, "-c", code, str(self.num_bytes), str(self.repeats),
                 str(torch.get_num_threads())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True)
        proc = self._proc
        assert proc.stdin is not None and proc.stdout is not None
        time.sleep(self.settle_s)
        try:
            proc.stdin.write("measure\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self.close()
            err = proc.stderr.read() if proc.stderr else ""
            raise RuntimeError(f"memory bandwidth measurement failed: {err.strip()[-2000:]}")
        return float(line)

    def before_run(self) -> None:
        """Measures before a timed run, unless the measurement after the previous run
        stands for this one too (so N runs take N + 1 measurements)."""
        if self._last is None:
            self._last = self.measure()

    def after_run(self) -> float:
        """Measures after a timed run; returns the run's bandwidth, the higher of this and
        the measurement before it."""
        before = self._last
        if before is None:
            raise RuntimeError("BandwidthProbe.after_run without before_run")
        self._last = self.measure()
        return max(before, self._last)

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            close_child(proc)

    def __enter__(self) -> BandwidthProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve_measurements(num_bytes: int, repeats: int, threads: int) -> None:
    """The child's side of BandwidthProbe: one bandwidth per line read from stdin. The
    buffer is filled first, so no timed pass pays for page faults."""
    torch.set_num_threads(threads)
    buf = hugepages.empty((max(num_bytes // 4, 1),), torch.float32, torch.device("cpu"))
    buf.fill_(1.0)
    buf.sum()  # one untimed pass: threads up, buffer resident
    for _ in sys.stdin:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            buf.sum()
            times.append(time.perf_counter() - start)
        print(buf.numel() * buf.element_size() / statistics.median(times), flush=True)
