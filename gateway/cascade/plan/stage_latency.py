"""Cascadia's Sim(w_i, f_i) for one replica, analytic (App. B): a stage workload's p95 latency and capacity.

Owns: `StageWorkload` (a stage's arrival rate and the prompt / answer lengths of the requests that reach it),
`ReplicaShape` (tp, pp), `StageLatencyModel` (per GPU type: the memory-feasible shapes of a model, and the
steady-state estimate of one replica under a share of a workload, memoised), `ReplicaEstimate` and the p95 of
a mixture of replicas (`mixture_p95`).
Must not: choose parallelism or allocate GPUs (`parallelism`, `milp`), route, read clocks or do I/O.

The model (App. B: FCFS, continuous batching, memory-limited batch; requests reach replicas round robin, so
each of R replicas sees rate / R). One replica in steady state, timed by the engine model the simulated GPU
steps with (`switchyard.perf_model.iteration_time_s`, pipeline parallelism included):

- Let u be the requests admitted per iteration. By Little's law over iterations, the mean batch holds
  u * E[chunks] prefill sequences (chunks = ceil(prompt / max_batched_tokens)), u * E[answer - 1] decoding
  ones with u * E[(o - 1)(p + (o + 2) / 2)] context tokens in all, and u * E[p] prefill tokens; the longest
  context is the sample's (p + o) quantile at n / (n + 1). Prompt chunks come whole: an iteration holds
  floor(x) or floor(x) + 1 mean chunks (x = u * E[chunks]), mixed to the mean (a mean of half a chunk would
  underestimate the lumpy prefill iterations: a roofline is convex). T(u) is that mix's mean iteration
  time, and the replica serves lambda(u) = u / T(u) requests per second.
- Limits: running sequences <= max_num_seqs, KV tokens (u * E[p * chunks + decode contexts]) <= the profile's
  KV capacity less one mean request (p + o: a prompt is admitted only when all of its chunk fits, so the last
  request's worth of blocks stays free; with a small cache this whole-request effect is what binds),
  tokens per iteration <= max_batched_tokens. u_max is the first limit reached; the capacity is
  max lambda(u) over (0, u_max]. A rate at or above it is overload: infinite latency.
- Below it, lambda(u) = rate gives the operating point (interpolated on a geometric grid of u, lambda made
  monotone); a tagged request sees the mean batch plus itself, T_seen(u), so at light load it is a lone
  request's iteration. Request j takes k_j = chunks_j + o_j - 1 iterations after the half iteration it waits
  on arrival: service_j = T_seen * (k_j + 0.5).
- Queueing when the batch is full: an M/M/c wait with c = the batch size at u_max (slots), offered load
  a = c * u / u_max, mean service S = T_seen * (E[k] + 0.5): P(wait > t) = ErlangC(c, a) * exp(-(c - a) t / S)
  (Halfin-Whitt's approximation of Erlang C above 30 slots).
- The replica's p95 is the 95th percentile of service_j + wait over the workload's requests (nearest rank when
  nobody waits, otherwise the root of the mixture's survival = 5 %, found by bisection).
Not modelled: the excess of a request's own prefill over the mean iteration (short MT-Bench prompts),
preemption (the mean KV must fit), the pipeline's bubbles beyond one activation hand-over per stage boundary.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from switchyard.hardware import MODELS, GpuSpec, ModelShape
from switchyard.perf_model import PerfCoefficients, iteration_time_s
from switchyard.profiles import PIPELINE_PARALLEL_DEGREES, TENSOR_PARALLEL_DEGREES, Profile, build_profile

PERCENTILE = 0.95
TAIL = 1.0 - PERCENTILE
GRID_POINTS = 96
GRID_LOW = 1e-4  # the grid of u spans u_max * [1e-4, 1]
NO_WAIT = 1e-7  # an Erlang C below this is taken as no waiting
EXACT_ERLANG_SLOTS = 30
INF = math.inf

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class StageWorkload:
    """What reaches one stage: its arrival rate and, per request of the profile sample, prompt and answer."""

    rate_rps: float
    prompt_tokens: tuple[int, ...]
    answer_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.rate_rps >= 0.0 or math.isinf(self.rate_rps):
            raise ValueError(f"rate_rps must be finite and >= 0, got {self.rate_rps}")
        if len(self.prompt_tokens) != len(self.answer_tokens):
            raise ValueError("prompt_tokens and answer_tokens must pair up, one of each per request")
        if self.rate_rps > 0.0 and not self.prompt_tokens:
            raise ValueError("a workload with traffic needs at least one request's lengths")
        if any(p < 1 for p in self.prompt_tokens) or any(o < 1 for o in self.answer_tokens):
            raise ValueError("prompt and answer lengths must be >= 1 token")

    @property
    def lengths(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.prompt_tokens, self.answer_tokens)

    @property
    def idle(self) -> bool:
        return self.rate_rps == 0.0


@dataclass(frozen=True, slots=True, order=True)
class ReplicaShape:
    """One replica's parallelism: tp GPUs per stage, pp stages."""

    tensor_parallel: int
    pipeline_parallel: int = 1

    @property
    def gpus(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def label(self) -> str:
        return f"tp{self.tensor_parallel}pp{self.pipeline_parallel}"


@dataclass(frozen=True, slots=True)
class LengthStats:
    """A workload's lengths reduced to what the model needs (for one chunk size)."""

    count: int
    mean_chunks: float
    mean_prompt: float
    mean_decodes: float  # E[o - 1]
    mean_pairs: float  # E[p (p + 1) / 2]
    mean_prior: float  # E[tokens already computed, summed over a prompt's chunks]
    mean_decode_context: float  # E[(o - 1)(p + (o + 2) / 2)]
    mean_kv_tokens: float  # E[p * chunks] + mean_decode_context: KV held, summed over a request's iterations
    iterations: tuple[float, ...]  # k_j = chunks_j + o_j - 1, sorted
    contexts: tuple[int, ...]  # p_j + o_j, sorted

    @classmethod
    def of(cls, prompts: Sequence[int], answers: Sequence[int], chunk_tokens: int) -> LengthStats:
        n = len(prompts)
        chunks = [-(-p // chunk_tokens) for p in prompts]
        prior = [sum(k * chunk_tokens for k in range(c)) for c in chunks]
        decode_ctx = [(o - 1) * (p + (o + 2) / 2.0) for p, o in zip(prompts, answers, strict=True)]
        return cls(
            count=n,
            mean_chunks=sum(chunks) / n,
            mean_prompt=sum(prompts) / n,
            mean_decodes=sum(o - 1 for o in answers) / n,
            mean_pairs=sum(p * (p + 1) / 2.0 for p in prompts) / n,
            mean_prior=sum(prior) / n,
            mean_decode_context=sum(decode_ctx) / n,
            mean_kv_tokens=(sum(p * c for p, c in zip(prompts, chunks, strict=True)) + sum(decode_ctx)) / n,
            iterations=tuple(sorted(float(c + o - 1) for c, o in zip(chunks, answers, strict=True))),
            contexts=tuple(sorted(p + o for p, o in zip(prompts, answers, strict=True))),
        )

    @property
    def mean_iterations(self) -> float:
        return sum(self.iterations) / self.count

    def context_quantile(self, level: float) -> int:
        index = min(self.count - 1, max(0, math.ceil(level * self.count) - 1))
        return self.contexts[index]


@dataclass(frozen=True, slots=True)
class ReplicaEstimate:
    """One replica's steady state under `rate_rps`; `p95_s` is infinite when overloaded."""

    rate_rps: float
    capacity_rps: float
    step_s: float  # T_seen: the iteration a request sees (one token per sequence)
    batch_seqs: float  # mean running sequences
    utilisation: float  # u / u_max
    wait_probability: float  # Erlang C
    wait_rate_per_s: float  # P(wait > t) = wait_probability * exp(-wait_rate_per_s * t)
    mean_s: float
    p95_s: float

    @property
    def overloaded(self) -> bool:
        return math.isinf(self.p95_s)

    def service_s(self, iterations: float) -> float:
        """Service latency of a request that takes this many iterations after arriving."""
        return self.step_s * (iterations + 0.5)

    def mean_wait_s(self) -> float:
        return self.wait_probability / self.wait_rate_per_s if self.wait_probability > 0.0 else 0.0


OVERLOADED = ReplicaEstimate(0.0, 0.0, INF, INF, INF, 1.0, 0.0, INF, INF)
IDLE = ReplicaEstimate(0.0, INF, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def erlang_c(servers: float, offered: float) -> float:
    """Probability that an arrival waits in M/M/c with `servers` (c) and offered load a = lambda * S."""
    if offered <= 0.0:
        return 0.0
    if offered >= servers:
        return 1.0
    if servers <= EXACT_ERLANG_SLOTS:
        c = max(1, math.floor(servers))
        if offered >= c:
            return 1.0
        blocking = 1.0
        for k in range(1, c + 1):
            blocking = offered * blocking / (k + offered * blocking)
        return blocking / (1.0 - offered / c * (1.0 - blocking))
    beta = (servers - offered) / math.sqrt(servers)  # Halfin-Whitt: (1 - rho) sqrt(c)
    phi = math.exp(-beta * beta / 2.0) / math.sqrt(2.0 * math.pi)
    big_phi = 0.5 * (1.0 + math.erf(beta / math.sqrt(2.0)))
    return 1.0 / (1.0 + beta * big_phi / phi)


def _survival(x: float, part: ReplicaEstimate, stats: LengthStats, ks: FloatArray) -> float:
    """P(latency > x) for a request drawn from the workload, served by this replica."""
    if part.wait_probability < NO_WAIT:
        threshold = x / part.step_s - 0.5
        return (stats.count - bisect.bisect_right(stats.iterations, threshold)) / stats.count
    service = part.step_s * (ks + 0.5)
    tail = part.wait_probability * np.exp(-part.wait_rate_per_s * np.maximum(x - service, 0.0))
    return float(np.mean(np.where(service > x, 1.0, tail)))


def mixture_p95(parts: Sequence[tuple[ReplicaEstimate, float]], stats: LengthStats) -> float:
    """The 95th percentile of latency when a request reaches replica r with probability weight_r.

    Infinite when any replica is overloaded (its queue grows without bound: the stage cannot keep up)."""
    if not parts:
        return INF
    if any(p.overloaded for p, _ in parts):
        return INF
    if len(parts) == 1 and parts[0][0].wait_probability < NO_WAIT:
        index = min(stats.count - 1, math.ceil(PERCENTILE * stats.count) - 1)
        return parts[0][0].service_s(stats.iterations[index])
    ks = np.asarray(stats.iterations, dtype=np.float64)
    hi = 0.0
    for part, _ in parts:
        hi = max(hi, part.service_s(stats.iterations[-1]))
        if part.wait_probability > TAIL:
            hi = max(hi, part.service_s(stats.iterations[-1])
                     + math.log(part.wait_probability / TAIL) / part.wait_rate_per_s)
    lo = 0.0
    total = sum(w for _, w in parts)
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        s = sum(w * _survival(mid, part, stats, ks) for part, w in parts) / total
        if s > TAIL:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-9 * hi:
            break
    return hi


@dataclass(frozen=True, slots=True)
class _Curve:
    """One shape's steady-state curve over u for one workload's lengths (rate-free)."""

    u_grid: FloatArray
    rate_grid: FloatArray  # lambda(u), made nondecreasing
    seen_grid: FloatArray  # T_seen(u)
    u_max: float
    slots: float
    capacity_rps: float
    batch_per_u: float


class StageLatencyModel:
    """Sim(w, f) for one GPU type, memoised per (model, shape, workload lengths): build once per planning run
    (or keep one across re-plans) and ask it for any rate."""

    def __init__(self, gpu: GpuSpec, *, models: Mapping[str, ModelShape] = MODELS, min_full_contexts: int = 1,
                 gpu_memory_utilization: float = 0.9) -> None:
        self.gpu = gpu
        self._models = models
        self._min_full_contexts = min_full_contexts
        self._utilisation = gpu_memory_utilization
        self._profiles: dict[tuple[str, ReplicaShape], Profile | None] = {}
        self._coeffs: dict[tuple[str, ReplicaShape], PerfCoefficients] = {}
        self._stats: dict[tuple[tuple[tuple[int, ...], tuple[int, ...]], int], LengthStats] = {}
        self._curves: dict[tuple[str, ReplicaShape, tuple[tuple[int, ...], tuple[int, ...]]], _Curve] = {}
        self._estimates: dict[tuple[str, ReplicaShape, tuple[tuple[int, ...], tuple[int, ...]], float],
                              ReplicaEstimate] = {}

    def model(self, name: str) -> ModelShape:
        try:
            return self._models[name]
        except KeyError:
            raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(self._models))}") from None

    def profile(self, model: str, shape: ReplicaShape) -> Profile | None:
        """The engine profile of this shape, or None when it does not fit (memory, heads over tp, pp)."""
        key = (model, shape)
        if key not in self._profiles:
            self._profiles[key] = build_profile(
                self.gpu, self.model(model), shape.tensor_parallel, shape.pipeline_parallel,
                min_full_contexts=self._min_full_contexts, gpu_memory_utilization=self._utilisation)
        return self._profiles[key]

    def shapes(self, model: str, max_gpus: int | None = None) -> tuple[ReplicaShape, ...]:
        """Every memory-feasible (tp, pp) with tp in {1,2,4,8}, pp in {1,2,3,4}, at most `max_gpus` GPUs."""
        found = [ReplicaShape(tp, pp) for tp in TENSOR_PARALLEL_DEGREES for pp in PIPELINE_PARALLEL_DEGREES
                 if (max_gpus is None or tp * pp <= max_gpus)
                 and self.profile(model, ReplicaShape(tp, pp)) is not None]
        return tuple(sorted(found, key=lambda s: (s.gpus, s.pipeline_parallel)))

    def stats(self, model: str, shape: ReplicaShape, workload: StageWorkload) -> LengthStats:
        profile = self._require(model, shape)
        key = (workload.lengths, profile.max_batched_tokens)
        if key not in self._stats:
            self._stats[key] = LengthStats.of(workload.prompt_tokens, workload.answer_tokens,
                                              profile.max_batched_tokens)
        return self._stats[key]

    def capacity_rps(self, model: str, shape: ReplicaShape, workload: StageWorkload) -> float:
        """Requests per second one replica sustains on this workload's lengths."""
        if not workload.prompt_tokens:
            return INF
        return self._curve(model, shape, workload).capacity_rps

    def replica(self, model: str, shape: ReplicaShape, workload: StageWorkload,
                replicas: int = 1) -> ReplicaEstimate:
        """One of `replicas` round-robin replicas of this shape, each receiving workload.rate / replicas."""
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        rate = workload.rate_rps / replicas
        if rate == 0.0:
            return IDLE
        key = (model, shape, workload.lengths, rate)
        found = self._estimates.get(key)
        if found is None:
            found = self._estimate(model, shape, workload, rate)
            self._estimates[key] = found
        return found

    def _require(self, model: str, shape: ReplicaShape) -> Profile:
        profile = self.profile(model, shape)
        if profile is None:
            raise ValueError(f"{model} does not fit on {shape.label} x {self.gpu.display_name}")
        return profile

    def _estimate(self, model: str, shape: ReplicaShape, workload: StageWorkload,
                  rate: float) -> ReplicaEstimate:
        curve = self._curve(model, shape, workload)
        if rate >= curve.capacity_rps:
            return OVERLOADED
        stats = self.stats(model, shape, workload)
        u = float(np.interp(rate, curve.rate_grid, curve.u_grid))
        seen = float(np.interp(u, curve.u_grid, curve.seen_grid))
        utilisation = u / curve.u_max
        offered = curve.slots * utilisation
        mean_service = seen * (stats.mean_iterations + 0.5)
        wait_p = erlang_c(curve.slots, offered)
        wait_rate = (curve.slots - offered) / mean_service
        part = ReplicaEstimate(rate, curve.capacity_rps, seen, u * curve.batch_per_u, utilisation, wait_p,
                               wait_rate, 0.0, 0.0)
        mean = mean_service + part.mean_wait_s()
        p95 = mixture_p95([(part, 1.0)], stats)
        return ReplicaEstimate(rate, curve.capacity_rps, seen, part.batch_seqs, utilisation, wait_p,
                               wait_rate, mean, p95)

    def _curve(self, model: str, shape: ReplicaShape, workload: StageWorkload) -> _Curve:
        key = (model, shape, workload.lengths)
        found = self._curves.get(key)
        if found is not None:
            return found
        profile = self._require(model, shape)
        coeffs = self._coeffs.get((model, shape))
        if coeffs is None:
            coeffs = self._coeffs[(model, shape)] = PerfCoefficients.from_profile(profile)
        st = self.stats(model, shape, workload)
        batch_per_u = st.mean_chunks + st.mean_decodes
        tokens_per_u = st.mean_prompt + st.mean_decodes
        kv_room = max(0.0, profile.kv_capacity_tokens - st.mean_prompt - st.mean_decodes - 1.0)
        u_max = min(profile.max_num_seqs / batch_per_u, kv_room / st.mean_kv_tokens,
                    profile.max_batched_tokens / tokens_per_u)
        if u_max <= 0.0:
            u_max = GRID_LOW  # not even one request's KV beside another: a near-zero capacity
        own_context = st.mean_decode_context / st.mean_decodes if st.mean_decodes > 0 else st.mean_prompt
        u_grid = u_max * np.geomspace(GRID_LOW, 1.0, GRID_POINTS)
        times = np.zeros(GRID_POINTS)
        seen = np.zeros(GRID_POINTS)
        per = st.mean_chunks
        chunk = (st.mean_prompt / per, st.mean_pairs / per, st.mean_prior / per)
        for i, u in enumerate(u_grid.tolist()):
            n_dec = u * st.mean_decodes
            n_seqs = n_dec + u * st.mean_chunks
            ctx_sum = u * st.mean_decode_context
            ctx_max = float(st.context_quantile(n_seqs / (n_seqs + 1.0)))
            chunks = u * st.mean_chunks
            low = math.floor(chunks)
            for k, weight in ((low, 1.0 - (chunks - low)), (low + 1, chunks - low)):
                args = (float(k), k * chunk[0], k * chunk[1], k * chunk[2])
                times[i] += weight * iteration_time_s(coeffs, *args, n_dec, ctx_sum, ctx_max)
                seen[i] += weight * iteration_time_s(coeffs, *args, n_dec + 1.0, ctx_sum + own_context,
                                                     ctx_max)
        rates = np.maximum.accumulate(u_grid / times)
        curve = _Curve(u_grid, rates, seen, u_max, max(1.0, u_max * batch_per_u), float(rates[-1]),
                       batch_per_u)
        self._curves[key] = curve
        return curve
