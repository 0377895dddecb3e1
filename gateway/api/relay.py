"""Event sinks that turn engine events into an OpenAI response: an SSE stream, or one JSON body.

Owns: `StreamRelay` (headers at the first event, per-choice role chunk, content chunks, finish chunk, optional
usage chunk, `[DONE]`; an error after the first byte becomes an error event + `[DONE]`; content chunks are
spliced into each choice's pre-encoded chunk, see `SplicedEvent`; a lone chunk is written at once, the rest
of a burst in one write at the end of the loop tick, a choice's first token always at once), `CollectRelay`
(accumulates n choices into one body) and `UsageTally` (usage summed over choices, prompt counted once, as
OpenAI reports n > 1). Both raise `ClientDisconnected` when the client is gone, so the dispatcher stops the
engines.
Must not: route, retry, or read engine transports.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from gateway.api.errors import ApiError
from gateway.api.openai_format import ResponseFormat, usage_object
from gateway.api.sse import SplicedEvent, SseWriter
from gateway.dispatch.dispatcher import ClientDisconnected
from gateway.domain import Admitted, Delta, EngineEvent, Finished


class UsageTally:
    __slots__ = ("prompt_tokens", "cached_tokens", "completion_tokens")

    def __init__(self, n: int) -> None:
        self.prompt_tokens = [0] * n
        self.cached_tokens = [0] * n
        self.completion_tokens = [0] * n

    def note(self, index: int, event: EngineEvent) -> None:
        if isinstance(event, Admitted):
            self.prompt_tokens[index] = event.prompt_tokens
        elif isinstance(event, Finished):
            self.prompt_tokens[index] = event.prompt_tokens or self.prompt_tokens[index]
            self.cached_tokens[index] = event.cached_tokens
            self.completion_tokens[index] = event.completion_tokens

    def usage(self) -> dict[str, Any]:
        # n choices share one prompt: count it once (choice 0's figures), completions summed.
        return usage_object(self.prompt_tokens[0], sum(self.completion_tokens), self.cached_tokens[0])


class StreamRelay:
    """`stream: true`: chunks as events arrive. Headers go out with the first event, so errors before it can
    still be answered with a proper HTTP status."""

    # Slotted, as the writer and the formats: one of each lives as long as its stream, idle or not.
    __slots__ = ("_sse", "_fmt", "_content", "_first_token", "_include_usage", "tally", "usage_of")

    def __init__(
        self,
        request: web.BaseRequest,
        fmt: ResponseFormat,
        n: int,
        include_usage: bool,
        headers: Mapping[str, str],
    ) -> None:
        self._sse = SseWriter(request, headers)
        self._fmt = fmt
        self._content: list[SplicedEvent | None] = [None] * n  # set when the choice opens
        self._first_token = [False] * n  # the choice's first content chunk was sent
        self._include_usage = include_usage
        self.tally = UsageTally(n)
        # What `usage` reports when not the tally of this stream's events (a cascade: its stages summed).
        self.usage_of: Callable[[], dict[str, Any]] | None = None

    @property
    def started(self) -> bool:
        return self._sse.started

    @property
    def response(self) -> web.StreamResponse:
        return self._sse.response

    async def on_event(self, index: int, event: EngineEvent) -> None:
        try:
            content = self._content[index]
            if content is None:
                content = self._content[index] = SplicedEvent(functools.partial(self._fmt.content, index))
                await self._sse.start()
                opening = self._fmt.opening(index)
                if opening is not None:
                    await self._sse.send(opening)
            if isinstance(event, Delta):
                if event.text:
                    if self._first_token[index]:
                        await self._sse.send_frame(content.encode(event.text))
                    else:  # the client's time to first token: written at once, whatever else this tick holds
                        self._first_token[index] = True
                        await self._sse.send_now(content.encode(event.text))
            elif isinstance(event, Finished):
                self.tally.note(index, event)
                await self._sse.send(self._fmt.finish(index, event.finish_reason))
            else:
                self.tally.note(index, event)
        except ConnectionResetError as e:
            raise ClientDisconnected(str(e)) from e

    async def finish(self) -> None:
        try:
            if self._include_usage:
                usage = self.tally.usage() if self.usage_of is None else self.usage_of()
                await self._sse.send(self._fmt.usage_chunk(usage))
            await self._sse.done()
        except ConnectionResetError as e:
            raise ClientDisconnected(str(e)) from e

    async def fail(self, err: ApiError) -> None:
        """After the first byte: the error as an event, then `[DONE]` (a gone client is not an error here)."""
        try:
            await self._sse.send_error(err.body())
        except ConnectionResetError:
            pass

    def close(self) -> None:
        """The request is over, however it ended: nothing more is written."""
        self._sse.close()


class CollectRelay:
    """`stream: false`: accumulate every choice, answer one JSON body at the end."""

    __slots__ = ("_request", "_fmt", "_texts", "_finish_reasons", "tally", "usage_of")

    def __init__(self, request: web.BaseRequest, fmt: ResponseFormat, n: int) -> None:
        self._request = request
        self._fmt = fmt
        self._texts: list[list[str]] = [[] for _ in range(n)]
        self._finish_reasons = ["stop"] * n
        self.tally = UsageTally(n)
        self.usage_of: Callable[[], dict[str, Any]] | None = None  # as StreamRelay's

    async def on_event(self, index: int, event: EngineEvent) -> None:
        transport = self._request.transport
        if transport is None or transport.is_closing():
            raise ClientDisconnected("client closed the connection")
        if isinstance(event, Delta):
            self._texts[index].append(event.text)
        else:
            self.tally.note(index, event)
            if isinstance(event, Finished):
                self._finish_reasons[index] = event.finish_reason

    def body(self) -> dict[str, Any]:
        usage = self.tally.usage() if self.usage_of is None else self.usage_of()
        return self._fmt.body(["".join(t) for t in self._texts], self._finish_reasons, usage)
