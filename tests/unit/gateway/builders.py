"""Builders for hand-made snapshots and request features in policy and dispatch tests."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from gateway.domain import ClusterSnapshot, EngineId, EngineView, LensState, RequestFeatures

MODEL = "m"
NOW_S = 100.0  # when `snapshot` takes its snapshots unless told otherwise


LENS_FIELDS = frozenset(f.name for f in fields(LensState))


def lens_state(**values: Any) -> LensState:
    """A LENS state vector: zeros and no SLO risk, but for `values` (P_max defaults to 10,000 tokens/s)."""
    base: dict[str, Any] = {name: 0 for name in LENS_FIELDS}
    base.update(slo_risk=False, peak_throughput_tokens_per_s=10_000.0)
    base.update(values)
    return LensState(**base)


def engine(engine_id: str, model: str = MODEL, **values: Any) -> EngineView:
    """A ready, fresh engine of `model`; any `EngineView` field can be overridden, LENS's fields
    (`peak_throughput_tokens_per_s=...`) given flat build its `lens` state, and `state_age_s=a` sets the
    report's arrival a seconds before NOW_S (the default snapshot time; default 0)."""
    values.setdefault("reported_at_s", NOW_S - values.pop("state_age_s", 0.0))
    lens = {k: values.pop(k) for k in list(values) if k in LENS_FIELDS}
    if lens:
        values["lens"] = lens_state(**lens)
    base = EngineView(engine_id=EngineId(engine_id), model=model)
    return replace(base, **values)


def snapshot(*engines: EngineView, taken_at_s: float = NOW_S) -> ClusterSnapshot:
    """A snapshot in the stable order the store produces (by engine id)."""
    return ClusterSnapshot(taken_at_s=taken_at_s, engines=tuple(sorted(engines, key=lambda e: e.engine_id)))


def features(
    request_id: str = "r1",
    model: str = MODEL,
    *,
    prompt_tokens: int = 100,
    max_tokens: int = 50,
    now_s: float = 100.0,
    dispatch_seq: int = 0,
    session_engine: str | None = None,
    exclude: tuple[str, ...] = (),
    **fields: Any,
) -> RequestFeatures:
    return RequestFeatures(
        request_id=request_id,
        model=model,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        now_s=now_s,
        dispatch_seq=dispatch_seq,
        session_engine=EngineId(session_engine) if session_engine is not None else None,
        exclude=frozenset(EngineId(e) for e in exclude),
        **fields,
    )
