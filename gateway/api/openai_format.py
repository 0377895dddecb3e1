"""OpenAI response objects, field for field: `chat.completion(.chunk)` and `text_completion`.

Owns: the chunk and body builders for both endpoints, the usage object, and the wall clock for `created`.
Chat stream: per choice a role chunk (`{"role": "assistant", "content": ""}`), content chunks, a finish chunk
with an empty delta; with `stream_options.include_usage` every chunk carries `"usage": null` and a last chunk
has `"choices": []` and the usage. Completions stream: text chunks, then a finish chunk with `"text": ""`.
Must not: write to the network or know about engines beyond counts and finish reasons.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, ClassVar


class WallClock:
    """Unix time for the `created` field (the gateway's monotonic `Clock` cannot give calendar time)."""

    def now(self) -> float:
        return time.time()


def usage_object(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class _ResponseFormat(ABC):
    """What chat and completions responses share: ids, the envelope, the usage chunk and the body."""

    ID_PREFIX: ClassVar[str]
    CHUNK_OBJECT: ClassVar[str]
    BODY_OBJECT: ClassVar[str]
    __slots__ = ("response_id", "_created", "_model", "_include_usage")  # one per request, as long as it

    def __init__(self, request_id: str, created: int, model: str, include_usage: bool) -> None:
        self.response_id = f"{self.ID_PREFIX}-{request_id}"
        self._created = created
        self._model = model
        self._include_usage = include_usage

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": obj,
            "created": self._created,
            "model": self._model,
            "choices": choices,
        }

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = self._envelope(self.CHUNK_OBJECT, [choice])
        if self._include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        chunk = self._envelope(self.CHUNK_OBJECT, [])
        chunk["usage"] = usage
        return chunk

    @abstractmethod
    def _body_choice(self, index: int, text: str, finish_reason: str) -> dict[str, Any]:
        """One choice of the non-streaming body, in the endpoint's shape."""

    def body(self, texts: list[str], finish_reasons: list[str], usage: dict[str, Any]) -> dict[str, Any]:
        choices = [
            self._body_choice(i, text, reason)
            for i, (text, reason) in enumerate(zip(texts, finish_reasons, strict=True))
        ]
        body = self._envelope(self.BODY_OBJECT, choices)
        body["usage"] = usage
        return body


class ChatFormat(_ResponseFormat):
    """Objects of one `/v1/chat/completions` response."""

    ID_PREFIX = "chatcmpl"
    CHUNK_OBJECT = "chat.completion.chunk"
    BODY_OBJECT = "chat.completion"
    __slots__ = ()

    def opening(self, index: int) -> dict[str, Any] | None:
        return self._chunk(
            {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        )

    def content(self, index: int, text: str) -> dict[str, Any]:
        return self._chunk(
            {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        )

    def finish(self, index: int, finish_reason: str) -> dict[str, Any]:
        return self._chunk({"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason})

    def _body_choice(self, index: int, text: str, finish_reason: str) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }


class CompletionFormat(_ResponseFormat):
    """Objects of one `/v1/completions` response."""

    ID_PREFIX = "cmpl"
    CHUNK_OBJECT = "text_completion"
    BODY_OBJECT = "text_completion"
    __slots__ = ()

    def opening(self, index: int) -> dict[str, Any] | None:
        return None  # completions have no role chunk

    def content(self, index: int, text: str) -> dict[str, Any]:
        return self._chunk({"text": text, "index": index, "logprobs": None, "finish_reason": None})

    def finish(self, index: int, finish_reason: str) -> dict[str, Any]:
        return self._chunk({"text": "", "index": index, "logprobs": None, "finish_reason": finish_reason})

    def _body_choice(self, index: int, text: str, finish_reason: str) -> dict[str, Any]:
        return {"text": text, "index": index, "logprobs": None, "finish_reason": finish_reason}


ResponseFormat = ChatFormat | CompletionFormat
