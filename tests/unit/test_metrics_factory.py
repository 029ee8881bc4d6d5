"""EngineMetrics writes every metric a second time through a MetricFactory (Ray's export in
a Ray Serve replica). Here the second place is another prometheus_client registry, so the
two expositions can be compared line by line."""
from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from aioengine.metrics import EngineMetrics


class RegistryFactory:
    """A MetricFactory over a prometheus_client registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

    def gauge(self, name: str, doc: str, labelnames: Sequence[str]) -> Gauge:
        return Gauge(name, doc, labelnames, registry=self.registry)

    def counter(self, name: str, doc: str, labelnames: Sequence[str]) -> Counter:
        return Counter(name, doc, labelnames, registry=self.registry)

    def histogram(self, name: str, doc: str, labelnames: Sequence[str],
                  buckets: Sequence[float]) -> Histogram:
        return Histogram(name, doc, labelnames, buckets=buckets, registry=self.registry)


def test_every_metric_but_the_lora_info_reaches_the_factory() -> None:
    stats = {"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.25,
             "prefix_cache_queries": 64, "prefix_cache_hits": 32, "num_preemptions": 1,
             "spec_decode_num_drafts": 3, "spec_decode_num_draft_tokens": 6,
             "spec_decode_num_accepted_tokens": 4,
             "spec_decode_num_accepted_tokens_per_pos_0": 3,
             "spec_decode_num_accepted_tokens_per_pos_1": 1,
             "spec_decode_num_accepted_tokens_per_pos_0_by_ngram": 3,
             "spec_decode_num_accepted_tokens_per_pos_1_by_ngram": 1}
    factory = RegistryFactory()
    metrics = EngineMetrics("m", stats_provider=lambda: stats, num_speculative_tokens=2,
                            metrics_factory=factory)
    metrics.track_lora_requests(2, lambda: (["a"], []))
    metrics.observe_step(17)
    metrics.observe_first_token(0.05, 12)
    metrics.observe_tokens(3, 0.02)
    metrics.observe_finished("stop", 1.5, 0.01)
    metrics.observe_finished("length", 0.7, None)
    metrics.update()
    ours = generate_latest(metrics.registry).decode().splitlines()
    mirrored = generate_latest(factory.registry).decode().splitlines()
    assert [line for line in ours if "lora_requests_info" not in line] == mirrored
    assert 'aioengine:prefix_cache_hits_total{model_name="m"} 32.0' in mirrored
    assert 'aioengine:request_success_total{finished_reason="length",model_name="m"} 1.0' \
        in mirrored
    assert any(line.startswith("aioengine:spec_decode_num_accepted_tokens_per_pos_total")
               for line in mirrored)
    # Counters follow the cumulative stats by their increase, in both places.
    stats["prefix_cache_hits"] = 40
    metrics.update()
    assert 'aioengine:prefix_cache_hits_total{model_name="m"} 40.0' in \
        generate_latest(factory.registry).decode()
