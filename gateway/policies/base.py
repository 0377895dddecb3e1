"""The routing seam: the `Policy` protocol every routing policy implements.

Owns: the protocols (`Policy`, `WeightedPolicy` for policies that count their picks, `ExplainedPolicy` for
policies that say why they picked, and may shed: `SHED`), the shared eligibility helper and `prefix_source`
(what a KV-cache-aware policy asks the executor to look up).
Must not (invariant I1, checked by tests/unit/test_import_rules.py): import asyncio, aiohttp, grpc, prometheus
or time; read a clock; do I/O; record metrics; mutate anything. A policy is a pure function of
(`RequestFeatures`, `ClusterSnapshot`); randomness and time come in through the features.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

from gateway.domain import ClusterSnapshot, EngineId, EngineView, RequestFeatures, RouteTag

# `ExplainedPolicy.decide`'s reason with no engine that means "shed this request": no engine can serve it
# within its SLO (the request's life answers `Shed`, live a 503 `fleet_saturated` like the admission gate's
# `slo_unattainable`), as opposed to no engine at all (`GiveUp`).
SHED = "no_feasible_shed"


class Policy(Protocol):
    NAME: ClassVar[str]

    def pick(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> EngineId | None:
        """The engine to serve the request, or None when no engine can."""
        ...


class WeightedPolicy(Protocol):
    """A policy whose picks follow weights over groups of engines and depend on the picks counted so far
    (`ClusterSnapshot.routes`): `choose` also returns the tag the ledger counts the pick under (None when
    the pick was not a weighted one). The request's life calls `choose` instead of `pick` when a policy has it
    and hands the tag to the ledger with the dispatch (`gateway.dispatch.life.record_dispatch`)."""

    NAME: ClassVar[str]

    def pick(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> EngineId | None: ...

    def choose(
        self, features: RequestFeatures, snapshot: ClusterSnapshot
    ) -> tuple[EngineId | None, RouteTag | None]: ...


class ExplainedPolicy(Protocol):
    """A policy that says why it picked: `decide` returns the pick and a short reason (a metric label, e.g.
    PRISM's "scored" or "no_feasible_soonest"). The request's life calls `decide` instead of `pick` when a
    policy has it; the reason travels in the dispatch (`Dispatch.why`) to metrics and debug logs. No engine
    with the reason `SHED` sheds the request (only for a new request: `decide` never sheds one with
    `resumed_tokens`, and `pick` never sheds)."""

    NAME: ClassVar[str]

    def pick(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> EngineId | None: ...

    def decide(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> tuple[EngineId | None, str]: ...


def prefix_source(policy: object) -> str | None:
    """Where the policy's `RequestFeatures.prefix_hits` must come from (`PREFIX_EVENTS` / `PREFIX_SENT`), or
    None when it does not read them: the executor then computes no prefix keys at all (they cost ~140 us for a
    12,000-token prompt). A policy declares it as a `prefix_source` attribute."""
    source = getattr(policy, "prefix_source", None)
    return source if isinstance(source, str) else None


def eligible(features: RequestFeatures, snapshot: ClusterSnapshot) -> tuple[EngineView, ...]:
    """Engines serving the request's model, ready, not ejected and not already tried for it (stale ones
    included: their views carry local accounting)."""
    serving = snapshot.serving(features.model)
    if not features.exclude:
        return serving
    return tuple(e for e in serving if e.engine_id not in features.exclude)
