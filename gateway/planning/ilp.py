"""CAUCHY's combo allocation (paper 004, §3.3.2, Eq. 16) as an integer program behind a `Solver` seam.

x_n >= 0 integer copies of candidate combo n, subject to
- goodput: sum_n goodput_n x_n >= demand (req/s at the SLO), when a demand is given;
- inventory: sum_n gpus_{n,g} x_n <= available_g for every GPU type g;
- budget: sum_n price_n x_n <= budget (USD/h), when a budget is given;
and one of three objectives (§4.3):
- `co` (CAUCHY's CO-LP, Eq. 16): minimise sum_n (price_n / CE_n) x_n: cheap and cost-efficient at once;
- `mce` (MCE-LP): minimise sum_n x_n / CE_n: the most cost-efficient combos whatever they cost;
- `mc` (MC-LP): minimise sum_n price_n x_n.
With a budget and no demand, the goodput is maximised within the budget instead (the objective breaks ties).

`PulpCbcSolver` (PuLP, with the CBC binary of its `cbc` extra, cbcbox) is this package's only effect: it
runs that binary. A problem the
solver proves infeasible comes back as `Allocation(status="infeasible")`; `explain_infeasible` then says why
in one line (the cheapest way to the demand against the budget, or the GPUs it needs against the inventory).
Must not: price or enumerate combos (gateway.planning.cost_model, combos), read engines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from gateway.planning.combos import Candidate

Objective = Literal["co", "mce", "mc"]
OBJECTIVES: tuple[Objective, ...] = ("co", "mce", "mc")


@dataclass(frozen=True, slots=True)
class AllocationProblem:
    candidates: tuple[Candidate, ...]
    inventory: Mapping[str, int]  # GPUs of each type available; a type absent here has none
    objective: Objective = "co"
    demand_rps: float | None = None
    budget_usd_per_h: float | None = None

    def __post_init__(self) -> None:
        if self.demand_rps is None and self.budget_usd_per_h is None:
            raise ValueError("give a goodput demand, a budget, or both")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")

    def weight(self, c: Candidate) -> float:
        """The objective's coefficient of one copy of `c`."""
        if self.objective == "co":
            return c.usd_per_hour / c.ce_tokens_per_usd
        if self.objective == "mce":
            return 1.0 / c.ce_tokens_per_usd
        return c.usd_per_hour


@dataclass(frozen=True, slots=True)
class Allocation:
    status: Literal["optimal", "infeasible"]
    counts: Mapping[str, int] = field(default_factory=dict)  # combo id -> copies (only those > 0)
    solver_ms: float = 0.0


class Solver(Protocol):
    def solve(self, problem: AllocationProblem) -> Allocation: ...


class PulpCbcSolver:
    """PuLP's model of Eq. 16 solved by CBC (cbcbox's binary; PuLP 3.3 deprecates the one it bundles),
    silently."""

    def __init__(self, time_limit_s: float = 10.0) -> None:
        self._time_limit_s = time_limit_s

    def solve(self, problem: AllocationProblem) -> Allocation:
        import cbcbox  # type: ignore[import-untyped]  # noqa: PLC0415 (imported only where a plan is made)
        import pulp  # type: ignore[import-untyped]  # noqa: PLC0415

        cands = problem.candidates
        lp = pulp.LpProblem("cauchy", pulp.LpMinimize if problem.demand_rps is not None else pulp.LpMaximize)
        x = [lp.add_variable(f"x{i}", lowBound=0, cat="Integer") for i in range(len(cands))]
        cost = pulp.lpSum(c.usd_per_hour * v for c, v in zip(cands, x, strict=True))
        goodput = pulp.lpSum(c.goodput_rps * v for c, v in zip(cands, x, strict=True))
        # The weights are normalised to at most 1: co's price / CE and mce's 1 / CE are ~1e-8, below CBC's
        # tolerances, which then takes any feasible point as optimal.
        top = max((problem.weight(c) for c in cands), default=1.0)
        weighted = pulp.lpSum(problem.weight(c) / top * v for c, v in zip(cands, x, strict=True))
        if problem.demand_rps is not None:
            lp += weighted
            lp += goodput >= problem.demand_rps
        else:  # budget only: the most goodput within it; the objective breaks ties
            lp += goodput - 1e-6 * weighted
        if problem.budget_usd_per_h is not None:
            lp += cost <= problem.budget_usd_per_h
        for gpu in sorted({g for c in cands for g in c.combo.gpus()}):
            lp += pulp.lpSum(c.combo.gpus().get(gpu, 0) * v for c, v in zip(cands, x, strict=True)) <= (
                problem.inventory.get(gpu, 0))
        solver = pulp.COIN_CMD(path=cbcbox.cbc_bin_path(), msg=False, timeLimit=self._time_limit_s)
        lp.solve(solver)
        solver_ms = float(lp.solutionTime) * 1e3
        if pulp.LpStatus[lp.status] != "Optimal":
            return Allocation("infeasible", {}, solver_ms)
        counts = {c.combo.id: round(v.value() or 0) for c, v in zip(cands, x, strict=True)}
        return Allocation("optimal", {k: n for k, n in counts.items() if n > 0}, solver_ms)


