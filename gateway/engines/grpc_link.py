"""The gateway's side of the gateway <-> agent link: what `EngineLinkConfig` names, made into what a gRPC
channel and its calls carry (docs/security.md).

Owns: reading the CA, client certificate, key and token files once at start (a missing, unreadable, empty or
malformed one is a `ConfigError` naming the config key and the file; certificates are checked with the
standard `ssl` module so that a key not matching its certificate fails here, not at every handshake), and
`EngineLink`: the channel credentials (None = plaintext), channel options (the TLS server-name override), the
call metadata that carries the bearer token, and a one-line summary for the log.
Token transport: explicit `authorization: Bearer <token>` metadata on every call the client makes, not gRPC
call credentials, which gRPC sends only over TLS; a token without TLS is a supported mode (a trusted network).
Must not: open channels or make calls (`gateway.engines.grpc_client` does), log or repr the token.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from gateway.config import ConfigError, EngineLinkConfig
from switchyard.link_token import parse_token


@dataclass(frozen=True)
class EngineLink:
    """How to reach the agents: `credentials` None = plaintext; `metadata` goes with every call."""

    credentials: grpc.ChannelCredentials | None = None
    channel_options: tuple[tuple[str, str], ...] = ()
    metadata: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    description: str = "plaintext, no token"

    @property
    def tls(self) -> bool:
        return self.credentials is not None


PLAINTEXT = EngineLink()


def _read(path: str, key: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"engine_link.{key}: cannot read {path}: {exc.strerror or exc}") from exc


def _read_token(path: str) -> str:
    """The token in `path`, surrounding whitespace stripped: non-empty printable ASCII, one word."""
    raw = _read(path, "auth_token_file")
    try:
        return parse_token(raw)
    except ValueError as exc:
        raise ConfigError(f"engine_link.auth_token_file: {path}: {exc}") from exc


def _no_password() -> bytes:
    raise ConfigError("the key is encrypted; give an unencrypted PEM key")


def _check_pem_files(config: EngineLinkConfig) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if config.tls_ca_file is not None:
        try:
            context.load_verify_locations(cafile=config.tls_ca_file)
        except ssl.SSLError as exc:
            where = f"engine_link.tls_ca_file: {config.tls_ca_file}"
            raise ConfigError(f"{where}: no PEM CA certificate in it ({exc.reason or exc})") from exc
    if config.tls_cert_file is not None and config.tls_key_file is not None:
        where = f"engine_link.tls_cert_file / tls_key_file: {config.tls_cert_file} / {config.tls_key_file}"
        try:
            context.load_cert_chain(config.tls_cert_file, config.tls_key_file, password=_no_password)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from exc
        except ssl.SSLError as exc:
            raise ConfigError(
                f"{where}: not a PEM certificate and its matching PEM private key ({exc.reason or exc})"
            ) from exc


def load_engine_link(config: EngineLinkConfig) -> EngineLink:
    """Read and check the files `config` names; raises `ConfigError`."""
    token = _read_token(config.auth_token_file) if config.auth_token_file is not None else None
    metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()
    token_part = f"bearer token from {config.auth_token_file}" if token is not None else "no token"
    if not config.tls:
        return EngineLink(metadata=metadata, description=f"plaintext, {token_part}")
    ca = _read(config.tls_ca_file, "tls_ca_file") if config.tls_ca_file is not None else None
    cert = _read(config.tls_cert_file, "tls_cert_file") if config.tls_cert_file is not None else None
    key = _read(config.tls_key_file, "tls_key_file") if config.tls_key_file is not None else None
    _check_pem_files(config)
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    options: tuple[tuple[str, str], ...] = ()
    if config.tls_server_name is not None:
        options = (("grpc.ssl_target_name_override", config.tls_server_name),)
    parts = [
        f"TLS (agents' CA: {config.tls_ca_file or 'the system CAs'}"
        + (f", expected name {config.tls_server_name}" if config.tls_server_name else "")
        + ")",
        f"client certificate {config.tls_cert_file}" if cert is not None else "no client certificate",
        token_part,
    ]
    return EngineLink(credentials, options, metadata, ", ".join(parts))
