"""A revoked peer's connections already open are closed when the CRL loads (sites.kits.revocation):
a real aiohttp HTTPS server on loopback with a certificate of a development PKI (cpn.certs), a
client session through PeerTrust's connector, the CRL loaded from its file and as published."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web
from cryptography import x509

from cpn.certs import Issued, Pki
from sites.kits.revocation import Peer, PeerRevoked, Revocations, TrustedConnector
from sites.kits.tls import PeerTrust, peer_connector, server_context


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    pki = Pki(tmp_path / "pki")
    pki.init()
    pki.write_crl()  # revoking nothing yet, as `cpn certs init` writes it
    return pki


@dataclass
class Server:
    issued: Issued
    url: str
    release: asyncio.Event = field(default_factory=asyncio.Event)


@pytest.fixture
async def server(pki: Pki) -> AsyncIterator[Server]:
    """An agent-like HTTPS endpoint: `/` answers at once, `/stream` sends a chunk and holds the
    rest until `release` is set (a log followed, a file streamed)."""
    issued = pki.issue("agent-a", server=True, client=False, hosts=["127.0.0.1"])
    release = asyncio.Event()

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"first\n")
        await release.wait()
        try:
            await response.write(b"rest\n")
        except ConnectionResetError:  # the client cut it: what the test asks of it
            pass
        return response

    app = web.Application()
    app.router.add_get("/", ok)
    app.router.add_get("/stream", stream)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    context = server_context(issued.cert_path, issued.key_path)
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield Server(issued, f"https://127.0.0.1:{port}", release)
    finally:
        release.set()
        await runner.cleanup()


def serial(issued: Issued) -> int:
    return x509.load_pem_x509_certificate(issued.cert_pem).serial_number


def opened(connector: aiohttp.TCPConnector) -> SimpleNamespace:
    """The connections open in `connector`, pooled and in use; fails loudly where aiohttp no
    longer keeps them where TrustedConnector walks them."""
    pooled, acquired = getattr(connector, "_conns", None), getattr(connector, "_acquired", None)
    assert isinstance(pooled, dict) and isinstance(acquired, set), (
        "aiohttp's TCPConnector changed its _conns/_acquired: sites.kits.revocation walks them"
    )
    idle = [p for entries in pooled.values() for p, _ in entries if p.is_connected()]
    busy = [p for p in acquired if p.is_connected()]
    return SimpleNamespace(idle=idle, busy=busy)


async def test_a_crl_file_that_revokes_the_peer_closes_its_pooled_connection_at_once(
    pki: Pki, server: Server
) -> None:
    trust = PeerTrust(pki.ca_path, pki.crl_path)
    assert trust.loads == 1  # the CRL revoking nothing
    connector = trust.connector()
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.get(server.url) as response:
            assert await response.text() == "ok"
        [kept] = opened(connector).idle  # keep-alive: pooled for the next request

        other = pki.issue("agent-b", server=True, client=False)
        pki.write_crl([serial(other)])
        assert trust.refresh() and trust.closed == 0  # another peer's serial: nothing closed
        async with session.get(server.url) as response:
            assert await response.text() == "ok"
        assert opened(connector).idle == [kept]  # the same connection, reused

        pki.write_crl([serial(server.issued)])
        assert trust.refresh()
        assert trust.closed == 1 and not kept.is_connected()  # at once, not at a next request
        assert opened(connector).idle == []
        with pytest.raises(aiohttp.ClientConnectorCertificateError, match="revoked"):
            await session.get(server.url)  # a new connection: the handshake refuses it
        assert trust.closed == 1


async def test_a_published_crl_closes_the_peers_connections_in_use_too(
    pki: Pki, server: Server
) -> None:
    trust = PeerTrust(pki.ca_path, None)  # no file: the CRL comes as etcd publishes it
    connector = trust.connector()
    async with aiohttp.ClientSession(connector=connector) as session:
        streaming = await session.get(f"{server.url}/stream")
        try:
            assert await streaming.content.readline() == b"first\n"
            async with session.get(server.url) as response:  # a second connection, pooled
                assert await response.text() == "ok"
            now = opened(connector)
            assert len(now.idle) == 1 and len(now.busy) == 1

            other = pki.issue("agent-b", server=True, client=False)
            assert trust.load_pem(pki.crl_path.read_bytes())  # init's, revoking nothing
            assert trust.load_pem(pki.write_crl([serial(other)]).read_bytes())
            assert trust.closed == 0 and opened(connector).busy == now.busy

            assert trust.load_pem(pki.write_crl([serial(server.issued)]).read_bytes())
            assert trust.closed == 2
            assert opened(connector).idle == [] and opened(connector).busy == []
            assert trust.load_pem(pki.write_crl().read_bytes())  # a newer one: closing ones
            assert trust.closed == 2  # are not counted again
            with pytest.raises(aiohttp.ClientError):  # the request in flight fails
                await asyncio.wait_for(streaming.read(), 5)
        finally:
            streaming.release()
        with pytest.raises(aiohttp.ClientConnectorCertificateError, match="revoked"):
            await session.get(server.url)


async def test_a_connection_handed_out_after_a_load_is_checked_again(
    pki: Pki, server: Server
) -> None:
    """One whose handshake ended just before the CRL loaded (its connector was still opening it
    while the pools were walked) is refused when a request would use it."""
    trust = PeerTrust(pki.ca_path, None)
    connector = trust.connector()
    assert isinstance(connector, TrustedConnector)
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.get(server.url) as response:
            assert await response.text() == "ok"
        [kept] = opened(connector).idle
        # the revocations as the load leaves them, the walk left out
        trust._revocations.add(pki.write_crl([serial(server.issued)]).read_bytes())
        assert kept.is_connected()
        with pytest.raises(PeerRevoked, match="certificate revoked") as refused:
            await session.get(server.url)
        assert refused.value.peer.serial == serial(server.issued)
        assert isinstance(refused.value, aiohttp.ClientConnectionError)  # what callers catch
        assert not kept.is_connected() and opened(connector).idle == []


async def test_without_a_trust_the_connector_is_a_plain_one() -> None:
    connector = peer_connector(None)
    try:
        assert type(connector) is aiohttp.TCPConnector
    finally:
        await connector.close()


def test_the_newest_crl_of_an_issuer_decides_as_openssl_does(pki: Pki) -> None:
    """An older CRL loaded after a newer one (a stale file beside a published CRL) does not undo
    a revocation; a block that does not parse is left out."""
    issued = pki.issue("agent-c", server=True, client=False)
    cert = x509.load_pem_x509_certificate(issued.cert_pem)
    peer = Peer(cert.issuer, cert.serial_number, "CN=agent-c", "127.0.0.1:1")
    older = pki.crl_path.read_bytes()  # the fixture's, revoking nothing
    revocations = Revocations()
    assert not revocations and revocations.add(pki.write_crl([serial(issued)]).read_bytes()) == 1
    assert revocations.revokes(peer)
    assert revocations.add(older) == 0 and revocations.revokes(peer)
    broken = b"-----BEGIN X509 CRL-----\nbm90IGEgQ1JM\n-----END X509 CRL-----\n"
    assert revocations.add(broken) == 0 and revocations.revokes(peer)
    other = Peer(cert.issuer, cert.serial_number + 1, "CN=other", "127.0.0.1:2")
    assert not revocations.revokes(other)
