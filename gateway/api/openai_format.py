"""OpenAI response objects, field for field: `chat.completion(.chunk)` and `text_completion`.

Owns: the chunk and body builders for both endpoints, the usage object, and the wall clock for `created`.
Chat stream: per choice a role chunk (`{"role": "assistant", "content": ""}`), content chunks, a finish chunk
with an empty delta; with `stream_options.include_usage` every chunk carries `"usage": null` and a last chunk
has `"choices": []` and the usage. Completions stream: text chunks, then a finish chunk with `"text": ""`.
Must not: write to the network or know about engines beyond counts and finish reasons.
"""

from __future__ import annotations

import time
from typing import Any


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


class ChatFormat:
    """Objects of one `/v1/chat/completions` response."""

    def __init__(self, request_id: str, created: int, model: str, include_usage: bool) -> None:
        self.response_id = f"chatcmpl-{request_id}"
        self._created = created
        self._model = model
        self._include_usage = include_usage

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": self._model,
            "choices": [choice],
        }
        if self._include_usage:
            chunk["usage"] = None
        return chunk

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

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": self._model,
            "choices": [],
            "usage": usage,
        }

    def body(self, texts: list[str], finish_reasons: list[str], usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "chat.completion",
            "created": self._created,
            "model": self._model,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": reason,
                }
                for i, (text, reason) in enumerate(zip(texts, finish_reasons, strict=True))
            ],
            "usage": usage,
        }


class CompletionFormat:
    """Objects of one `/v1/completions` response."""

    def __init__(self, request_id: str, created: int, model: str, include_usage: bool) -> None:
        self.response_id = f"cmpl-{request_id}"
        self._created = created
        self._model = model
        self._include_usage = include_usage

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.response_id,
            "object": "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": [choice],
        }
        if self._include_usage:
            chunk["usage"] = None
        return chunk

    def opening(self, index: int) -> dict[str, Any] | None:
        return None  # completions have no role chunk

    def content(self, index: int, text: str) -> dict[str, Any]:
        return self._chunk({"text": text, "index": index, "logprobs": None, "finish_reason": None})

    def finish(self, index: int, finish_reason: str) -> dict[str, Any]:
        return self._chunk({"text": "", "index": index, "logprobs": None, "finish_reason": finish_reason})

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": [],
            "usage": usage,
        }

    def body(self, texts: list[str], finish_reasons: list[str], usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": [
                {"text": text, "index": i, "logprobs": None, "finish_reason": reason}
                for i, (text, reason) in enumerate(zip(texts, finish_reasons, strict=True))
            ],
            "usage": usage,
        }


ResponseFormat = ChatFormat | CompletionFormat
