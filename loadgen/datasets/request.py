"""The replayable request record and the tokenizer seam used by the dataset loaders.

Owns: ``Request`` (one prompt to replay, with its token counts and optional trace arrival time), the
``TokenizerLike`` protocol (anything with ``encode(text).ids``) and the byte-based token estimate.
Must not: read files, sample randomness, or know about HTTP, engines or arrival processes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

BYTES_PER_TOKEN_ESTIMATE = 4

Message = tuple[str, str]


class EncodingLike(Protocol):
    """The part of a ``tokenizers.Encoding`` the loaders use."""

    @property
    def ids(self) -> Sequence[int]: ...


class TokenizerLike(Protocol):
    """The part of a ``tokenizers.Tokenizer`` the loaders use: ``encode(text).ids``."""

    def encode(self, text: str, /) -> EncodingLike: ...


def _empty_metadata() -> Mapping[str, object]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Request:
    """One request to replay.

    ``prompt_tokens`` is exact when ``prompt_tokens_estimated`` is False (trace token counts, synthesised
    prompts, or a tokenizer count) and ``ceil(utf8 bytes / 4)`` otherwise. ``output_tokens`` is a forced
    length (replay with ``max_tokens=output_tokens`` and ``ignore_eos``) or None to let the model stop.
    ``arrival_s`` is the trace timestamp relative to the trace's first row, None for untimed datasets.
    """

    request_id: str
    prompt_tokens: int
    prompt: str | None = None
    messages: tuple[Message, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    output_tokens: int | None = None
    arrival_s: float | None = None
    session_id: str | None = None
    prompt_tokens_estimated: bool = False
    metadata: Mapping[str, object] = field(default_factory=_empty_metadata, hash=False, compare=False)

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0:
            raise ValueError(f"request {self.request_id}: prompt_tokens {self.prompt_tokens} is negative")
        if self.output_tokens is not None and self.output_tokens < 0:
            raise ValueError(f"request {self.request_id}: output_tokens {self.output_tokens} is negative")
        if not isinstance(self.metadata, MappingProxyType):
            object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))


def estimate_tokens(text: str) -> int:
    """The byte-based estimate: ``ceil(len(text.encode('utf-8')) / 4)``."""
    return math.ceil(len(text.encode("utf-8")) / BYTES_PER_TOKEN_ESTIMATE)


def count_tokens(text: str, tokenizer: TokenizerLike | None) -> tuple[int, bool]:
    """(token count, estimated?) of ``text``: exact with a tokenizer, the byte estimate without one."""
    if tokenizer is None:
        return estimate_tokens(text), True
    return len(tokenizer.encode(text).ids), False


def text_request(
    request_id: str,
    text: str,
    *,
    tokenizer: TokenizerLike | None,
    output_tokens: int | None = None,
    arrival_s: float | None = None,
    session_id: str | None = None,
    metadata: Mapping[str, object] | None = None,
) -> Request:
    """A request whose prompt is ``text``, sent as a single user message in chat form."""
    prompt_tokens, estimated = count_tokens(text, tokenizer)
    return Request(
        request_id=request_id,
        prompt_tokens=prompt_tokens,
        prompt=text,
        messages=(("user", text),),
        output_tokens=output_tokens,
        arrival_s=arrival_s,
        session_id=session_id,
        prompt_tokens_estimated=estimated,
        metadata=metadata if metadata is not None else {},
    )
