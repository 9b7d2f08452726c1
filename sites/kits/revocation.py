"""A revocation that takes effect at once on the connections already open (docs/auth.md,
"Certificates that rotate, and revocation").

OpenSSL checks a CRL added to a client's context (sites.kits.tls.PeerTrust) at a handshake
only, and aiohttp keeps a connection open between requests (keep-alive) and through a long one
(a log followed, a file streamed). So `Revocations` keeps what the loaded CRLs revoke, and the
connectors PeerTrust hands out (`TrustedConnector`) are walked at each load: every connection
whose peer presented a revoked certificate is aborted, idle in the pool or in use (a request in
flight fails). A connection is checked again whenever it is handed to a request, so one whose
handshake ended just before the load (its connector was still opening it) is not used either.

The walk reads two private attributes of aiohttp's TCPConnector, `_conns` (key -> deque of
(protocol, released at)) and `_acquired` (the protocols in use), as of aiohttp 3.14. Where an
aiohttp lacks them it logs that once and the check at each request still refuses a revoked
peer; tests/sites/kits/test_revocation.py fails on such an aiohttp.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp.client_proto import ResponseHandler
from cryptography import x509

from sites.model.errors import SitesError

if TYPE_CHECKING:  # types of the connect() override only
    from aiohttp.connector import Connection
    from aiohttp.tracing import Trace

__all__ = ["Peer", "PeerRevoked", "Revocations", "TrustedConnector"]

log = logging.getLogger(__name__)

_CRL_PEM = re.compile(rb"-----BEGIN X509 CRL-----.+?-----END X509 CRL-----", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Peer:
    """Who is at the other end of a TLS connection: its certificate's issuer and serial (what
    a CRL names), subject and address (what a log line names)."""

    issuer: x509.Name
    serial: int
    subject: str
    address: str

    def __str__(self) -> str:
        return f"{self.address} ({self.subject}, serial {self.serial:#x})"


class PeerRevoked(SitesError, aiohttp.ClientConnectionError):
    """A connection to a peer whose certificate a CRL loaded since revokes (what callers catch
    as any aiohttp.ClientError)."""

    def __init__(self, peer: Peer) -> None:
        super().__init__(f"{peer}: certificate revoked")
        self.peer = peer


class Revocations:
    """The newest CRL loaded per issuer, as OpenSSL uses them: it checks a leaf against the one
    of its CA's CRLs with the latest last_update (cpn.certs signs each later than the last).
    Their signatures are not checked here: OpenSSL checks them at the handshake, and refuses
    every peer of that CA when one does not verify."""

    def __init__(self) -> None:
        self._newest: dict[x509.Name, x509.CertificateRevocationList] = {}

    def add(self, pem: bytes) -> int:
        """Take the CRLs in `pem` (as OpenSSL loaded it: a block that does not parse is left
        out, logged); how many became their issuer's newest."""
        taken = 0
        for block in _CRL_PEM.findall(pem):
            try:
                crl = x509.load_pem_x509_crl(block)
            except ValueError as exc:
                log.warning("a CRL that does not parse is left out of the connections' check: %s",
                            exc)  # fmt: skip
                continue
            held = self._newest.get(crl.issuer)
            if held is None or crl.last_update_utc >= held.last_update_utc:
                self._newest[crl.issuer] = crl
                taken += 1
        return taken

    def revokes(self, peer: Peer) -> bool:
        crl = self._newest.get(peer.issuer)
        if crl is None:
            return False
        return crl.get_revoked_certificate_by_serial_number(peer.serial) is not None

    def __bool__(self) -> bool:
        return bool(self._newest)


def _peer(protocol: ResponseHandler) -> Peer | None:
    """The peer of a connection open over TLS; None for plain HTTP or one already closed."""
    transport = protocol.transport
    if transport is None:
        return None
    ssl_object = transport.get_extra_info("ssl_object")
    der = None if ssl_object is None else ssl_object.getpeercert(binary_form=True)
    if not der:
        return None
    cert = x509.load_der_x509_certificate(der)
    address = transport.get_extra_info("peername") or ("?", 0)
    return Peer(cert.issuer, cert.serial_number, cert.subject.rfc4514_string(),
                f"{address[0]}:{address[1]}")  # fmt: skip


class TrustedConnector(aiohttp.TCPConnector):
    """An aiohttp connector whose connections to a revoked peer are closed at once (module
    docstring); made by PeerTrust.connector, which walks it at each CRL it loads."""

    def __init__(self, *, revocations: Revocations, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._revocations = revocations
        # read once per connection: its certificate does not change while it is open
        self._peers: weakref.WeakKeyDictionary[ResponseHandler, Peer | None] = (
            weakref.WeakKeyDictionary()
        )
        self._blind = False

    def _peer_of(self, protocol: ResponseHandler) -> Peer | None:
        if protocol.transport is None:  # closed, or a placeholder for one being opened
            return None
        if protocol in self._peers:
            return self._peers[protocol]
        peer = self._peers[protocol] = _peer(protocol)
        return peer

    async def connect(
        self, req: aiohttp.ClientRequest, traces: list[Trace], timeout: aiohttp.ClientTimeout
    ) -> Connection:
        connection = await super().connect(req, traces, timeout)
        protocol = connection.protocol
        if self._revocations and protocol is not None:
            peer = self._peer_of(protocol)
            if peer is not None and self._revocations.revokes(peer):
                connection.close()  # released as not to be used again
                log.warning("closed a connection to %s: its certificate is revoked", peer)
                raise PeerRevoked(peer)
        return connection

    def _open(self) -> Iterator[ResponseHandler]:
        """The connections open now, pooled and in use (the private attributes' shape is
        checked: module docstring)."""
        pooled = getattr(self, "_conns", None)
        acquired = getattr(self, "_acquired", None)
        if not isinstance(pooled, dict) or not isinstance(acquired, set):
            if not self._blind:
                self._blind = True
                log.error("this aiohttp's connector keeps no _conns/_acquired: connections to a "
                          "revoked peer are refused at their next request only")  # fmt: skip
            return
        for entries in list(pooled.values()):
            if isinstance(entries, deque):
                for entry in list(entries):
                    yield entry[0]
        yield from list(acquired)

    def close_revoked(self) -> list[Peer]:
        """Abort each open connection whose peer the CRLs revoke; the peers it closed.
        A pooled one stays in the pool, closed: aiohttp drops it when it next looks."""
        closed: list[Peer] = []
        for protocol in self._open():
            transport = protocol.transport
            if transport is None or transport.is_closing():  # closed, closing or being opened
                continue
            peer = self._peer_of(protocol)
            if peer is not None and self._revocations.revokes(peer):
                # the transport, not the protocol: its connection_lost (next loop turn) fails a
                # request in flight with aiohttp's error (ServerDisconnected, ClientPayload),
                # where a protocol cut under a reader answers it RuntimeError; no TLS goodbye
                transport.abort()
                closed.append(peer)
                log.warning("closed a connection to %s: its certificate is revoked", peer)
        return closed
