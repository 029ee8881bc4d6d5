"""The result types the benchmarks share: one engine's offline run of a workload
(`EngineResult`, made by `make_result`) and its agreement with a peer's outputs, and one
engine's latency runs of a single request (`LatencyRun`, `EngineLatency`).

Our engine's runners (offline.py, latency.py) and the peers in their own interpreters
(peers.py) all build these, so they live here rather than in any one runner: the runners
import this module and nothing imports a runner back."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from aioengine.bench.datasets import Workload

OUR_ENGINE = "aioengine"


# ---- offline: one engine's run of a whole workload ----------------------------------------


@dataclass
class EngineResult:
    """One engine's timed run of the whole workload (warm-up excluded)."""

    engine: str
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    elapsed_s: float
    threads: int
    outputs: list[list[int]] = field(repr=False)
    # Our engines only: see offline.engine_stats().
    engine_stats: dict[str, Any] | None = None
    # Peers in their own interpreters (peers.py): versions and set-up.
    peer_info: dict[str, Any] | None = None

    @property
    def output_tps(self) -> float:
        return self.num_output_tokens / self.elapsed_s

    @property
    def total_tps(self) -> float:
        return (self.num_prompt_tokens + self.num_output_tokens) / self.elapsed_s

    def summary(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "outputs"}
        return {**d, "output_tok_per_s": self.output_tps, "total_tok_per_s": self.total_tps}


def make_result(engine: str, workload: Workload, outputs: list[list[int]],
                elapsed_s: float) -> EngineResult:
    # Invariant the comparison relies on: every engine did exactly the same work.
    want = [r.output_len for r in workload.requests]
    bad = [i for i, (o, n) in enumerate(zip(outputs, want)) if len(o) != n]
    if len(outputs) != len(want) or bad:
        raise RuntimeError(f"{engine}: expected {len(want)} outputs of the requested "
                           f"lengths; wrong length at requests {bad[:8]}")
    import torch  # here: peers.py imports this module and stays free of torch

    return EngineResult(engine=engine, num_requests=len(outputs),
                        num_prompt_tokens=workload.num_prompt_tokens,
                        num_output_tokens=sum(len(o) for o in outputs),
                        elapsed_s=elapsed_s, threads=torch.get_num_threads(), outputs=outputs)


@dataclass
class OutputAgreement:
    """How many of our greedy outputs equal a peer's, token for token.

    Informational: batched fp32 with padding changes summation order, so near-ties in
    the logits may flip a late token and everything after it.
    """

    num_equal: int
    num_requests: int
    # request index -> first position where the two outputs differ
    first_diffs: dict[int, int]

    @property
    def mean_first_diff(self) -> float | None:
        if not self.first_diffs:
            return None
        return sum(self.first_diffs.values()) / len(self.first_diffs)


def compare_outputs(ours: list[list[int]], peer: list[list[int]]) -> OutputAgreement:
    first_diffs = {}
    for i, (a, b) in enumerate(zip(ours, peer, strict=True)):
        if a != b:
            first_diffs[i] = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                                  min(len(a), len(b)))
    return OutputAgreement(num_equal=len(ours) - len(first_diffs), num_requests=len(ours),
                           first_diffs=first_diffs)


# ---- latency: one request's runs ----------------------------------------------------------


@dataclass
class LatencyRun:
    """One request's token arrival times, in seconds since it was submitted, and the memory
    read bandwidth (bytes/s) for its floor (`BandwidthProbe`)."""

    token_times_s: list[float]
    bandwidth: float = 0.0
    # Our engine with speculative decoding: spec_decode_delta over this run.
    spec_decode: dict[str, Any] | None = None

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0]

    @property
    def e2e_s(self) -> float:
        return self.token_times_s[-1]

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (len(self.token_times_s) - 1)

    @property
    def itls_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]

    def to_json(self) -> dict[str, Any]:
        out = {"ttft_ms": self.ttft_s * 1e3, "tpot_ms": self.tpot_s * 1e3,
               "itl_median_ms": statistics.median(self.itls_s) * 1e3,
               "e2e_ms": self.e2e_s * 1e3, "num_tokens": len(self.token_times_s),
               "bandwidth_gb_per_s": self.bandwidth / 1e9}
        if self.spec_decode is not None:
            out["spec_decode"] = self.spec_decode
        return out


def checked_run(engine: str, times: list[float], output_len: int,
                bandwidth: float) -> LatencyRun:
    """The LatencyRun of `times`; RuntimeError unless exactly `output_len` tokens came."""
    if len(times) != output_len:
        raise RuntimeError(f"{engine}: {len(times)} tokens arrived, expected {output_len}")
    return LatencyRun(times, bandwidth)


@dataclass
class EngineLatency:
    engine: str
    runs: list[LatencyRun]
    threads: int
    # Our engine: the weights it holds, for the floor.
    weight_bytes: int | None = field(default=None, repr=False)
    # Each timed run's output token ids (greedy: the runs should agree with each other).
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    # A peer's versions and set-up (peers.py).
    peer_info: dict[str, Any] | None = None
    # Our engine: spec_decode_delta over all timed runs (None without speculative decoding).
    spec_decode: dict[str, Any] | None = None

    def summary(self, weight_bytes: int | None = None) -> dict[str, Any]:
        """Median and best (min) over runs of each per-run number; with `weight_bytes`, also
        each run's TPOT over the floor from its bandwidth (`BandwidthProbe`)."""
        per_run = [r.to_json() for r in self.runs]
        if weight_bytes is not None:
            for run, summary in zip(self.runs, per_run):
                summary["tpot_over_floor"] = run.tpot_s / (weight_bytes / run.bandwidth)
        out: dict[str, Any] = {"engine": self.engine, "threads": self.threads,
                               "num_runs": len(per_run)}
        keys = ["ttft_ms", "tpot_ms", "itl_median_ms", "e2e_ms"]
        for key in keys + (["tpot_over_floor"] if weight_bytes is not None else []):
            values = [r[key] for r in per_run]
            out[key] = {"median": statistics.median(values), "best": min(values)}
        out["runs"] = per_run
        if self.engine == OUR_ENGINE:
            out["spec_decode"] = self.spec_decode
        if self.peer_info is not None:
            out["peer_info"] = self.peer_info
        return out
