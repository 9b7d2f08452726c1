"""Certificates that rotate, for real: renewal within a window, a running TLS server that serves
the renewed certificate at its next handshake, a client that refuses a revoked one once the CRL
changes, and etcd doing both (its CRL read at every handshake). Handshakes are real, on
loopback; the CLI runs in-process."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from prometheus_client import CollectorRegistry

from cpn.certs import Pki, Profile, profile_of
from cpn.cli import main
from cpn.rotation import Held, held, renew, revoke, rotate
from cpn.secure import credentials_for, init_pki
from sites.emulation.etcd_server import EmbeddedEtcd
from sites.kits.tls import PeerTrust, ReloadingServer
from sites.model import keys
from sites.model.errors import RegistryUnavailable
from sites.registry import connection
from sites.registry.client import Registry
from sites.registry.crl import follow_crl, publish_crl
from sites.registry.security import EtcdTls, load_credentials, write_credentials
from tests.conftest import wait_for

NOW = dt.datetime.now(dt.UTC)
MONTH = dt.timedelta(days=30)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    pki = Pki(tmp_path / "pki")
    init_pki(pki)
    return pki


def serial_of(pem: bytes) -> int:
    return x509.load_pem_x509_certificate(pem).serial_number


@asynccontextmanager
async def tls_server(context: ssl.SSLContext) -> AsyncIterator[int]:
    """An echo server on loopback with `context`; its port."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(100):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0, ssl=context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def handshake(port: int, context: ssl.SSLContext) -> int:
    """The serial of the certificate the server presents (ssl.SSLError if refused)."""
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        return x509.load_der_x509_certificate(der).serial_number
    finally:
        writer.close()
        await writer.wait_closed()


def held_named(pki: Pki, name: str) -> Held:
    return next(c for c in held(pki) if c.name == name)


def expiring(pki: Pki, name: str, days: int) -> None:
    """Replace `name`'s certificate by one like it that expires in `days`."""
    old = held_named(pki, name)
    cert_pem, key_pem = pki.sign(profile_of(old.cert), days=days)
    if old.in_credentials:
        creds = load_credentials(old.path)
        write_credentials(
            old.path, creds.model_copy(update={"cert": cert_pem.decode(), "key": key_pem.decode()})
        )
    else:
        pki.write(name, cert_pem, key_pem)


def test_rotate_renews_what_expires_within_the_window_and_keeps_names(pki: Pki) -> None:
    pki.issue("agent-soon", hosts=["10.1.2.3", "agent.example"], server=True, client=False)
    creds = credentials_for(pki, "site-soon", "https://127.0.0.1:2379", name="soon")
    expiring(pki, "agent-soon", days=10)
    expiring(pki, "credentials/soon", days=5)
    before = {c.name: c for c in held(pki)}

    dry = rotate(pki, now=NOW, within=MONTH, dry_run=True)
    assert {old.name for old, _ in dry.renewed} == {"agent-soon", "credentials/soon"}
    assert all(new is None for _, new in dry.renewed)
    assert {c.name: c.serial for c in held(pki)} == {n: c.serial for n, c in before.items()}

    report = rotate(pki, now=NOW, within=MONTH)
    assert {old.name for old, _ in report.renewed} == {"agent-soon", "credentials/soon"}
    after = {c.name: c for c in held(pki)}
    for name in ("agent-soon", "credentials/soon"):
        assert after[name].serial != before[name].serial
        assert after[name].not_after > NOW + dt.timedelta(days=800)
        assert profile_of(after[name].cert) == profile_of(before[name].cert)  # names, usages
    assert set(profile_of(after["agent-soon"].cert).hosts) == {"10.1.2.3", "agent.example"}
    assert after["broker"].serial == before["broker"].serial  # not due: kept
    renewed = load_credentials(creds)  # still a credential file, mode 0600, with a new key
    assert renewed.user == "site-soon" and renewed.endpoints == "https://127.0.0.1:2379"
    assert not report.ca_due
    assert rotate(pki, now=NOW, within=MONTH).renewed == []  # nothing left to do


