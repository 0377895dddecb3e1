"""The routing seam: the `Policy` protocol every routing policy implements.

Owns: the protocol and the shared eligibility helper.
Must not (invariant I1, checked by tests/unit/test_import_rules.py): import asyncio, aiohttp, grpc, prometheus
or time; read a clock; do I/O; record metrics; mutate anything. A policy is a pure function of
(`RequestFeatures`, `ClusterSnapshot`); randomness and time come in through the features.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

from gateway.domain import ClusterSnapshot, EngineId, EngineView, RequestFeatures


class Policy(Protocol):
    NAME: ClassVar[str]

    def pick(self, features: RequestFeatures, snapshot: ClusterSnapshot) -> EngineId | None:
        """The engine to serve the request, or None when no engine can."""
        ...


def eligible(features: RequestFeatures, snapshot: ClusterSnapshot) -> tuple[EngineView, ...]:
    """Engines serving the request's model, ready, not ejected and not already tried for it (stale ones
    included: their views carry local accounting)."""
    return tuple(e for e in snapshot.serving(features.model) if e.engine_id not in features.exclude)
