"""Prometheus metrics of one gateway process, on the process's own registry (no globals).

Owns: `GatewayMetrics` (request counters, latency histograms, routing-decision timing, event-loop lag fed by
`loop_lag`), `LoopHistogram` (the histogram of the per-token path) and the scrape-time collector that turns
the cluster store's pushed engine state into per-engine gauges; `SHARED_GAUGES`, the gauges a multi-worker
gateway's merged scrape takes from one worker instead of summing (observability/merge.py).
Must not: read clocks (callers pass durations in seconds), decide anything, or touch engines; the engine
collector only reads a snapshot when Prometheus scrapes.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from gateway.domain import ClusterSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Gauges every worker process of one gateway (gateway.workers) reports alike: the engine state each worker's
# store is pushed, the configured worker count, the cascades' thresholds (re-planned in one-process gateways
# only), CascadeInfer's stage and bound per engine (each worker's rescheduler reads the same reports; the
# answering worker's layout is taken, not a sum). A merged scrape (observability/merge.py) takes them from the
# answering worker; every other gauge describes its own process (in-flight requests) and is summed.
SHARED_GAUGES = frozenset(
    {
        "switchyard_engine_running_requests",
        "switchyard_engine_waiting_requests",
        "switchyard_engine_kv_free_ratio",
        "switchyard_engine_ready",
        "switchyard_engine_stale",
        "switchyard_engine_state_age_seconds",
        "switchyard_gateway_workers",
        "switchyard_cascade_threshold",
        "switchyard_engine_stage",
        "switchyard_engine_stage_bound_tokens",
    }
)

# Buckets follow vLLM's front-end histograms so dashboards line up.
_TTFT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
_ITL_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
_E2E_BUCKETS_S = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
)
_DECISION_BUCKETS_S = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2)
# Fine from 0.5 to 10 ms, where a p99 target sits (gateway/observability/loop_lag.py); coarse beyond.
_LOOP_LAG_BUCKETS_S = (
    0.0005,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.004,
    0.005,
    0.006,
    0.008,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
_go_float: Callable[[float], str] = floatToGoString  # how prometheus_client writes `le` (untyped there)


class HistogramSeries:
    """One label set's buckets (non-cumulative, the last one +Inf) and sum."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self._bounds, amount)] += 1  # the first bucket whose bound is >= amount
        self.sum += amount


class LoopHistogram(Collector):
    """A Prometheus histogram observed from one event loop's thread (the gateway's only thread; scrapes run
    there too).

    `observe` is a bisect and two additions, without prometheus_client's lock per bucket and sum (a quarter of
    its cost), since the dispatcher observes one per streamed token. Exposed like prometheus_client's
    `Histogram` (`_bucket` with `le` first, `_count`, `_sum`), less its optional `_created` series. With
    `labelnames`, `labels(*values)` returns that label set's series (created on first use, then cached)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: Sequence[float],
        registry: CollectorRegistry,
        labelnames: Sequence[str] = (),
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._bounds = tuple(float(b) for b in buckets)
        self._le = [_go_float(b) for b in self._bounds] + ["+Inf"]
        self._labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], HistogramSeries] = {}
        self._unlabelled = None if self._labelnames else self.labels()
        registry.register(self)

    def labels(self, *values: str) -> HistogramSeries:
        series = self._series.get(values)
        if series is None:
            if len(values) != len(self._labelnames):
                raise ValueError(f"{self._name}: expected labels {self._labelnames}, got {values}")
            series = self._series[values] = HistogramSeries(self._bounds)
        return series

    def observe(self, amount: float) -> None:
        if self._unlabelled is None:
            raise ValueError(f"{self._name} has labels {self._labelnames}: observe through labels(...)")
        self._unlabelled.observe(amount)

    def describe(self) -> Iterator[Metric]:
        yield Metric(self._name, self._documentation, "histogram")

    def collect(self) -> Iterator[Metric]:
        metric = Metric(self._name, self._documentation, "histogram")
        for values, series in self._series.items():
            labels = dict(zip(self._labelnames, values, strict=True))
            cumulative = 0
            for le, count in zip(self._le, series.counts, strict=True):
                cumulative += count
                metric.add_sample(f"{self._name}_bucket", {"le": le, **labels}, float(cumulative))
            metric.add_sample(f"{self._name}_count", labels, float(cumulative))
            metric.add_sample(f"{self._name}_sum", labels, series.sum)
        yield metric


class EngineStateCollector(Collector):
    """Per-engine gauges computed from the store's snapshot at scrape time (never stale, never polled)."""

    def __init__(self, snapshot: Callable[[], ClusterSnapshot]) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterator[Metric]:
        return iter(())  # unchecked collector: families are produced on collect

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        running = GaugeMetricFamily(
            "switchyard_engine_running_requests", "Running requests, as last reported", labels=["engine"]
        )
        waiting = GaugeMetricFamily(
            "switchyard_engine_waiting_requests", "Waiting requests, as last reported", labels=["engine"]
        )
        kv_free = GaugeMetricFamily(
            "switchyard_engine_kv_free_ratio", "Free KV blocks / total, as last reported", labels=["engine"]
        )
        ready = GaugeMetricFamily(
            "switchyard_engine_ready",
            "1 when the engine is in the pool (ready, not ejected)",
            labels=["engine"],
        )
        stale = GaugeMetricFamily(
            "switchyard_engine_stale",
            "1 when the engine's last report is older than stale_after_s (routed on local accounting)",
            labels=["engine"],
        )
        ejected = GaugeMetricFamily(
            "switchyard_engine_ejected",
            "1 while outlier detection keeps the engine out of the pool (summed over a gateway's workers)",
            labels=["engine"],
        )
        age = GaugeMetricFamily(
            "switchyard_engine_state_age_seconds", "Seconds since the engine's last report", labels=["engine"]
        )
        for e in snap.engines:
            labels = [str(e.engine_id)]
            running.add_metric(labels, e.num_running)
            waiting.add_metric(labels, e.num_waiting)
            kv_free.add_metric(labels, e.kv_free_ratio)
            ready.add_metric(labels, 1.0 if e.ready and not e.ejected else 0.0)
            stale.add_metric(labels, 1.0 if e.stale else 0.0)
            ejected.add_metric(labels, 1.0 if e.ejected else 0.0)
            age.add_metric(labels, snap.state_age_s(e))
        yield from (running, waiting, kv_free, ready, stale, ejected, age)


