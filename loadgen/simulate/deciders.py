"""The gateway's deciding processes in the simulator: one `Decider` per gateway worker (`--workers N`).

Owns: `Decider` (one worker's own `ClusterState`: engines, optimistic in-flight ledger, session table and
latency window; its policy instance, its dispatch counter and its random stream), `build_deciders`, and
`DeciderAssigner` (which worker an arriving request reaches, per `SimOptions.decider_assignment`).
Must not: route, order events, read clocks or touch engines (the runner does, through each decider's state).

The model of `--workers N` (N processes accepting on one port with SO_REUSEPORT):
- The kernel hands each new connection to a worker by a hash of its 4-tuple. "random": clients open a
  connection per request, so each request reaches a uniformly random worker (one seeded draw per arrival,
  from a stream of its own, so the deciders' draws do not shift). "session": a client keeps one keep-alive
  connection per session, so every request of a session reaches the same worker (a seeded hash of the
  session id); a request without a session id is drawn as under "random".
- Every worker opens its own watch streams: all receive the same engine reports (the runner hands every
  received report to every decider's state, with the same receive time).
- A worker's ledger counts only its own dispatches and releases, its session table only the sessions it
  served, its latency window only its own requests' samples; its dispatch counter (round robin's rotation)
  and its random draws are its own.
- Decider 0 is exactly the single-process gateway: `random.Random(seed)` and a counter from 0, so
  `deciders=1` replays the unsplit run bit for bit. Decider i > 0 draws from its own stream, seeded from
  (seed, i).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Mapping
from typing import Literal

from gateway.cluster.state import ClusterState
from gateway.dispatch.life import Moment
from gateway.policies.base import Policy

DeciderAssignment = Literal["random", "session"]
DECIDER_ASSIGNMENTS: tuple[DeciderAssignment, ...] = ("random", "session")

PolicyFactory = Callable[[str, Mapping[str, object] | None], Policy]


class Decider:
    """One gateway worker: what it knows of the fleet and how it draws its decisions."""

    __slots__ = ("index", "state", "policy", "rng", "dispatch_seq")

    def __init__(self, index: int, state: ClusterState, policy: Policy, rng: random.Random) -> None:
        self.index = index
        self.state = state
        self.policy = policy
        self.rng = rng
        self.dispatch_seq = 0  # this worker's decisions so far (the live dispatcher's counter)

    def moment(self, now_s: float) -> Moment:
        """Sample this worker's next decision: its counter (then advanced), one draw and its snapshot."""
        seq = self.dispatch_seq
        self.dispatch_seq = seq + 1
        return Moment(now_s, seq, self.rng.random(), self.state.snapshot(now_s))


def decider_rng(seed: int, index: int) -> random.Random:
    """Decider `index`'s random stream: the unsplit run's `Random(seed)` for 0, an independent one else."""
    return random.Random(seed) if index == 0 else random.Random(f"switchyard.loadgen.decider:{seed}:{index}")


def build_deciders(
    count: int,
    make_policy: PolicyFactory,
    policy: str,
    policy_params: Mapping[str, object],
    *,
    seed: int,
    stale_after_s: float,
) -> list[Decider]:
    """`count` workers, each with its own cluster state, its own policy instance and its own random stream."""
    if count < 1:
        raise ValueError(f"a gateway needs at least one decider, got {count}")
    return [
        Decider(
            i,
            ClusterState(stale_after_s=stale_after_s),
            make_policy(policy, policy_params),
            decider_rng(seed, i),
        )
        for i in range(count)
    ]


class DeciderAssigner:
    """Which worker each arriving request reaches (see the module docstring); deterministic for a seed."""

    __slots__ = ("_count", "_by_session", "_rng", "_salt")

    def __init__(self, count: int, mode: DeciderAssignment, seed: int) -> None:
        if count < 1:
            raise ValueError(f"a gateway needs at least one decider, got {count}")
        if mode not in DECIDER_ASSIGNMENTS:
            known = ", ".join(DECIDER_ASSIGNMENTS)
            raise ValueError(f"decider assignment must be one of {known}, got {mode!r}")
        self._count = count
        self._by_session = mode == "session"
        self._rng = random.Random(f"switchyard.loadgen.assign:{seed}")
        self._salt = f"{seed}:".encode()

    def __call__(self, session_id: str) -> int:
        """The decider of the next arrival (`session_id` "" when it has none). One decider: always 0, and
        nothing is drawn."""
        count = self._count
        if count == 1:
            return 0
        if self._by_session and session_id:
            return zlib.crc32(self._salt + session_id.encode()) % count
        return self._rng.randrange(count)
