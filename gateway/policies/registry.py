"""Builds a routing policy from its configured name and parameters.

Owns: `make_policy`, `POLICY_NAMES`, `PolicyParamsError`, and the immutable table name -> (parameter model,
builder). Each policy declares its parameters as a pydantic model next to it (`LeastLoadedParams`, ...); this
module validates the configured mapping through that model, so unknown keys, wrong types and out-of-range
values are rejected with the policy's name and the bad field's path, e.g.
`policy 'prism': weights.latency: Input should be a valid number`. Session affinity's fallback is built here
too, through `make_policy`, with its errors reported under `fallback` / `fallback_params.<path>`.
Must not: import asyncio, aiohttp, grpc, prometheus or time; hold mutable module state; check parameters by
hand (the models do).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TypeVar

from pydantic import ValidationError

from gateway.policies.base import Policy
from gateway.policies.goodput_rr import GoodputRRParams, GoodputRRPolicy
from gateway.policies.kv_aware import ApproxPrefixParams, ApproxPrefixPolicy, KvAwareParams, KvAwarePolicy
from gateway.policies.latency_based import LatencyBasedParams, LatencyBasedPolicy
from gateway.policies.least_loaded import LeastLoadedParams, LeastLoadedPolicy
from gateway.policies.length_stages import LengthStagesPolicy, LengthStagesPolicyParams
from gateway.policies.params import PolicyParams
from gateway.policies.prism import PrismParams, PrismPolicy
from gateway.policies.round_robin import RoundRobinParams, RoundRobinPolicy
from gateway.policies.session_affinity import SessionAffinityParams, SessionAffinityPolicy
from gateway.policies.static_weighted import StaticWeightedParams, StaticWeightedPolicy

P = TypeVar("P", bound=PolicyParams)
_Factory = Callable[[Mapping[str, object]], Policy]


class PolicyParamsError(ValueError):
    """Parameters a policy's model rejects: `problems` holds (field path, reason), path "" for the whole."""

    def __init__(self, policy: str, problems: Sequence[tuple[str, str]]) -> None:
        self.policy = policy
        self.problems = tuple(problems)
        described = "; ".join(f"{path}: {reason}" if path else reason for path, reason in self.problems)
        super().__init__(f"policy {policy!r}: {described}")


def _problems(error: ValidationError) -> list[tuple[str, str]]:
    return [
        (".".join(str(part) for part in e["loc"]), e["msg"].removeprefix("Value error, "))
        for e in error.errors(include_url=False)
    ]


def _validated(name: str, model: type[P], params: Mapping[str, object]) -> P:
    try:
        return model.model_validate(params)
    except ValidationError as e:
        raise PolicyParamsError(name, _problems(e)) from None


def _factory(name: str, model: type[P], build: Callable[[P], Policy]) -> _Factory:
    def make(params: Mapping[str, object]) -> Policy:
        return build(_validated(name, model, params))

    return make


def _session_affinity(params: SessionAffinityParams) -> Policy:
    name = SessionAffinityPolicy.NAME
    if params.fallback not in _FACTORIES:
        known = ", ".join(n for n in POLICY_NAMES if n != name)
        raise PolicyParamsError(name, [("fallback", f"unknown policy {params.fallback!r}; known: {known}")])
    try:
        fallback = make_policy(params.fallback, params.fallback_params)
    except PolicyParamsError as e:
        nested = [(f"fallback_params.{path}" if path else "fallback_params", why) for path, why in e.problems]
        raise PolicyParamsError(name, nested) from None
    return SessionAffinityPolicy(params, fallback=fallback)


_FACTORIES: Mapping[str, _Factory] = MappingProxyType(
    {
        RoundRobinPolicy.NAME: _factory(RoundRobinPolicy.NAME, RoundRobinParams, RoundRobinPolicy),
        LeastLoadedPolicy.NAME: _factory(LeastLoadedPolicy.NAME, LeastLoadedParams, LeastLoadedPolicy),
        SessionAffinityPolicy.NAME: _factory(
            SessionAffinityPolicy.NAME, SessionAffinityParams, _session_affinity
        ),
        PrismPolicy.NAME: _factory(PrismPolicy.NAME, PrismParams, PrismPolicy),
        LatencyBasedPolicy.NAME: _factory(LatencyBasedPolicy.NAME, LatencyBasedParams, LatencyBasedPolicy),
        StaticWeightedPolicy.NAME: _factory(
            StaticWeightedPolicy.NAME, StaticWeightedParams, StaticWeightedPolicy
        ),
        GoodputRRPolicy.NAME: _factory(GoodputRRPolicy.NAME, GoodputRRParams, GoodputRRPolicy),
        KvAwarePolicy.NAME: _factory(KvAwarePolicy.NAME, KvAwareParams, KvAwarePolicy),
        ApproxPrefixPolicy.NAME: _factory(ApproxPrefixPolicy.NAME, ApproxPrefixParams, ApproxPrefixPolicy),
        LengthStagesPolicy.NAME: _factory(
            LengthStagesPolicy.NAME, LengthStagesPolicyParams, LengthStagesPolicy
        ),
    }
)

POLICY_NAMES: tuple[str, ...] = tuple(sorted(_FACTORIES))


def make_policy(name: str, params: Mapping[str, object] | None = None) -> Policy:
    """The policy configured as `name` (its `NAME`), built from `params`; ValueError on an unknown name, and
    `PolicyParamsError` (a ValueError) on parameters its model rejects."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(POLICY_NAMES)}")
    return factory(params if params is not None else {})
