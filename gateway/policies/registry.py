"""Builds a routing policy from its configured name and parameters.

Owns: `make_policy`, `POLICY_NAMES`, and the parameter checking of each built-in policy (unknown or mistyped
parameters are rejected, never ignored).
Must not: import asyncio, aiohttp, grpc, prometheus or time; hold mutable module state (the name table
below is an immutable mapping).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from gateway.policies.base import Policy
from gateway.policies.least_loaded import LeastLoadedPolicy
from gateway.policies.round_robin import RoundRobinPolicy
from gateway.policies.session_affinity import (
    DEFAULT_MIN_KV_FREE_RATIO,
    DEFAULT_TTL_S,
    SessionAffinityPolicy,
)

Params = Mapping[str, object]


def _no_params(name: str, params: Params) -> None:
    if params:
        raise ValueError(f"policy {name!r} takes no parameters, got {sorted(params)}")


def _float_param(name: str, params: Params, key: str, default: float) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"policy {name!r} parameter {key!r} must be a number, got {value!r}")
    return float(value)


def _make_round_robin(params: Params) -> Policy:
    _no_params(RoundRobinPolicy.NAME, params)
    return RoundRobinPolicy()


def _make_least_loaded(params: Params) -> Policy:
    _no_params(LeastLoadedPolicy.NAME, params)
    return LeastLoadedPolicy()


def _make_session_affinity(params: Params) -> Policy:
    name = SessionAffinityPolicy.NAME
    known = {"ttl_s", "min_kv_free_ratio", "fallback", "fallback_params"}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"policy {name!r}: unknown parameters {unknown}; known: {sorted(known)}")
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
    }
)

POLICY_NAMES: tuple[str, ...] = tuple(sorted(_FACTORIES))


def make_policy(name: str, params: Mapping[str, object] | None = None) -> Policy:
    """The policy configured as `name` (its `NAME`), built from `params`; ValueError on anything unknown."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(POLICY_NAMES)}")
    return factory(params or {})
