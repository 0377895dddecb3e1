"""CascadeInfer's length-aware stage partition (paper 000, §4.2), pure: request lengths in, a pipeline out.

E instances are cut into stages, each serving a contiguous range [lo, hi) of sequence lengths; a request
starts in the stage holding its prompt length and is handed over (its KV cache moved) each time its growing
length crosses a cut. The pipeline quality to minimise is Σ_stages (e-e') Q^{n_{l',l}/(e-e')} + Σ_cuts c_{l'}.

Which length fills the buckets. A request (I, O) decodes at lengths I, I+1, ..., I+O-1 (a prompt-only
request, O = 0, counts as one step at I) and lives in whichever stage's range holds its current length. The
request set is read as one snapshot of the sequences the instances hold, since Eq. 1's n is a batch size and
D was fitted on real batch sizes: each request is somewhere on its way from I to I+O, uniformly over its
decode steps (one token per iteration). A range [lo, hi) therefore holds request r with probability
p_r = |[I, I+O) ∩ [lo, hi)| / O (O >= 1), the share of its decode tokens spent there, and then at a length
uniform over that clipped interval. A range's features are the expectations: n = Σ p_r, ΣI = Σ p_r I_r,
ΣI² = Σ p_r I_r², ΣL = Σ p_r (mean clipped length). Why: every stage a request crosses sees it, in proportion
to the work it does there (the literal "requests whose length lies in [l', l)" puts a 100-token prompt with
30K output tokens in one stage, whichever length is picked); the p_r of a request sum to 1 over any
partition, so every partition carries the same load; and the features are additive over buckets, so a
range's are prefix-sum differences. I stays the prompt length in every stage, as in the features D was
fitted on (`switchyard.qoe.features`).

n_{l',l}/(e-e') is footnote 1's division made exact for probability-weighted sequences: each of k instances
holds 1/k of every feature sum, so the stage's QoE is
k Q^{n/k} = n (D_0 + (D_1 n + D_2 ΣI + D_3 ΣI² + D_4 ΣL) / k).
For identical unit-weight sequences it equals k x `QoEModel.batch(divide(...))`; unlike footnote 1's
systematic sample it has no empty subset (and so no free stage) when a range holds fewer sequences than
instances. c_{l'} = (requests with I < l' < I+O) x l' tokens x KV bytes per token / bandwidth, in seconds:
each such request is handed over once at l' with l' tokens of KV. As in the paper it is added to the QoE sum
as is.

Cut candidates are base-2: edges 0, 1, 2, 4, ..., 2^m < L, L (B buckets); the last stage ends at L.
- `exact`: the recursion f_{s,e,l} = min_{e',l'} f_{s-1,e',l'} + (e-e') Q^{n_{l',l}/(e-e')} + c_{l'} over the
  buckets. The objective does not depend on s (it only counts stages), so min_s f_{s,E,L} is solved as
  g_{e,l} = min_{k>=1, l'<l} g_{e-k,l'} + k Q^{n_{l',l}/k} + c_{l'}. Every stage gets >= 1 instance (the
  paper's e' in [s-1, e] would allow a stage of none, a typo). O(E² B²), vectorised over e and k.
- `paper_heuristic`, §4.2's two phases as written: a DP with exactly one instance per stage gives a chain of
  min(E, B) stages (when E > B, where the paper's E-stage chain cannot exist, the spare instances go one at
  a time to the stage whose QoE they lower most: optimal for fixed ranges, k Q^{n/k} being convex in k);
  then the adjacent pair with the highest positive merge gain is merged (a heapq max-heap, stale entries
  skipped) until no gain is positive. Its instance counts are an artefact of the chain: every empty bucket
  the chain had to cover leaves its instance wherever it is merged. On 400 random cases (E <= 32) it was
  1.8 % above exact on average and 85 % in the worst case.
- `heuristic`, the default: the same two phases started from the best chain of every length s = 1..min(E, B)
  (phase 1's DP yields them all in one pass), each merged result's instances re-spread over its ranges the
  same greedy way, the best kept. On the same cases: 0.01 % above exact on average, 0.9 % at worst; 97 %
  exact. O(min(E, B) (B² + B E + E log E)).
- `brute_force`: every cut set and instance split, for tests on small cases.
Owns: the base-2 buckets and their features' prefix sums, the memoised stage QoE of a (bucket range,
instances) pair, the cut costs, the solvers above and `StagePlan`.
Must not: read clocks (callers time `plan_ms` with their own timer), do I/O, or fit D (`switchyard.qoe`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from switchyard.hardware import BYTES_PER_GB, ModelShape
from switchyard.qoe import QoEModel

FloatArray = npt.NDArray[np.float64]
Method = Literal["heuristic", "paper", "exact", "brute_force", "chain"]
_REL_EPS = 1e-12  # a merge gain within this share of the pair's QoE is float noise, not a gain


class StagePlanError(ValueError):
    """Inputs the partition cannot be planned for; the message says which, in one line."""


class RequestLengths(NamedTuple):
    """One request of the workload: prompt tokens and output tokens (a plain (I, O) tuple works too)."""

    input_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class TransferCost:
    """What a hand-over costs: KV bytes per token moved over `bandwidth_gb_s` (decimal GB/s)."""

    kv_bytes_per_token: float
    bandwidth_gb_s: float

    def __post_init__(self) -> None:
        if not self.kv_bytes_per_token >= 0 or not self.bandwidth_gb_s > 0:
            raise StagePlanError(f"transfer cost needs KV bytes/token >= 0 and bandwidth > 0, got {self}")

    @classmethod
    def for_model(cls, shape: ModelShape, bandwidth_gb_s: float) -> TransferCost:
        """K and V of every layer per token (`ModelShape.kv_bytes_per_token`) over `bandwidth_gb_s`."""
        return cls(float(shape.kv_bytes_per_token), bandwidth_gb_s)

    def seconds(self, tokens: float) -> float:
        return tokens * self.kv_bytes_per_token / (self.bandwidth_gb_s * BYTES_PER_GB)


@dataclass(frozen=True, slots=True)
class Stage:
    lo: int  # sequence lengths [lo, hi) (the last stage also holds hi = L)
    hi: int
    instances: int


@dataclass(frozen=True, slots=True)
class StagePlan:
    stages: tuple[Stage, ...]
    quality: float  # pipeline QoE: Σ stage QoE + Σ cut transfer seconds; lower is better
    method: Method


def length_edges(max_len: int) -> tuple[int, ...]:
    """The base-2 cut candidates: 0, 1, 2, 4, ..., the last power of two below `max_len`, then `max_len`."""
    if max_len < 1:
        raise StagePlanError(f"max_len must be >= 1, got {max_len}")
    powers = [1 << k for k in range(max_len.bit_length()) if (1 << k) < max_len]
    return (0, *powers, max_len)


class StageProblem:
    """The bucketed instance: per-range features (prefix sums), cut costs, and memoised stage QoE.

    Ranges are given by edge indices i < j (lengths [edges[i], edges[j])); `stage_qoe(i, j, k)` is
    k Q^{n/k} of that range on k instances and `cut_cost(i)` is c at edges[i] (0 at 0 and L)."""

    __slots__ = ("instances", "max_len", "model", "edges", "n", "load", "cuts", "_memo")

    def __init__(self, instances: int, max_len: int, requests: Sequence[tuple[int, int]], model: QoEModel,
                 transfer: TransferCost) -> None:
        if instances < 1:
            raise StagePlanError(f"instances must be >= 1, got {instances}")
        self.instances = instances
        self.max_len = max_len
        self.model = model
        self.edges = length_edges(max_len)
        io = _lengths(requests, max_len)
        inputs, outputs = io[:, 0], io[:, 1]
        width = np.maximum(outputs, 1.0)  # decode steps; a prompt-only request is one step at I
        edges = np.asarray(self.edges, dtype=np.float64)
        start = np.maximum(inputs[:, None], edges[None, :-1])  # each request's clipped interval per bucket
        end = np.minimum((inputs + width)[:, None], edges[None, 1:])
        overlap = np.maximum(end - start, 0.0)
        share = overlap / width[:, None]  # p: the request's presence in the bucket
        sums = np.stack([share.sum(axis=0), inputs @ share, (inputs * inputs) @ share,
                         (overlap * (start + end - 1.0) / 2.0 / width[:, None]).sum(axis=0)])
        prefix = np.concatenate([np.zeros((4, 1)), np.cumsum(sums, axis=1)], axis=1)  # (4, B+1)
        ranges = np.maximum(prefix[:, None, :] - prefix[:, :, None], 0.0)  # [f, i, j] = features of [i, j)
        d0, d1, d2, d3, d4 = model.d
        self.n: FloatArray = ranges[0]
        # k Q^{n/k} = n d0 + n load / k: `load` is the part an instance more divides
        self.load: FloatArray = d1 * ranges[0] + d2 * ranges[1] + d3 * ranges[2] + d4 * ranges[3]
        cut_at = edges[:, None]
        straddling = ((inputs[None, :] < cut_at) & (cut_at < (inputs + outputs)[None, :])).sum(axis=1)
        self.cuts: FloatArray = np.array([transfer.seconds(float(c * x)) for c, x in zip(straddling, edges,
                                                                                          strict=True)])
        self.cuts[0] = self.cuts[-1] = 0.0
        self._memo: dict[tuple[int, int, int], float] = {}

    @property
    def buckets(self) -> int:
        return len(self.edges) - 1

    def stage_qoe(self, i: int, j: int, k: int) -> float:
        """k Q^{n_{i,j}/k}: the QoE of range [edges[i], edges[j]) on k instances (memoised)."""
        key = (i, j, k)
        cached = self._memo.get(key)
        if cached is None:
            n = self.n[i, j]
            cached = self._memo[key] = float(n * self.model.d[0] + n * self.load[i, j] / k)
        return cached

    def cut_cost(self, i: int) -> float:
        return float(self.cuts[i])

    def quality(self, bounds: Sequence[int], counts: Sequence[int]) -> float:
        """Pipeline quality of stages [bounds[s], bounds[s+1]) on counts[s] instances (edge indices)."""
        return sum(self.stage_qoe(i, j, k) + self.cut_cost(i)
                   for i, j, k in zip(bounds[:-1], bounds[1:], counts, strict=True))

    def plan(self, bounds: Sequence[int], counts: Sequence[int], method: Method) -> StagePlan:
        stages = tuple(Stage(self.edges[i], self.edges[j], k)
                       for i, j, k in zip(bounds[:-1], bounds[1:], counts, strict=True))
        return StagePlan(stages, self.quality(bounds, counts), method)


def _lengths(requests: Sequence[tuple[int, int]], max_len: int) -> FloatArray:
    """(I, O) rows as floats, refused unless whole, non-negative and within `max_len`."""
    if len(requests) == 0:
        raise StagePlanError("no requests to plan for")
    io = np.asarray(requests, dtype=np.float64)
    if io.ndim != 2 or io.shape[1] != 2:
        raise StagePlanError("requests must be (input tokens, output tokens) pairs")
    if not np.all(np.isfinite(io)) or np.any(io < 0) or np.any(io != np.floor(io)):
        raise StagePlanError("request lengths must be whole numbers >= 0")
    final = io[:, 0] + np.maximum(io[:, 1], 1.0)
    if final.max() > max_len:
        r = int(final.argmax())
        raise StagePlanError(f"request {r} (input {io[r, 0]:.0f}, output {io[r, 1]:.0f}) grows past "
                             f"max_len {max_len}: raise the max length or drop the request")
    return io


def heuristic(problem: StageProblem) -> StagePlan:
    """The default: §4.2's two phases started from every chain length, each merged result re-spread."""
    return _two_phase(problem, every_chain=True)


