"""CAUCHY's GPU combos (paper 004, §3.1, §3.3.1): enumerate, price, keep the better direction, rank by CE.

A combo is `<a x P, b x D>`: `a` GPUs of type P prefill and `b` GPUs of type D decode, each side one instance
whose GPUs are consolidated by tensor parallelism (§3.1), or an aggregated pool `<n x G>` serving both phases.
Counts run from 1:1 to 2:6 (§3.3.2); aggregated pools take 1 or 2 GPUs. The models' tensor-parallel limits
(heads divisible by the degree) are not checked: like Eq. 5 and 11, throughput scales with the GPU count.

Goodput at the SLO, `modelled_goodput`, uses the same roofline as the cost model: the decode side runs the
largest batch whose step, (C3 + B C4 (R_in + R_out / 2)) / (n BW), meets the TPOT target (capped by the KV
cache and `max_num_seqs`); a prompt's prefill, R_in (C1 R_in + C2) / (n F), must fit in the TTFT target; a
disaggregated combo serves the slower phase's rate, an aggregated one time-shares. No queueing, no KV
handoff time: an upper bound. A measured table (`goodput_table`) replaces it and is then the candidate set:
combos it does not list are left out rather than mixed with modelled ones.

A length mix (`length_mix`: base-2 buckets of prompt and output tokens, Mélange's request-size buckets, each
with its share and mean lengths) replaces the means in the goodput when a workload's lengths spread widely:
`mix_goodput` times each bucket at its own modelled goodput and shares one instance's time between them (a
request costs Σ share_b / goodput_b seconds of it, Mélange's load model); a bucket that cannot meet the SLO
on the combo at all makes the combo unfit for the mix. Prices and CE stay at the means.

Pareto filtering (§3.3.1): of a combo and its reverse (the same GPUs and counts with the phases swapped) only
the one with the higher CE stays. Candidates are ranked by CE (Eq. 15), best first.
Must not: solve the allocation (gateway.planning.ilp), do I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gateway.planning.cost_model import (
    DEFAULT_MAX_NUM_SEQS,
    ComboCost,
    CostModelError,
    Side,
    Workload,
    coefficients,
    price_combo,
)
from switchyard.hardware import GpuSpec, ModelShape

PREFILL_COUNTS = (1, 2)
DECODE_COUNTS = (1, 2, 3, 4, 5, 6)
AGGREGATED_COUNTS = (1, 2)


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True, slots=True)
class Combo:
    """`prefill` None: aggregated (`decode` is the pool)."""

    decode_gpu: str
    decode_count: int
    prefill_gpu: str | None = None
    prefill_count: int = 0

    @property
    def id(self) -> str:
        pool = f"{self.decode_count}x{self.decode_gpu}"
        return pool if self.prefill_gpu is None else f"{self.prefill_count}x{self.prefill_gpu}+{pool}"

    @property
    def aggregated(self) -> bool:
        return self.prefill_gpu is None

    def gpus(self) -> dict[str, int]:
        """GPUs of each type the combo takes."""
        out = {self.decode_gpu: self.decode_count}
        if self.prefill_gpu is not None:
            out[self.prefill_gpu] = out.get(self.prefill_gpu, 0) + self.prefill_count
        return out

    def reversed(self) -> Combo:
        if self.prefill_gpu is None:
            return self
        return Combo(self.prefill_gpu, self.prefill_count, self.decode_gpu, self.decode_count)


@dataclass(frozen=True, slots=True)
class Candidate:
    combo: Combo
    cost: ComboCost
    goodput_rps: float  # at the SLO: modelled, or from a measured table
    goodput_source: str  # "modelled" | "table"
    decode_step_s: float  # the decode side's step at the batch it runs under the TPOT target

    @property
    def usd_per_hour(self) -> float:
        return self.cost.usd_per_hour

    @property
    def ce_tokens_per_usd(self) -> float:
        return self.cost.ce_tokens_per_usd

    @property
    def goodput_per_usd_h(self) -> float:
        return self.goodput_rps / self.usd_per_hour


def enumerate_combos(gpu_names: Iterable[str]) -> list[Combo]:
    """Every aggregated pool and every P:D pair (the same type on both sides included) of these GPUs."""
    names = sorted(set(gpu_names))
    out = [Combo(g, n) for g in names for n in AGGREGATED_COUNTS]
    out += [Combo(d, nd, p, np_) for p in names for d in names
            for np_ in PREFILL_COUNTS for nd in DECODE_COUNTS if np_ <= nd]
    return out


def decode_step_s(shape: ModelShape, side: Side, workload: Workload, batch: int) -> float:
    """One decode step at `batch` requests of mean context R_in + R_out / 2 (Eq. 10 per token)."""
    c = coefficients(shape)
    return (c.c3 + batch * c.c4 * (workload.input_tokens + workload.output_tokens / 2)) / side.bytes_per_s


def prefill_s(shape: ModelShape, side: Side, workload: Workload) -> float:
    """One prompt's prefill (Eq. 4 at B = 1)."""
    c = coefficients(shape)
    return workload.input_tokens * (c.c1 * workload.input_tokens + c.c2) / side.flops


