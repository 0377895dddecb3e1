"""Builds a routing policy from its configured name and parameters.

Owns: `make_policy`, `POLICY_NAMES`, and the parameter checking of each built-in policy (unknown or mistyped
parameters are rejected, never ignored).
Must not: import asyncio, aiohttp, grpc, prometheus or time; hold mutable module state (the name table
below is an immutable mapping).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields
from types import MappingProxyType

from gateway.policies.base import Policy
from gateway.policies.latency_based import LATENCY_METRICS, LatencyBasedPolicy
from gateway.policies.least_loaded import LOAD_MEASURES, LeastLoadedPolicy
from gateway.policies.prism import PrismParams, PrismPolicy, PrismWeights
from gateway.policies.round_robin import RoundRobinPolicy
from gateway.policies.session_affinity import (
    DEFAULT_MIN_KV_FREE_RATIO,
    DEFAULT_TTL_S,
    SessionAffinityPolicy,
)
from gateway.policies.static_weighted import StaticWeightedPolicy

Params = Mapping[str, object]


def _no_params(name: str, params: Params) -> None:
    if params:
        raise ValueError(f"policy {name!r} takes no parameters, got {sorted(params)}")


def _known_params(name: str, params: Params, known: set[str]) -> None:
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"policy {name!r}: unknown parameters {unknown}; known: {sorted(known)}")


def _number(name: str, key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"policy {name!r} parameter {key!r} must be a number, got {value!r}")
    return float(value)


def _float_param(name: str, params: Params, key: str, default: float) -> float:
    return _number(name, key, params.get(key, default))


def _choice_param(name: str, params: Params, key: str, choices: tuple[str, ...]) -> str:
    value = params.get(key, choices[0])
    if value not in choices:
        raise ValueError(f"policy {name!r} parameter {key!r} must be one of {list(choices)}, got {value!r}")
    return str(value)


def _mapping_param(name: str, params: Params, key: str) -> Mapping[str, object]:
    value = params.get(key, {})
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"policy {name!r} parameter {key!r} must be a mapping with string keys")
    return value


def _make_round_robin(params: Params) -> Policy:
    _no_params(RoundRobinPolicy.NAME, params)
    return RoundRobinPolicy()


def _make_least_loaded(params: Params) -> Policy:
    name = LeastLoadedPolicy.NAME
    _known_params(name, params, {"measure"})
    measure = _choice_param(name, params, "measure", LOAD_MEASURES)
    return LeastLoadedPolicy(measure="requests" if measure == "requests" else "tokens")


def _make_latency_based(params: Params) -> Policy:
    name = LatencyBasedPolicy.NAME
    _known_params(name, params, {"metric"})
    metric = _choice_param(name, params, "metric", LATENCY_METRICS)
    return LatencyBasedPolicy(metric="ttft" if metric == "ttft" else "e2e")


def _make_static_weighted(params: Params) -> Policy:
    name = StaticWeightedPolicy.NAME
    _known_params(name, params, {"weights", "default_weight"})
    raw = _mapping_param(name, params, "weights")
    weights = {k: _number(name, f"weights.{k}", v) for k, v in raw.items()}
    try:
        return StaticWeightedPolicy(weights, _float_param(name, params, "default_weight", 1.0))
    except ValueError as e:
        raise ValueError(f"policy {name!r}: {e}") from None


def _make_prism(params: Params) -> Policy:
    name = PrismPolicy.NAME
    scalars = {f.name for f in fields(PrismParams)} - {"weights"}
    _known_params(name, params, scalars | {"weights"})
    raw_weights = _mapping_param(name, params, "weights")
    weight_names = {f.name for f in fields(PrismWeights)}
    unknown = sorted(set(raw_weights) - weight_names)
    if unknown:
        raise ValueError(f"policy {name!r}: unknown weights {unknown}; known: {sorted(weight_names)}")
    try:
        weights = PrismWeights(**{k: _number(name, f"weights.{k}", v) for k, v in raw_weights.items()})
        values = {k: _number(name, k, v) for k, v in params.items() if k in scalars}
        return PrismPolicy(PrismParams(weights=weights, **values))
    except ValueError as e:
        raise ValueError(f"policy {name!r}: {e}") from None


def _make_session_affinity(params: Params) -> Policy:
    name = SessionAffinityPolicy.NAME
    _known_params(name, params, {"ttl_s", "min_kv_free_ratio", "fallback", "fallback_params"})
    fallback_name = params.get("fallback", LeastLoadedPolicy.NAME)
    if not isinstance(fallback_name, str):
        raise ValueError(f"policy {name!r} parameter 'fallback' must be a policy name, got {fallback_name!r}")
    if fallback_name == name:
        raise ValueError(f"policy {name!r} cannot fall back to itself")
    fallback_params = params.get("fallback_params")
    if fallback_params is not None and not isinstance(fallback_params, Mapping):
        raise ValueError(f"policy {name!r} parameter 'fallback_params' must be a mapping")
    return SessionAffinityPolicy(
        ttl_s=_float_param(name, params, "ttl_s", DEFAULT_TTL_S),
        min_kv_free_ratio=_float_param(name, params, "min_kv_free_ratio", DEFAULT_MIN_KV_FREE_RATIO),
        fallback=make_policy(fallback_name, fallback_params),
    )


_FACTORIES: Mapping[str, Callable[[Params], Policy]] = MappingProxyType(
    {
        RoundRobinPolicy.NAME: _make_round_robin,
        LeastLoadedPolicy.NAME: _make_least_loaded,
        SessionAffinityPolicy.NAME: _make_session_affinity,
        PrismPolicy.NAME: _make_prism,
        LatencyBasedPolicy.NAME: _make_latency_based,
        StaticWeightedPolicy.NAME: _make_static_weighted,
    }
)

POLICY_NAMES: tuple[str, ...] = tuple(sorted(_FACTORIES))


def make_policy(name: str, params: Mapping[str, object] | None = None) -> Policy:
    """The policy configured as `name` (its `NAME`), built from `params`; ValueError on anything unknown."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(POLICY_NAMES)}")
    return factory(params or {})
