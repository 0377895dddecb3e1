"""Re-planning a cascade on workload shift (Cascadia §4.4, footnote 5, App. G): what the gateway watches,
when it re-runs Algorithm 1, and how a new deployment rolls out.

Owns:
- `WorkloadMonitor`: windows of `window_s` (5 min). It counts every arrival (the rate), keeps a uniform
  sample of `sample_size` (50) answered requests' prompt and answer tokens (reservoir sampling), says which
  arrivals to shadow (`shadow_share`, 5 %: the server runs them through every stage and judges each answer,
  unbilled) and collects the shadowed requests' per-model scores (`ShadowRow`), footnote 5's "quality score
  distributions".
- The shift rule, tested when a window closes against the workload the running plan was made for
  (`Baseline`). Any of:
  - rate: the window's arrivals are unlikely under a Poisson process at the planned rate (two-sided,
    p < `alpha`) and differ from it by at least `min_rate_change` (10 %);
  - lengths: the sampled prompt or answer tokens' mean differs from the planned one (a one-sample t-test
    against the mean the plan assumed, p < `alpha`);
  - complexity: some stage model's mean shadow score differs from the planned one (the same test; Welch's
    two-sample t-test instead when the baseline is itself observed, `Baseline.sampled`,
    p < `alpha` / number of models), once `min_shadow` shadowed scores of it are in hand (the window's,
    pooled with the windows before it since the last plan when fewer).
  The tests are on means because the planner's inputs are means (Q(H) is a mean score, the load a mean
  length times a rate). On MT-Bench's scores (standard deviation about 30 points) a two-sample
  Kolmogorov-Smirnov test against the profile's items caught the hard -> all shift (13 points of mean) in
  1 window of 8 with 90 shadowed rows, Welch's two-sample t-test in 1 of 8; the one-sample test, which does
  not treat the plan's profile as a noisy sample, in 7 of 8.
  `alpha` is 0.001: a stable workload closes about 300 windows (25 h at 5 min) per false re-plan per test.
  A shift gives the data to plan on (`Shift`): the window's rate and a `QualityProfile` of the shadowed rows
  that scored every model (they carry their texts' tokens and each model's score; None when fewer than
  `min_shadow`), which becomes the new `Baseline` once the plan is adopted (`adopt`). A row may lack a
  model: it counts for the others (the gateway and the simulator leave out a model whose stage could not
  run or whose verdict failed, e.g. a model the running plan gives no replica, so its rows still test the
  models that ran; such a shift re-plans on the previous profile when too few rows are whole).
- `rollout`: the steps from one deployment to another. Replicas in both stay and serve. One replica is
  reconfigured at a time: first whatever new replicas fit in idle GPUs (make before break), then each step
  drains one old replica and loads the new replicas its GPUs (with those already free) can hold. A model is
  drained of its last serving replica only when no other order exists; `Step.gap` says so.
Must not: read clocks, run the planner on the request path (the caller runs `plan_cascade` off it: a worker
thread live, a solve whose time is measured in the simulator), or touch engines.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from scipy import stats

from gateway.cascade.quality import Item, ItemScore, QualityProfile, QualityProfileError, prompt_tokens

MAX_THRESHOLD = 100.0  # the gateway's thresholds stop at 100 (a 100 score is still accepted)
SHADOW_CONCURRENCY = 8  # shadowed requests running at once per cascade; more are skipped (and counted)
OBSERVED_CATEGORY = "observed"  # the category of a shadowed request's item (no MT-Bench category live)


@dataclass(frozen=True)
class ReplanParams:
    window_s: float = 300.0  # §4.4: every 5 minutes
    sample_size: int = 50  # §4.4: 50 requests sampled per window
    shadow_share: float = 0.05  # footnote 5: 5 % of requests through every stage
    alpha: float = 0.001  # significance of each shift test
    min_rate_change: float = 0.10  # a significant rate change smaller than this is no shift
    min_shadow: int = 20  # shadowed rows needed to test (and re-plan) complexity
    history_windows: int = 3  # windows pooled (since the last plan) when one holds too few shadowed rows

    def __post_init__(self) -> None:
        if not (math.isfinite(self.window_s) and self.window_s > 0):
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if self.sample_size < 2 or self.min_shadow < 2 or self.history_windows < 1:
            raise ValueError("sample_size and min_shadow must be >= 2 and history_windows >= 1")
        if not 0.0 <= self.shadow_share <= 1.0:
            raise ValueError(f"shadow_share must be in [0, 1], got {self.shadow_share}")
        if not 0.0 < self.alpha < 1.0 or not self.min_rate_change >= 0.0:
            raise ValueError("alpha must be in (0, 1) and min_rate_change >= 0")


@dataclass(frozen=True)
class ShadowRow:
    """A shadowed request: its item (texts, for prompt lengths) and each stage model's score and length (a
    model that could not run is missing)."""

    item: Item
    scores: Mapping[str, ItemScore]


@dataclass(frozen=True)
class Baseline:
    """The workload a plan was made for: rate, prompt and answer token samples, each model's scores."""

    rate_rps: float
    prompt_tokens: tuple[int, ...]
    answer_tokens: tuple[int, ...]
    scores: Mapping[str, tuple[float, ...]]
    # False: a plan's profile, the population the plan assumed (windows are tested against its means);
    # True: observed samples (shadowed rows, a window's sample), themselves noisy (two-sample tests).
    sampled: bool = False

    @classmethod
    def of_profile(
        cls, profile: QualityProfile, models: Sequence[str], thresholds: Sequence[float], rate_rps: float
    ) -> Baseline:
        """What a plan on `profile` expects: prompts as the first stage sees them, answers of the stage that
        answers each item under `thresholds`."""
        routing = profile.route(models, thresholds)
        prompts = tuple(prompt_tokens(item, profile, models[0]) for item in profile.items)
        answers = tuple(
            profile.scores(models[stage])[i].answer_tokens for i, stage in enumerate(routing.answering_stage)
        )
        scores = {m: tuple(s.score for s in profile.scores(m)) for m in models}
        return cls(rate_rps, prompts, answers, scores)


