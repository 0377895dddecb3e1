"""Moving running requests between engines (STAR §5.4): the live executor of one migration's cut.

Owns: `Mover`: `migrate(request_id, target)` finds the engine running the request (the cluster's dispatch
ledger), checks the limits, and asks that engine to cut it (`MigrateOut`). The cut request's stream then ends
with `Migrated`, and the dispatcher's splice (`ChoiceLife.follow`) resumes it on the target or a fallback, so
the mover never touches client streams. Limits (Llumnix-style locks, bounded per request):
- one migration at a time per request and per engine (as source or target), held while `MigrateOut` runs and
  for `engine_cooldown_s` after it, so a target is not picked again before its report shows the new load;
- at most `max_migrations_per_request` cuts of one request;
- a request is not cut again within `request_cooldown_s` of its last cut.
`MoveError` says why a migration was not started (`status`: 404 unknown request or engine, 409 refused by a
limit or by the engine, 503 engine unreachable), for `/admin/migrate` and the rescheduler's log.
The decisions the mover makes without I/O are pure and shared with the simulator (`loadgen.simulate`, which
moves requests in virtual time): `check_target` (is the named target usable for the request's engine) and
`MoveLimits` (the limits' bookkeeping, at times given by the caller).
`RescheduleLoop` is the task that asks a rescheduler (`gateway.rescheduling`, pure; the `Rescheduler`
protocol) every `interval_s` for its migrations per model (requests and engines the mover cannot use now
excluded), hands each to the mover, gives back those not started (`not_started`), and publishes the
rescheduler's layouts into the cluster store (CascadeInfer's stages, read by the `length_stages` policy).
Must not: decide which request to move where (the rescheduler or the operator does), relay tokens (the
splice does), or read a clock other than the one it is given.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.domain import (
    ClusterSnapshot,
    EngineId,
    EngineUnavailable,
    MigrationRefusedError,
    MigrationTicket,
    StageLayout,
)
from gateway.engines.base import EngineClient, MigratingClient
from gateway.observability.metrics import GatewayMetrics
from gateway.rescheduling.length_stages import MAX_MOVES_PER_REQUEST, LengthStages
from switchyard.clock import Clock

log = logging.getLogger(__name__)

_REQUESTS_REMEMBERED = 65_536  # per-request move counts kept (oldest forgotten first)


@dataclass(frozen=True, slots=True)
class MoveParams:
    max_migrations_per_request: int = 2
    request_cooldown_s: float = 5.0
    engine_cooldown_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_migrations_per_request < 0 or self.request_cooldown_s < 0 or self.engine_cooldown_s < 0:
            raise ValueError("max_migrations_per_request and the cooldowns must be >= 0")


class MoveError(Exception):
    """A migration that was not started; `status` is the HTTP status `/admin/migrate` answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class MoverState(Protocol):
    """The part of the cluster store the mover uses."""

    def snapshot(self) -> ClusterSnapshot: ...

    def engine_of(self, request_id: str) -> EngineId | None: ...

    def client(self, engine_id: EngineId) -> EngineClient: ...


def check_target(
    snapshot: ClusterSnapshot, request_id: str, source: EngineId, target: EngineId | None
) -> None:
    """`MoveError` unless `target` (None: wherever the splice's policy picks) can take `request_id` from
    `source`: another engine, known, of the source's model, ready and not ejected."""
    if target is None:
        return
    view = snapshot.get(source)
    model = view.model if view is not None else ""
    if target == source:
        raise MoveError(409, f"request {request_id!r} already runs on {target!r}")
    tview = snapshot.get(target)
    if tview is None:
        raise MoveError(404, f"unknown engine {target!r}")
    if tview.model != model or not tview.ready or tview.ejected:
        raise MoveError(409, f"engine {target!r} cannot take a request of model {model!r} now")


