"""Prometheus metrics with vLLM's names under the `aioengine:` prefix.

Each engine owns its own CollectorRegistry (several engines can live in one process, as in
the tests). The engine loop feeds per-step numbers; the output processor feeds per-request
latencies at the moment outputs reach the caller. With LoRA, vLLM's lora_requests_info
gauge (`track_lora_requests`). With speculative decoding, vLLM's
spec_decode_* counters (from the scheduler's cumulative SpecDecodingStats, at scrape time)
and its periodic "SpecDecoding" log line (`SpecDecodingLogging`). A `MetricFactory` writes
every metric (but the LoRA info gauge) a second time, elsewhere: Ray's metrics export.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable, Mapping, Protocol, Sequence

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
# The *_created series (a timestamp per counter) are noise for an engine's scrape.
disable_created_metrics()

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_STEP_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
                      0.25, 0.5, 1.0, 2.5, 5.0)
_LOOP_LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
# EngineCore.stats() keys of speculative decoding: spec_decode_<counter>, and the drafts
# accepted at position i (0-based) under SPEC_PER_POS_PREFIX + str(i).
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
SPEC_PER_POS_PREFIX = "spec_decode_num_accepted_tokens_per_pos_"
# The same per drafting method (suffix, ngram, eagle3, ...): SPEC_PER_POS_PREFIX + str(i) +
# SPEC_METHOD_INFIX + method; the Prometheus counter's `method` label.
SPEC_METHOD_INFIX = "_by_"


def spec_method_key(pos: int, method: str) -> str:
    return f"{SPEC_PER_POS_PREFIX}{pos}{SPEC_METHOD_INFIX}{method}"

logger = logging.getLogger("aioengine")


def spec_decode_delta(before: Mapping[str, float],
                      after: Mapping[str, float]) -> dict[str, Any] | None:
    """What speculative decoding did between two `EngineCore.stats()` snapshots (`before`
    may be {}: since the start): each counter's increase, the accepted drafts per position,
    the mean acceptance length (tokens per verification: 1 + accepted / drafts, the token
    sampled after the drafts included, as vLLM counts it), the draft acceptance rate and
    the acceptance rate at each position (accepted there / drafts). None without
    speculative decoding; the ratios are None when no draft was verified."""
    if "spec_decode_num_drafts" not in after:
        return None
    counts = {name: after[f"spec_decode_{name}"] - before.get(f"spec_decode_{name}", 0)
              for name in SPEC_COUNTERS}
    keys = itertools.takewhile(after.__contains__,
                               (f"{SPEC_PER_POS_PREFIX}{pos}" for pos in itertools.count()))
    per_pos = [after[key] - before.get(key, 0) for key in keys]
    drafts, drafted = counts["num_drafts"], counts["num_draft_tokens"]
    accepted = counts["num_accepted_tokens"]
    return {**counts, "num_accepted_tokens_per_pos": per_pos,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_rate": accepted / drafted if drafted else None,
            "per_position_acceptance_rate": [n / drafts for n in per_pos] if drafts else None}


def format_spec_decode(delta: Mapping[str, Any]) -> str:
    """`spec_decode_delta` in one line (the periodic log's, and the benchmarks')."""
    if not delta["num_drafts"]:
        return "no drafts verified"
    rates = ", ".join(f"{r:.3f}" for r in delta["per_position_acceptance_rate"])
    return (f"mean acceptance length {delta['mean_acceptance_length']:.2f}, accepted "
            f"{delta['num_accepted_tokens']} / drafted {delta['num_draft_tokens']} tokens "
            f"({100 * delta['acceptance_rate']:.1f}%) in {delta['num_drafts']} drafts, "
            f"per-position acceptance rate [{rates}]")


class SpecDecodingLogging:
    """vLLM's periodic "SpecDecoding" log line: what speculative decoding did since the
    previous line (nothing is logged for an interval without drafts)."""

    def __init__(self, stats_provider: Callable[[], Mapping[str, float]]) -> None:
        self.stats_provider = stats_provider
        self._last: Mapping[str, float] = {}

    def log(self) -> None:
        stats = self.stats_provider()
        delta = spec_decode_delta(self._last, stats)
        self._last = stats
        if delta is not None and delta["num_drafts"]:
            logger.info("SpecDecoding: %s", format_spec_decode(delta))


class MetricFactory(Protocol):
    """Makes metrics with prometheus_client's interface: `labels(*values)` gives a series
    with `set`, `inc` or `observe`. EngineMetrics writes to its own registry and, given a
    factory, to the metrics this makes too (aioengine.ray_serve.metrics: Ray's export)."""

    def gauge(self, name: str, doc: str, labelnames: Sequence[str]) -> Any: ...

    def counter(self, name: str, doc: str, labelnames: Sequence[str]) -> Any: ...

    def histogram(self, name: str, doc: str, labelnames: Sequence[str],
                  buckets: Sequence[float]) -> Any: ...


class _Tee:
    """A metric (or one labelled series of it) written to several places at once."""

    def __init__(self, *metrics: Any) -> None:
        self._metrics = metrics

    def labels(self, *values: str) -> _Tee:
        return _Tee(*(m.labels(*values) for m in self._metrics))

    def set(self, value: float) -> None:
        for m in self._metrics:
            m.set(value)

    def inc(self, value: float = 1.0) -> None:
        for m in self._metrics:
            m.inc(value)

    def observe(self, value: float) -> None:
        for m in self._metrics:
            m.observe(value)


class EngineMetrics:
    def __init__(self, model_name: str,
                 stats_provider: Callable[[], dict[str, float]] | None = None,
                 num_speculative_tokens: int = 0,
                 metrics_factory: MetricFactory | None = None) -> None:
        """`num_speculative_tokens` > 0 (speculative decoding configured) adds the
        spec_decode_* counters, the per-position one for positions 0 .. that - 1.
        `metrics_factory`: where each metric is also written (MetricFactory)."""
        self.stats_provider = stats_provider
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        f = metrics_factory

        def family(kind: str, name: str, doc: str, labelnames: list[str],
                   buckets: tuple | None = None) -> Any:
            """prometheus_client's metric `kind`, and the factory's beside it."""
            name = f"aioengine:{name}"
            extra = {} if buckets is None else {"buckets": buckets}
            cls = {"gauge": Gauge, "counter": Counter, "histogram": Histogram}[kind]
            metric = cls(name, doc, labelnames, registry=r, **extra)
            if f is None:
                return metric
            return _Tee(metric, getattr(f, kind)(name, doc, labelnames, *extra.values()))

        def gauge(name: str, doc: str) -> Any:
            return family("gauge", name, doc, labels).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return family("counter", name, doc, labels).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple) -> Any:
            return family("histogram", name, doc, labels, buckets).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to run.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc",
                                         "Fraction of KV blocks in use (0 = all free).")
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted (recompute).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        success = family("counter", "request_success", "Finished requests by finish reason.",
                         ["model_name", "finished_reason"])
        self.request_success = {reason: success.labels(model_name, reason)
                                for reason in FINISH_REASONS}
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Arrival to first token.", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Time between consecutive tokens of a sample.",
                                             _ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "Arrival to last output.", _LATENCY_BUCKETS)
        self.time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "First to last token of a finished sample, per token after the first (TPOT).",
            _ITL_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds",
                                            "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens per engine step.",
                                          _STEP_TOKEN_BUCKETS)
        self.event_loop_lag = histogram(
            "event_loop_lag_seconds", "How late a timer on the engine's event loop fired "
            "(sampled every 0.1 s): what anything holding the loop cost every request.",
            _LOOP_LAG_BUCKETS)
        self._step_time_family = family(
            "histogram", "step_time_seconds", "Worker time of an engine step (prepare, "
            "forward, sample and drafting), by the executor that ran its layers.",
            ["model_name", "executor"], _STEP_TIME_BUCKETS)
        self._step_time: dict[str, Any] = {}  # executor -> its child, made on first use
        # Counters that follow cumulative stats() values: (stats key, counter).
        self._cumulative: list[tuple[str, Any]] = [
            ("prefix_cache_queries", self.prefix_cache_queries),
            ("prefix_cache_hits", self.prefix_cache_hits),
            ("num_preemptions", self.num_preemptions)]
        self._per_pos: Any = None
        if num_speculative_tokens > 0:
            docs = {"num_drafts": "Number of spec decoding drafts.",
                    "num_draft_tokens": "Number of draft tokens.",
                    "num_accepted_tokens": "Number of accepted tokens."}
            self._cumulative += [(f"spec_decode_{name}", counter(f"spec_decode_{name}", doc))
                                 for name, doc in docs.items()]
            # Children per (position, method) as the stats name them (spec_method_key).
            self._per_pos = family("counter", "spec_decode_num_accepted_tokens_per_pos",
                                   "Accepted tokens per draft position, by the method that "
                                   "drafted them.", ["model_name", "position", "method"])
        self._last: dict[str, float] = {}
        self._lora_info: Gauge | None = None
        self._lora_max = 0
        self._lora_provider: Callable[[], tuple[list[str], list[str]]] | None = None

    def track_lora_requests(self, max_loras: int,
                            provider: Callable[[], tuple[list[str], list[str]]]) -> None:
        """vLLM's `lora_requests_info` gauge: labels `max_lora`, `waiting_lora_adapters` and
        `running_lora_adapters` (the sorted adapter names of the running and of the waiting
        requests, as `provider()` returns them, comma-joined), value the time (Unix seconds) of the update,
        at each scrape. Only the current label set is kept (vLLM keeps every one it has
        seen; readers take the newest either way)."""
        if self._lora_info is None:  # a second call only replaces the source
            self._lora_info = Gauge("aioengine:lora_requests_info",
                                    "Running stats on LoRA requests.",
                                    ["max_lora", "waiting_lora_adapters",
                                     "running_lora_adapters"], registry=self.registry)
        self._lora_max, self._lora_provider = max_loras, provider

    def _refresh_lora_info(self) -> None:
        if self._lora_info is None or self._lora_provider is None:
            return
        running, waiting = self._lora_provider()
        self._lora_info.clear()
        self._lora_info.labels(str(self._lora_max), ",".join(waiting),
                               ",".join(running)).set(time.time())

    def observe_step(self, num_scheduled_tokens: int, seconds: float | None = None,
                     executor: str | None = None) -> None:
        """A step of `num_scheduled_tokens`; with `seconds`, its worker time, labelled by
        the `executor` that ran its layers ("fused", "layerwise", ...; "" if none said)."""
        self.iteration_tokens.observe(num_scheduled_tokens)
        if seconds is None:
            return
        label = executor or ""
        metric = self._step_time.get(label)
        if metric is None:
            metric = self._step_time[label] = self._step_time_family.labels(self.model_name,
                                                                            label)
        metric.observe(seconds)

    def _add_per_pos_children(self, stats: dict[str, float]) -> None:
        """A counter child for each per-method per-position stats key not seen before (the
        stats list every method the config may draft with from the start)."""
        known = {key for key, _ in self._cumulative}
        for key in stats:
            if key.startswith(SPEC_PER_POS_PREFIX) and key not in known:
                pos, infix, method = key[len(SPEC_PER_POS_PREFIX):].partition(SPEC_METHOD_INFIX)
                if infix and pos.isdigit():
                    self._cumulative.append((key, self._per_pos.labels(self.model_name, pos,
                                                                       method)))

    def refresh(self, stats: dict[str, float]) -> None:
        """Gauges from the scheduler's current state; counters from its cumulative stats.
        Called at scrape time, so an idle engine still reports its latest state."""
        self.num_requests_running.set(stats["num_running"])
        self.num_requests_waiting.set(stats["num_waiting"])
        self.kv_cache_usage_perc.set(stats["kv_cache_usage"])
        if self._per_pos is not None:
            self._add_per_pos_children(stats)
        for key, counter in self._cumulative:
            delta = stats[key] - self._last.get(key, 0)
            if delta > 0:
                counter.inc(delta)
            self._last[key] = stats[key]

    def observe_first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        self.time_to_first_token.observe(ttft)
        self.prompt_tokens.inc(num_prompt_tokens)

    def observe_tokens(self, num_tokens: int, inter_token_latency: float | None) -> None:
        self.generation_tokens.inc(num_tokens)
        if inter_token_latency is not None:
            self.inter_token_latency.observe(inter_token_latency)

    def observe_finished(self, reason: str, e2e_latency: float, queue_time: float | None,
                         time_per_output_token: float | None = None) -> None:
        self.request_success[reason].inc()
        self.e2e_request_latency.observe(e2e_latency)
        if time_per_output_token is not None:
            self.time_per_output_token.observe(time_per_output_token)
        if queue_time is not None:
            self.request_queue_time.observe(queue_time)

    def update(self) -> None:
        """Everything that follows the engine's state, brought up to date (a scrape does
        this first; so does a replica for Ray's export, which nobody scrapes)."""
        if self.stats_provider is not None:
            self.refresh(self.stats_provider())
        self._refresh_lora_info()

    def render(self) -> bytes:
        self.update()
        return generate_latest(self.registry)