async def test_a_running_server_serves_the_renewed_certificate(pki: Pki) -> None:
    issued = pki.write("agent-a", *pki.sign(Profile("agent-a", client=False, server=True), days=20))
    reloading = ReloadingServer(issued.cert_path, issued.key_path)
    metrics = CollectorRegistry()
    reloading.expose(metrics, "cpn_test", site="a")
    expiry = "cpn_test_certificate_expiry_timestamp_seconds"
    assert metrics.get_sample_value(expiry, {"site": "a"}) < (NOW + MONTH).timestamp()
    client = ssl.create_default_context(cafile=str(pki.ca_path))
    async with tls_server(reloading.context) as port:
        assert await handshake(port, client) == serial_of(issued.cert_pem)
        # a connection open across the renewal keeps working
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
        new = renew(pki, held_named(pki, "agent-a"))
        assert await handshake(port, client) == new.serial
        assert metrics.get_sample_value(expiry, {"site": "a"}) == new.not_after.timestamp()
        writer.write(b"still here")
        assert await reader.readexactly(10) == b"still here"
        writer.close()
        await writer.wait_closed()
        # a key without its certificate (a renewal half written) keeps the last good pair
        cert_pem, key_pem = pki.sign(Profile("agent-a", client=False, server=True))
        pki.write("agent-a", new.cert.public_bytes(Encoding.PEM), key_pem)
        assert await handshake(port, client) == new.serial
        assert reloading.last_error is not None and "cannot load" in reloading.last_error
        pki.write("agent-a", cert_pem, key_pem)
        assert await handshake(port, client) == serial_of(cert_pem)
        assert reloading.reloads == 2


async def test_a_revoked_certificate_is_refused_at_the_next_handshake(pki: Pki) -> None:
    issued = pki.issue("agent-b", server=True, client=False)
    trust = PeerTrust(pki.ca_path, pki.crl_path)
    async with tls_server(ReloadingServer(issued.cert_path, issued.key_path).context) as port:
        assert await handshake(port, trust.context) == serial_of(issued.cert_pem)
        [(old, _)] = revoke(pki, ["agent-b"])  # still served: a thief's copy
        assert trust.refresh()
        with pytest.raises(ssl.SSLCertVerificationError, match="revoked"):
            await handshake(port, trust.context)
        assert not trust.refresh()  # unchanged: nothing to load
        new = renew(pki, old)  # the site's new certificate is accepted
        assert await handshake(port, trust.context) == new.serial


