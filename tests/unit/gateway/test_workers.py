"""`--workers`: the config key and its flag and environment variable, what the supervisor hands a worker, how
a worker's end is described, and the supervisor's refusals (the processes themselves are exercised in
tests/integration/test_gateway_workers.py)."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import pytest

from gateway.__main__ import build_argparser, cli_overrides
from gateway.config import ConfigError, GatewayConfig, build_config
from gateway.workers.spec import WorkerSpec, read_spec, write_spec
from gateway.workers.supervisor import _bind, exit_status, supervise
from launcher.cli import build_up_parser, check_up_args

ENGINE = "127.0.0.1:50051"


def config_from(argv: list[str], environ: dict[str, str] | None = None) -> GatewayConfig:
    return build_config(environ=environ or {}, cli=cli_overrides(build_argparser().parse_args(argv)))


def test_workers_default_to_one_and_come_from_flag_environment_or_file(tmp_path: Path) -> None:
    assert config_from(["--engine", ENGINE]).workers == 1
    assert config_from(["--workers", "3"]).workers == 3
    assert config_from([], {"SWITCHYARD_GATEWAY_WORKERS": "4"}).workers == 4
    assert config_from(["--workers", "2"], {"SWITCHYARD_GATEWAY_WORKERS": "4"}).workers == 2
    path = tmp_path / "gw.json"
    path.write_text('{"workers": 5}')
    assert build_config(file_path=path).workers == 5


@pytest.mark.parametrize("value", ["0", "-1"])
def test_fewer_than_one_worker_is_refused_naming_the_key(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^workers: Input should be greater than or equal to 1$"):
        config_from(["--workers", value])


def test_up_refuses_fewer_than_one_gateway_worker(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_up_parser()
    args = parser.parse_args(["--gateway-workers", "0"])
    with pytest.raises(SystemExit) as exited:
        check_up_args(parser, args)
    assert exited.value.code == 2
    assert "--gateway-workers must be at least 1" in capsys.readouterr().err
    args = parser.parse_args(["--gateway-workers", "3"])
    check_up_args(parser, args)
    assert args.gateway_workers == 3


def test_the_spec_round_trips_and_names_the_sibling_sockets(tmp_path: Path) -> None:
    config = GatewayConfig(port=8123, engines=(ENGINE,), workers=3, policy={"name": "least_loaded"})
    spec = WorkerSpec(index=1, count=3, run_dir=str(tmp_path), listen_fd=None, config=config)
    assert read_spec(write_spec(spec)) == spec
    assert spec.sibling_sockets() == {0: str(tmp_path / "worker-0.sock"), 2: str(tmp_path / "worker-2.sock")}
    assert spec.metrics_socket() == str(tmp_path / "worker-1.sock")


def test_an_unreadable_spec_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read worker spec"):
        read_spec(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"index": 0}')
    with pytest.raises(ConfigError, match="worker spec"):
        read_spec(bad)


@pytest.mark.parametrize(
    ("code", "text"),
    [(0, "exit status 0"), (3, "exit status 3"), (-9, "killed by SIGKILL"), (-15, "killed by SIGTERM")],
)
def test_exit_status(code: int, text: str) -> None:
    assert exit_status(code) == text


async def test_supervise_is_for_two_or_more_workers() -> None:
    with pytest.raises(ConfigError, match="2 or more"):
        await supervise(GatewayConfig(engines=(ENGINE,), workers=1))


@pytest.mark.parametrize("reuse_port", [True, False])
async def test_a_port_already_served_is_refused_before_any_worker_starts(reuse_port: bool) -> None:
    """Even by a listener with SO_REUSEPORT, which SO_REUSEPORT workers would otherwise silently join."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = GatewayConfig(port=port, engines=(ENGINE,), workers=2)
        with pytest.raises(ConfigError, match=f"^cannot listen on 127.0.0.1:{port}: "):
            await _bind(config, reuse_port)


async def test_more_workers_than_cpus_is_allowed_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    workers = (os.cpu_count() or 1) + 1
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:  # so that it stops before spawning
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = GatewayConfig(port=taken.getsockname()[1], engines=(ENGINE,), workers=workers)
        with caplog.at_level(logging.WARNING), pytest.raises(ConfigError, match="cannot listen"):
            await supervise(config, handle_signals=False)
    assert f"{workers} gateway workers on {workers - 1} CPUs" in caplog.text


async def test_port_0_is_resolved_once_for_every_worker() -> None:
    listener = await _bind(GatewayConfig(port=0, engines=(ENGINE,), workers=2), True)
    try:
        assert listener.port > 0 and not listener.inherit
        # a worker binding the same port with SO_REUSEPORT is accepted while the supervisor holds it
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as worker:
            worker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            worker.bind(("127.0.0.1", listener.port))
            worker.listen()
    finally:
        listener.held.close()
