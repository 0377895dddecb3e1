"""Start-up errors of the gateway <-> agent link's files (docs/security.md): one line naming the flag or
config key and the file, exit 2, before any backend or worker starts. Real certificates from `link_certs`;
the agent's and the gateway's `main` run in this process."""

from __future__ import annotations

from pathlib import Path

import pytest
from link_certs import LinkCerts, make_link_certs

import engine_agent.__main__ as agent_main
import gateway.__main__ as gateway_main
from gateway.config import ConfigError, EngineLinkConfig
from gateway.engines.grpc_link import load_engine_link

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> LinkCerts:
    return make_link_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def not_pem(tmp_path: Path) -> Path:
    path = tmp_path / "not-pem"
    path.write_text("hello\n")
    return path


def agent_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert agent_main.main(["--port", "0", *argv], prog="agent") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("agent: error: ")
    return err


def test_agent_tls_file_errors(certs: LinkCerts, not_pem: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cert, key = str(certs.server.cert), str(certs.server.key)
    err = agent_error(capsys, "--tls-cert", cert, "--tls-key", str(certs.client.key))
    assert f"--tls-cert {cert} / --tls-key {certs.client.key}: not a PEM certificate" in err
    assert "--tls-cert" in agent_error(capsys, "--tls-cert", str(not_pem), "--tls-key", key)
    err = agent_error(capsys, "--tls-cert", cert, "--tls-key", key, "--tls-client-ca", str(not_pem))
    assert f"--tls-client-ca {not_pem}: no PEM CA certificate" in err
    err = agent_error(capsys, "--tls-cert", cert, "--tls-key", key + ".missing")
    assert f"--tls-key {key}.missing: cannot read it: No such file or directory" in err
    err = agent_error(capsys, "--tls-key", key)
    assert err == "agent: error: invalid config: --tls-key needs --tls-cert too"
    assert "--tls-client-ca (mutual TLS) needs" in agent_error(capsys, "--tls-client-ca", str(certs.ca))


def test_agent_token_file_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    assert f"--auth-token-file {empty}: the file is empty" in agent_error(
        capsys, "--auth-token-file", str(empty)
    )
    two = tmp_path / "two-words"
    two.write_text("two words\n")
    assert "one word of printable ASCII" in agent_error(capsys, "--auth-token-file", str(two))
    missing = tmp_path / "missing"
    assert "cannot read it" in agent_error(capsys, "--auth-token-file", str(missing))


def test_agent_reads_the_link_files_from_the_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "from-env"
    monkeypatch.setenv("SWITCHYARD_AGENT_AUTH_TOKEN_FILE", str(missing))
    assert f"--auth-token-file {missing}: cannot read it" in agent_error(capsys)


def test_gateway_link_file_errors(certs: LinkCerts, not_pem: Path) -> None:
    with pytest.raises(
        ConfigError, match="engine_link.tls_cert_file / tls_key_file: .*: not a PEM certificate"
    ):
        load_engine_link(
            EngineLinkConfig(
                tls=True, tls_cert_file=str(certs.client.cert), tls_key_file=str(certs.server.key)
            )
        )
    with pytest.raises(ConfigError, match=f"engine_link.tls_ca_file: {not_pem}: no PEM CA"):
        load_engine_link(EngineLinkConfig(tls=True, tls_ca_file=str(not_pem)))
    link = load_engine_link(
        EngineLinkConfig(
            tls=True,
            tls_ca_file=str(certs.ca),
            tls_cert_file=str(certs.client.cert),
            tls_key_file=str(certs.client.key),
        )
    )
    assert link.tls and link.metadata == ()
    assert f"client certificate {certs.client.cert}" in link.description


def test_gateway_refuses_to_start_with_a_bad_link_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing-token"
    argv = ["--port", "0", "--engine", "127.0.0.1:1", "--engine-auth-token-file", str(missing)]
    assert gateway_main.main(argv, prog="gateway") == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"gateway: error: engine_link.auth_token_file: cannot read {missing}: No such file or directory"
    )
