"""Serving metrics: per-request timings in, vLLM-style summary out (pure maths, no I/O).

Per request, with t=0 when the request is sent:

    send        first content chunk        later content chunks              done
     |---- ttft ----|---- itl ----|---- itl ----| ... |---- itl ----|
     |--------------------------------- e2e ------------------------------------|

    TPOT = (e2e - ttft) / (output_tokens - 1)   (undefined for a one-token output)

ITL is measured between content chunks as they arrive; TPOT divides by tokens, so a
server that packs several tokens per chunk shows fewer, longer ITLs but the same TPOT.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """One request as the client saw it. Times in seconds."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0  # the server's usage.prompt_tokens, else the dataset's count
    output_tokens: int = 0  # usage.completion_tokens, else the number of content chunks
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens (prefix-cache hits)
    start_s: float = 0.0  # send time, from the benchmark's start
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    # arrival time of each content chunk, from the request's send time
    chunk_times_s: list[float] = field(default_factory=list)

    @property
    def itls_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s}


def parse_slo(spec: str | None) -> dict[str, float]:
    """`ttft:MS,tpot:MS[,e2el:MS]` -> {"ttft": seconds, ...}."""
    if not spec:
        return {}
    slo: dict[str, float] = {}
    for part in spec.split(","):
        key, sep, value = part.partition(":")
        key = key.strip()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo wants KEY:MS pairs with KEY in {SLO_KEYS}, got {part!r}")
        ms = float(value)
        if not ms > 0:
            raise ValueError(f"--slo {key} must be > 0 ms, got {value}")
        slo[key] = ms / 1000.0
    return slo


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    """A successful request within every given bound (an undefined TPOT meets any bound)."""
    if not r.success:
        return False
    tpot = r.tpot_s
    return (r.ttft_s <= slo.get("ttft", math.inf)
            and (tpot is None or tpot <= slo.get("tpot", math.inf))
            and r.e2e_s <= slo.get("e2el", math.inf))


def latency_stats(values_s: list[float]) -> dict[str, float]:
    """mean / std / p50 / p90 / p99 in milliseconds (linear interpolation, as numpy);
    zeros when there are no values, so reports never carry NaN."""
    if not values_s:
        return {"mean_ms": 0.0, "std_ms": 0.0, **{f"p{p}_ms": 0.0 for p in PERCENTILES}}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    stats = {"mean_ms": float(ms.mean()), "std_ms": float(ms.std())}
    for p, v in zip(PERCENTILES, np.percentile(ms, PERCENTILES)):
        stats[f"p{p}_ms"] = float(v)
    return stats


def summarize(results: list[RequestResult], duration_s: float,
              slo: dict[str, float] | None = None) -> dict[str, Any]:
    """The serving summary: counts, throughputs and latency stats over successful requests."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    cached_tokens = sum(r.cached_tokens for r in ok)
    tpots = [t for t in (r.tpot_s for r in ok) if t is not None]
    summary: dict[str, Any] = {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        # Prompt tokens the server read from its prefix cache, over all prompt tokens.
        "total_cached_tokens": cached_tokens,
        "prefix_cache_hit_rate": cached_tokens / in_tokens if in_tokens else 0.0,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "ttft": latency_stats([r.ttft_s for r in ok]),
        "tpot": latency_stats(tpots),
        "itl": latency_stats([x for r in ok for x in r.itls_s]),
        "e2el": latency_stats([r.e2e_s for r in ok]),
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in results)
        summary["slo_ms"] = {k: v * 1000.0 for k, v in slo.items()}
        summary["goodput_requests"] = good
        summary["request_goodput"] = good / duration_s
    return summary


def throughput_over_time(results: list[RequestResult], duration_s: float,
                         num_bins: int | None = None) -> tuple[list[float], list[float]]:
    """(bin centres in s, output tok/s per bin): each content chunk carries an equal share
    of its request's output tokens, placed at its arrival time.

    Default: at most 30 bins, each at least a second wide; narrower bins alias with the
    engine's step time and show each step as a spike."""
    if num_bins is None:
        num_bins = min(30, max(1, int(duration_s)))
    num_bins = max(1, num_bins)
    width = max(duration_s, 1e-9) / num_bins
    counts = [0.0] * num_bins
    for r in results:
        if not r.success or not r.chunk_times_s:
            continue
        share = r.output_tokens / len(r.chunk_times_s)
        for t in r.chunk_times_s:
            counts[min(num_bins - 1, int((r.start_s + t) / width))] += share
    return [(i + 0.5) * width for i in range(num_bins)], [c / width for c in counts]
