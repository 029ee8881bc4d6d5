"""The engine's Prometheus metrics through Ray's metrics export.

Each replica's engine writes every metric twice: to its own prometheus_client registry (the
replica app's /metrics, as in `aioengine serve`) and, through `RayMetricFactory`, to
`ray.util.metrics`, which Ray's agent on each node exports in Prometheus format (the port
`ray.init(_metrics_export_port=...)` or `ray start --metrics-export-port` sets). Ray
refuses ':' in names and adds a `ray_` prefix: `aioengine:generation_tokens` is exported
as `ray_aioengine_generation_tokens_total`. Every series carries a `replica` tag, so one scrape of each node shows
every replica. Gauges and the cumulative counters follow the scheduler's state, which
nobody scrapes from a replica: the replica refreshes them every few seconds
(`EngineMetrics.update`).
"""
from __future__ import annotations

from collections.abc import Sequence

from ray.util import metrics as ray_metrics

REPLICA_TAG = "replica"


class _RayChild:
    """One labelled series of a Ray metric, with prometheus_client's child methods."""

    def __init__(self, metric: ray_metrics.Metric, tags: dict[str, str]) -> None:
        self._metric = metric
        self._tags = tags

    def set(self, value: float) -> None:
        self._metric.set(value, tags=self._tags)

    def inc(self, value: float = 1.0) -> None:
        if value > 0:  # Ray's Counter refuses 0, which prometheus_client takes
            self._metric.inc(value, tags=self._tags)

    def observe(self, value: float) -> None:
        self._metric.observe(value, tags=self._tags)


class _RayMetric:
    """A Ray metric with prometheus_client's `labels(*values)`."""

    def __init__(self, metric: ray_metrics.Metric, labelnames: Sequence[str]) -> None:
        self._metric = metric
        self._labelnames = tuple(labelnames)

    def labels(self, *values: str) -> _RayChild:
        return _RayChild(self._metric, dict(zip(self._labelnames, map(str, values))))


class RayMetricFactory:
    """`aioengine.metrics.MetricFactory` for Ray: the same names, documentation, labels and
    buckets, plus a `replica` tag with this replica's id."""

    def __init__(self, replica_id: str) -> None:
        self.default_tags = {REPLICA_TAG: replica_id}

    def _keys(self, labelnames: Sequence[str]) -> tuple[str, ...]:
        return (*labelnames, REPLICA_TAG)

    def gauge(self, name: str, doc: str, labelnames: Sequence[str]) -> _RayMetric:
        metric = ray_metrics.Gauge(ray_name(name), doc, tag_keys=self._keys(labelnames))
        return _RayMetric(metric.set_default_tags(self.default_tags), labelnames)

    def counter(self, name: str, doc: str, labelnames: Sequence[str]) -> _RayMetric:
        metric = ray_metrics.Counter(ray_name(name), doc, tag_keys=self._keys(labelnames))
        return _RayMetric(metric.set_default_tags(self.default_tags), labelnames)

    def histogram(self, name: str, doc: str, labelnames: Sequence[str],
                  buckets: Sequence[float]) -> _RayMetric:
        metric = ray_metrics.Histogram(ray_name(name), doc, boundaries=list(buckets),
                                       tag_keys=self._keys(labelnames))
        return _RayMetric(metric.set_default_tags(self.default_tags), labelnames)


def ray_name(name: str) -> str:
    """A metric name as Ray takes it (no ':')."""
    return name.replace(":", "_")
