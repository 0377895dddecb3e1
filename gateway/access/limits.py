"""Per-key limits: token buckets in caller-given time, and the admission decision over a key's limits.

Owns: `TokenBucket` (a capacity refilled at a rate; `try_take` all or nothing, `charge` which may leave the
bucket in debt, reads that take `now_s` and never mutate), `KeyLimiter` (one per key: a requests bucket, a
tokens bucket and the count of its requests in flight; `admit` -> `Admit | Reject`, `charge_tokens`,
`release`), the values of OpenAI's `x-ratelimit-*` headers, and `go_duration` (OpenAI's reset format, Go's
duration syntax: "20ms", "1s", "1.5s", "6m0s").
Must not: import aiohttp, asyncio or a clock (time is an argument), or know HTTP status codes or messages.

The limits (all optional; absent = unlimited):
- requests/s: a bucket of max(1, rate) requests refilled at `requests_per_s`; each admitted request takes one.
- tokens/min: a bucket of `tokens_per_min` refilled at `tokens_per_min / 60` per second. A request is admitted
  when the bucket holds its prompt estimate, which is taken then; completion tokens are charged as they
  stream, whatever the bucket holds, so a long answer can leave it in debt and the key's next request waits
  until it has refilled. A prompt estimate above the whole capacity is `too_large`: waiting cannot help.
- concurrency: at most `max_concurrent_streams` requests of the key in flight (streamed or not).
Checks run in that order of cost to the client (concurrency, requests, tokens) and take nothing unless all
pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from gateway.access.keys import ApiKey

RejectReason = Literal["concurrency", "requests", "tokens", "too_large"]


class TokenBucket:
    """`capacity` units, refilled at `rate_per_s`, full at `now_s`. `level` may be negative (debt)."""

    __slots__ = ("capacity", "rate_per_s", "_level", "_at_s")

    def __init__(self, capacity: float, rate_per_s: float, now_s: float) -> None:
        if not capacity > 0 or not rate_per_s > 0:
            raise ValueError("a bucket needs a positive capacity and refill rate")
        self.capacity = capacity
        self.rate_per_s = rate_per_s
        self._level = capacity
        self._at_s = now_s

    def level(self, now_s: float) -> float:
        """Units held at `now_s` (negative while in debt); time before the last update counts as no time."""
        elapsed_s = max(0.0, now_s - self._at_s)
        return min(self.capacity, self._level + elapsed_s * self.rate_per_s)

    def _settle(self, now_s: float) -> float:
        self._level = self.level(now_s)
        self._at_s = max(self._at_s, now_s)
        return self._level

    def try_take(self, amount: float, now_s: float) -> bool:
        """Take `amount` if the bucket holds it; else take nothing."""
        if self._settle(now_s) < amount:
            return False
        self._level -= amount
        return True

    def charge(self, amount: float, now_s: float) -> None:
        """Take `amount` whatever the bucket holds (it may go into debt); a negative amount gives back, up to
        the capacity."""
        self._level = min(self.capacity, self._settle(now_s) - amount)

    def time_until(self, amount: float, now_s: float) -> float:
        """Seconds from `now_s` until the bucket holds `amount` (0 if it does; inf above the capacity)."""
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.level(now_s)) / self.rate_per_s)

    def time_until_full(self, now_s: float) -> float:
        return (self.capacity - self.level(now_s)) / self.rate_per_s


@dataclass(frozen=True, slots=True)
class Admit:
    headers: dict[str, str]  # x-ratelimit-* after this request's admission


@dataclass(frozen=True, slots=True)
class Reject:
    reason: RejectReason
    limit: float  # of the limit that refused: requests (bucket size), tokens per minute, or streams
    requested: int  # what this request needed of it
    retry_after_s: float | None  # None: waiting cannot help (`too_large`)
    headers: dict[str, str]


def go_duration(seconds: float) -> str:
    """`seconds` in Go's `time.Duration` syntax, to the millisecond, as OpenAI writes its reset headers."""
    ms = max(0, round(seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest_ms = divmod(ms, 3_600_000)
    minutes, sec_ms = divmod(rest_ms, 60_000)
    secs = f"{sec_ms // 1000}.{sec_ms % 1000:03d}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def retry_after_header(seconds: float) -> str:
    """`Retry-After`: whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(seconds)))


class KeyLimiter:
    """One key's limits and its requests in flight. Every method takes the time."""

    __slots__ = ("key", "requests", "tokens", "in_flight")

    def __init__(self, key: ApiKey, now_s: float) -> None:
        self.key = key
        rps, tpm = key.requests_per_s, key.tokens_per_min
        self.requests = None if rps is None else TokenBucket(max(1.0, rps), rps, now_s)
        self.tokens = None if tpm is None else TokenBucket(float(tpm), tpm / 60.0, now_s)
        self.in_flight = 0

    def admit(self, prompt_tokens: int, now_s: float) -> Admit | Reject:
        """Start a request whose prompt is estimated at `prompt_tokens`: take one request and the prompt's
        tokens and count it in flight, or take nothing and say which limit refused and for how long."""
        cap = self.key.max_concurrent_streams
        if cap is not None and self.in_flight >= cap:
            return Reject("concurrency", cap, self.in_flight + 1, 1.0, self.headers(now_s))
        if self.requests is not None and self.requests.level(now_s) < 1:
            wait_s = self.requests.time_until(1, now_s)
            return Reject("requests", self.requests.capacity, 1, wait_s, self.headers(now_s))
        if self.tokens is not None:
            if prompt_tokens > self.tokens.capacity:
                return Reject("too_large", self.tokens.capacity, prompt_tokens, None, self.headers(now_s))
            need = max(0, prompt_tokens)  # a bucket in debt admits nothing, not even an empty prompt
            if self.tokens.level(now_s) < need:
                wait_s = self.tokens.time_until(need, now_s)
                return Reject("tokens", self.tokens.capacity, prompt_tokens, wait_s, self.headers(now_s))
            self.tokens.charge(prompt_tokens, now_s)
        if self.requests is not None:
            self.requests.charge(1, now_s)
        self.in_flight += 1
        return Admit(self.headers(now_s))

    def charge_tokens(self, tokens: int, now_s: float) -> None:
        """Tokens the key used beyond what admission took (completion tokens as they stream; a prompt whose
        exact size differs from its estimate, negative when smaller)."""
        if self.tokens is not None and tokens:
            self.tokens.charge(tokens, now_s)

    def release(self) -> None:
        """An admitted request is over, however it ended."""
        self.in_flight = max(0, self.in_flight - 1)

    def headers(self, now_s: float) -> dict[str, str]:
        """OpenAI's `x-ratelimit-*` values for the limits this key has (none for an unlimited one): the
        bucket's size, what it holds now (whole units, 0 in debt), and the time until it is full again."""
        out: dict[str, str] = {}
        for kind, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is not None:
                out[f"x-ratelimit-limit-{kind}"] = str(math.floor(bucket.capacity))
                out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(bucket.level(now_s))))
                out[f"x-ratelimit-reset-{kind}"] = go_duration(bucket.time_until_full(now_s))
        return out
