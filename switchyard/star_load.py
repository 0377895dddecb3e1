"""STAR's token-load arithmetic (paper 003, §5.2, Eq. 3-4, Algorithm 1), shared by the agent (its worker-side
future-load summary), the rescheduler (`gateway.rescheduling.star`) and the simulator.

Owns: what one request contributes to its engine's token load now and over the next H rounds, an engine's
summary (the sum over its requests), the horizon weights and the weighted workload w_i.
Must not: import anything of the project (ground floor), read a clock or do I/O.

Definitions (the paper leaves the discretisation open; these are ours):
- A round is k decode steps (k = the prediction interval, 20 by default); round t is t*k steps ahead,
  t = 1..H.
- A request r with N(r) tokens now (prompt + generated: the KV it holds, the paper's "current number of
  tokens") and N-hat(r) predicted remaining tokens contributes N(r) + t*k at round t while t*k < N-hat(r)
  (it is still decoding, one token per step), and 0 once it has finished. Round 0 (Eq. 3's sigma_0) is N(r).
- beta_t = beta**t (0.9 by default): the paper's "time-dependent weighting factor", its value unstated.
- w_i = sum_t beta_t * N-hat_i(B_{i,t}) (Algorithm 1, line 13).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

DEFAULT_HORIZON = 32  # H rounds
DEFAULT_ROUND_TOKENS = 20  # k decode steps per round (the paper's prediction interval)
DEFAULT_BETA = 0.9


def request_trace(
    current_tokens: float, predicted_remaining: float, round_tokens: int, horizon: int
) -> list[float]:
    """The request's load at rounds 1..H: N(r) + t*k while t*k < N-hat(r), else 0."""
    if round_tokens < 1 or horizon < 0:
        raise ValueError(f"need round_tokens >= 1 and horizon >= 0, got {round_tokens}, {horizon}")
    out = [0.0] * horizon
    for t in range(1, horizon + 1):
        ahead = t * round_tokens
        if ahead >= predicted_remaining:
            break
        out[t - 1] = current_tokens + ahead
    return out


def engine_summary(
    requests: Iterable[tuple[float, float]], round_tokens: int, horizon: int
) -> list[float]:
    """Sum of `request_trace` over (N(r), N-hat(r)) pairs: the engine's predicted load at rounds 1..H.

    O(R + H): each request adds N(r) + t*k on the rounds 1..T(r) it is still running (T(r) = the last t with
    t*k < N-hat(r)), accumulated with difference arrays instead of R*H additions.
    """
    if round_tokens < 1 or horizon < 0:
        raise ValueError(f"need round_tokens >= 1 and horizon >= 0, got {round_tokens}, {horizon}")
    count = [0] * (horizon + 2)  # running requests per round, as differences
    base = [0.0] * (horizon + 2)  # sum of N(r) of those, as differences
    for current, remaining in requests:
        last = min(horizon, _last_round(remaining, round_tokens))
        if last < 1:
            continue
        count[1] += 1
        count[last + 1] -= 1
        base[1] += current
        base[last + 1] -= current
    out = [0.0] * horizon
    running = 0
    tokens = 0.0
    for t in range(1, horizon + 1):
        running += count[t]
        tokens += base[t]
        out[t - 1] = tokens + running * t * round_tokens
    return out


def _last_round(predicted_remaining: float, round_tokens: int) -> int:
    """The last round t >= 0 with t*k < N-hat (the request runs through rounds 1..that)."""
    if predicted_remaining <= 0:
        return 0
    # t*k < R  <=>  t < R/k  <=>  t <= ceil(R/k) - 1
    whole = int(predicted_remaining // round_tokens)
    return whole - 1 if whole * round_tokens >= predicted_remaining else whole


def horizon_weights(horizon: int, beta: float = DEFAULT_BETA) -> list[float]:
    """beta_t = beta**t for t = 1..H."""
    if not 0.0 < beta <= 1.0:
        raise ValueError(f"beta must be in (0, 1], got {beta}")
    return [beta**t for t in range(1, horizon + 1)]


def weighted_load(summary: Sequence[float], weights: Sequence[float]) -> float:
    """w_i = sum_t beta_t * load_t (Algorithm 1, line 13), over the rounds both sequences cover."""
    return sum(w * x for w, x in zip(weights, summary, strict=False))
