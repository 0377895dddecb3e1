"""CAUCHY's combo-level autoscaler (paper 004, §3.5, Algorithm 1), pure: QPS samples in, actions out.

`Autoscaler.observe(now_s, qps)` pushes one QPS sample and returns the actions it decides (usually none):
- every `local_window_s` after the last action (Line 7), the window's mean QPS is compared with the deployed
  capacity, the sum of the combos' goodput (Lines 8-10). Beyond `ratio` of it (Line 11):
  - a deficit Δ is covered by the cheapest allocation of Δ from the GPUs left (Line 13: the ILP, through the
    `Solver` seam). The new combos serve `provisioning_s` later. When the GPUs left cannot cover Δ, a
    `Blocked` action says so (the paper's `avail_resources(R) >= Δ`) and nothing changes;
  - an excess removes combos, largest first, while the rest still carries the window's QPS (Line 16,
    "closest excess capacity") and at least `min_copies` stay. They drain for `grace_s`, then leave.
- after `global_window_s` without an action (Lines 22-27), the whole fleet is re-planned for the global
  window's mean QPS and reconciled: make before break. Combos to add are provisioned first; those to remove
  leave only once the new ones serve, plus the drain grace. Nothing happens when the plan is the current
  fleet.
Capacity counts combos being provisioned (they were decided) and stops counting a combo once its removal is
decided; GPUs count until a removed combo has left. Time is passed in; nothing here reads a clock.
Must not: start or stop engines (the simulator and the live gateway apply the actions), do I/O.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gateway.planning.combos import Candidate
from gateway.planning.ilp import AllocationProblem, Objective, Solver


@dataclass(frozen=True, slots=True)
class AutoscalerParams:
    ratio: float = 0.2
    local_window_s: float = 120.0
    global_window_s: float = 1800.0
    provisioning_s: float = 90.0
    grace_s: float = 30.0
    # A scale-in never leaves fewer copies deployed than this (Algorithm 1 would remove every combo at zero
    # load, and a live fleet of none fails every request until the next scale-out).
    min_copies: int = 1

    def __post_init__(self) -> None:
        if not (0 < self.ratio < 1):
            raise ValueError(f"ratio must be in (0, 1), got {self.ratio}")
        if not (0 < self.local_window_s <= self.global_window_s):
            raise ValueError("local_window_s must be <= global_window_s (and > 0)")
        if self.provisioning_s < 0 or self.grace_s < 0:
            raise ValueError("provisioning_s and grace_s must be >= 0")
        if self.min_copies < 0:
            raise ValueError(f"min_copies must be >= 0, got {self.min_copies}")


class QpsMeter:
    """Arrivals in, the autoscaler's QPS samples out: one sample per `step_s` bin [k step, (k+1) step) of
    time since `start_s`, taken at the bin's end as (end s, arrivals in the bin / step_s). The offline
    `switchyard plan --autoscale` and the simulator's closed loop both sample through it, so the same
    arrivals give the autoscaler the same samples."""

    __slots__ = ("step_s", "start_s", "_bin", "_count")

    def __init__(self, step_s: float, start_s: float = 0.0) -> None:
        if not step_s > 0:
            raise ValueError(f"step_s must be > 0, got {step_s}")
        self.step_s = step_s
        self.start_s = start_s
        self._bin = 0  # the open bin
        self._count = 0  # arrivals in it

    @property
    def next_sample_s(self) -> float:
        """When the open bin closes."""
        return self.start_s + (self._bin + 1) * self.step_s

    def arrive(self, at_s: float) -> list[tuple[float, float]]:
        """Count one arrival at `at_s` (non-decreasing); returns the samples of the bins it closed."""
        samples = self.until(at_s)
        self._count += 1
        return samples

    def until(self, now_s: float) -> list[tuple[float, float]]:
        """The samples of every bin that closed by `now_s` (a bin [a, b) closes at b)."""
        samples: list[tuple[float, float]] = []
        while now_s >= self.next_sample_s:
            samples.append((self.next_sample_s - self.start_s, self._count / self.step_s))
            self._bin += 1
            self._count = 0
        return samples


@dataclass(frozen=True, slots=True)
class ScaleOut:
    at_s: float
    combos: Mapping[str, int]  # combo id -> copies added
    serving_at_s: float  # when they take traffic (after provisioning)
    reason: str


@dataclass(frozen=True, slots=True)
class ScaleIn:
    at_s: float
    combos: Mapping[str, int]  # combo id -> copies removed (they take no new requests from `at_s`)
    gone_at_s: float  # when their GPUs are free (after the drain grace)
    reason: str


@dataclass(frozen=True, slots=True)
class Blocked:
    at_s: float
    deficit_rps: float
    reason: str


Action = ScaleOut | ScaleIn | Blocked


@dataclass(slots=True)
class _Leaving:
    combos: Counter[str]
    gone_at_s: float


@dataclass(slots=True)
class Autoscaler:
    """Algorithm 1 over a fixed candidate list. `initial`: the deployed combos (id -> copies)."""

    candidates: Sequence[Candidate]
    inventory: Mapping[str, int]
    solver: Solver
    initial: Mapping[str, int]
    objective: Objective = "co"
    params: AutoscalerParams = field(default_factory=AutoscalerParams)
    start_s: float = 0.0
    deployed: Counter[str] = field(init=False)  # serving or being provisioned, not leaving
    _leaving: list[_Leaving] = field(init=False, default_factory=list)
    _local: deque[tuple[float, float]] = field(init=False, default_factory=deque)
    _global: deque[tuple[float, float]] = field(init=False, default_factory=deque)
    _last_s: float = field(init=False)
    _by_id: dict[str, Candidate] = field(init=False)

    def __post_init__(self) -> None:
        self._by_id = {c.combo.id: c for c in self.candidates}
        unknown = set(self.initial) - set(self._by_id)
        if unknown:
            raise ValueError(f"initial combos not among the candidates: {', '.join(sorted(unknown))}")
        self.deployed = Counter({k: n for k, n in self.initial.items() if n > 0})
        self._last_s = self.start_s

    # -- state -----------------------------------------------------------------------------------------

    def capacity_rps(self) -> float:
        return sum(self._by_id[k].goodput_rps * n for k, n in self.deployed.items())

    def gpus_in_use(self, now_s: float) -> Counter[str]:
        self._leaving = [leaving for leaving in self._leaving if leaving.gone_at_s > now_s]
        used: Counter[str] = Counter()
        for combos in (self.deployed, *(leaving.combos for leaving in self._leaving)):
            for k, n in combos.items():
                for g, m in self._by_id[k].combo.gpus().items():
                    used[g] += m * n
        return used

    def usd_per_hour(self, now_s: float | None = None) -> float:
        """What the fleet costs per hour: the deployed combos, and with `now_s` those still draining too."""
        combos = [self.deployed]
        if now_s is not None:
            self.gpus_in_use(now_s)  # drops the combos that have left
            combos += [leaving.combos for leaving in self._leaving]
        return sum(self._by_id[k].usd_per_hour * n for c in combos for k, n in c.items())

    # -- Algorithm 1 -----------------------------------------------------------------------------------

    def observe(self, now_s: float, qps: float) -> list[Action]:
        p = self.params
        self._local.append((now_s, qps))
        self._global.append((now_s, qps))
        while self._local and self._local[0][0] <= now_s - p.local_window_s:
            self._local.popleft()
        while self._global and self._global[0][0] <= now_s - p.global_window_s:
            self._global.popleft()
        if now_s - self._last_s < p.local_window_s:
            return []
        q_avg = sum(q for _, q in self._local) / len(self._local)
        q_total = self.capacity_rps()
        delta = q_avg - q_total
        if abs(delta) > p.ratio * q_total:
            self._last_s = now_s
            if delta > 0:
                return [self._scale_out(now_s, delta, q_avg, q_total)]
            removed = self._scale_in(now_s, q_avg, q_total)
            return [removed] if removed is not None else []
        if now_s - self._last_s >= p.global_window_s:
            self._last_s = now_s
            return self._refine(now_s, sum(q for _, q in self._global) / len(self._global))
        return []

    def _free(self, now_s: float) -> dict[str, int]:
        used = self.gpus_in_use(now_s)
        return {g: n - used.get(g, 0) for g, n in self.inventory.items()}

    def _scale_out(self, now_s: float, delta: float, q_avg: float, q_total: float) -> Action:
        free = self._free(now_s)
        problem = AllocationProblem(tuple(self.candidates), free, self.objective, demand_rps=delta)
        allocation = self.solver.solve(problem)
        why = f"window mean {q_avg:.2f} req/s against {q_total:.2f} deployed"
        if allocation.status != "optimal":
            left = ", ".join(f"{n} {g}" for g, n in sorted(free.items()) if n > 0) or "none"
            return Blocked(now_s, delta, f"{why}: the GPUs left ({left}) cannot cover {delta:.2f} req/s")
        self.deployed.update(allocation.counts)
        return ScaleOut(now_s, dict(allocation.counts), now_s + self.params.provisioning_s, why)

    def _scale_in(self, now_s: float, q_avg: float, q_total: float) -> ScaleIn | None:
        """Remove combos, the largest that fits first, while what stays carries the window's mean."""
        removed: Counter[str] = Counter()
        keep = q_total
        left = sum(self.deployed.values())
        for k in sorted(self.deployed, key=lambda k: (-self._by_id[k].goodput_rps, k)):
            goodput = self._by_id[k].goodput_rps
            while (self.deployed[k] - removed[k] > 0 and keep - goodput >= q_avg
                   and left > self.params.min_copies):
                removed[k] += 1
                keep -= goodput
                left -= 1
        if not removed:
            return None
        self.deployed.subtract(removed)
        self.deployed = +self.deployed
        gone = now_s + self.params.grace_s
        self._leaving.append(_Leaving(removed, gone))
        return ScaleIn(now_s, dict(removed), gone, f"window mean {q_avg:.2f} req/s against {q_total:.2f} "
                       f"deployed; {keep:.2f} stays")

    def _refine(self, now_s: float, q_global: float) -> list[Action]:
        """Re-plan the whole fleet for the global mean; make before break."""
        problem = AllocationProblem(tuple(self.candidates), dict(self.inventory), self.objective,
                                    demand_rps=max(q_global, 1e-9))
        allocation = self.solver.solve(problem)
        if allocation.status != "optimal":
            return []
        target = Counter(allocation.counts)
        add, remove = target - self.deployed, self.deployed - target
        if not add and not remove:
            return []
        free = self._free(now_s)
        need: Counter[str] = Counter()
        for k, n in add.items():
            for g, m in self._by_id[k].combo.gpus().items():
                need[g] += m * n
        if any(need[g] > free.get(g, 0) for g in need):
            # Both fleets do not fit at once: making before breaking is impossible; keep the current one.
            return [Blocked(now_s, 0.0, f"refinement to {dict(target)} needs {dict(need)} free GPUs at once; "
                            f"{free} free")]
        actions: list[Action] = []
        why = f"global mean {q_global:.2f} req/s: re-planned"
        serving = now_s + self.params.provisioning_s
        if add:
            self.deployed.update(add)
            actions.append(ScaleOut(now_s, dict(add), serving, why))
        if remove:
            self.deployed.subtract(remove)
            self.deployed = +self.deployed
            gone = serving + self.params.grace_s
            self._leaving.append(_Leaving(Counter(remove), gone))
            actions.append(ScaleIn(serving, dict(remove), gone, why + " (after the new combos serve)"))
        return actions


