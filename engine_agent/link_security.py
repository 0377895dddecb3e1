"""Who may call an engine agent: TLS or mutual TLS on its gRPC port, and a shared bearer token.

Owns: reading the files a `LinkSecurityConfig` names (certificate, key, client CA, token) into a
`LinkSecurity`, failing with a one-line `LinkSecurityError` that names the flag and the file; checking the
certificate files with the standard `ssl` module first (a key that does not match its certificate, or a file
that is no PEM, fails here at start, not at the first handshake); the gRPC server credentials; the grpc.aio
server interceptor that refuses every RPC without `authorization: Bearer <token>` with UNAUTHENTICATED
(constant-time comparison), except grpc.health.v1 `Health/Check`; the one-line description logged at start.
Why Check is exempt: Docker healthchecks and the launcher probe readiness with it, and it tells a caller only
SERVING or not. `Health/Watch` and every EngineAgent RPC need the token. With mutual TLS nothing is exempt:
the handshake itself refuses a caller without a certificate, before any RPC.
Must not: bind ports or build the server (`engine_agent.server` does), parse the command line, or log or repr
the token.
"""

from __future__ import annotations

import hmac
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from engine_agent.config import LinkSecurityConfig
from switchyard.link_token import parse_token

log = logging.getLogger(__name__)

# RPCs a caller may make without the token (see the module docstring).
TOKEN_EXEMPT_METHODS: frozenset[str] = frozenset({"/grpc.health.v1.Health/Check"})
_REFUSAL_LOG_EVERY_S = 10.0  # refused calls are logged at most this often (a misconfigured peer retries)
_SHORT_TOKEN_CHARS = 16


class LinkSecurityError(ValueError):
    """A link security file is missing, unreadable or malformed; the message is one line naming the flag."""


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise LinkSecurityError(f"{flag} {path}: cannot read it: {exc.strerror or exc}") from exc


def read_token_file(path: str, flag: str = "--auth-token-file") -> str:
    """The token in `path`, surrounding whitespace stripped; it must be non-empty printable ASCII without
    whitespace inside (it travels as an HTTP/2 header value)."""
    raw = _read(path, flag)  # its own error names the file
    try:
        return parse_token(raw)
    except ValueError as exc:
        raise LinkSecurityError(f"{flag} {path}: {exc}") from exc


def _refuse_encrypted_key() -> bytes:
    raise LinkSecurityError("the key is encrypted")


def _check_pem_files(config: LinkSecurityConfig) -> None:
    """The standard library's OpenSSL reads the files first: clearer errors than gRPC's, and at start."""
    assert config.tls_cert_file is not None and config.tls_key_file is not None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    files = f"--tls-cert {config.tls_cert_file} / --tls-key {config.tls_key_file}"
    try:
        context.load_cert_chain(config.tls_cert_file, config.tls_key_file, password=_refuse_encrypted_key)
    except LinkSecurityError as exc:
        raise LinkSecurityError(f"{files}: {exc}; give an unencrypted PEM key") from exc
    except ssl.SSLError as exc:
        raise LinkSecurityError(
            f"{files}: not a PEM certificate (chain) and its matching PEM private key ({exc.reason or exc})"
        ) from exc
    if config.tls_client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=config.tls_client_ca_file)
        except ssl.SSLError as exc:
            where = f"--tls-client-ca {config.tls_client_ca_file}"
            raise LinkSecurityError(f"{where}: no PEM CA certificate in it ({exc.reason or exc})") from exc


@dataclass(frozen=True)
class LinkSecurity:
    """What `serve` needs: server credentials (None = plaintext), the token (None = none asked), a summary."""

    server_credentials: grpc.ServerCredentials | None
    token: str | None = field(repr=False)
    description: str

    @property
    def open(self) -> bool:
        return self.server_credentials is None and self.token is None

    def interceptors(self) -> tuple[grpc.aio.ServerInterceptor, ...]:
        return () if self.token is None else (BearerTokenInterceptor(self.token),)


def load_link_security(config: LinkSecurityConfig) -> LinkSecurity:
    """Read and check the files `config` names; raises `LinkSecurityError`."""
    cert = _read(config.tls_cert_file, "--tls-cert") if config.tls_cert_file is not None else None
    key = _read(config.tls_key_file, "--tls-key") if config.tls_key_file is not None else None
    client_ca = (
        _read(config.tls_client_ca_file, "--tls-client-ca") if config.tls_client_ca_file is not None else None
    )
    token = read_token_file(config.auth_token_file) if config.auth_token_file is not None else None
    if token is not None and len(token) < _SHORT_TOKEN_CHARS:
        log.warning("the bearer token in %s has only %d characters", config.auth_token_file, len(token))
    parts: list[str] = []
    credentials: grpc.ServerCredentials | None = None
    if cert is not None and key is not None:
        _check_pem_files(config)
        credentials = grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
        )
        parts.append(f"TLS (certificate {config.tls_cert_file})")
        if client_ca is not None:
            parts.append(f"mutual TLS (callers need a certificate signed by {config.tls_client_ca_file})")
    else:
        parts.append("no TLS (plaintext)")
    if token is not None:
        parts.append(f"bearer token required (from {config.auth_token_file}; grpc.health.v1 Check exempt)")
    else:
        parts.append("no token")
    return LinkSecurity(credentials, token, "; ".join(parts))


def _bearer_token(metadata: Sequence[Any] | None) -> bytes | None:
    """The token of the first `authorization: Bearer <token>` entry, None when there is none."""
    for key, value in metadata or ():
        if key == "authorization":
            raw = value.encode("latin-1", "replace") if isinstance(value, str) else bytes(value)
            scheme, _, token = raw.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    return None


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every RPC (but `TOKEN_EXEMPT_METHODS`) whose `authorization` metadata is not `Bearer <token>`
    with UNAUTHENTICATED; logs refusals, at most one line per `_REFUSAL_LOG_EVERY_S`."""

    def __init__(self, token: str, *, exempt: frozenset[str] = TOKEN_EXEMPT_METHODS) -> None:
        self._token = token.encode("ascii")
        self._exempt = exempt
        self._refused_since_log = 0
        self._last_log_s = float("-inf")

    def __repr__(self) -> str:
        return "BearerTokenInterceptor(<token hidden>)"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = handler_call_details.method
        if method in self._exempt:
            return await continuation(handler_call_details)
        given = _bearer_token(handler_call_details.invocation_metadata)
        if given is not None and hmac.compare_digest(given, self._token):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:  # an unknown method: UNIMPLEMENTED, as without the interceptor
            return handler
        why = "no bearer token" if given is None else "wrong bearer token"
        return self._refusal(handler, method, why)

    def _refusal(self, handler: grpc.RpcMethodHandler, method: str, why: str) -> grpc.RpcMethodHandler:
        async def refuse(_request: object, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            self._note_refusal(method, context.peer(), why)
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{why}: this engine agent needs `authorization: Bearer <token>` metadata",
            )

        kinds = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }
        make = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
        return make(
            refuse,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _note_refusal(self, method: str, peer: str, why: str) -> None:
        self._refused_since_log += 1
        now_s = time.monotonic()
        if now_s - self._last_log_s >= _REFUSAL_LOG_EVERY_S:
            log.warning(
                "refused %d call(s) without a valid bearer token (UNAUTHENTICATED); latest: %s from %s (%s)",
                self._refused_since_log,
                method,
                peer,
                why,
            )
            self._refused_since_log = 0
            self._last_log_s = now_s
