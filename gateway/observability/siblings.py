"""A worker's `/metrics` answered for the whole gateway: its own exposition merged with its siblings'.

Owns: `SiblingScrape`, which on each public scrape fetches every sibling worker's own exposition from that
worker's private endpoint (a unix socket in the supervisor's run directory, see `gateway.workers.spec`),
concurrently and each within `timeout_s`, then merges them with this worker's (`merge.merge_expositions`,
engine gauges from this worker only: `metrics.SHARED_GAUGES`). A sibling that does not answer in time (busy,
starting, gone) is left out and counted in `switchyard_metrics_scrape_worker_errors_total{worker}`: a scrape
never fails for it. Also `private_metrics_app`, the private endpoint's app, serving this worker's own
exposition unmerged (a sibling merging merged expositions would count everything N times).
Its client sessions (one per sibling socket) are born and closed in the app's `cleanup_ctx` (`ctx`).
Why pull at scrape time (rather than workers pushing to the supervisor or a shared file): a merged scrape is
as fresh as a single process's, costs nothing between scrapes, and needs no new process state; unix sockets,
because each worker's path follows from its index (no address to announce) and nothing outside the host
reaches them.
Must not: be used by a single-process gateway (its `/metrics` is its own registry), or retry: the next scrape
asks again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping

import aiohttp
from aiohttp import web

from gateway.observability.merge import merge_expositions
from gateway.observability.metrics import CONTENT_TYPE, SHARED_GAUGES, GatewayMetrics

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 1.0
_URL = "http://worker/metrics"  # the host is ignored on a unix socket


class SiblingScrape:
    """`exposition()` is the merged scrape; `siblings` maps each sibling's worker index to its socket path."""

    def __init__(
        self, metrics: GatewayMetrics, siblings: Mapping[int, str], *, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self._metrics = metrics
        self._siblings = dict(siblings)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    async def ctx(self, app: web.Application) -> AsyncIterator[None]:
        self._sessions = {
            index: aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path), timeout=self._timeout)
            for index, path in self._siblings.items()
        }
        try:
            yield
        finally:
            sessions, self._sessions = self._sessions, {}
            await asyncio.gather(*(s.close() for s in sessions.values()))

    async def exposition(self) -> bytes:
        fetched = await asyncio.gather(*(self._fetch(i) for i in self._siblings))
        texts = [text for text in fetched if text is not None]
        # Rendered after the fetches, so this scrape's own error counts are in it.
        own = self._metrics.render().decode()
        return merge_expositions(own, texts, shared=SHARED_GAUGES)

    async def _fetch(self, index: int) -> str | None:
        session = self._sessions.get(index)
        try:
            if session is None:
                raise RuntimeError("not started")
            async with session.get(_URL) as resp:
                resp.raise_for_status()
                return await resp.text()
        except (aiohttp.ClientError, TimeoutError, RuntimeError) as e:
            self._metrics.scrape_worker_errors.labels(str(index)).inc()
            log.warning("metrics of worker %d left out of this scrape: %s", index, str(e) or type(e).__name__)
            return None


def private_metrics_app(metrics: GatewayMetrics) -> web.Application:
    """The private endpoint: `GET /metrics`, this worker's own exposition."""

    async def own(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application()
    app.router.add_get("/metrics", own)
    return app
