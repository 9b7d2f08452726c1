"""A development PKI: one CA and the certificates of etcd, the broker and every site
(`cpn certs`, `cpn up --secure`; long form: docs/auth.md).

    DIR/ca.pem, ca-key.pem              the CA (ECDSA P-256), 10 years by default
    DIR/<name>.pem, <name>-key.pem      a certificate it signed and its key (mode 0600)
    DIR/crl.pem                         the certificates it revoked (a CRL it signed)

A client certificate's common name is the etcd user it authenticates as: etcd started with
``--client-cert-auth`` takes the user from the CN, so an agent needs no password that could
expire or leak from a process list. A server certificate names its hosts as DNS or IP SANs.

A certificate is renewed (`renew`: a new key, the same names and usages) before it expires, and
revoked (`revoke`) by adding its serial to the CRL, which is signed again each time with a
`last_update` later than the one before: a process that adds each new CRL to its trust store
uses the newest (OpenSSL picks the latest of a CA's CRLs), cpn.rotation says who reads it.

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

__all__ = ["Issued", "Pki", "PkiError", "Profile", "profile_of"]

CA_DAYS = 3650
LEAF_DAYS = 825  # the CA/Browser forum's old ceiling for leaf certificates
RENEW_WITHIN_DAYS = 30  # `cpn certs rotate`'s default window: a month to notice a failed renewal
CRL_DAYS = 365
CLOCK_SKEW = dt.timedelta(minutes=5)  # how far behind a peer's clock may be: back-dated by it
"""A CRL's next_update: clients that check it refuse every handshake once it has passed, so it
is long, and `cpn certs rotate` signs it again when it falls within the renewal window."""
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


@dataclass(frozen=True)
class Profile:
    """What a certificate says, and so what its renewal says again: its common name, the hosts
    it names (a server's SANs) and its usages."""

    common_name: str
    hosts: tuple[str, ...] = ()
    client: bool = True
    server: bool = False


def profile_of(cert: x509.Certificate) -> Profile:
    """The profile of a certificate issued by `Pki.issue` (or one like it)."""
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    common_name = str(cns[0].value) if cns else ""
    try:
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        client = ExtendedKeyUsageOID.CLIENT_AUTH in usages
        server = ExtendedKeyUsageOID.SERVER_AUTH in usages
    except x509.ExtensionNotFound:
        client, server = True, False
    hosts: list[str] = []
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        hosts = [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
        hosts += san.get_values_for_type(x509.DNSName)
    except x509.ExtensionNotFound:
        pass
    return Profile(common_name, tuple(hosts), client, server)


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
            .not_valid_before(now - CLOCK_SKEW)
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

    def sign(self, profile: Profile, *, days: int = LEAF_DAYS) -> tuple[bytes, bytes]:
        """(certificate, key) as PEM for `profile`, signed by the CA with a fresh key; a
        server's certificate names `profile.hosts` (default: loopback) as SANs."""
        ca_cert, ca_key = self._ca()
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        usages = ([ExtendedKeyUsageOID.CLIENT_AUTH] if profile.client else []) + (
            [ExtendedKeyUsageOID.SERVER_AUTH] if profile.server else []
        )
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(profile.common_name))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
            )
        )
        if profile.server:
            builder = builder.add_extension(
                _san(list(profile.hosts) or DEFAULT_HOSTS), critical=False
            )
        cert = builder.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)

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
        profile = Profile(common_name or name, tuple(hosts), client, server)
        return self.write(name, *self.sign(profile, days=days))

    def write(self, name: str, cert_pem: bytes, key_pem: bytes) -> Issued:
        """Write `<name>-key.pem`, then `<name>.pem`, each atomically (a server that reloads
        them and finds the key new but the certificate old keeps what it had and tries again
        at its next handshake)."""
        cert_path = self.directory / f"{name}.pem"
        key_path = self.directory / f"{name}-key.pem"
        write_private(key_path, key_pem.decode())
        write_private(cert_path, cert_pem.decode())
        return Issued(name, cert_pem, key_pem, cert_path, key_path)

    # -- revocation ------------------------------------------------------------------------

    @property
    def crl_path(self) -> Path:
        return self.directory / "crl.pem"

    def crl(self) -> x509.CertificateRevocationList | None:
        """The CRL as written, or None where none is yet."""
        try:
            return x509.load_pem_x509_crl(self.crl_path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise PkiError(f"{self.crl_path}: does not load: {exc}") from None

    def revoked(self) -> dict[int, dt.datetime]:
        """{serial: when it was revoked} of the CRL."""
        crl = self.crl()
        if crl is None:
            return {}
        return {r.serial_number: r.revocation_date_utc for r in crl}

    def write_crl(self, revoke: Sequence[int] = (), *, days: int = CRL_DAYS) -> Path:
        """Sign the CRL again with `revoke` added to what it held. Its last_update is five
        minutes ago (a client whose clock is behind would take a CRL from its future for not
        yet valid, and use the one before), or a second after the previous one's where that is
        later: each CRL is the newest (see the module's doc)."""
        ca_cert, ca_key = self._ca()
        previous = self.crl()
        now = dt.datetime.now(dt.UTC).replace(microsecond=0)
        last_update = now - CLOCK_SKEW
        number = 1
        if previous is not None:
            last_update = max(last_update, previous.last_update_utc + dt.timedelta(seconds=1))
            try:
                number = (
                    previous.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number + 1
                )
            except x509.ExtensionNotFound:
                pass
        revoked = self.revoked()
        for serial in revoke:
            revoked.setdefault(serial, now)
        builder = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(ca_cert.subject)
            .last_update(last_update)
            .next_update(min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc))
            .add_extension(x509.CRLNumber(number), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
            )
        )
        for serial, when in sorted(revoked.items()):
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build()
            )
        crl = builder.sign(ca_key, hashes.SHA256())
        write_private(self.crl_path, crl.public_bytes(serialization.Encoding.PEM).decode())
        self.crl_path.chmod(0o644)  # public: etcd and every client reads it
        return self.crl_path
