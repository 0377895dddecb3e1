"""A `switchyard plan --json` document (schema `switchyard.plan/1`) read back: what to deploy and how to
re-plan.

Owns: `Plan` (the deployed combos, and everything the candidates were built from: model, workload means,
SLO, inventory, prices, objective, max_num_seqs, and a measured goodput table or a length mix when one was
given), `parse_plan`
(a decoded JSON document -> `Plan`, ValueError naming the bad field) and `Plan.candidates()`, the same
candidate list `switchyard plan` solved over, so an autoscaler started from a plan file re-plans exactly as
the planner would. The simulator (`loadgen simulate --plan`) reads plans through this module.
Must not: do I/O (callers read the file), solve anything.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.planning.combos import Candidate, LengthMix, Slo, candidates
from gateway.planning.cost_model import DEFAULT_MAX_NUM_SEQS, Workload, with_prices
from gateway.planning.ilp import Objective
from switchyard.hardware import GPUS, MODELS, ModelShape

PLAN_SCHEMA = "switchyard.plan/1"
OBJECTIVES: tuple[Objective, ...] = ("co", "mce", "mc")


@dataclass(frozen=True, slots=True)
class Plan:
    model: ModelShape
    workload: Workload
    slo: Slo
    objective: Objective
    inventory: Mapping[str, int]
    prices: Mapping[str, float]
    combos: Mapping[str, int]  # combo id -> copies deployed
    goodput_rps: Mapping[str, float]  # combo id -> goodput per copy, as planned
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    goodput_table: Mapping[str, float] | None = None
    length_mix: LengthMix | None = None  # `plan --length-mix`: goodput over these length buckets

    def candidates(self) -> list[Candidate]:
        gpus = with_prices({g: GPUS[g] for g in self.inventory}, self.prices)
        return candidates(self.model, self.workload, self.slo, gpus, goodput_table=self.goodput_table,
                          max_num_seqs=self.max_num_seqs, mix=self.length_mix)


def _number(doc: Mapping[str, Any], key: str, where: str = "") -> float:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"plan: {where}{key} must be a number, got {value!r}")
    return float(value)


def _counts(doc: Mapping[str, Any], key: str) -> dict[str, int]:
    value = doc.get(key)
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(n, int) and not isinstance(n, bool) and n >= 0
            for k, n in value.items()):
        raise ValueError(f"plan: {key} must map names to whole numbers >= 0, got {value!r}")
    return dict(value)


def parse_plan(doc: Any) -> Plan:
    """The plan of a decoded `switchyard.plan/1` document; ValueError naming what is wrong."""
    if not isinstance(doc, dict):
        raise ValueError("plan: expected a JSON object")
    if doc.get("schema") != PLAN_SCHEMA:
        raise ValueError(f"plan: schema must be {PLAN_SCHEMA!r}, got {doc.get('schema')!r}")
    model = doc.get("model")
    if model not in MODELS:
        raise ValueError(f"plan: unknown model {model!r}; known: {', '.join(sorted(MODELS))}")
    slo = doc.get("slo_ms")
    if not isinstance(slo, dict):
        raise ValueError("plan: slo_ms must be an object {ttft, tpot}")
    objective = doc.get("objective")
    if objective not in OBJECTIVES:
        raise ValueError(f"plan: objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    inventory = _counts(doc, "inventory")
    unknown = sorted(set(inventory) - set(GPUS))
    if unknown:
        raise ValueError(f"plan: unknown GPU(s) {', '.join(unknown)}; known: {', '.join(sorted(GPUS))}")
    prices_doc = doc.get("prices", {})
    if not isinstance(prices_doc, dict):
        raise ValueError("plan: prices must map GPU names to USD per hour")
    prices = {g: _number(prices_doc, g, "prices.") for g in prices_doc}
    rows = doc.get("combos")
    if not isinstance(rows, list):
        raise ValueError("plan: combos must be a list of {combo, count, goodput_rps}")
    combos: dict[str, int] = {}
    goodput: dict[str, float] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("combo"), str):
            raise ValueError(f"plan: combos[{i}] must be an object with a combo id")
        count = row.get("count")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"plan: combos[{i}].count must be a whole number >= 0, got {count!r}")
        combos[row["combo"]] = count
        goodput[row["combo"]] = _number(row, "goodput_rps", f"combos[{i}].")
    table_doc = doc.get("goodput_table")
    table = None
    if table_doc is not None:
        if not isinstance(table_doc, dict):
            raise ValueError("plan: goodput_table must map combo ids to req/s")
        table = {k: _number(table_doc, k, "goodput_table.") for k in table_doc}
    mix_doc = doc.get("length_mix")
    mix: LengthMix | None = None
    if mix_doc is not None:
        if not (isinstance(mix_doc, list) and mix_doc and all(isinstance(x, dict) for x in mix_doc)):
            raise ValueError("plan: length_mix must be a non-empty list of {share, input_tokens, "
                             "output_tokens}")
        mix = tuple((_number(b, "share", f"length_mix[{i}]."),
                     Workload(_number(b, "input_tokens", f"length_mix[{i}]."),
                              _number(b, "output_tokens", f"length_mix[{i}].")))
                    for i, b in enumerate(mix_doc))
    max_num_seqs = doc.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS)
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"plan: max_num_seqs must be a whole number >= 1, got {max_num_seqs!r}")
    return Plan(
        model=MODELS[model],
        workload=Workload(_number(doc, "input_tokens"), _number(doc, "output_tokens")),
        slo=Slo(_number(slo, "ttft", "slo_ms.") / 1e3, _number(slo, "tpot", "slo_ms.") / 1e3),
        objective=objective,
        inventory=inventory,
        prices=prices,
        combos=combos,
        goodput_rps=goodput,
        max_num_seqs=max_num_seqs,
        goodput_table=table,
        length_mix=mix,
    )
