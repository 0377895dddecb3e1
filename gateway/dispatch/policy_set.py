"""The policies one gateway can route with: the configured one, plus per-request overrides when allowed.

Owns: `PolicySet` (name -> built `Policy`, built once and reused) and `UnknownPolicy`.
Must not: call `pick` (the dispatcher does, with timing), read headers, or know the registry's internals; it
gets a factory (`make_policy`) and the list of known names.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from gateway.policies.base import Policy

PolicyFactory = Callable[[str, Mapping[str, Any]], Policy]


class UnknownPolicy(ValueError):
    """A per-request override named a policy this gateway does not have."""


class PolicySet:
    def __init__(
        self,
        factory: PolicyFactory,
        known_names: Collection[str],
        default_name: str,
        default_params: Mapping[str, Any],
    ) -> None:
        self._factory = factory
        self._known = frozenset(known_names)
        self.default_name = default_name
        self._built: dict[str, Policy] = {default_name: factory(default_name, default_params)}

    @property
    def known_names(self) -> frozenset[str]:
        return self._known

    def resolve(self, name: str | None) -> tuple[str, Policy]:
        """The policy to use: the default for None, else the named one built with its default parameters."""
        if name is None or name == self.default_name:
            return self.default_name, self._built[self.default_name]
        policy = self._built.get(name)
        if policy is None:
            if name not in self._known:
                raise UnknownPolicy(f"unknown policy {name!r}; known: {', '.join(sorted(self._known))}")
            try:
                policy = self._factory(name, {})
            except (TypeError, ValueError) as e:
                raise UnknownPolicy(f"policy {name!r} cannot be used without parameters: {e}") from e
            self._built[name] = policy
        return name, policy
