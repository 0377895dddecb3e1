"""The gateway's engine link settings (`engine_link`): the config's checks, the environment and flags that set
it, and `load_engine_link` turning a token file into call metadata. (TLS against real agents:
tests/integration/test_agent_link_auth.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.__main__ import build_argparser, cli_overrides
from gateway.config import ConfigError, EngineLinkConfig, build_config
from gateway.engines.grpc_link import PLAINTEXT, load_engine_link


def test_default_is_plaintext_without_token() -> None:
    config = build_config(environ={})
    assert config.engine_link == EngineLinkConfig()
    link = load_engine_link(config.engine_link)
    assert link == PLAINTEXT and not link.tls and link.metadata == ()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tls": True, "tls_cert_file": "c"}, "tls_cert_file and tls_key_file go together"),
        ({"tls": True, "tls_key_file": "k"}, "tls_cert_file and tls_key_file go together"),
        ({"tls_ca_file": "ca"}, "tls_ca_file given but tls is false"),
        ({"tls_server_name": "agent"}, "tls_server_name given but tls is false"),
        ({"auth_token_file": ""}, "at least 1 character"),
        ({"tls": True, "ca": "x"}, "engine_link.ca: Extra inputs are not permitted"),
    ],
)
def test_inconsistent_settings_are_rejected_naming_the_path(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(cli={"engine_link": fields})


def test_environment_sets_the_link() -> None:
    config = build_config(
        environ={
            "SWITCHYARD_GATEWAY_ENGINE_LINK__TLS": "true",
            "SWITCHYARD_GATEWAY_ENGINE_LINK__TLS_CA_FILE": "/run/secrets/agent_link_ca",
            "SWITCHYARD_GATEWAY_ENGINE_LINK__AUTH_TOKEN_FILE": "/run/secrets/agent_link_token",
        }
    )
    assert config.engine_link == EngineLinkConfig(
        tls=True, tls_ca_file="/run/secrets/agent_link_ca", auth_token_file="/run/secrets/agent_link_token"
    )


def test_flags_set_the_link_and_absent_flags_leave_it_alone() -> None:
    parser = build_argparser()
    assert "engine_link" not in cli_overrides(parser.parse_args([]))
    args = parser.parse_args(
        [
            "--engine-tls",
            "--engine-tls-ca", "ca.pem",
            "--engine-tls-cert", "gw.pem",
            "--engine-tls-key", "gw.key",
            "--engine-tls-server-name", "agent.internal",
            "--engine-auth-token-file", "token",
        ]
    )  # fmt: skip
    environ = {"SWITCHYARD_GATEWAY_ENGINE_LINK__AUTH_TOKEN_FILE": "/env/token"}
    config = build_config(environ=environ, cli=cli_overrides(args))
    assert config.engine_link == EngineLinkConfig(
        tls=True,
        tls_ca_file="ca.pem",
        tls_cert_file="gw.pem",
        tls_key_file="gw.key",
        tls_server_name="agent.internal",
        auth_token_file="token",
    )


def test_token_becomes_authorization_metadata_and_stays_out_of_reprs(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("  very-secret-token \n")
    link = load_engine_link(EngineLinkConfig(auth_token_file=str(path)))
    assert link.metadata == (("authorization", "Bearer very-secret-token"),)
    assert not link.tls
    assert link.description == f"plaintext, bearer token from {path}"
    assert "very-secret" not in repr(link)


@pytest.mark.parametrize(
    ("content", "why"),
    [("", "the file is empty"), (" \n", "the file is empty"), ("a b", "the token must be one word")],
)
def test_bad_token_files_are_config_errors(tmp_path: Path, content: str, why: str) -> None:
    path = tmp_path / "token"
    path.write_text(content)
    with pytest.raises(ConfigError, match=f"engine_link.auth_token_file: {path}: {why}"):
        load_engine_link(EngineLinkConfig(auth_token_file=str(path)))


def test_missing_files_are_config_errors_naming_the_key(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(ConfigError, match=f"engine_link.auth_token_file: cannot read {missing}"):
        load_engine_link(EngineLinkConfig(auth_token_file=str(missing)))
    with pytest.raises(ConfigError, match=f"engine_link.tls_ca_file: cannot read {missing}"):
        load_engine_link(EngineLinkConfig(tls=True, tls_ca_file=str(missing)))


def test_tls_with_the_system_cas_and_a_server_name() -> None:
    link = load_engine_link(EngineLinkConfig(tls=True, tls_server_name="agent.internal"))
    assert link.tls
    assert link.channel_options == (("grpc.ssl_target_name_override", "agent.internal"),)
    assert link.description.startswith("TLS (agents' CA: the system CAs, expected name agent.internal)")