def paper_heuristic(problem: StageProblem) -> StagePlan:
    """§4.2's two phases as written: the min(E, B)-stage chain, then greedy merges."""
    return _two_phase(problem, every_chain=False)


def _two_phase(problem: StageProblem, *, every_chain: bool) -> StagePlan:
    most = min(problem.instances, problem.buckets)
    best: tuple[float, list[int], list[int]] | None = None
    for bounds in _chains(problem, most)[0 if every_chain else most - 1:]:
        counts = _spread(problem, bounds, problem.instances - (len(bounds) - 1))
        bounds, counts = _merge(problem, bounds, counts)
        if every_chain:
            counts = _spread(problem, bounds, problem.instances - (len(bounds) - 1))
        q = problem.quality(bounds, counts)
        if best is None or q < best[0]:
            best = (q, bounds, counts)
    assert best is not None  # most >= 1
    return problem.plan(best[1], best[2], "heuristic" if every_chain else "paper")


def chain(problem: StageProblem) -> StagePlan:
    """§6.5's chain layout: the best pipeline of min(E, B) stages, one instance each (spares spread)."""
    bounds = _chains(problem, min(problem.instances, problem.buckets))[-1]
    return problem.plan(bounds, _spread(problem, bounds, problem.instances - (len(bounds) - 1)), "chain")


