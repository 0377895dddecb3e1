"""Cascadia's planner (§3, App. B-E), a pure core shared by the gateway and the simulator.

`stage_latency` (Sim(w, f): one replica's p95 and capacity, analytic), `parallelism` (l_i(f): the best
replicas per GPU count), `milp` (§3.2's MILP over those tables), `routing` (§3.3's Chebyshev-guided search
over thresholds, App. C's latency-budget variant) and `bilevel` (Algorithm 1, `plan_cascade` ->
`CascadePlan`).
"""

from gateway.cascade.plan.bilevel import CascadePlan, PlanRequest, plan_cascade

__all__ = ["CascadePlan", "PlanRequest", "plan_cascade"]
