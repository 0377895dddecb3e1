"""Token buckets and per-key admission in manual time (gateway.access.limits). Times and rates are binary
fractions so that every expectation is exact."""

from __future__ import annotations

import math

import pytest

from gateway.access.keys import ApiKey
from gateway.access.limits import Admit, KeyLimiter, Reject, TokenBucket, go_duration, retry_after_header


def key(**limits: float | int | None) -> ApiKey:
    return ApiKey("k", None, **limits)  # type: ignore[arg-type]


# --- TokenBucket


def test_a_bucket_starts_full_and_refills_at_its_rate_up_to_its_capacity() -> None:
    b = TokenBucket(capacity=4, rate_per_s=2, now_s=10.0)
    assert b.level(10.0) == 4
    assert b.try_take(3, 10.0) and b.level(10.0) == 1
    assert not b.try_take(2, 10.0) and b.level(10.0) == 1  # all or nothing
    assert b.level(10.25) == 1.5
    assert b.try_take(2, 10.5) and b.level(10.5) == 0
    assert b.level(100.0) == 4  # never above the capacity


@pytest.mark.parametrize(
    ("charges", "now_s", "level"),
    [
        ([(6, 0.0)], 0.0, -2),  # charge takes whatever the bucket holds: debt
        ([(6, 0.0)], 1.0, 0),  # debt repaid at the refill rate
        ([(6, 0.0), (1, 0.5)], 1.5, 0),
        ([(2, 0.0), (-1, 0.0)], 0.0, 3),  # a negative charge gives back ...
        ([(1, 0.0), (-5, 0.0)], 0.0, 4),  # ... up to the capacity
    ],
)
def test_charge_may_leave_debt(charges: list[tuple[float, float]], now_s: float, level: float) -> None:
    b = TokenBucket(4, 2, 0.0)
    for amount, at_s in charges:
        b.charge(amount, at_s)
    assert b.level(now_s) == level


@pytest.mark.parametrize(
    ("taken", "amount", "now_s", "wait_s"),
    [
        (0, 4, 0.0, 0.0),  # holds it
        (4, 1, 0.0, 0.5),
        (4, 4, 0.0, 2.0),
        (4, 4, 1.0, 1.0),
        (6, 1, 0.0, 1.5),  # debt first
        (0, 5, 0.0, math.inf),  # above the capacity: never
    ],
)
def test_time_until(taken: float, amount: float, now_s: float, wait_s: float) -> None:
    b = TokenBucket(4, 2, 0.0)
    b.charge(taken, 0.0)
    assert b.time_until(amount, now_s) == wait_s


def test_reads_do_not_mutate_and_time_never_runs_backwards() -> None:
    b = TokenBucket(4, 2, 10.0)
    b.charge(4, 10.0)
    assert b.level(11.0) == 2 and b.time_until(4, 11.0) == 1.0 and b.time_until_full(11.0) == 1.0
    assert b.level(10.0) == 0  # reading the future did not refill
    b.charge(1, 11.0)
    assert b.level(10.5) == 1  # an earlier reading than the last update counts as no time passed


@pytest.mark.parametrize(("capacity", "rate"), [(0, 1), (1, 0), (-1, 1)])
def test_a_bucket_needs_positive_parameters(capacity: float, rate: float) -> None:
    with pytest.raises(ValueError):
        TokenBucket(capacity, rate, 0.0)