async def test_a_crl_published_in_etcd_is_followed_at_once(pki: Pki, registry: Registry) -> None:
    """No file on the client's host: the CRL comes through etcd (sites.registry.crl)."""
    issued = pki.issue("agent-p", server=True, client=False)
    trust = PeerTrust(pki.ca_path, None)
    follower = asyncio.create_task(follow_crl(registry, trust), name="published crl")
    try:
        async with tls_server(ReloadingServer(issued.cert_path, issued.key_path).context) as port:
            assert await handshake(port, trust.context) == serial_of(issued.cert_pem)
            revoke(pki, ["agent-p"])
            await publish_crl(registry, pki.crl_path.read_bytes())
            await wait_for(lambda: trust.loads == 1, timeout=10)
            with pytest.raises(ssl.SSLCertVerificationError, match="revoked"):
                await handshake(port, trust.context)
            assert not trust.load_pem(pki.crl_path.read_bytes())  # the same one: not again
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_lists_rotates_and_revokes(
    pki: Pki, capsys: pytest.CaptureFixture[str], etcd: EmbeddedEtcd
) -> None:
    pki.issue("agent-c", server=True, client=False)
    expiring(pki, "agent-c", days=3)
    d = str(pki.directory)
    code, out, _ = cli(capsys, "certs", "ls", "--dir", d, "-o", "json")
    rows = {r["name"]: r for r in json.loads(out)["certificates"]}
    assert code == 0 and rows["agent-c"]["state"] == "due" and rows["broker"]["state"] == "ok"
    code, out, _ = cli(capsys, "certs", "rotate", "--dir", d, "--within", "7")
    assert code == 0 and out.startswith("renewed agent-c: until ")
    code, out, _ = cli(capsys, "certs", "revoke", "agent-c", "--reissue", "--dir", d)
    assert code == 0 and "revoked agent-c" in out and "issued agent-c anew" in out
    code, out, _ = cli(capsys, "certs", "ls", "--dir", d)
    assert "1 revoked" in out
    code, out, err = cli(
        capsys, "certs", "revoke", "broker", "--dir", d, "--publish", "--etcd", etcd.url
    )
    assert code == 0 and "published the CRL" in out, err

    async def published() -> bytes | None:
        async with Registry.from_urls(etcd.url) as reg:
            got = await reg.get_raw(keys.CRL)
            await reg.commit(guards=[], deletes=[keys.CRL])
            return None if got is None else got[0]

    assert asyncio.run(published()) == pki.crl_path.read_bytes()
    credentials_for(pki, "site-c", "https://127.0.0.1:2379", name="c")
    code, out, _ = cli(capsys, "certs", "revoke", "--site", "c", "--dir", d)
    assert code == 0 and "revoked agent-c" in out and "revoked credentials/c" in out
    for argv, message in (
        (("revoke", "nope"), "no certificate 'nope'"),
        (("revoke",), "name the certificates to revoke"),
        (("revoke", "--site", "nowhere"), "--site nowhere: no agent-nowhere"),
        (("rotate", "--within", "-1"), "--within: -1 days"),
    ):
        code, out, err = cli(capsys, "certs", *argv, "--dir", d)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


async def test_etcd_refuses_a_revoked_client_and_takes_renewed_certificates(
    pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd reads its CRL and its own certificate at every handshake; a running client takes
    its renewed credential file for the connections it opens next."""
    monkeypatch.setattr(connection, "CREDENTIALS_CHECK_S", 0.0)  # look at every call
    etcd_tls = init_pki(pki)
    server = EmbeddedEtcd(data_dir=pki.directory / "etcd", unsafe_no_fsync=True, tls=etcd_tls)
    server.start()
    try:
        site = pki.issue("site-x", common_name="site-x")
        tls = EtcdTls(pki.ca_pem(), site.cert_pem, site.key_pem)
        async with Registry.from_urls(server.url, tls=tls, timeout_s=3) as reg:
            await reg.put_raw("/cpn/v1/probe", b"1")
        revoke(pki, ["site-x"])
        with pytest.raises(RegistryUnavailable):  # its next handshake
            async with Registry.from_urls(server.url, tls=tls, timeout_s=3):
                pass

        path = credentials_for(pki, "site-y", server.url, name="y")
        async with Registry.from_credentials(load_credentials(path), timeout_s=3) as reg:
            await reg.put_raw("/cpn/v1/probe", b"2")
            old, old_tls = held_named(pki, "credentials/y"), load_credentials(path).tls()
            new = renew(pki, old)
            pki.write_crl([old.serial])  # from now on only the renewed one opens a connection
            await reg.put_raw("/cpn/v1/probe", b"3")  # a new channel, the new certificate
            assert reg.tls is not None and serial_of(reg.tls.cert_pem or b"") == new.serial
            # and the HTTP/2 connection transactions open (the first one, made now)
            assert await reg.commit(guards=[], puts={"/cpn/v1/probe": b"4"})
            assert await reg.get_raw("/cpn/v1/probe") is not None
        with pytest.raises(RegistryUnavailable):  # the old certificate is refused
            async with Registry.from_urls(server.url, tls=old_tls, timeout_s=3):
                pass

        client = ssl.create_default_context(cafile=str(pki.ca_path))
        client.load_cert_chain(pki.issue("root").cert_path, pki.directory / "root-key.pem")
        port = int(server.url.rsplit(":", 1)[1])
        renewed = renew(pki, held_named(pki, "etcd"))
        assert await handshake(port, client) == renewed.serial  # etcd re-reads its files
    finally:
        server.stop()