class GatewayMetrics:
    """All gateway metrics on one registry. Create one per app; `render()` serves `/metrics`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "switchyard_requests_total",
            "HTTP inference requests by model and status code",
            ["model", "status"],
            registry=r,
        )
        self.in_flight = Gauge("switchyard_requests_in_flight", "Inference requests being served", registry=r)
        self.client_disconnects = Counter(
            "switchyard_client_disconnects_total",
            "Requests whose client went away before the end",
            registry=r,
        )
        self.ttft = LoopHistogram(
            "switchyard_time_to_first_token_seconds",
            "Arrival to first content token, per choice",
            buckets=_TTFT_BUCKETS_S,
            registry=r,
        )
        self.itl = LoopHistogram(
            "switchyard_inter_token_latency_seconds",
            "Gap between successive token deltas, per choice",
            buckets=_ITL_BUCKETS_S,
            registry=r,
        )
        self.e2e = LoopHistogram(
            "switchyard_e2e_request_latency_seconds",
            "Arrival to finish, per choice",
            buckets=_E2E_BUCKETS_S,
            registry=r,
        )
        self.routing_decision = LoopHistogram(
            "switchyard_routing_decision_seconds",
            "Time inside policy.pick",
            buckets=_DECISION_BUCKETS_S,
            registry=r,
            labelnames=["policy"],
        )
        self.loop_lag = LoopHistogram(
            "switchyard_event_loop_lag_seconds",
            "How late the event loop woke a periodic timer (gateway.observability.loop_lag)",
            buckets=_LOOP_LAG_BUCKETS_S,
            registry=r,
        )
        self.retries = Counter(
            "switchyard_dispatch_retries_total",
            "Dispatches whose engine was unavailable before the first event (then retried elsewhere)",
            registry=r,
        )
        self.retry_budget_exhausted = Counter(
            "switchyard_retry_budget_exhausted_total",
            "Choices that failed before the first event and were not retried: the retry budget was spent",
            registry=r,
        )
        self.outlier_ejections = Counter(
            "switchyard_outlier_ejections_total",
            "Engines taken out of the pool by outlier detection, by engine and the failure that did it",
            ["engine", "reason"],
            registry=r,
        )
        self.stream_errors = Counter(
            "switchyard_stream_errors_total",
            "Choices that ended with an error after their stream began, by reason",
            ["reason"],
            registry=r,
        )
        self.migrations = Counter(
            "switchyard_migrations_total",
            "Migrations by outcome: cut (an engine cut a request for this gateway), refused (the engine "
            "would not cut it), resumed (on the named target), fallback (on another engine), handoff (a "
            "prefill engine's request resumed on a decode engine), failed (no engine resumed it: the "
            "stream ended with an error)",
            ["outcome"],
            registry=r,
        )
        self.splice_stall = LoopHistogram(
            "switchyard_migration_splice_stall_seconds",
            "Gap the client saw at a migration: the source's last token to the resuming engine's first",
            buckets=_TTFT_BUCKETS_S,
            registry=r,
        )
        self.stage_moves = Counter(
            "switchyard_stage_migrations_total",
            "CascadeInfer's migrations started by the length_stages rescheduler, by reason: handover (a "
            "request grew past its engine's bound) or rebalance (intra-stage bid-ask)",
            ["reason"],
            registry=r,
        )
        self.engine_stage = Gauge(
            "switchyard_engine_stage",
            "CascadeInfer: the length stage (0 = shortest) an engine serves in its model's layout",
            ["engine", "model"],
            registry=r,
        )
        self.engine_stage_bound = Gauge(
            "switchyard_engine_stage_bound_tokens",
            "CascadeInfer: an engine's refined upper bound (sequence tokens; the last stage's is its range)",
            ["engine", "model"],
            registry=r,
        )
        self.admission = Counter(
            "switchyard_admission_total",
            "Requests at the admission gate by model and outcome (admitted at once, queued, rejected)",
            ["model", "outcome"],
            registry=r,
        )
        self.admission_rejection_time = LoopHistogram(
            "switchyard_admission_rejection_seconds",
            "Inside the gateway: a refused request's arrival at the handler to the refusal (the HTTP parse "
            "and the answer's write are not in it)",
            buckets=_LOOP_LAG_BUCKETS_S,
            registry=r,
        )
        self.admission_rejections = Counter(
            "switchyard_admission_rejections_total",
            "Requests the admission gate refused (503 fleet_saturated), by model and reason",
            ["model", "reason"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "switchyard_gateway_queue_depth",
            "Requests waiting in the gateway's admission queue",
            ["model"],
            registry=r,
        )
        self.queue_wait = LoopHistogram(
            "switchyard_gateway_queue_wait_seconds",
            "Time queued requests waited at the admission gate before dispatch",
            buckets=_TTFT_BUCKETS_S,
            registry=r,
        )
        self.routing_decisions = Counter(
            "switchyard_routing_decisions_total",
            "Routing decisions by policy and outcome (dispatch, retry, no_engine, retry_budget, shed)",
            ["policy", "reason"],
            registry=r,
        )
        self.policy_picks = Counter(
            "switchyard_policy_picks_total",
            "Picks of a policy that says why (PRISM: scored, or no_feasible_soonest when no engine meets the "
            "request's SLO and the one finishing it soonest is taken, or no_feasible_shed when it was shed)",
            ["policy", "why"],
            registry=r,
        )
        # CAUCHY's autoscaler (gateway.fleet.autoscale), only with autoscale on.
        self.autoscale_actions = Counter(
            "switchyard_autoscale_actions_total",
            "Autoscaler decisions by kind (ScaleOut, ScaleIn, Blocked: the GPUs left cannot cover a deficit)",
            ["kind"],
            registry=r,
        )
        self.autoscale_qps = Gauge(
            "switchyard_autoscale_qps", "The autoscaler's last QPS sample (requests received per second)",
            registry=r,
        )
        self.autoscale_usd_per_hour = Gauge(
            "switchyard_autoscale_usd_per_hour",
            "What the autoscaler's fleet costs per hour (its combos at their prices, draining ones included)",
            registry=r,
        )
        # Cascades (gateway.cascade): which stage answered, why requests escalated, what the judge cost.
        self.cascade_answers = Counter(
            "switchyard_cascade_answers_total",
            "Cascade responses by cascade, answering stage (0-based), its model and whether it was degraded "
            "(the next stage could not run, the held answer went out)",
            ["cascade", "stage", "model", "degraded"],
            registry=r,
        )
        self.cascade_escalations = Counter(
            "switchyard_cascade_escalations_total",
            "Escalations by cascade, the stage escalated from and the reason "
            "(below_threshold, judge_<outcome>)",
            ["cascade", "stage", "reason"],
            registry=r,
        )
        self.cascade_judge_seconds = LoopHistogram(
            "switchyard_cascade_judge_seconds",
            "Judge latency per verdict, by cascade and outcome (ok, timeout, http_5xx, malformed, ...)",
            (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0),
            registry=r,
            labelnames=("cascade", "outcome"),
        )
        self.cascade_judge_tokens = Counter(
            "switchyard_cascade_judge_tokens_total",
            "Tokens the judge used (kind: prompt or completion), by cascade; never billed to the client",
            ["cascade", "kind"],
            registry=r,
        )
        # Re-planning cascades on workload shift (gateway.cascade.replanner), only with `replan:` configured;
        # the thresholds gauge for every cascade.
        self.cascade_shadow_tokens = Counter(
            "switchyard_cascade_shadow_tokens_total",
            "Tokens of shadowed requests' unbilled work (kind: prompt or completion of the stages the "
            "cascade did not run for them, judge: the judge's prompt and completion tokens), by cascade",
            ["cascade", "kind"],
            registry=r,
        )
        self.cascade_shadow_requests = Counter(
            "switchyard_cascade_shadow_requests_total",
            "Shadowed requests by cascade and outcome (recorded; partial: a model left out; stage_failed, "
            "judge_failed: no model scored; skipped: over the concurrency bound; cancelled: at shutdown)",
            ["cascade", "outcome"],
            registry=r,
        )
        self.cascade_replans = Counter(
            "switchyard_cascade_replans_total",
            "Re-plans adopted (Algorithm 1 re-run on a workload shift, thresholds swapped), by cascade",
            ["cascade"],
            registry=r,
        )
        self.cascade_threshold = Gauge(
            "switchyard_cascade_threshold",
            "A cascade's current acceptance threshold (0-100) at each stage but the last (0-based)",
            ["cascade", "stage"],
            registry=r,
        )
        self.cascade_replan_solver_seconds = LoopHistogram(
            "switchyard_cascade_replan_solver_seconds",
            "Seconds one re-plan's Algorithm 1 took (in a worker thread, off the event loop)",
            (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0),
            registry=r,
        )
        self.workers = Gauge(
            "switchyard_gateway_workers", "Worker processes serving this gateway's port", registry=r
        )
        self.workers.set(1)
        self.scrape_worker_errors = Counter(
            "switchyard_metrics_scrape_worker_errors_total",
            "Scrapes that left out a sibling worker's metrics (it did not answer in time), by that worker",
            ["worker"],
            registry=r,
        )
        self._engine_collector: EngineStateCollector | None = None
        self._request_counts: dict[tuple[str, int], Callable[[], None]] = {}
        # API keys (gateway.api.access), labelled by key name, never the key; only with a key file. Keyless or
        # bad-key requests count as key="unauthenticated".
        self.key_requests = Counter(
            "switchyard_key_requests_total",
            "Requests by API key name, model and status code",
            ["key", "model", "status"],
            registry=r,
        )
        self.key_tokens = Counter(
            "switchyard_key_tokens_total",
            "Tokens charged to an API key (kind: prompt or completion), counted when the request ends",
            ["key", "kind"],
            registry=r,
        )
        self.rate_limited = Counter(
            "switchyard_rate_limited_total",
            "Requests refused with 429, by API key name and limit (requests, tokens, concurrency, too_large)",
            ["key", "reason"],
            registry=r,
        )
        # Hostile clients (gateway.api.client_guard): a response write the client left unread for
        # client_limits.slow_client_timeout_s; the connection was cut and the engine request aborted.
        self.slow_client_aborts = Counter(
            "switchyard_slow_client_aborts_total",
            "Requests aborted because the client stopped reading the response",
            registry=r,
        )

    def attach_engine_state(self, snapshot: Callable[[], ClusterSnapshot]) -> None:
        """Expose per-engine gauges read from `snapshot()` at each scrape (one source at a time)."""
        self.detach_engine_state()
        self._engine_collector = EngineStateCollector(snapshot)
        self.registry.register(self._engine_collector)

    def detach_engine_state(self) -> None:
        if self._engine_collector is not None:
            self.registry.unregister(self._engine_collector)
            self._engine_collector = None

    def observe_request(self, model: str, status: int) -> None:
        inc = self._request_counts.get((model, status))
        if inc is None:  # prometheus_client's label lookup costs more than the increment: done once per pair
            inc = self._request_counts[(model, status)] = self.requests.labels(model, str(status)).inc
        inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