def copy_label(combo: str, k: int) -> str:
    """Copy k of a combo, as engines report it (`--combo C#k`) and goodput_rr groups it."""
    return f"{combo}#{k}"


def newest_copies(live: Iterable[tuple[str, int]], combos: Mapping[str, int]) -> list[tuple[str, int]]:
    """The copies a `ScaleIn` of `combos` (combo -> copies removed) takes from the `live` ones ((combo, k),
    neither leaving nor gone): the newest (highest k) of each combo, combos in name order. The simulator and
    the live gateway both choose through this."""
    by_combo: dict[str, list[int]] = {}
    for combo, k in live:
        by_combo.setdefault(combo, []).append(k)
    return [(combo, k) for combo, n in sorted(combos.items())
            for k in sorted(by_combo.get(combo, ()), reverse=True)[:n]]


def action_row(action: Action) -> dict[str, object]:
    """An action as a JSON row (`switchyard plan --autoscale`'s and the simulator's timelines)."""
    row: dict[str, object] = {"kind": type(action).__name__, "at_s": action.at_s, "reason": action.reason}
    if isinstance(action, ScaleOut):
        row |= {"combos": dict(action.combos), "serving_at_s": action.serving_at_s}
    elif isinstance(action, ScaleIn):
        row |= {"combos": dict(action.combos), "gone_at_s": action.gone_at_s}
    else:
        row |= {"deficit_rps": action.deficit_rps}
    return row