@dataclass(frozen=True)
class Shift:
    """A window whose workload left the plan's: why, and what to plan on."""

    at_s: float
    reasons: tuple[str, ...]
    rate_rps: float
    profile: QualityProfile | None  # the shadowed rows; None when too few (re-plan on the old profile)
    prompt_tokens: tuple[int, ...]
    answer_tokens: tuple[int, ...]


@dataclass
class _Window:
    start_s: float
    arrivals: int = 0
    seen: int = 0  # answered requests offered to the sample
    sample: list[tuple[int, int]] = field(default_factory=list)
    rows: list[ShadowRow] = field(default_factory=list)


class WorkloadMonitor:
    """One cascade's windows; the caller feeds it and asks `close` when `next_close_s` has passed."""

    def __init__(
        self, models: Sequence[str], baseline: Baseline, params: ReplanParams, *, start_s: float, seed: int
    ) -> None:
        self.models = tuple(models)
        self.params = params
        self.baseline = baseline
        self._rng = random.Random(seed)
        self._window = _Window(start_s)
        self._history: list[_Window] = []  # closed windows since the last adopted plan, newest last
        self.windows = 0
        self.shadowed = 0
        self.last_tests: dict[str, float] = {}  # test -> p-value at the last close (metrics, reports)

    @property
    def next_close_s(self) -> float:
        return self._window.start_s + self.params.window_s

    def on_arrival(self) -> bool:
        """Count an arrival; True when it is to be shadowed."""
        self._window.arrivals += 1
        shadow = self._rng.random() < self.params.shadow_share
        self.shadowed += shadow
        return shadow

    def on_answer(self, prompt_tokens: int, answer_tokens: int) -> None:
        """An answered request's tokens (reservoir sample of `sample_size` per window)."""
        window = self._window
        window.seen += 1
        if len(window.sample) < self.params.sample_size:
            window.sample.append((prompt_tokens, answer_tokens))
            return
        slot = self._rng.randrange(window.seen)
        if slot < self.params.sample_size:
            window.sample[slot] = (prompt_tokens, answer_tokens)

    def on_shadow(self, row: ShadowRow) -> None:
        unknown = [m for m in row.scores if m not in self.models]
        if unknown or not row.scores:
            got = ", ".join(row.scores) or "none"
            raise ValueError(f"a shadow row scores stage models ({', '.join(self.models)}); got {got}")
        self._window.rows.append(row)

    def close(self, now_s: float) -> Shift | None:
        """Close every window ended by `now_s`; the shift the last of them shows, if any."""
        shift: Shift | None = None
        while self.next_close_s <= now_s:
            window = self._window
            end_s = self.next_close_s
            self._window = _Window(end_s)
            self.windows += 1
            self._history = [*self._history, window][-self.params.history_windows :]
            shift = self._test(window, end_s)
        return shift

    def adopt(self, baseline: Baseline) -> None:
        """A new plan runs: later windows are tested against what it was made for."""
        self.baseline = baseline
        self._history = []

    def _pooled_rows(self, model: str | None = None) -> list[ShadowRow]:
        """The newest windows' rows scoring `model` (every model: None), back until `min_shadow`."""
        rows: list[ShadowRow] = []
        for window in reversed(self._history):
            rows = [r for r in window.rows if _scores(r, model, self.models)] + rows
            if len(rows) >= self.params.min_shadow:
                break
        return rows

    def _test(self, window: _Window, end_s: float) -> Shift | None:
        params, base = self.params, self.baseline
        reasons: list[str] = []
        tests: dict[str, float] = {}
        rate = window.arrivals / params.window_s
        expected = base.rate_rps * params.window_s
        if expected > 0:
            k = window.arrivals
            p = min(1.0, 2 * min(stats.poisson.cdf(k, expected), stats.poisson.sf(k - 1, expected)))
            tests["rate"] = float(p)
            if p < params.alpha and abs(k / expected - 1.0) >= params.min_rate_change:
                reasons.append(f"rate {base.rate_rps:.3g} -> {rate:.3g} req/s (p={p:.2g})")
        elif window.arrivals:
            reasons.append(f"rate 0 -> {rate:.3g} req/s")
        prompts = tuple(p for p, _ in window.sample)
        answers = tuple(a for _, a in window.sample)
        if len(window.sample) >= params.sample_size:
            for name, seen, planned in (
                ("prompt_tokens", prompts, base.prompt_tokens),
                ("answer_tokens", answers, base.answer_tokens),
            ):
                p = _t_test(seen, planned, base.sampled)
                tests[name] = p
                if p < params.alpha:
                    reasons.append(f"{name} mean {_mean(planned):.0f} -> {_mean(seen):.0f} (p={p:.2g})")
        per_model = params.alpha / len(self.models)
        for model in self.models:
            rows = self._pooled_rows(model)
            planned_scores = base.scores.get(model, ())
            if len(rows) < params.min_shadow or not planned_scores:
                continue
            seen_scores = [r.scores[model].score for r in rows]
            p = _t_test(seen_scores, planned_scores, base.sampled)
            tests[f"scores:{model}"] = p
            if p < per_model:
                reasons.append(
                    f"{model} scores mean {_mean(planned_scores):.1f} -> {_mean(seen_scores):.1f} "
                    f"(p={p:.2g}, {len(rows)} shadowed)"
                )
        self.last_tests = tests
        if not reasons:
            return None
        full = self._pooled_rows()
        profile = _profile(full, self.models) if len(full) >= params.min_shadow else None
        return Shift(end_s, tuple(reasons), rate, profile, prompts, answers)