@dataclass(frozen=True, slots=True)
class PlanSummary:
    total_usd_per_h: float
    goodput_rps: float
    tokens_per_usd: float  # the plan's balanced tokens per dollar: tokens/s of its goodput over its $/h
    gpus: Mapping[str, int]


def summarize(allocation: Allocation, candidates: Sequence[Candidate],
              tokens_per_request: float) -> PlanSummary:
    by_id = {c.combo.id: c for c in candidates}
    usd = sum(by_id[k].usd_per_hour * n for k, n in allocation.counts.items())
    rps = sum(by_id[k].goodput_rps * n for k, n in allocation.counts.items())
    gpus: dict[str, int] = {}
    for k, n in allocation.counts.items():
        for g, m in by_id[k].combo.gpus().items():
            gpus[g] = gpus.get(g, 0) + m * n
    tokens_per_usd = rps * tokens_per_request * 3600.0 / usd if usd > 0 else 0.0
    return PlanSummary(usd, rps, tokens_per_usd, gpus)


def explain_infeasible(problem: AllocationProblem) -> str:
    """One line on why no allocation exists: the budget, the inventory, or both."""
    cands = problem.candidates
    if not cands:
        return "no combo of the given GPUs holds the model and meets the SLO"
    if problem.demand_rps is not None:
        demand = problem.demand_rps
        cheapest = min(cands, key=lambda c: c.usd_per_hour / c.goodput_rps)
        need_usd = demand * cheapest.usd_per_hour / cheapest.goodput_rps
        if problem.budget_usd_per_h is not None and need_usd > problem.budget_usd_per_h:
            return (f"{demand:g} req/s needs >= ${need_usd:.2f}/h (at {cheapest.combo.id}'s "
                    f"${cheapest.usd_per_hour / cheapest.goodput_rps:.3f}/h per req/s); budget "
                    f"${problem.budget_usd_per_h:g}/h")
        for c in sorted(cands, key=lambda c: c.usd_per_hour / c.goodput_rps):
            copies = -(-demand // c.goodput_rps)
            short = {g: int(copies * m) for g, m in c.combo.gpus().items()
                     if copies * m > problem.inventory.get(g, 0)}
            if not short:
                break
        else:
            best = min(cands, key=lambda c: c.usd_per_hour / c.goodput_rps)
            copies = -(-demand // best.goodput_rps)
            g, need = max(((g, int(copies * m)) for g, m in best.combo.gpus().items()),
                          key=lambda t: t[1] - problem.inventory.get(t[0], 0))
            return (f"{demand:g} req/s needs {need} {g} ({int(copies)} x {best.combo.id}), "
                    f"{problem.inventory.get(g, 0)} available")
        return f"{demand:g} req/s cannot be met with the GPUs available (inventory and budget together)"
    return "no combo fits in the budget and the inventory"
