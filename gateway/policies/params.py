"""What every policy's parameter model shares: the frozen, extra-forbidding base and the strict number types.

Owns: `PolicyParams` (the base of `RoundRobinParams`, `LeastLoadedParams`, ..., each declared next to its
policy) and the annotated number types `NonNegative`, `NonNegativeFinite` and `PositiveFinite`.
A number field is strict: an int is taken as a float, but a string ("10") or a bool is rejected rather than
coerced; bounds and finiteness are field constraints, so a bad value is rejected, never rewritten.
Must not: import asyncio, aiohttp, grpc, prometheus or time; know any policy (the registry maps names to
models).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictFloat

NonNegative = Annotated[StrictFloat, Field(ge=0)]  # NaN fails the bound; +inf passes (e.g. "never expires")
NonNegativeFinite = Annotated[StrictFloat, Field(ge=0, allow_inf_nan=False)]
PositiveFinite = Annotated[StrictFloat, Field(gt=0, allow_inf_nan=False)]


class PolicyParams(BaseModel):
    """Base of a policy's parameters: immutable, unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)