def _scores(row: ShadowRow, model: str | None, models: Sequence[str]) -> bool:
    return all(m in row.scores for m in models) if model is None else model in row.scores


def _t_test(seen: Sequence[float], planned: Sequence[float], sampled: bool) -> float:
    """Two-sided p-value that `seen`'s mean is the planned one: a one-sample t-test against the planned mean
    when the plan's profile is the population it assumed, Welch's two-sample test when the baseline is
    itself a sample (`Baseline.sampled`). With no variance: 1 when the means are equal, else 0."""
    if sampled:
        p = float(stats.ttest_ind(seen, planned, equal_var=False).pvalue)
    else:
        p = float(stats.ttest_1samp(seen, _mean(planned)).pvalue)
    if math.isnan(p):
        return 1.0 if _mean(seen) == _mean(planned) else 0.0
    return p


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _profile(rows: Sequence[ShadowRow], models: Sequence[str]) -> QualityProfile:
    try:
        return QualityProfile([r.item for r in rows], {m: [r.scores[m] for r in rows] for m in models})
    except QualityProfileError as exc:  # rows were checked on the way in; this is a bug, not input
        raise AssertionError(str(exc)) from None


def adopted_baseline(
    profile: QualityProfile,
    models: Sequence[str],
    thresholds: Sequence[float],
    shift: Shift,
    *,
    shadowed: bool,
    sample_size: int,
) -> Baseline:
    """What later windows are tested against once a plan made on `profile` at `shift.rate_rps` runs (the
    gateway and the simulator adopt through this).

    The rate and the scores are the plan's. The lengths are the engines' counts where they are known, so a
    steady workload does not look shifted for ever: prompts are the window's full sample (the profile's are
    ceil(bytes / 4) of the question, without a chat template); answers are the shadowed rows' under the new
    thresholds when the plan was made on them (`shadowed`), else the window's full sample, else the
    profile's."""
    planned = Baseline.of_profile(profile, models, thresholds, shift.rate_rps)
    full = len(shift.prompt_tokens) >= sample_size
    prompts = shift.prompt_tokens if full else planned.prompt_tokens
    answers = planned.answer_tokens if shadowed or not full else shift.answer_tokens
    return Baseline(shift.rate_rps, tuple(prompts), tuple(answers), planned.scores, shadowed or full)