def _chains(problem: StageProblem, most: int) -> list[list[int]]:
    """Phase 1: for s = 1..`most`, the bounds of the best s-stage pipeline with one instance per stage."""
    size = problem.buckets + 1
    single = problem.n * problem.model.d[0] + problem.n * problem.load / 1.0 + problem.cuts[:, None]
    single[np.tril_indices(size)] = np.inf  # a stage [i, j) needs i < j
    best = np.full(size, np.inf)
    best[0] = 0.0
    back = []
    chains = []
    for _ in range(most):
        total = best[:, None] + single
        arg = total.argmin(axis=0)
        best = total[arg, np.arange(size)]
        back.append(arg)
        bounds = [problem.buckets]
        for step in reversed(back):
            bounds.append(int(step[bounds[-1]]))
        chains.append(bounds[::-1])
    return chains


def _spread(problem: StageProblem, bounds: Sequence[int], spare: int) -> list[int]:
    """One instance per stage, then each spare one to the stage whose QoE it lowers most. The (k+1)-th
    instance of a stage lowers n d0 + n load / k by n load / (k (k+1)), less for each one more, so giving
    them one at a time is taking the `spare` largest of these drops over every stage and k at once."""
    stages = len(bounds) - 1
    if spare <= 0:
        return [1] * stages
    lo, hi = np.asarray(bounds[:-1]), np.asarray(bounds[1:])
    ks = np.arange(1, spare + 1, dtype=np.float64)
    drops = (problem.n[lo, hi] * problem.load[lo, hi])[:, None] / (ks * (ks + 1))[None, :]
    taken = np.argpartition(-drops, spare - 1, axis=None)[:spare] // spare  # the stage of each drop taken
    return [1 + int(c) for c in np.bincount(taken, minlength=stages)]


