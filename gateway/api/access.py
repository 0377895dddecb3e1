"""The API's access gate: API keys and per-key limits on HTTP requests (the adapter of `gateway.access`).

Owns: `AccessGate` (reads `Authorization: Bearer`; answers 401, 403 and 429 in OpenAI's shapes, a 429 with
`Retry-After` and OpenAI's `x-ratelimit-*` headers, which admitted responses carry too; a keyed request's
routing priority; the models a key sees; the per-key metrics), `Ticket` (one admitted request: its key's
stream slot, released once, and the tokens charged to it) and `ChargingSink` (the relay wrapped: completion
tokens charged to the key as deltas pass, the prompt estimate corrected to the engine's exact count).
An open gate (no key file) lets everything through and counts nothing per key.
Must not: decide limits (`gateway.access.limits` does), keep, log or label with a raw key (names only), route,
or format chunks.

Priority: lower values run first (as the agents' and vLLM's). A key's `priority` is the request's when it
sends no `x-priority`; a header may ask for less urgency, never more: the effective priority is
max(header, key's).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Mapping
from pathlib import Path

from gateway.access.keys import UNAUTHENTICATED, ApiKey, KeyTable, load_key_table
from gateway.access.limits import Admit, KeyLimiter, Reject, go_duration, retry_after_header
from gateway.api import errors
from gateway.dispatch.dispatcher import EventSink
from gateway.dispatch.features import RoutingHints
from gateway.domain import Admitted, Delta, EngineEvent, Finished
from gateway.observability.metrics import GatewayMetrics
from switchyard.clock import Clock

log = logging.getLogger(__name__)

_UNKNOWN_MODEL = "unknown"


class Ticket:
    """One admitted request of a key: released once; the tokens charged to the key for it."""

    __slots__ = ("key", "_limiter", "_clock", "prompt_tokens", "completion_tokens", "_prompt_exact", "_open")

    def __init__(self, key: ApiKey, limiter: KeyLimiter, clock: Clock, prompt_estimate: int) -> None:
        self.key = key
        self._limiter = limiter
        self._clock = clock
        self.prompt_tokens = prompt_estimate  # the estimate admission took, until the engine says
        self.completion_tokens = 0
        self._prompt_exact = False
        self._open = True

    def charge_completion(self, tokens: int) -> None:
        self.completion_tokens += tokens
        self._limiter.charge_tokens(tokens, self._clock.now())

    def correct_prompt(self, exact: int) -> None:
        """The engine's prompt count replaces the estimate (once; a smaller one gives tokens back)."""
        if self._prompt_exact or exact <= 0:
            return
        self._prompt_exact = True
        self._limiter.charge_tokens(exact - self.prompt_tokens, self._clock.now())
        self.prompt_tokens = exact

    def release(self) -> bool:
        """Free the key's stream slot; True the first time only."""
        if not self._open:
            return False
        self._open = False
        self._limiter.release()
        return True

    def sink(self, relay: EventSink) -> ChargingSink:
        return ChargingSink(self, relay)


class ChargingSink:
    """The relay, with the key charged as events pass: each delta's tokens as it streams, then any rest of a
    choice's `Finished.completion_tokens` the deltas did not count; choice 0's exact prompt count."""

    __slots__ = ("_ticket", "_relay", "_streamed")

    def __init__(self, ticket: Ticket, relay: EventSink) -> None:
        self._ticket = ticket
        self._relay = relay
        self._streamed: dict[int, int] = {}  # choice index -> completion tokens charged from its deltas

    async def on_event(self, index: int, event: EngineEvent) -> None:
        if isinstance(event, Delta):
            if event.num_tokens:
                self._streamed[index] = self._streamed.get(index, 0) + event.num_tokens
                self._ticket.charge_completion(event.num_tokens)
        elif isinstance(event, Finished):
            rest = event.completion_tokens - self._streamed.get(index, 0)
            if rest > 0:
                self._streamed[index] = event.completion_tokens
                self._ticket.charge_completion(rest)
            if index == 0:
                self._ticket.correct_prompt(event.prompt_tokens)
        elif isinstance(event, Admitted) and index == 0:
            self._ticket.correct_prompt(event.prompt_tokens)
        await self._relay.on_event(index, event)


