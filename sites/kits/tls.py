"""TLS contexts from PEM files: a server's (its certificate and key) and a client's (the CA it
trusts), for the agents' endpoints and the broker's API (docs/auth.md). A file that does not
load is a ConfigError naming it, raised where the process starts, not at the first request.

Certificates rotate under running processes (docs/security.md): a server re-reads its
certificate when the files change (ReloadingServer), a client its CA's revocation list
(PeerTrust), so a renewed certificate is served and a revoked one refused at the next
handshake, with no restart; and a client's connections already open to a peer it revokes are
closed when the CRL loads (sites.kits.revocation).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import tempfile
import weakref
from pathlib import Path
from typing import Any

import aiohttp
from cryptography import x509
from prometheus_client import CollectorRegistry, Gauge

from sites.kits.revocation import Revocations, TrustedConnector
from sites.model.errors import ConfigError, Problem

__all__ = [
    "CRL_POLL_S",
    "PeerTrust",
    "ReloadingServer",
    "client_context",
    "peer_connector",
    "server_context",
]

log = logging.getLogger(__name__)

MIN_VERSION = ssl.TLSVersion.TLSv1_2
CRL_POLL_S = 1.0
"""How often a client looks whether its CRL file changed (one stat): how late a revocation
can be for it."""


def _why(exc: OSError | ssl.SSLError) -> str:
    return getattr(exc, "strerror", None) or str(exc)


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """TLS 1.2 or later, serving `cert` (PEM, the chain after the leaf) with its `key`."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = MIN_VERSION
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError([Problem(f"{cert} / {key}", "", f"cannot load: {_why(exc)}")]) from None
    return context


def client_context(ca: Path | None) -> ssl.SSLContext:
    """TLS 1.2 or later, verifying the server's certificate and host name against `ca` (PEM:
    the federation's CA), or against the system's CAs when None."""
    try:
        context = ssl.create_default_context(cafile=None if ca is None else str(ca))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError([Problem(str(ca), "", f"cannot load the CA: {_why(exc)}")]) from None
    context.minimum_version = MIN_VERSION
    return context


Stamp = tuple[tuple[int, int, int], ...]


def _stamp(*paths: Path) -> Stamp | None:
    """What tells a replaced file (inode, mtime, size; an atomic write is a new inode), or None
    while one of them cannot be read."""
    try:
        return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in (p.stat() for p in paths))
    except OSError:
        return None


def _not_after(cert: Path) -> float:
    try:
        return x509.load_pem_x509_certificate(cert.read_bytes()).not_valid_after_utc.timestamp()
    except (OSError, ValueError):
        return 0.0