def _merge(problem: StageProblem, bounds: Sequence[int],
           counts: Sequence[int]) -> tuple[list[int], list[int]]:
    """Phase 2: merge the adjacent pair with the highest positive gain until none is positive."""
    lo, hi, k = list(bounds[:-1]), list(bounds[1:]), list(counts)
    size = len(k)
    nxt, prv = list(range(1, size + 1)), list(range(-1, size - 1))
    alive, version = [True] * size, [0] * size
    heap: list[tuple[float, int, int, int, int]] = []

    def push(a: int, b: int) -> None:
        if a < 0 or b >= size:
            return
        apart = problem.stage_qoe(lo[a], hi[a], k[a]) + problem.stage_qoe(lo[b], hi[b], k[b])
        apart += problem.cut_cost(lo[b])
        merged = problem.stage_qoe(lo[a], hi[b], k[a] + k[b])
        gain = apart - merged
        if gain > _REL_EPS * (apart + merged):
            heapq.heappush(heap, (-gain, a, version[a], b, version[b]))

    for a in range(size - 1):
        push(a, a + 1)
    while heap:
        _, a, va, b, vb = heapq.heappop(heap)
        if not (alive[a] and alive[b] and nxt[a] == b and version[a] == va and version[b] == vb):
            continue  # a stage of this pair has changed since the gain was computed
        hi[a], k[a], alive[b], version[a] = hi[b], k[a] + k[b], False, version[a] + 1
        nxt[a] = nxt[b]
        if nxt[a] < size:
            prv[nxt[a]] = a
        push(prv[a], a)
        push(a, nxt[a])
    kept = [s for s in range(size) if alive[s]]
    return [lo[s] for s in kept] + [hi[kept[-1]]], [k[s] for s in kept]


