"""Test helper: a throwaway CA, an agent (server) certificate and gateway (client) certificates, as PEM files.

Made with the `cryptography` package at test time (EC P-256: fast to generate); nothing is committed.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER_NAMES = ("localhost", "agent.test")  # DNS names in the agent's certificate (and IP 127.0.0.1)


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class LinkCerts:
    ca: Path  # the CA that signed `server` and `client`
    server: CertPair  # the agent's: SAN localhost, agent.test, 127.0.0.1; serverAuth
    client: CertPair  # the gateway's: clientAuth
    other_ca: Path  # an unrelated CA
    stranger: CertPair  # a client certificate signed by `other_ca`


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


def _make_ca(common_name: str, path: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def _issue(
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    common_name: str,
    usage: x509.ObjectIdentifier,
    out: Path,
    *,
    server: bool,
) -> CertPair:
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if server:
        names: list[x509.GeneralName] = [x509.DNSName(n) for n in SERVER_NAMES]
        names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    pair = CertPair(out / f"{common_name}.crt", out / f"{common_name}.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, pair.key)
    return pair


def make_link_certs(out: Path) -> LinkCerts:
    """Write a CA, the agent's and the gateway's certificates, and a stranger's, under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    ca = _make_ca("switchyard-test-ca", out / "ca.crt")
    other = _make_ca("other-ca", out / "other-ca.crt")
    return LinkCerts(
        ca=out / "ca.crt",
        server=_issue(ca, "agent", ExtendedKeyUsageOID.SERVER_AUTH, out, server=True),
        client=_issue(ca, "gateway", ExtendedKeyUsageOID.CLIENT_AUTH, out, server=False),
        other_ca=out / "other-ca.crt",
        stranger=_issue(other, "stranger", ExtendedKeyUsageOID.CLIENT_AUTH, out, server=False),
    )
