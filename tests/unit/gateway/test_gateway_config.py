"""The gateway config tree: defaults, file < environment < flags, and errors that name the field path."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.__main__ import build_argparser, cli_overrides
from gateway.config import ConfigError, GatewayConfig, build_config, env_overrides


def test_defaults() -> None:
    c = GatewayConfig()
    assert (c.port, c.max_body_bytes, c.request_timeout_s, c.policy.name) == (
        8000,
        4 * 1024 * 1024,
        600.0,
        "round_robin",
    )
    assert (c.allow_policy_override, c.engines, c.upstreams) == (False, (), ())


def test_file_then_env_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text("port: 9000\nengines: ['a:1']\npolicy: {name: least_loaded}\nslo: {ttft_ms: 500}\n")
    environ = {"SWITCHYARD_GATEWAY_PORT": "9100", "SWITCHYARD_GATEWAY_ENGINES": "b:2, c:3", "HOME": "/x"}
    args = build_argparser().parse_args(["--policy", "session_affinity", "--policy-param", "ttl_s=30"])
    c = build_config(file_path=path, environ=environ, cli=cli_overrides(args))
    assert (c.port, c.engines) == (9100, ("b:2", "c:3"))
    assert (c.policy.name, c.policy.params, c.slo.ttft_ms) == ("session_affinity", {"ttl_s": 30}, 500.0)


def test_json_file_and_nested_env(tmp_path: Path) -> None:
    path = tmp_path / "gw.json"
    path.write_text('{"upstreams": ["http://127.0.0.1:8001"]}')
    c = build_config(file_path=path, environ={"SWITCHYARD_GATEWAY_POLICY__PARAMS": '{"k": 1}'})
    assert c.upstreams == ("http://127.0.0.1:8001",) and c.policy.params == {"k": 1}


@pytest.mark.parametrize(
    ("cli", "path"),
    [
        ({"engines": ["ok:1", "no-port"]}, "engines.1"),
        ({"upstreams": ["ftp://x"]}, "upstreams.0"),
        ({"port": 70000}, "port"),
        ({"slo": {"ttft_ms": 0}}, "slo.ttft_ms"),
        ({"policy": {"nme": "x"}}, "policy.nme"),
        ({"max_body_bytes": "lots"}, "max_body_bytes"),
    ],
)
def test_errors_name_the_path(cli: dict[str, object], path: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{path}: "):
        build_config(cli=cli)


def test_unknown_env_key_is_rejected() -> None:
    with pytest.raises(ConfigError, match="^colour: Extra inputs"):
        build_config(environ={"SWITCHYARD_GATEWAY_COLOUR": "blue"})


def test_env_overrides_only_read_the_prefix() -> None:
    assert env_overrides({"PATH": "/bin", "SWITCHYARD_GATEWAY_HOST": "0.0.0.0"}) == {"host": "0.0.0.0"}


def test_config_is_frozen() -> None:
    with pytest.raises(ValueError, match="frozen"):
        GatewayConfig().port = 1  # type: ignore[misc]


def test_nested_policy_params_from_a_file_build_prism_and_static_weighted(tmp_path: Path) -> None:
    from gateway.policies.registry import make_policy  # noqa: PLC0415 (config must not import policies)

    path = tmp_path / "gw.yaml"
    path.write_text(
        "policy:\n  name: prism\n  params: {weights: {affinity: 2.0}, tpot_slo_ms: 12}\n"
        "slo: {ttft_ms: 2000, tpot_ms: 12}\n"
    )
    c = build_config(file_path=path)
    assert (c.slo.ttft_ms, c.slo.tpot_ms) == (2000.0, 12.0)
    assert make_policy(c.policy.name, c.policy.params).NAME == "prism"
    environ = {
        "SWITCHYARD_GATEWAY_POLICY__NAME": "static_weighted",
        "SWITCHYARD_GATEWAY_POLICY__PARAMS": '{"weights": {"10.0.0.1:50051": 3, "a6000x2-llama3-8b": 1}}',
    }
    c = build_config(environ=environ)
    assert make_policy(c.policy.name, c.policy.params).NAME == "static_weighted"


def test_engine_streams_default_session_and_flag() -> None:
    assert GatewayConfig().engine_streams == "session"
    args = build_argparser().parse_args(["--engine-streams", "per_request"])
    assert build_config(environ={}, cli=cli_overrides(args)).engine_streams == "per_request"
    with pytest.raises(ConfigError, match="engine_streams"):
        build_config(environ={"SWITCHYARD_GATEWAY_ENGINE_STREAMS": "carrier-pigeon"})
