"""A development PKI: one CA and the certificates of etcd, the broker and every site
(`cpn certs`, `cpn up --secure`; long form: docs/auth.md).

    DIR/ca.pem, ca-key.pem              the CA (ECDSA P-256), 10 years by default
    DIR/<name>.pem, <name>-key.pem      a certificate it signed and its key (mode 0600)

A client certificate's common name is the etcd user it authenticates as: etcd started with
``--client-cert-auth`` takes the user from the CN, so an agent needs no password that could
expire or leak from a process list. A server certificate names its hosts as DNS or IP SANs.

For production, bring your own CA: etcd, the broker and the credential files take PEM files,
whoever issued them. This module is for the demo, the tests and small federations.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from cpn.state import write_private

__all__ = ["Issued", "Pki", "PkiError"]

CA_DAYS = 3650
LEAF_DAYS = 825  # the CA/Browser forum's old ceiling for leaf certificates
DEFAULT_HOSTS = ("127.0.0.1", "localhost", "::1")


class PkiError(Exception):
    """The PKI directory cannot be used (no CA where one is needed, unreadable files)."""


@dataclass(frozen=True)
class Issued:
    """A certificate and its key as PEM, and the files they were written to."""

    name: str
    cert_pem: bytes
    key_pem: bytes
    cert_path: Path
    key_path: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "cpn"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


class Pki:
    """The CA in `directory` and what it issues. `init()` makes the CA once; every later call
    reuses it, so certificates issued on different days verify against one ca.pem."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    @property
    def ca_path(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def ca_key_path(self) -> Path:
        return self.directory / "ca-key.pem"

    def exists(self) -> bool:
        return self.ca_path.exists() and self.ca_key_path.exists()

    def init(self, *, common_name: str = "cpn development CA", days: int = CA_DAYS) -> bool:
        """Create the CA unless there is one; True if it was created now."""
        if self.exists():
            return False
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(_name(common_name))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )  # fmt: skip
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256())
        )
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_private(self.ca_key_path, _key_pem(key).decode())
        write_private(self.ca_path, cert.public_bytes(serialization.Encoding.PEM).decode())
        return True

    def ca_pem(self) -> bytes:
        try:
            return self.ca_path.read_bytes()
        except OSError as exc:
            raise PkiError(f"{self.ca_path}: {exc.strerror}; run `cpn certs init` first") from None

    def _ca(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        try:
            cert = x509.load_pem_x509_certificate(self.ca_path.read_bytes())
            key = serialization.load_pem_private_key(self.ca_key_path.read_bytes(), None)
        except OSError as exc:
            raise PkiError(
                f"{exc.filename}: {exc.strerror}; run `cpn certs init --dir {self.directory}`"
            ) from None
        except ValueError as exc:
            raise PkiError(f"{self.directory}: the CA does not load: {exc}") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise PkiError(f"{self.ca_key_path}: not an ECDSA key")
        return cert, key

    def issue(
        self,
        name: str,
        *,
        common_name: str | None = None,
        hosts: Sequence[str] = (),
        client: bool = True,
        server: bool = False,
        days: int = LEAF_DAYS,
    ) -> Issued:
        """Sign a certificate for `common_name` (default `name`) and write `<name>.pem` and
        `<name>-key.pem`; `server` adds `hosts` as SANs and the server-auth usage."""
        ca_cert, ca_key = self._ca()
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        usages = ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else []) + (
            [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
        )
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name or name))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
            )
        )
        if server:
            builder = builder.add_extension(_san(list(hosts) or DEFAULT_HOSTS), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        cert_pem = cert.public_bytes(serialization.Encoding.PEM)
        key_pem = _key_pem(key)
        cert_path = self.directory / f"{name}.pem"
        key_path = self.directory / f"{name}-key.pem"
        write_private(key_path, key_pem.decode())
        write_private(cert_path, cert_pem.decode())
        return Issued(name, cert_pem, key_pem, cert_path, key_path)