def modelled_goodput(shape: ModelShape, workload: Workload, slo: Slo, cost: ComboCost,
                     max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> tuple[float, float]:
    """(requests/s meeting the SLO, the decode step at that batch); (0, step at B = 1) when the SLO cannot be
    met at all."""
    c = coefficients(shape)
    decode = cost.decode
    context = workload.input_tokens + workload.output_tokens / 2
    fastest = decode_step_s(shape, decode, workload, 1)
    b_tpot = math.floor((slo.tpot_s * decode.bytes_per_s - c.c3) / (c.c4 * context))
    batch = min(b_tpot, cost.batch, max_num_seqs)
    prefill_side = cost.prefill or decode
    p_s = prefill_s(shape, prefill_side, workload)
    if batch < 1 or p_s > slo.ttft_s:
        return 0.0, fastest
    step = decode_step_s(shape, decode, workload, batch)
    decode_rps = batch / (step * workload.output_tokens)
    prefill_rps = 1.0 / p_s
    rps = (1.0 / (1.0 / prefill_rps + 1.0 / decode_rps)) if cost.aggregated else min(prefill_rps, decode_rps)
    return rps, step


# (share of requests, their mean lengths) per bucket; shares sum to 1.
LengthMix = tuple[tuple[float, Workload], ...]


def length_bucket(tokens: float) -> int:
    """The base-2 bucket of a length: 0 for [1, 2), k for [2^k, 2^(k+1)); lengths below 1 go to bucket 0."""
    return max(0, math.frexp(max(tokens, 1.0))[1] - 1)


def length_mix(lengths: Iterable[tuple[float, float]]) -> LengthMix:
    """(prompt, output) token counts bucketed base-2 on both: each non-empty bucket's share and mean lengths
    (at least one token each), ordered by bucket. ValueError when `lengths` is empty."""
    sums: dict[tuple[int, int], list[float]] = {}
    total = 0
    for r_in, r_out in lengths:
        acc = sums.setdefault((length_bucket(r_in), length_bucket(r_out)), [0.0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += r_in
        acc[2] += r_out
        total += 1
    if total == 0:
        raise ValueError("a length mix needs at least one request")
    return tuple((n / total, Workload(max(s_in / n, 1.0), max(s_out / n, 1.0)))
                 for _, (n, s_in, s_out) in sorted(sums.items()))


def mix_goodput(shape: ModelShape, mix: LengthMix, slo: Slo, decode: Side, prefill: Side | None,
                max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> float:
    """Requests/s of the mix meeting the SLO on one combo instance: 1 / Σ share_b / goodput_b, each bucket's
    goodput modelled at its own lengths; 0 when a bucket with a share cannot meet the SLO there."""
    seconds = 0.0
    for share, bucket in mix:
        try:
            cost = price_combo(shape, bucket, decode=decode, prefill=prefill, max_num_seqs=max_num_seqs)
        except CostModelError:
            return 0.0  # the bucket's KV for one request does not fit
        goodput, _ = modelled_goodput(shape, bucket, slo, cost, max_num_seqs)
        if goodput <= 0:
            return 0.0
        seconds += share / goodput
    return 1.0 / seconds if seconds > 0 else 0.0


def candidates(shape: ModelShape, workload: Workload, slo: Slo, gpus: Mapping[str, GpuSpec],
               goodput_table: Mapping[str, float] | None = None,
               max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, mix: LengthMix | None = None) -> list[Candidate]:
    """Priced combos of `gpus` that hold the model and meet the SLO (goodput > 0), reversed directions
    dropped, best CE first. `mix`: goodput over these length buckets instead of at the means."""
    priced: dict[Combo, Candidate] = {}
    for combo in enumerate_combos(gpus):
        try:
            pre = combo.prefill_gpu
            prefill = None if pre is None else Side(gpus[pre], combo.prefill_count)
            cost = price_combo(shape, workload, decode=Side(gpus[combo.decode_gpu], combo.decode_count),
                               prefill=prefill, max_num_seqs=max_num_seqs)
        except CostModelError:
            continue  # the weights do not fit on a side
        goodput, step = modelled_goodput(shape, workload, slo, cost, max_num_seqs)
        source = "modelled"
        if mix is not None:
            goodput = mix_goodput(shape, mix, slo, cost.decode, cost.prefill, max_num_seqs)
            source = "modelled-mix"
        if goodput_table is not None:  # a measured table is the candidate set: no mixing with the model
            if combo.id not in goodput_table:
                continue
            goodput, source = goodput_table[combo.id], "table"
        if goodput > 0:
            priced[combo] = Candidate(combo, cost, goodput, source, step)
    kept = [c for combo, c in priced.items()
            if (rev := priced.get(combo.reversed())) is None or rev is c
            or (c.ce_tokens_per_usd, combo.id) > (rev.ce_tokens_per_usd, rev.combo.id)]
    return sorted(kept, key=lambda c: (-c.ce_tokens_per_usd, c.combo.id))


def fastest_decode_step(shape: ModelShape, workload: Workload,
                        gpus: Mapping[str, GpuSpec]) -> tuple[str, float]:
    """The combo side with the shortest decode step at B = 1 (for "TPOT below the fastest step" errors)."""
    best: tuple[str, float] | None = None
    for combo in enumerate_combos(gpus):
        side = Side(gpus[combo.decode_gpu], combo.decode_count)
        step = decode_step_s(shape, side, workload, 1)
        if best is None or step < best[1]:
            best = (f"{combo.decode_gpu}x{combo.decode_count}", step)
    if best is None:
        raise CostModelError("no GPUs to plan with")
    return best