def exact(problem: StageProblem) -> StagePlan:
    """The bucketed recursion solved exactly: g_{e,j} over instances e and edge j, vectorised over e and k."""
    instances, size = problem.instances, problem.buckets + 1
    d0 = problem.model.d[0]
    ks = np.arange(1, instances + 1, dtype=np.float64)
    before = np.arange(instances + 1)[:, None] - np.arange(1, instances + 1)[None, :]  # [e, k-1] = e - k
    valid = before >= 0
    before = np.where(valid, before, 0)
    rows = np.arange(instances + 1)
    g = np.full((instances + 1, size), np.inf)
    g[0, 0] = 0.0
    from_i = np.zeros((instances + 1, size), dtype=np.int64)
    with_k = np.zeros((instances + 1, size), dtype=np.int64)
    for j in range(1, size):
        for i in range(j):
            n = problem.n[i, j]
            stage = n * d0 + n * problem.load[i, j] / ks + problem.cuts[i]  # [k-1]
            total = np.where(valid, g[:, i][before], np.inf) + stage[None, :]
            arg = total.argmin(axis=1)
            value = total[rows, arg]
            better = value < g[:, j]
            g[better, j] = value[better]
            from_i[better, j] = i
            with_k[better, j] = arg[better] + 1
    if not np.isfinite(g[instances, size - 1]):
        raise StagePlanError("no partition found")  # unreachable: one stage of every instance always fits
    bounds, counts, e, j = [size - 1], [], instances, size - 1
    while j > 0:
        k = int(with_k[e, j])
        j = int(from_i[e, j])
        bounds.append(j)
        counts.append(k)
        e -= k
    return problem.plan(bounds[::-1], counts[::-1], "exact")


def brute_force(problem: StageProblem) -> StagePlan:
    """Every cut set and every split of the instances over its stages (tests only: exponential)."""
    best: tuple[float, list[int], list[int]] | None = None
    inner = range(1, problem.buckets)
    for stages in range(1, min(problem.instances, problem.buckets) + 1):
        for cuts in itertools.combinations(inner, stages - 1):
            bounds = [0, *cuts, problem.buckets]
            for splits in itertools.combinations(range(1, problem.instances), stages - 1):
                marks = [0, *splits, problem.instances]
                counts = [b - a for a, b in itertools.pairwise(marks)]
                q = problem.quality(bounds, counts)
                if best is None or q < best[0]:
                    best = (q, bounds, counts)
    assert best is not None  # one stage on every instance is always enumerated
    return problem.plan(best[1], best[2], "brute_force")


def plan_stages(instances: int, max_len: int, requests: Sequence[tuple[int, int]], model: QoEModel,
                transfer: TransferCost, method: Method = "heuristic") -> StagePlan:
    """The stage partition of `instances` over lengths [0, max_len] for `requests` ((I, O) pairs)."""
    problem = StageProblem(instances, max_len, requests, model, transfer)
    solve = {"heuristic": heuristic, "paper": paper_heuristic, "exact": exact, "brute_force": brute_force,
             "chain": chain}
    return solve[method](problem)