class ReloadingServer:
    """A server's TLS context that serves the certificate its files hold now, with no restart.

    `context` is what the server listens with; at each handshake (its SNI callback, called
    with or without a server name) it looks whether `cert` or `key` was replaced (two stat
    calls) and, if so, loads them into a fresh context that this handshake and the next ones
    use; connections already open keep the one they began with. A pair that does not load (a
    key already new, its certificate not yet, or a broken file) leaves the last good context
    serving, logged once per change of the files (cpn.rotation writes the key, then the
    certificate)."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.cert, self.key = cert, key
        self._stamp = _stamp(cert, key)
        self._current = server_context(cert, key)  # a ConfigError at start, naming the files
        self.context = server_context(cert, key)
        self.context.sni_callback = self._on_hello
        self.reloads = 0
        self.last_error: str | None = None
        self.not_after = _not_after(cert)
        """When the certificate served expires (Unix time; 0 when it cannot be read)."""

    def expose(self, registry: CollectorRegistry, prefix: str, **labels: str) -> None:
        """`<prefix>_certificate_expiry_timestamp_seconds` in `registry`: what to alert on
        well before it comes (`cpn certs rotate` renews within its window)."""
        gauge = Gauge(
            f"{prefix}_certificate_expiry_timestamp_seconds",
            "When the TLS certificate this server presents expires (Unix time)",
            list(labels),
            registry=registry,
        )
        (gauge.labels(**labels) if labels else gauge).set_function(lambda: self.not_after)

    def refresh(self) -> bool:
        """Load the files again if they changed since the last look; True when it did."""
        stamp = _stamp(self.cert, self.key)
        if stamp is None or stamp == self._stamp:
            return False
        self._stamp = stamp  # a pair that fails is tried again once the files change again
        try:
            self._current = server_context(self.cert, self.key)
        except ConfigError as exc:
            self.last_error = str(exc.problems[0])
            log.warning("keeping the certificate served so far: %s", self.last_error)
            return False
        self.reloads += 1
        self.last_error = None
        self.not_after = _not_after(self.cert)
        log.info("serving the renewed certificate %s", self.cert)
        return True

    def _on_hello(
        self, ssl_object: ssl.SSLObject | ssl.SSLSocket, _name: str | None, _: ssl.SSLContext
    ) -> None:
        self.refresh()
        ssl_object.context = self._current


class PeerTrust:
    """A client's TLS context (client_context's) that also refuses the certificates `crl` (a PEM
    CRL of the CA) revokes, once that file exists: `refresh()` adds it again when it changed;
    `load_pem` adds one published in etcd (sites.registry.crl).

    The CRL is added to the context's trust store in place (an aiohttp connector holds the
    context), and OpenSSL checks a leaf against the newest of its CA's CRLs (the latest
    last_update, which cpn.certs makes later at each signing). Until a CRL has loaded nothing
    is checked against one: a CRL check with no CRL would refuse every peer.

    A handshake is where OpenSSL checks, so the connectors made by `connector()` are walked at
    each load and their connections to a peer the CRL revokes are closed, idle or in use
    (sites.kits.revocation): the next request opens a new one, which the handshake refuses."""

    def __init__(self, ca: Path | None, crl: Path | None) -> None:
        self.context = client_context(ca)
        self.crl = crl
        self._stamp: Stamp | None = None
        self._pem: bytes | None = None
        self._revocations = Revocations()
        self._connectors: weakref.WeakSet[TrustedConnector] = weakref.WeakSet()
        self.loads = 0
        self.closed = 0
        """Connections closed because a CRL loaded since they opened revokes their peer."""
        self.refresh()

    def connector(self, **kwargs: Any) -> aiohttp.TCPConnector:
        """An aiohttp connector verifying peers with this context (`kwargs` as TCPConnector's,
        but ssl), whose connections to a revoked peer are closed as each CRL loads."""
        made = TrustedConnector(revocations=self._revocations, ssl=self.context, **kwargs)
        self._connectors.add(made)
        return made

    def refresh(self) -> bool:
        """Add the CRL to the trust store if its file changed since the last look."""
        if self.crl is None:
            return False
        stamp = _stamp(self.crl)
        if stamp is None or stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            pem = self.crl.read_bytes()
        except OSError as exc:  # replaced again between the stat and the read
            self._stamp = None
            log.warning("%s does not load, the last CRL stays: %s", self.crl, _why(exc))
            return False
        return self._load(pem, str(self.crl))

    def load_pem(self, pem: bytes) -> bool:
        """Add a CRL given as PEM (one published in etcd: sites.registry.crl) unless it is the
        one added last; True when it loaded."""
        if pem == self._pem:
            return False
        self._pem = pem
        return self._load(pem, "the published CRL")

    def _load(self, pem: bytes, what: str) -> bool:
        # OpenSSL reads CRLs from files only: a private directory, removed at once (so the
        # bytes OpenSSL checks with are the bytes the open connections are checked against)
        with tempfile.TemporaryDirectory(prefix="cpn-crl-") as tmp:
            path = Path(tmp) / "crl.pem"
            path.write_bytes(pem)
            try:
                self.context.load_verify_locations(cafile=str(path))
            except (OSError, ssl.SSLError) as exc:
                log.warning("%s does not load, the last CRL stays: %s", what, _why(exc))
                return False
        self.context.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
        self.loads += 1
        log.info("%s: the CRL loaded (%d since start)", what, self.loads)
        if self._revocations.add(pem):
            for connector in list(self._connectors):
                self.closed += len(connector.close_revoked())
        return True

    async def follow(self, interval_s: float = CRL_POLL_S) -> None:
        """refresh() every `interval_s` seconds, forever (a supervised task's body)."""
        while True:
            await asyncio.sleep(interval_s)
            self.refresh()


def peer_connector(trust: PeerTrust | None, **kwargs: Any) -> aiohttp.TCPConnector:
    """A connector to peers verified by `trust` (and closed when it revokes them), or with the
    system's CAs when None."""
    if trust is None:
        return aiohttp.TCPConnector(ssl=True, **kwargs)
    return trust.connector(**kwargs)