class MoveLimits:
    """The mover's limits as bookkeeping at times the caller gives (no clock, no I/O): which requests and
    engines a new migration must leave alone, whether one may start, and what starting, ending and completing
    a cut record. `Mover` keeps one and reads its clock; the simulator keeps one per gateway worker in
    virtual time."""

    def __init__(self, params: MoveParams) -> None:
        self.params = params
        self._busy_requests: set[str] = set()
        self._busy_engines: dict[EngineId, float] = {}  # engine -> busy until (inf while a cut runs)
        self._moves: OrderedDict[str, tuple[int, float]] = OrderedDict()  # request -> (cuts, last cut at)

    def busy_engines(self, now_s: float) -> frozenset[EngineId]:
        """Engines that must not take part in a new migration at `now_s`."""
        return frozenset(e for e, until in self._busy_engines.items() if until > now_s)

    def unmovable_requests(self, now_s: float) -> frozenset[str]:
        """Requests a new migration must not pick at `now_s` (being cut, at their limit, or cooling down)."""
        p = self.params
        out = set(self._busy_requests)
        for request_id, (cuts, last_s) in self._moves.items():
            if cuts >= p.max_migrations_per_request or now_s - last_s < p.request_cooldown_s:
                out.add(request_id)
        return frozenset(out)

    def check(self, request_id: str, source: EngineId, target: EngineId | None, now_s: float) -> None:
        """`MoveError` (409) when a limit forbids cutting `request_id` on `source` for `target` at `now_s`."""
        if request_id in self._busy_requests:
            raise MoveError(409, f"request {request_id!r} is already being migrated")
        cuts, last_s = self._moves.get(request_id, (0, float("-inf")))
        p = self.params
        if cuts >= p.max_migrations_per_request:
            raise MoveError(409, f"request {request_id!r} has moved {cuts} times (the limit)")
        if now_s - last_s < p.request_cooldown_s:
            raise MoveError(
                409,
                f"request {request_id!r} moved {now_s - last_s:.1f} s ago (cooldown "
                f"{p.request_cooldown_s:g} s)",
            )
        for e in (source,) if target is None else (source, target):
            if self._busy_engines.get(e, float("-inf")) > now_s:
                raise MoveError(409, f"engine {e!r} is in another migration or cooling down")

    def begin(self, request_id: str, engines: tuple[EngineId, ...]) -> None:
        """A cut of `request_id` involving `engines` starts: all are held until `end`."""
        self._busy_requests.add(request_id)
        for engine_id in engines:
            self._busy_engines[engine_id] = float("inf")

    def end(self, request_id: str, engines: tuple[EngineId, ...], now_s: float) -> None:
        """The cut ended at `now_s` (done or refused): the engines cool down for `engine_cooldown_s`."""
        self._busy_requests.discard(request_id)
        for engine_id in engines:
            self._busy_engines[engine_id] = now_s + self.params.engine_cooldown_s
        for e in [e for e, until in self._busy_engines.items() if until <= now_s]:
            del self._busy_engines[e]

    def note_cut(self, request_id: str, now_s: float) -> None:
        """`request_id` was cut at `now_s`: one more towards its limit, and its cooldown starts."""
        cuts, _ = self._moves.pop(request_id, (0, 0.0))
        self._moves[request_id] = (cuts + 1, now_s)
        while len(self._moves) > _REQUESTS_REMEMBERED:
            self._moves.popitem(last=False)


class Mover:
    def __init__(self, state: MoverState, clock: Clock, metrics: GatewayMetrics, params: MoveParams) -> None:
        self.params = params
        self._state = state
        self._clock = clock
        self._metrics = metrics
        self._limits = MoveLimits(params)

    def busy_engines(self) -> frozenset[EngineId]:
        """Engines that must not take part in a new migration now."""
        return self._limits.busy_engines(self._clock.now())

    def unmovable_requests(self) -> frozenset[str]:
        """Requests a new migration must not pick now (being cut, at their limit, or cooling down)."""
        return self._limits.unmovable_requests(self._clock.now())

    async def migrate(self, request_id: str, target: EngineId | None = None) -> MigrationTicket:
        """Cut `request_id` on its engine for `target` (None: wherever the splice's policy picks)."""
        state = self._state
        source = state.engine_of(request_id)
        if source is None:
            raise MoveError(404, f"request {request_id!r} is not running on any engine of this gateway")
        check_target(state.snapshot(), request_id, source, target)
        limits = self._limits
        limits.check(request_id, source, target, self._clock.now())
        client = state.client(source)
        if not isinstance(client, MigratingClient):
            raise MoveError(409, f"engine {source!r} cannot migrate requests")
        engines = (source,) if target is None else (source, target)
        limits.begin(request_id, engines)
        try:
            ticket = await client.migrate_out(request_id, target or "")
        except MigrationRefusedError as exc:
            self._metrics.migrations.labels("refused").inc()
            raise MoveError(409, str(exc)) from None
        except EngineUnavailable as exc:
            self._metrics.migrations.labels("refused").inc()
            raise MoveError(503, str(exc)) from None
        finally:
            limits.end(request_id, engines, self._clock.now())
        limits.note_cut(request_id, self._clock.now())
        self._metrics.migrations.labels("cut").inc()
        log.info(
            "request %s cut on %s for %s after %d tokens (%d KV tokens, %d bytes)",
            request_id,
            source,
            target or "any engine",
            ticket.output_tokens,
            ticket.kv_tokens,
            ticket.kv_bytes,
        )
        return ticket