def servable_thresholds(thresholds: Sequence[float]) -> tuple[tuple[float, ...], tuple[str, ...]]:
    """A plan's thresholds as the gateway takes them: the routing search's 101 (escalate every request) is
    served as 100, which escalates all but a perfect score; notes say where."""
    out: list[float] = []
    notes: list[str] = []
    for stage, value in enumerate(thresholds):
        served = min(max(float(value), 0.0), MAX_THRESHOLD)
        if served != value:
            notes.append(f"stage {stage}: the plan's threshold {value:g} is served as {served:g}")
        out.append(served)
    return tuple(out), tuple(notes)


def shadow_item(index: int, questions: Sequence[str]) -> Item:
    """The item of a shadowed live request (its user turns; no MT-Bench id or category)."""
    return Item(question_id=-1 - index, turn=1, category=OBSERVED_CATEGORY, questions=tuple(questions))


# ---- rolling reconfiguration ---------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Replica:
    model: str
    tensor_parallel: int
    pipeline_parallel: int

    @property
    def gpus(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel


@dataclass(frozen=True)
class Step:
    """Drain `remove` (None: nothing), then load `add` on its GPUs and those idle. `gap`: `remove` was its
    model's last serving replica, so nothing of the model serves from its drain until a replica of it loads
    (the cascade then answers with the held stage, degraded, or starts past an empty first stage)."""

    remove: Replica | None
    add: tuple[Replica, ...]
    gap: bool = False


def replicas(models: Sequence[str], shapes: Sequence[Sequence[Sequence[int]]]) -> list[Replica]:
    """A plan's `shapes` ([[tp, pp, count], ...] per stage) as replicas."""
    out: list[Replica] = []
    for model, stage in zip(models, shapes, strict=True):
        for tp, pp, count in stage:
            out += [Replica(model, int(tp), int(pp))] * int(count)
    return out


def rollout(old: Sequence[Replica], new: Sequence[Replica], total_gpus: int) -> tuple[Step, ...]:
    """The steps from `old` to `new` on `total_gpus` GPUs (both must fit), one replica reconfigured at a
    time."""
    for name, deployment in (("old", old), ("new", new)):
        if sum(r.gpus for r in deployment) > total_gpus:
            raise ValueError(f"the {name} deployment needs more than {total_gpus} GPUs")
    old_c, new_c = Counter(old), Counter(new)
    keep = old_c & new_c
    remove = sorted((old_c - keep).elements(), key=lambda r: (-r.gpus, r))
    add = sorted((new_c - keep).elements(), key=lambda r: (-r.gpus, r))
    serving = Counter(r.model for r in keep.elements())
    serving.update(r.model for r in remove)
    free = total_gpus - sum(r.gpus for r in old)
    steps: list[Step] = []

    def load() -> tuple[Replica, ...]:
        nonlocal free
        loaded = []
        for replica in list(add):
            if replica.gpus <= free:
                add.remove(replica)
                free -= replica.gpus
                loaded.append(replica)
        serving.update(r.model for r in loaded)
        return tuple(loaded)

    first = load()
    if first:
        steps.append(Step(None, first))
    while remove:
        # Prefer a replica whose model keeps another serving, then one whose GPUs let a new replica load,
        # then one of the model with the most replicas serving (it loses the least capacity).
        def rank(r: Replica, free: int = free) -> tuple[bool, bool, int, int]:
            unlocks = any(a.gpus <= free + r.gpus for a in add)
            return (serving[r.model] <= 1, not unlocks, -serving[r.model], -r.gpus)

        victim = min(remove, key=rank)
        remove.remove(victim)
        gap = serving[victim.model] <= 1
        serving[victim.model] -= 1
        free += victim.gpus
        loaded = load()
        steps.append(Step(victim, loaded, gap))
    if add:
        raise AssertionError(f"rollout left {add} unplaced")  # the sizes were checked above
    return tuple(steps)
