"""One stream's output text: incremental detokenization, stop strings and stop token ids, across migrations.

Owns: `OutputText`, the text state of one Generate or MigrateIn stream: what each group of tokens releases
(detokenized, then held back or cut by the stop matcher; tokens in `stop_token_ids` add no text once
`min_tokens` are out), the tail released at the finish, and the text state's hand-over at a migration
(`prime` on the target, `cut` on the source).
Must not: know gRPC, protobuf or the backend, decide when a stream ends (the servicer, `engine_agent.service`,
does, reading `matched`), or read time.

Text across a migration: the source stream ends with `migrated` without flushing what its detokenizer and
stop matcher hold back; the target primes the same state by feeding the ticket's output tokens one at a time
and releases only what follows. Text state depends on how tokens were grouped (a group ending mid-character
releases nothing), so just before `migrated` the source releases whatever a one-token-at-a-time pass over the
same tokens would have released by then (usually nothing): concatenated text from source and target then
equals an unmigrated run's, and a stop string straddling the cut still matches on the target.
"""

from __future__ import annotations

from engine_agent.domain import SamplingSpec
from engine_agent.tokenization import IncrementalDetokenizer, StopMatcher, Tokenizer


class OutputText:
    """One stream's text: incremental detokenization, then stop strings; stop-token-id tokens add no text."""

    __slots__ = ("_tokenizer", "_stops", "_sampling", "_detok", "_stop", "_stop_ids", "_min_tokens",
                 "_released")

    def __init__(self, tokenizer: Tokenizer, stops: list[str], sampling: SamplingSpec) -> None:
        self._tokenizer = tokenizer
        self._stops = stops
        self._sampling = sampling
        self._detok: IncrementalDetokenizer = tokenizer.detokenizer()
        self._stop = StopMatcher(stops)
        self._stop_ids = frozenset(sampling.stop_token_ids)
        self._min_tokens = sampling.min_tokens
        self._released = 0  # characters of text released so far (primed text included)

    @property
    def stops_active(self) -> bool:
        return self._stop.active

    @property
    def matched(self) -> str | None:
        return self._stop.matched

    def add(self, ids: tuple[int, ...], position: int) -> str:
        """Text released by `ids`, the tokens at output positions `position`, `position + 1`, ..."""
        if self._stop_ids:
            ids = tuple(
                t for k, t in enumerate(ids) if t not in self._stop_ids or position + k < self._min_tokens
            )
        released = self._stop.feed(self._detok.add(ids))
        self._released += len(released)
        return released

    def finish(self) -> str:
        released = self._stop.feed(self._detok.flush())
        return released + self._stop.flush()

    def prime(self, ids: tuple[int, ...]) -> str:
        """Feed a migrated request's earlier output one token at a time; returns the text that released."""
        return "".join([self.add(ids[k : k + 1], k) for k in range(len(ids))])

    def cut(self, ids: tuple[int, ...]) -> str:
        """At a migration: the text a target primed with `ids` (all output so far) takes as already released
        but this stream has not released yet (grouped tokens can hold back complete text); usually empty."""
        primed = OutputText(self._tokenizer, self._stops, self._sampling).prime(ids)
        return primed[self._released :]
