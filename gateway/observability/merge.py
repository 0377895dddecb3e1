"""One Prometheus exposition for the whole gateway, merged from its worker processes' own expositions.

Owns: `merge_expositions`, the rule that makes N workers' `/metrics` read as one gateway's, sample by sample
(matched by sample name and label set):
- counters, histograms (every `_bucket`, `_sum` and `_count`), summaries and gauge histograms are summed;
- the `_created` timestamps prometheus_client writes beside a counter (a gauge family of their own in the text
  format) take the earliest;
- gauges are summed (each worker's in-flight requests are its own), except the `shared` ones: gauges that
  describe what every worker sees alike (the per-engine state each worker's store gets pushed, the configured
  worker count), which are taken from the answering worker's exposition only, never multiplied by N;
- anything else (info, stateset, untyped) comes from the answering worker only.
A label set that only a sibling has is added (a model only that worker has served); a family only a sibling
has is added when its kind is summed.
Must not: do I/O or read clocks (text in, text out: `gateway.observability.siblings` fetches), or know the
metric names (the caller passes the shared gauges: `metrics.SHARED_GAUGES`).

Why not prometheus_client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`): it aggregates only the library's
own `Counter`/`Gauge`/`Histogram` values through mmap'd files; the gateway's `LoopHistogram` and the
scrape-time engine collector are custom collectors it cannot see, and it needs every process to share one
directory wiped at each start. Merging expositions keeps every metric as is and per-process registries
(no globals).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

SUMMED_TYPES = frozenset({"counter", "histogram", "summary", "gaugehistogram"})
_CREATED = "_created"

_SampleKey = tuple[str, tuple[tuple[str, str], ...]]


class _Merged(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


class _Family:
    """One metric family being merged: its first-seen metadata and samples in first-seen order."""

    __slots__ = ("name", "type", "documentation", "samples", "combine")

    def __init__(self, metric: Metric, combine: str) -> None:
        self.name: str = metric.name
        self.type: str = metric.type
        self.documentation: str = metric.documentation
        self.samples: dict[_SampleKey, Sample] = {}
        self.combine = combine  # "sum", "min" or "local"
        self.add(metric)

    def add(self, metric: Metric) -> None:
        for s in metric.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            seen = self.samples.get(key)
            if seen is None:
                self.samples[key] = Sample(s.name, dict(s.labels), s.value)
            elif self.combine == "sum":
                self.samples[key] = seen._replace(value=seen.value + s.value)
            elif self.combine == "min":
                self.samples[key] = seen._replace(value=min(seen.value, s.value))

    def metric(self) -> Metric:
        out = Metric(self.name, self.documentation, self.type)
        out.samples = list(self.samples.values())
        return out


def _combine(metric: Metric, families: dict[str, _Family], shared: Collection[str]) -> str:
    if metric.type in SUMMED_TYPES:
        return "sum"
    if metric.type == "gauge":
        counted = families.get(metric.name.removesuffix(_CREATED))
        if metric.name.endswith(_CREATED) and counted is not None and counted.type in SUMMED_TYPES:
            return "min"  # a counter's creation time: the earliest worker's (the family precedes it)
        return "local" if metric.name in shared else "sum"
    return "local"


def merge_expositions(local: str, siblings: Sequence[str], *, shared: Collection[str] = ()) -> bytes:
    """The text exposition of `local` (the answering worker's) merged with its `siblings`' (see the module
    docstring for the rule); `shared` names the gauge families taken from `local` alone."""
    families: dict[str, _Family] = {}
    for metric in text_string_to_metric_families(local):
        families[metric.name] = _Family(metric, _combine(metric, families, shared))
    for text in siblings:
        for metric in text_string_to_metric_families(text):
            family = families.get(metric.name)
            if family is None:
                combine = _combine(metric, families, shared)
                if combine != "local":
                    families[metric.name] = _Family(metric, combine)
            elif family.combine != "local" and family.type == metric.type:
                family.add(metric)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(f.metric() for f in families.values()))
    return generate_latest(registry)
