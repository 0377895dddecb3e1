"""The supervisor of a multi-worker gateway (`--workers N`, N > 1): N worker processes serving one port.

Owns: `supervise(config)`: the listening address (port 0 resolved here, once, so that every worker binds the
same port), a run directory (a fresh temporary directory: each worker's spec and private metrics socket;
removed at the end), the worker processes (`python -m gateway --worker-spec PATH`, the same entry code as a
single gateway, so each installs uvloop and sets up logging the same way; each in a session of its own, so a
terminal's Ctrl-C reaches the supervisor alone and is forwarded once), the "gateway listening on URL (N
workers)" line on stdout once every worker listens, signals (SIGTERM/SIGINT forwarded to every worker, which
then drains as a single gateway does: stop accepting, `/health` 503, in-flight streams finish for up to
`drain_timeout_s`; a second signal kills them), and failure: a worker that exits unexpectedly, before or after
listening, stops the others (SIGTERM, the same drain) and makes `supervise` raise `WorkerFailed` naming the
worker, its pid and its exit status (the command exits 1).

Listening. Where the platform has SO_REUSEPORT (Linux, the BSDs, macOS), every worker binds `host:port` itself
with it and the kernel spreads new connections over the workers' listening sockets. The supervisor first binds
the address without SO_REUSEPORT for a moment (a port already served, even by another SO_REUSEPORT group of
this user, is refused with the usual one-line error instead of being joined), then holds a bound, not
listening SO_REUSEPORT socket until every worker listens (for port 0, that is what picks the port). Where
SO_REUSEPORT is missing, the supervisor binds one listening socket and the workers inherit it (its descriptor
passed to each process) and all accept from it: the kernel wakes one waiting worker per connection, with no
balancing guarantee. The first address `host` resolves to is the one used. Windows (no descriptor passing, no
unix sockets for the metrics endpoints) is refused with a one-line error.

What is per worker: everything of a single gateway (cluster store and its `WatchState` subscriptions,
optimistic in-flight accounting, policies' state, session-affinity memory, metrics registry). `/metrics` on
any worker answers for the whole gateway (`gateway.observability.siblings`).
Must not: serve HTTP or touch engines (workers do), or leave a worker running when it returns or raises (a
worker whose supervisor dies drains and exits by itself: `worker.py`'s parent watch).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.config import ConfigError, GatewayConfig
from gateway.workers.spec import LISTENING, WorkerSpec, write_spec

log = logging.getLogger(__name__)

# Past the workers' own deadline (drain_timeout_s, then aiohttp's grace, then closing clients) before the
# supervisor kills what is left.
STOP_GRACE_S = 10.0
_BACKLOG = 4096  # as a single gateway's (gateway.app.LISTEN_BACKLOG)
_READER_GRACE_S = 1.0
_PROJECT_ROOT = Path(__file__).resolve().parents[2]


class WorkerFailed(RuntimeError):
    """A worker process ended unexpectedly or would not stop; the message names it and how it ended."""


def exit_status(code: int) -> str:
    """`exit status 3`, or `killed by SIGKILL` for a negative return code."""
    if code >= 0:
        return f"exit status {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


@dataclass
class _Listener:
    """What the supervisor holds while workers start: a bound SO_REUSEPORT socket (not listening) or the
    listening socket the workers inherit (`inherit`)."""

    host: str
    port: int
    held: socket.socket
    inherit: bool

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass
class _Worker:
    index: int
    proc: asyncio.subprocess.Process
    listening: asyncio.Future[str]
    exited: asyncio.Task[int] = field(init=False)
    reader: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        self.exited = asyncio.ensure_future(self.proc.wait())

    def __str__(self) -> str:
        return f"worker {self.index} (pid {self.proc.pid})"


async def _bind(config: GatewayConfig, reuse_port: bool) -> _Listener:
    where = f"{config.host}:{config.port}"
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(
            config.host, config.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as e:
        raise ConfigError(f"cannot listen on {where}: {e.strerror or e}") from e
    family, _, _, _, address = infos[0]
    try:
        if not reuse_port:
            sock = socket.create_server(address[:2], family=family, backlog=_BACKLOG)
            sock.set_inheritable(True)
            return _Listener(config.host, int(sock.getsockname()[1]), sock, inherit=True)
        if config.port != 0:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
        held = socket.socket(family, socket.SOCK_STREAM)
        try:
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            held.bind(address)
        except OSError:
            held.close()
            raise
        return _Listener(config.host, int(held.getsockname()[1]), held, inherit=False)
    except OSError as e:
        raise ConfigError(f"cannot listen on {where}: {e.strerror or e}") from e


class Supervisor:
    """Starts, watches and stops the workers of one gateway; `run` is `supervise`'s body."""

    def __init__(self, config: GatewayConfig, *, reuse_port: bool, python: str) -> None:
        self.config = config
        self.reuse_port = reuse_port
        self.python = python
        self.workers: list[_Worker] = []
        self._signal: signal.Signals | None = None  # the first signal received, forwarded to the workers
        self._force = asyncio.Event()  # a second signal: kill instead of drain

    def on_signal(self, sig: signal.Signals, stop: asyncio.Event) -> None:
        if self._signal is None:
            self._signal = sig
            log.info("%s: stopping %d workers (draining)", sig.name, len(self.workers))
            stop.set()
        else:
            log.warning("%s again: killing the workers", sig.name)
            self._force.set()

    async def run(self, stop: asyncio.Event, on_listening: Callable[[str], None] | None) -> None:
        n = self.config.workers
        cpus = os.cpu_count() or 1
        if n > cpus:
            log.warning("%d gateway workers on %d CPUs: they will share cores", n, cpus)
        run_dir = tempfile.mkdtemp(prefix="switchyard-gateway-")
        listener: _Listener | None = None
        try:
            listener = await _bind(self.config, self.reuse_port)
            config = self.config.model_copy(update={"port": listener.port})
            for i in range(n):
                self.workers.append(await self._spawn(i, config, run_dir, listener))
            stopping = asyncio.ensure_future(stop.wait())
            try:
                await self._serve(stopping, listener, on_listening)
            finally:
                stopping.cancel()
        finally:
            if listener is not None:
                listener.held.close()
            await self._reap()
            shutil.rmtree(run_dir, ignore_errors=True)

    async def _spawn(self, index: int, config: GatewayConfig, run_dir: str, listener: _Listener) -> _Worker:
        fd = listener.held.fileno() if listener.inherit else None
        spec = WorkerSpec(index=index, count=config.workers, run_dir=run_dir, listen_fd=fd, config=config)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PROJECT_ROOT), env.get("PYTHONPATH")) if p)
        proc = await asyncio.create_subprocess_exec(
            self.python,
            "-m",
            "gateway",
            "--worker-spec",
            str(write_spec(spec)),
            stdin=asyncio.subprocess.PIPE,  # never written: its end-of-file tells the worker we are gone
            stdout=asyncio.subprocess.PIPE,  # the worker's LISTENING line; anything else is passed through
            pass_fds=() if fd is None else (fd,),
            start_new_session=True,
            env=env,
        )
        worker = _Worker(index, proc, asyncio.get_running_loop().create_future())
        worker.reader = asyncio.create_task(self._read(worker))
        log.info("gateway %s started", worker)
        return worker

    async def _read(self, worker: _Worker) -> None:
        assert worker.proc.stdout is not None
        async for raw in worker.proc.stdout:
            line = raw.decode(errors="replace")
            head, _, url = line.rstrip("\n").partition(" ")
            if head == LISTENING and not worker.listening.done():
                worker.listening.set_result(url)
            else:
                sys.stdout.write(line)
                sys.stdout.flush()

    async def _serve(
        self, stopping: asyncio.Future[Any], listener: _Listener, on_listening: Callable[[str], None] | None
    ) -> None:
        exits: list[asyncio.Future[Any]] = [w.exited for w in self.workers]
        ready = asyncio.gather(*(w.listening for w in self.workers))
        try:
            await asyncio.wait([stopping, ready, *exits], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not ready.done():
                ready.cancel()
        self._check_alive("before listening")
        if not stopping.done():
            listener.held.close()  # every worker listens: the supervisor's hold on the port can go
            url = listener.url
            print(f"gateway listening on {url} ({len(self.workers)} workers)", flush=True)
            if on_listening is not None:
                on_listening(url)
            await asyncio.wait([stopping, *exits], return_when=asyncio.FIRST_COMPLETED)
            self._check_alive("unexpectedly")
        await self._stop(self._signal or signal.SIGTERM)

    def _check_alive(self, when: str) -> None:
        for w in self.workers:
            if w.exited.done():
                message = f"{w} ended {when} ({exit_status(w.exited.result())})"
                log.warning("%s: stopping the other workers", message)
                raise WorkerFailed(message)

    async def _stop(self, sig: signal.Signals) -> None:
        """Forward `sig` to every worker, then wait for them to drain; WorkerFailed if one does not end
        cleanly (0, or killed by `sig` itself before it could handle it) or past the deadline."""
        self._send(sig)
        deadline_s = self.config.drain_timeout_s + STOP_GRACE_S
        forced: asyncio.Future[Any] = asyncio.ensure_future(self._force.wait())
        all_exited: asyncio.Future[Any] = asyncio.gather(*(w.exited for w in self.workers))
        try:
            done, _ = await asyncio.wait(
                [forced, all_exited], timeout=deadline_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            forced.cancel()
        late = [w for w in self.workers if not w.exited.done()]
        if late:
            self._send(signal.SIGKILL)
            await asyncio.gather(*(w.exited for w in late))
            why = "a second signal" if forced in done else f"not stopped within {deadline_s:g} s"
            raise WorkerFailed(f"killed {', '.join(map(str, late))}: {why}")
        for w in self.workers:
            code = w.exited.result()
            if code not in (0, -sig):
                raise WorkerFailed(f"{w} ended badly while stopping ({exit_status(code)})")

    def _send(self, sig: signal.Signals) -> None:
        for w in self.workers:
            if w.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(sig)

    async def _reap(self) -> None:
        """However `run` ends: no worker left running (drained if the run failed, killed past the deadline),
        every process waited for and its output read."""
        if any(w.proc.returncode is None for w in self.workers):
            with contextlib.suppress(WorkerFailed):
                await self._stop(signal.SIGTERM)
        readers = [w.reader for w in self.workers if w.reader is not None]
        if readers:
            _, pending = await asyncio.wait(readers, timeout=_READER_GRACE_S)
            for task in pending:
                task.cancel()
            await asyncio.gather(*readers, return_exceptions=True)


async def supervise(
    config: GatewayConfig,
    *,
    stop: asyncio.Event | None = None,
    on_listening: Callable[[str], None] | None = None,
    handle_signals: bool = True,
    reuse_port: bool | None = None,
    python: str = sys.executable,
) -> None:
    """Run `config.workers` gateway workers on one port until `stop` is set (or SIGTERM/SIGINT, when
    `handle_signals`), then drain them. `on_listening` gets the base URL once every worker listens.
    `reuse_port`: None = SO_REUSEPORT where the platform has it; False = the inherited-socket fallback.
    Raises `WorkerFailed` when a worker dies unexpectedly, `ConfigError` when the address cannot be bound."""
    if config.workers < 2:
        raise ConfigError("workers: the supervisor is for 2 or more workers (1 runs `serve` itself)")
    if os.name != "posix":
        raise ConfigError("workers: more than 1 needs a POSIX system (descriptor passing, unix sockets)")
    use_reuse_port = hasattr(socket, "SO_REUSEPORT") if reuse_port is None else reuse_port
    if use_reuse_port and not hasattr(socket, "SO_REUSEPORT"):
        raise ConfigError("workers: this platform has no SO_REUSEPORT")
    stop = stop or asyncio.Event()
    supervisor = Supervisor(config, reuse_port=use_reuse_port, python=python)
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT) if handle_signals else ():
        try:
            loop.add_signal_handler(sig, supervisor.on_signal, sig, stop)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    try:
        await supervisor.run(stop, on_listening)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
