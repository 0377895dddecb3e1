"""Every stream's verdict: one category from what the client saw and what an undisturbed run answered.

Owns: the categories (`OK_CATEGORIES`, by design; `BUG_CATEGORIES`, failures of the gateway's contract),
`Reference` (the undisturbed run's text and finish reason of a request content) and `classify`, a pure
function of a `StreamRecord` and its reference.
Must not: do I/O or read clocks.

The contract checked: a stream either completes (finish reason, then `[DONE]`) with exactly the undisturbed
text, or ends with exactly one OpenAI error event (then `[DONE]` or the end of the body) after a prefix of
that text; no text is ever repeated. A client that closes on purpose must have seen a prefix. Categories:
  completed_identical   finish reason and [DONE]; text and finish reason equal the reference
  error_event           one error event ({"error": {message, type, param, code}}), text so far a prefix
  client_disconnected   the client closed on purpose; text so far a prefix
  http_error            a non-200 status before the stream, with an OpenAI error body (counted by status+code)
  completed_different   BUG: finished, but text or finish reason differ (a prefix that "finished" included)
  duplicated            BUG: text longer than the reference, or a prefix of it repeated
  silently_truncated    BUG: the body ended without a finish reason and without an error event
  hang                  BUG: no byte for the client's inactivity timeout
  malformed             BUG: protocol breaks: two error events, events after the end, a finish without
                        [DONE], an error body not in the OpenAI shape, lines that are not SSE data
  connect_error         BUG: no HTTP answer at all (connection refused or reset before the status)
  no_reference          the undisturbed run did not complete this content (its own category, not judged)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.chaos.client import StreamRecord

OK_CATEGORIES = ("completed_identical", "error_event", "client_disconnected", "http_error", "no_reference")
BUG_CATEGORIES = (
    "completed_different",
    "duplicated",
    "silently_truncated",
    "hang",
    "malformed",
    "connect_error",
)
_ERROR_KEYS = ("message", "type", "param", "code")


@dataclass(frozen=True, slots=True)
class Reference:
    text: str
    finish_reason: str


@dataclass(frozen=True, slots=True)
class Verdict:
    category: str
    detail: str = ""

    @property
    def is_bug(self) -> bool:
        return self.category in BUG_CATEGORIES


def is_openai_error(value: Any) -> bool:
    return (
        isinstance(value, dict) and all(k in value for k in _ERROR_KEYS) and isinstance(value["message"], str)
    )


def repeated_prefix(text: str, ref: str) -> bool:
    """True when `text` is a prefix of `ref` followed by a restart of `ref` (text[:j] and text[j:] both
    prefixes of ref, j > 0), or simply longer than `ref` while starting with it."""
    if len(text) > len(ref) and text.startswith(ref):
        return True
    for j in range(1, len(text)):
        if ref.startswith(text[j:]) and ref.startswith(text[:j]):
            return True
    return False


def _text_verdict(text: str, ref: Reference) -> Verdict | None:
    """A BUG verdict when `text` (a partial stream) is not a prefix of the reference, else None."""
    if ref.text.startswith(text):
        return None
    if repeated_prefix(text, ref.text):
        return Verdict("duplicated", f"{len(text)} chars vs {len(ref.text)} in the reference")
    return Verdict(
        "completed_different" if len(text) <= len(ref.text) else "duplicated",
        f"text diverges from the reference at char {_diverge(text, ref.text)}",
    )


def _diverge(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def classify(rec: StreamRecord, ref: Reference | None) -> Verdict:
    if rec.status is None:
        if rec.timed_out:
            return Verdict("hang", f"no response status within the client timeout ({rec.transport_error})")
        return Verdict("connect_error", rec.transport_error or "no status")
    if rec.status != 200:
        if not is_openai_error(
            (rec.http_error or {}).get("error") if isinstance(rec.http_error, dict) else None
        ):
            return Verdict("malformed", f"HTTP {rec.status} without an OpenAI error body")
        return Verdict("http_error", f"{rec.status} {rec.http_error['error'].get('code')}")
    if rec.malformed:
        return Verdict("malformed", f"unparsed line: {rec.malformed[0][:80]}")
    if len(rec.errors) > 1:
        return Verdict("malformed", f"{len(rec.errors)} error events")
    if rec.after_end:
        return Verdict("malformed", f"{rec.after_end} event(s) after the end of the stream")
    if ref is None:
        return Verdict("no_reference")
    text = rec.text
    if rec.errors:
        error = rec.errors[0][1]
        if not is_openai_error(error):
            return Verdict("malformed", "error event not in the OpenAI shape")
        if rec.finish_reason is not None:
            return Verdict("malformed", "both a finish reason and an error event")
        bad = _text_verdict(text, ref)
        return bad or Verdict("error_event", f"{error.get('code')}")
    if rec.disconnected:
        bad = _text_verdict(text, ref)
        return bad or Verdict("client_disconnected")
    if rec.timed_out:
        bad = _text_verdict(text, ref)
        return bad or Verdict("hang", f"stalled after {len(text)} of {len(ref.text)} chars")
    if rec.finish_reason is None:
        bad = _text_verdict(text, ref)
        detail = rec.transport_error or ("[DONE] without a finish reason" if rec.done else "body ended")
        return bad or Verdict("silently_truncated", f"{detail}; {len(text)} of {len(ref.text)} chars")
    if not rec.done:
        return Verdict("malformed", "finish reason but no [DONE]")
    if text == ref.text and rec.finish_reason == ref.finish_reason:
        return Verdict("completed_identical")
    if len(text) > len(ref.text) or repeated_prefix(text, ref.text):
        return Verdict("duplicated", f"{len(text)} chars vs {len(ref.text)} in the reference")
    return Verdict(
        "completed_different",
        f"finish {rec.finish_reason} vs {ref.finish_reason}; "
        f"{len(text)} vs {len(ref.text)} chars, first difference at {_diverge(text, ref.text)}",
    )
