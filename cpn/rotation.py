"""Certificates that rotate: what a PKI directory holds, which certificates are due for renewal,
their renewal, and revocation (`cpn certs ls|rotate|revoke`; long form: docs/auth.md,
"Certificates that rotate").

A PKI directory (cpn.certs) holds two kinds of certificates:

    DIR/<name>.pem + <name>-key.pem     servers' (etcd, broker, agent-<site>): files a running
                                        process re-reads at its next handshake
                                        (sites.kits.tls.ReloadingServer; etcd does it itself)
    DIR/credentials/<name>.yaml         etcd users' client certificates (root, cpn-broker, each
                                        site's), inside the credential file

`rotate` renews every certificate that expires within the window (a new key, the same names
and usages, written atomically in place) and signs the CRL again when its next_update falls in
the window too; it decides first (`due`) and then acts, so `--dry-run` shows the same list.
`revoke` adds certificates' serials to the CRL and, with `reissue`, renews them at once (a
compromised key: the site gets a new one, the old one is refused).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from cryptography import x509

from cpn.certs import Pki, PkiError, profile_of
from sites.model.errors import ConfigError
from sites.registry.security import (
    EtcdCredentials,
    load_credentials,
    site_user,
    write_credentials,
)

__all__ = ["Held", "RotationReport", "due", "held", "renew", "revoke", "rotate"]

CREDENTIALS = "credentials/"
_NOT_LEAVES = frozenset({"ca.pem", "crl.pem"})


@dataclass(frozen=True)
class Held:
    """One certificate of the directory: `name` as `cpn certs ls` shows it (`broker`,
    `agent-beijing-a`, `credentials/beijing-a`) and the file that holds it."""

    name: str
    path: Path
    cert: x509.Certificate

    @property
    def serial(self) -> int:
        return self.cert.serial_number

    @property
    def not_after(self) -> dt.datetime:
        return self.cert.not_valid_after_utc

    @property
    def common_name(self) -> str:
        return profile_of(self.cert).common_name

    @property
    def in_credentials(self) -> bool:
        return self.name.startswith(CREDENTIALS)

    def state(self, now: dt.datetime, revoked: set[int], within: dt.timedelta) -> str:
        """revoked, expired, due (expires within the window) or ok."""
        if self.serial in revoked:
            return "revoked"
        if self.not_after <= now:
            return "expired"
        return "due" if self.not_after <= now + within else "ok"


def held(pki: Pki) -> list[Held]:
    """Every leaf certificate of the directory and of its credential files, by name."""
    out: list[Held] = []
    for path in sorted(pki.directory.glob("*.pem")):
        if path.name in _NOT_LEAVES or path.name.endswith("-key.pem"):
            continue
        out.append(Held(path.stem, path, _load_cert(path, path.read_bytes())))
    for path in sorted((pki.directory / "credentials").glob("*.yaml")):
        creds = _credentials(path)
        out.append(Held(CREDENTIALS + path.stem, path, _load_cert(path, creds.cert.encode())))
    return out


def _load_cert(path: Path, pem: bytes) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise PkiError(f"{path}: not a PEM certificate: {exc}") from None


def _credentials(path: Path) -> EtcdCredentials:
    try:
        return load_credentials(path)
    except ConfigError as exc:
        raise PkiError(str(exc)) from None


def due(certs: Sequence[Held], now: dt.datetime, within: dt.timedelta) -> list[Held]:
    """The certificates to renew: those that expire within `within` of `now`, expired ones
    too (a revoked one is not renewed by rotation: `revoke --reissue` does that)."""
    return [c for c in certs if c.state(now, set(), within) in ("due", "expired")]


def renew(pki: Pki, old: Held, *, user: str | None = None) -> Held:
    """A new certificate with the same names and usages as `old`, and a new key, written
    where `old` was; `user`: a credential's certificate for another etcd user (its CN)."""
    profile = profile_of(old.cert)
    if user is not None:
        if not old.in_credentials:
            raise PkiError(f"{old.name}: not an etcd user's credentials")
        profile = replace(profile, common_name=user)
    cert_pem, key_pem = pki.sign(profile)
    if old.in_credentials:
        creds = _credentials(old.path)
        update = {"cert": cert_pem.decode(), "key": key_pem.decode()}
        if user is not None:
            update["user"] = user
        write_credentials(old.path, creds.model_copy(update=update))
    else:
        pki.write(old.name, cert_pem, key_pem)
    return Held(old.name, old.path, x509.load_pem_x509_certificate(cert_pem))


@dataclass(frozen=True)
class RotationReport:
    """What `rotate` did (or, dry, would do)."""

    renewed: list[tuple[Held, Held | None]]  # (old, new: None when dry)
    crl_signed: bool
    ca_expires: dt.datetime
    ca_due: bool


def rotate(
    pki: Pki, *, now: dt.datetime, within: dt.timedelta, dry_run: bool = False
) -> RotationReport:
    """Renew what is due (see the module's doc); the CA itself is only reported on."""
    certs = held(pki)
    crl = pki.crl()
    crl_due = crl is None or (
        crl.next_update_utc is not None and crl.next_update_utc <= now + within
    )
    renewed: list[tuple[Held, Held | None]] = []
    for old in due(certs, now, within):
        renewed.append((old, None if dry_run else renew(pki, old)))
    if crl_due and not dry_run:
        pki.write_crl()
    ca = x509.load_pem_x509_certificate(pki.ca_pem())
    return RotationReport(
        renewed=renewed,
        crl_signed=crl_due,
        ca_expires=ca.not_valid_after_utc,
        ca_due=ca.not_valid_after_utc <= now + within,
    )


def revoke(
    pki: Pki,
    names: Sequence[str],
    *,
    reissue: bool = False,
    users: Mapping[str, str] | None = None,
) -> list[tuple[Held, Held | None]]:
    """Add the certificates held under `names` to the CRL (PkiError naming an unknown one), and
    with `reissue` give each a new certificate in its place, for the etcd user `users` names
    for it, if any (`site_of`); [(revoked, its successor)]."""
    by_name = {c.name: c for c in held(pki)}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        known = ", ".join(sorted(by_name)) or "none"
        raise PkiError(f"no certificate {unknown[0]!r} in {pki.directory} (there are: {known})")
    chosen = [by_name[n] for n in names]
    pki.write_crl([c.serial for c in chosen])
    users = users or {}
    return [(c, renew(pki, c, user=users.get(c.name)) if reissue else None) for c in chosen]


def site_of(pki: Pki, name: str) -> str | None:
    """The site whose etcd user `name` (`credentials/<site>`) is the credential of; None for
    any other certificate."""
    if not name.startswith(CREDENTIALS):
        return None
    site = name[len(CREDENTIALS) :]
    path = pki.directory / f"{name}.yaml"
    if not path.exists() or not _credentials(path).user.startswith(site_user(site)):
        return None
    return site