# --- formats


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0s"),
        (0.0004, "0s"),
        (0.012, "12ms"),
        (0.9996, "1s"),
        (1.0, "1s"),
        (1.5, "1.5s"),
        (8.64, "8.64s"),
        (59.999, "59.999s"),
        (60.0, "1m0s"),
        (86.4, "1m26.4s"),
        (360.0, "6m0s"),
        (3723.5, "1h2m3.5s"),
        (-1.0, "0s"),
    ],
)
def test_go_duration_as_openai_writes_resets(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text


@pytest.mark.parametrize(
    ("seconds", "header"), [(0.0, "1"), (0.001, "1"), (1.0, "1"), (1.01, "2"), (59.5, "60")]
)
def test_retry_after_is_whole_seconds_at_least_one(seconds: float, header: str) -> None:
    assert retry_after_header(seconds) == header


# --- KeyLimiter


def test_an_unlimited_key_is_always_admitted_and_sends_no_limit_headers() -> None:
    lim = KeyLimiter(key(), 0.0)
    for _ in range(100):
        assert lim.admit(10**9, 0.0) == Admit({})
    assert lim.in_flight == 100


def test_requests_per_second() -> None:
    lim = KeyLimiter(key(requests_per_s=2), 0.0)
    assert lim.admit(0, 0.0) == Admit(
        {
            "x-ratelimit-limit-requests": "2",
            "x-ratelimit-remaining-requests": "1",
            "x-ratelimit-reset-requests": "500ms",
        }
    )
    assert isinstance(lim.admit(0, 0.0), Admit)
    refused = lim.admit(0, 0.25)
    assert refused == Reject(
        "requests",
        limit=2,
        requested=1,
        retry_after_s=0.25,
        headers={
            "x-ratelimit-limit-requests": "2",
            "x-ratelimit-remaining-requests": "0",
            "x-ratelimit-reset-requests": "750ms",
        },
    )
    assert lim.in_flight == 2  # a refused request is not in flight
    assert isinstance(lim.admit(0, 0.5), Admit)


def test_a_slow_rate_still_allows_one_request() -> None:
    lim = KeyLimiter(key(requests_per_s=0.5), 0.0)
    assert isinstance(lim.admit(0, 0.0), Admit)
    refused = lim.admit(0, 1.0)
    assert isinstance(refused, Reject) and refused.retry_after_s == 1.0
    assert isinstance(lim.admit(0, 2.0), Admit)


def test_tokens_per_minute_prompt_at_admission_completion_as_it_streams() -> None:
    lim = KeyLimiter(key(tokens_per_min=120), 0.0)  # 2 tokens/s
    admitted = lim.admit(20, 0.0)
    assert isinstance(admitted, Admit)
    assert admitted.headers == {
        "x-ratelimit-limit-tokens": "120",
        "x-ratelimit-remaining-tokens": "100",
        "x-ratelimit-reset-tokens": "10s",
    }
    for _ in range(140):  # a long answer streams: 140 completion tokens, past what the bucket holds
        lim.charge_tokens(1, 0.0)
    assert lim.tokens is not None and lim.tokens.level(0.0) == -40
    lim.release()
    refused = lim.admit(0, 0.0)  # even an empty prompt waits for the debt
    assert isinstance(refused, Reject) and (refused.reason, refused.retry_after_s) == ("tokens", 20.0)
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
    assert refused.headers["x-ratelimit-reset-tokens"] == "1m20s"
    refused = lim.admit(10, 20.0)
    assert isinstance(refused, Reject) and refused.retry_after_s == 5.0 and refused.requested == 10
    assert isinstance(lim.admit(10, 25.0), Admit)


def test_a_prompt_larger_than_the_bucket_is_too_large() -> None:
    lim = KeyLimiter(key(tokens_per_min=60), 0.0)
    refused = lim.admit(61, 0.0)
    assert isinstance(refused, Reject)
    assert (refused.reason, refused.limit, refused.requested, refused.retry_after_s) == (
        "too_large",
        60,
        61,
        None,
    )
    assert isinstance(lim.admit(60, 0.0), Admit)


def test_concurrent_streams_are_capped_and_released() -> None:
    lim = KeyLimiter(key(max_concurrent_streams=2), 0.0)
    assert isinstance(lim.admit(0, 0.0), Admit) and isinstance(lim.admit(0, 0.0), Admit)
    refused = lim.admit(0, 0.0)
    assert isinstance(refused, Reject) and (refused.reason, refused.limit, refused.requested) == (
        "concurrency",
        2,
        3,
    )
    lim.release()
    assert isinstance(lim.admit(0, 0.0), Admit)


@pytest.mark.parametrize(
    ("in_flight", "requests_taken", "tokens_taken", "prompt", "reason"),
    [
        (1, 0, 0, 1, "concurrency"),  # checked first: nothing else consulted
        (0, 1, 0, 1, "requests"),
        (0, 0, 50, 20, "tokens"),
        (0, 1, 50, 20, "requests"),  # requests before tokens
        (0, 0, 0, 100, "too_large"),
    ],
)
def test_a_refusal_takes_nothing(
    in_flight: int, requests_taken: int, tokens_taken: int, prompt: int, reason: str
) -> None:
    lim = KeyLimiter(key(requests_per_s=1, tokens_per_min=60, max_concurrent_streams=1), 0.0)
    lim.in_flight = in_flight
    assert lim.requests is not None and lim.tokens is not None
    lim.requests.charge(requests_taken, 0.0)
    lim.tokens.charge(tokens_taken, 0.0)
    before = (lim.in_flight, lim.requests.level(0.0), lim.tokens.level(0.0))
    refused = lim.admit(prompt, 0.0)
    assert isinstance(refused, Reject) and refused.reason == reason
    assert (lim.in_flight, lim.requests.level(0.0), lim.tokens.level(0.0)) == before


def test_a_smaller_exact_prompt_gives_tokens_back() -> None:
    lim = KeyLimiter(key(tokens_per_min=60), 0.0)
    assert isinstance(lim.admit(50, 0.0), Admit)
    lim.charge_tokens(30 - 50, 0.0)  # the engine counted 30
    assert lim.tokens is not None and lim.tokens.level(0.0) == 30


def test_release_never_goes_below_zero() -> None:
    lim = KeyLimiter(key(max_concurrent_streams=1), 0.0)
    lim.release()
    assert lim.in_flight == 0 and isinstance(lim.admit(0, 0.0), Admit)
