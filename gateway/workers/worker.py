"""One worker process of a multi-worker gateway: today's `serve` with this worker's own app.

Owns: `run_worker` (given its `WorkerSpec`): the app built with `worker=spec` (its own cluster store, hence
its own `WatchState` subscriptions and its own optimistic in-flight accounting; `/metrics` merged over the
siblings), this worker's private metrics endpoint on its unix socket (started before the public listener,
stopped after it has drained, so siblings can still scrape it meanwhile), the public listener (SO_REUSEPORT on
`config.host:port`, or the listening socket inherited from the supervisor), the one line that tells the
supervisor it listens (`LISTENING <url>` on stdout), and the parent watch: end-of-file on stdin (the
supervisor's pipe; it closes when the supervisor dies, even by SIGKILL) drains and stops the worker as SIGTERM
does.
Must not: install an event loop (the entry code in `gateway.__main__` does, as for a single process), read the
config file or the environment (the spec carries the supervisor's effective config), or outlive its
supervisor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import sys

from aiohttp import web

from gateway.app import METRICS_KEY, build_app, serve
from gateway.observability.siblings import private_metrics_app
from gateway.workers.spec import LISTENING, WorkerSpec, spec_path

log = logging.getLogger(__name__)

_PRIVATE_SHUTDOWN_S = 1.0


def announce(url: str) -> None:
    """Tell the supervisor this worker listens (one line on stdout, its pipe)."""
    print(f"{LISTENING} {url}", flush=True)


class _ParentWatch(asyncio.Protocol):
    """Stops the worker when its stdin pipe closes: the supervisor is gone."""

    def __init__(self, stop: asyncio.Event) -> None:
        self._stop = stop

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._stop.is_set():
            log.warning("supervisor gone (stdin closed): draining")
            self._stop.set()


async def _watch_parent(stop: asyncio.Event) -> asyncio.BaseTransport | None:
    """Watch stdin when it is a pipe or a socket (the supervisor's: uvloop's subprocess pipes are socket
    pairs); anything else (a terminal, /dev/null) is not the supervisor's."""
    try:
        mode = os.fstat(0).st_mode
        if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
            return None
    except OSError:
        return None
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_read_pipe(lambda: _ParentWatch(stop), sys.stdin)
    return transport


async def run_worker(spec: WorkerSpec) -> None:
    """Serve until SIGTERM/SIGINT (forwarded by the supervisor) or the supervisor's end, then drain."""
    config = spec.config
    app = build_app(config, worker=spec)
    stop = asyncio.Event()
    private = web.AppRunner(
        private_metrics_app(app[METRICS_KEY]), access_log=None, shutdown_timeout=_PRIVATE_SHUTDOWN_S
    )
    await private.setup()
    sock = socket.socket(fileno=spec.listen_fd) if spec.listen_fd is not None else None
    watch: asyncio.BaseTransport | None = None
    try:
        path = spec.metrics_socket()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a stale socket of an earlier worker with this index
        await web.UnixSite(private, path).start()
        watch = await _watch_parent(stop)
        await serve(config, stop=stop, app=app, on_listening=announce, reuse_port=sock is None, sock=sock)
    finally:
        if watch is not None:
            watch.close()
        await private.cleanup()
        _remove_own_files(spec)
        sys.stdout.flush()


def _remove_own_files(spec: WorkerSpec) -> None:
    """This worker's socket and spec, and the run directory once empty (the supervisor removes it too, but
    it cannot when it was killed)."""
    for path in (spec.metrics_socket(), str(spec_path(spec.run_dir, spec.index))):
        with contextlib.suppress(OSError):
            os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(spec.run_dir)