class Proposal(Protocol):
    """What a rescheduler proposes (`gateway.rescheduling.star.Migration` and `length_stages.Move` are)."""

    @property
    def request_id(self) -> str: ...

    @property
    def source(self) -> EngineId: ...

    @property
    def target(self) -> EngineId: ...


def move_params_for(rescheduler: object, configured: MoveParams) -> MoveParams:
    """The mover's limits under `rescheduler`, live and simulated: CascadeInfer's (`LengthStages`) paces its
    own transfers, so no cooldowns and its own per-request cap; any other keeps `configured`."""
    if isinstance(rescheduler, LengthStages):
        return MoveParams(MAX_MOVES_PER_REQUEST, 0.0, 0.0)
    return configured


class Rescheduler(Protocol):
    """A rescheduler as the loop drives it (`gateway.rescheduling`: `StarRescheduler`, `LengthStages`)."""

    def propose(self, snapshot: ClusterSnapshot, model: str, exclude: frozenset[str], busy: frozenset[str],
                now_s: float) -> Sequence[Proposal]:
        """The migrations to start for `model` now, leaving `exclude` (requests) and `busy` (engines) be."""
        ...

    def not_started(self, proposal: Any, status: int) -> None:
        """The mover did not start `proposal` (`MoveError.status`)."""
        ...

    def layouts(self) -> Mapping[str, StageLayout]:
        """What it publishes for the policies (CascadeInfer's stage layouts; empty for STAR)."""
        ...


class RescheduleLoop:
    """Every `interval_s`: per model, the rescheduler's migrations, carried out by the mover, then its layouts
    published (see the module docstring). Run `run()` as a background task (the app does, in its cleanup
    context)."""

    def __init__(
        self,
        mover: Mover,
        snapshot: Callable[[], ClusterSnapshot],
        rescheduler: Rescheduler,
        interval_s: float,
        metrics: GatewayMetrics,
        clock: Clock,
        publish: Callable[[Mapping[str, StageLayout]], None] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._mover = mover
        self._snapshot = snapshot
        self._rescheduler = rescheduler
        self._interval_s = interval_s
        self._metrics = metrics
        self._clock = clock
        self._publish = publish

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.once()

    async def once(self) -> int:
        """One interval: the migrations started (a failure to start one is logged and handed back)."""
        snapshot = self._snapshot()
        started = 0
        now_s = self._clock.now()
        for model in sorted({e.model for e in snapshot.engines if e.model}):
            proposals = self._rescheduler.propose(
                snapshot, model, self._mover.unmovable_requests(), self._mover.busy_engines(), now_s
            )
            for proposal in proposals:
                try:
                    await self._mover.migrate(proposal.request_id, proposal.target)
                    started += 1
                    reason = getattr(proposal, "reason", "")
                    if reason:
                        self._metrics.stage_moves.labels(reason).inc()
                except MoveError as e:
                    self._rescheduler.not_started(proposal, e.status)
                    log.info("rescheduler: %s -> %s not started: %s", proposal.request_id, proposal.target, e)
        if self._publish is not None:
            self._publish(self._rescheduler.layouts())
        return started