class AccessGate:
    """API keys and limits for the handlers. `table=None`: the open gateway (every request passes)."""

    def __init__(self, table: KeyTable | None, metrics: GatewayMetrics, clock: Clock) -> None:
        self.table = table
        self._metrics = metrics
        self._clock = clock
        now_s = clock.now()
        self._limiters = {k.name: KeyLimiter(k, now_s) for k in table} if table is not None else {}

    @classmethod
    def from_file(cls, path: str | Path | None, metrics: GatewayMetrics, clock: Clock) -> AccessGate:
        """The gate of the key file at `path` (`ConfigError` naming the file and entry), or the open gate,
        saying so at WARNING."""
        if path is None:
            log.warning("no API key file: the gateway accepts every request")
            return cls(None, metrics, clock)
        table = load_key_table(path)
        log.info("API keys: %d key(s) from %s: %s", len(table), path, ", ".join(k.name for k in table))
        return cls(table, metrics, clock)

    @property
    def is_open(self) -> bool:
        return self.table is None

    def authenticate(self, headers: Mapping[str, str]) -> ApiKey | None:
        """The request's key (None at an open gate); raises a 401 `ApiError` when it has no valid one."""
        if self.table is None:
            return None
        scheme, _, presented = headers.get("Authorization", "").partition(" ")
        presented = presented.strip()
        if scheme.lower() != "bearer" or not presented:
            self._refused(401)
            raise errors.missing_api_key()
        key = self.table.authenticate(presented)
        if key is None:
            self._refused(401)
            raise errors.invalid_api_key()
        return key

    def visible_models(self, key: ApiKey | None, served: Collection[str]) -> list[str]:
        return sorted(m for m in served if key is None or key.allows(m))

    def check_model(self, key: ApiKey | None, model: str) -> None:
        if key is not None and not key.allows(model):
            raise errors.model_not_allowed(model, key.name)

    def hints(self, key: ApiKey | None, hints: RoutingHints, priority_header: bool) -> RoutingHints:
        """`hints` with the key's priority applied (see the module docstring)."""
        if key is None:
            return hints
        priority = max(hints.priority, key.priority) if priority_header else key.priority
        return hints if priority == hints.priority else dataclasses.replace(hints, priority=priority)

    def admit(self, key: ApiKey | None, prompt_tokens: int, headers: dict[str, str]) -> Ticket | None:
        """Start a request of `key` (None: open, no ticket). Adds the `x-ratelimit-*` headers to `headers`
        either way; raises a 429 `ApiError` (with `Retry-After` added) when a limit refuses."""
        if key is None:
            return None
        limiter = self._limiters[key.name]
        decision = limiter.admit(prompt_tokens, self._clock.now())
        headers.update(decision.headers)
        if isinstance(decision, Admit):
            return Ticket(key, limiter, self._clock, prompt_tokens)
        if decision.retry_after_s is None:
            headers["x-should-retry"] = "false"  # the official clients' hint: retrying cannot help
        else:
            headers["retry-after"] = retry_after_header(decision.retry_after_s)
        self._metrics.rate_limited.labels(key.name, decision.reason).inc()
        log.debug("API key %s: rate limited (%s)", key.name, decision.reason)
        raise errors.rate_limited(_limit_message(key.name, decision), _limit_type(decision))

    def end(self, key: ApiKey | None, ticket: Ticket | None, model: str, status: int) -> None:
        """A request of `key` is over: its slot freed, its tokens and status counted."""
        if ticket is not None and ticket.release():
            self._metrics.key_tokens.labels(ticket.key.name, "prompt").inc(ticket.prompt_tokens)
            self._metrics.key_tokens.labels(ticket.key.name, "completion").inc(ticket.completion_tokens)
        if key is not None:
            self._metrics.key_requests.labels(key.name, model, str(status)).inc()

    def _refused(self, status: int) -> None:
        log.debug("request refused (%d): no valid API key", status)
        self._metrics.key_requests.labels(UNAUTHENTICATED, _UNKNOWN_MODEL, str(status)).inc()


def _limit_type(reject: Reject) -> str:
    return "tokens" if reject.reason in ("tokens", "too_large") else "requests"


def _limit_message(name: str, reject: Reject) -> str:
    limit = f"{reject.limit:g}"
    if reject.reason == "concurrency":
        return (
            f"Too many concurrent requests for API key `{name}`: limit {limit}. "
            "Please try again when one of them has finished."
        )
    if reject.reason == "too_large":
        return (
            f"Request too large for API key `{name}` on tokens per min (TPM): limit {limit}, requested "
            f"{reject.requested}. The input must be reduced in order to run successfully."
        )
    what = "tokens per min (TPM)" if reject.reason == "tokens" else "requests per second (burst)"
    wait = go_duration(reject.retry_after_s or 0.0)
    return (
        f"Rate limit reached for API key `{name}` on {what}: limit {limit}, requested {reject.requested}. "
        f"Please try again in {wait}."
    )
