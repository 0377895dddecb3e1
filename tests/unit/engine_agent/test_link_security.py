"""The agent's link security settings: flags and their environment variables, the config's checks, the token
file's rules and the `authorization` header parsing of the bearer-token interceptor. (Real agents refusing and
serving callers: tests/integration/test_agent_link_auth.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from engine_agent.__main__ import build_agent_argparser, config_from_args
from engine_agent.config import LinkSecurityConfig
from engine_agent.link_security import (
    TOKEN_EXEMPT_METHODS,
    BearerTokenInterceptor,
    LinkSecurityError,
    _bearer_token,
    load_link_security,
    read_token_file,
)


def link_of(argv: list[str], environ: dict[str, str]) -> LinkSecurityConfig:
    return config_from_args(build_agent_argparser().parse_args(argv), environ).link


def test_default_is_open() -> None:
    link = link_of([], {})
    assert link == LinkSecurityConfig() and not link.tls and not link.mutual_tls
    security = load_link_security(link)
    assert security.open and security.interceptors() == ()
    assert security.description == "no TLS (plaintext); no token"


def test_flags_win_over_environment_and_empty_variables_are_unset() -> None:
    environ = {
        "SWITCHYARD_AGENT_TLS_CERT": "/env/cert.pem",
        "SWITCHYARD_AGENT_TLS_KEY": "/env/key.pem",
        "SWITCHYARD_AGENT_TLS_CLIENT_CA": "",
        "SWITCHYARD_AGENT_AUTH_TOKEN_FILE": "/env/token",
    }
    assert link_of([], environ) == LinkSecurityConfig(
        tls_cert_file="/env/cert.pem", tls_key_file="/env/key.pem", auth_token_file="/env/token"
    )
    flags = ["--auth-token-file", "/flag/token", "--tls-client-ca", "/flag/ca.pem"]
    link = link_of(flags, environ)
    assert (link.auth_token_file, link.tls_client_ca_file, link.tls_cert_file) == (
        "/flag/token",
        "/flag/ca.pem",
        "/env/cert.pem",
    )
    assert link.mutual_tls


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tls_key_file": "k"}, "--tls-key needs --tls-cert too"),
        ({"tls_cert_file": "c"}, "--tls-cert needs --tls-key too"),
        ({"tls_client_ca_file": "ca"}, "--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key"),
        ({"auth_token_file": ""}, "at least 1 character"),
    ],
)
def test_inconsistent_settings_are_rejected(fields: dict[str, str], message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LinkSecurityConfig(**fields)


def test_token_file_is_stripped_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("\n  abc123-XYZ_=  \n")
    assert read_token_file(str(path)) == "abc123-XYZ_="
    for bad, why in (("", "empty"), ("  \n", "empty"), ("a b", "one word"), ("tok\x01", "one word")):
        path.write_text(bad)
        with pytest.raises(LinkSecurityError, match=why):
            read_token_file(str(path))
    path.write_bytes("tökén".encode())
    with pytest.raises(LinkSecurityError, match="ASCII"):
        read_token_file(str(path))


def test_the_token_never_shows_in_reprs(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("very-secret-token-value")
    security = load_link_security(LinkSecurityConfig(auth_token_file=str(path)))
    assert security.token == "very-secret-token-value"
    (interceptor,) = security.interceptors()
    for text in (repr(security), repr(interceptor), security.description):
        assert "very-secret" not in text
    assert "bearer token required" in security.description


@pytest.mark.parametrize(
    ("metadata", "token"),
    [
        (None, None),
        ((), None),
        ((("x-other", "Bearer t"),), None),
        ((("authorization", "Bearer t0k"),), b"t0k"),
        ((("authorization", "bearer  t0k "),), b"t0k"),
        ((("authorization", "Basic dXNlcjpw"),), b""),
        ((("authorization", "t0k"),), b""),
        ((("authorization", b"Bearer t0k"),), b"t0k"),
        ((("authorization", "Bearer first"), ("authorization", "Bearer second")), b"first"),
    ],
)
def test_bearer_token_parsing(
    metadata: tuple[tuple[str, str | bytes], ...] | None, token: bytes | None
) -> None:
    assert _bearer_token(metadata) == token


def test_only_health_check_is_exempt() -> None:
    assert TOKEN_EXEMPT_METHODS == frozenset({"/grpc.health.v1.Health/Check"})
    assert "abc" not in repr(BearerTokenInterceptor("abc"))
