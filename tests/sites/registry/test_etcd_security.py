"""etcd with TLS and authentication, for real: a CA made by cpn.certs, etcd started with
client-certificate auth, root and the broker's user, a user per site whose role may write only
that site's keys; the CLI's `cpn certs`, `cpn etcd secure` and `cpn site join` on it."""

from __future__ import annotations

import asyncio
import os
import stat
import urllib.error
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from aetcd import rpc  # noqa: I001 - the auth stub, to read a role back

from cpn.certs import Pki
from cpn.secure import credentials_dir, init_pki, secure_etcd, site_credentials
from sites.emulation.etcd_server import EmbeddedEtcd
from sites.model import keys
from sites.model.catalog import DeviceCatalog
from sites.model.config import load_site
from sites.model.errors import ConfigError, PermissionDenied, RegistryError, RegistryUnavailable
from sites.model.spec import SiteSpec
from sites.registry.admin import ensure_role
from sites.registry.client import Registry
from sites.registry.security import (
    BROKER_USER,
    ROOT_USER,
    EtcdTls,
    load_credentials,
    role_permissions,
    site_grants,
)
from tests.broker.apiserver import ApiBroker, start_api_broker
from tests.conftest import Processes, run_cpn, wait_for, write_admin_token

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)


@dataclass
class SecureEtcd:
    server: EmbeddedEtcd
    pki: Pki

    @property
    def url(self) -> str:
        return self.server.url

    def credentials(self, user: str) -> Path:
        return credentials_dir(self.pki) / f"{user}.yaml"

    def registry(self, user: str) -> Registry:
        return Registry.from_credentials(load_credentials(self.credentials(user)))


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    """One etcd with TLS and auth for the module, secured as `cpn etcd secure` does it."""
    root = tmp_path_factory.mktemp("secure-etcd")
    pki = Pki(root / "pki")
    server = EmbeddedEtcd(data_dir=root / "etcd", unsafe_no_fsync=True, tls=init_pki(pki))
    server.start()
    try:
        result = run_cpn("etcd", "secure", "--etcd", server.url, "--certs", str(pki.directory))
        assert result.returncode == 0, result.stderr
        assert "etcd auth enabled" in result.stdout
        yield SecureEtcd(server, pki)
    finally:
        server.stop()


@pytest.fixture
async def root(secure: SecureEtcd) -> AsyncIterator[Registry]:
    reg = secure.registry(ROOT_USER)
    await reg.connect()
    await reg.delete_prefix(keys.ROOT)
    await write_admin_token(reg)
    yield reg
    await reg.delete_prefix(keys.ROOT)
    await reg.close()


@pytest.fixture
def spec_of(site_file: Callable[..., Path]) -> Callable[..., SiteSpec]:
    catalog = DeviceCatalog.load(None)

    def make(site_id: str, **overrides: object) -> SiteSpec:
        return load_site(site_file(site_id, **overrides), catalog)

    return make


async def test_no_client_gets_in_without_the_ca_and_a_certificate(secure: SecureEtcd) -> None:
    with pytest.raises(RegistryUnavailable):  # the system's CAs do not know ours
        async with Registry.from_urls(secure.url, timeout_s=2):
            pass
    with pytest.raises(RegistryUnavailable):  # the CA, but no client certificate
        async with Registry.from_urls(secure.url, timeout_s=2, tls=EtcdTls(secure.pki.ca_pem())):
            pass
    other = Pki(secure.pki.directory.parent / "other-ca")  # a certificate of another CA
    other.init()
    stranger = other.issue("root")
    tls = EtcdTls(secure.pki.ca_pem(), stranger.cert_pem, stranger.key_pem)
    with pytest.raises(RegistryUnavailable):
        async with Registry.from_urls(secure.url, timeout_s=2, tls=tls):
            pass
    async with secure.registry(ROOT_USER) as reg:  # with both, it works
        await reg.put_raw("/cpn/v1/probe", b"1")
        assert (await reg.get_raw("/cpn/v1/probe")) is not None


async def test_a_site_writes_its_own_keys_and_no_one_elses(
    secure: SecureEtcd, root: Registry, spec_of: Callable[..., SiteSpec]
) -> None:
    a = spec_of("sec-a", services=[
        {"name": "chat", "model": "m", "url": "http://127.0.0.1:1/", "max_concurrency": 4}
    ])  # fmt: skip
    b = spec_of("sec-b")
    for spec in (a, b):
        await root.join(spec)
        assert await site_credentials(root, secure.pki, spec) == secure.credentials(spec.id)
    path = secure.credentials(a.id)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_credentials(path).user == "site-sec-a"

    async with secure.registry(a.id) as site_a:
        # its own keys, as its agent writes them
        for key in (
            keys.site_status(a.id),
            keys.site_last_seen(a.id),
            keys.agent(a.id),
            keys.link(a.id, b.id),
            keys.report(a.id, "job-1"),
            keys.service("chat", a.id),
            keys.service_replica("any-managed-service", a.id, "job-2"),
        ):
            await site_a.put_raw(key, b"{}")
        assert await site_a.get_spec(a.id) == a
        # another site's keys, the broker's records, tokens and the site's own spec: refused
        for key in (
            keys.site_status(b.id),
            keys.agent(b.id),
            keys.link(b.id, a.id),
            keys.report(b.id, "job-1"),
            keys.service("chat", b.id),
            keys.service_replica("any-managed-service", b.id, "job-2"),
            keys.site_spec(a.id),
            keys.assignment(a.id, "job-1"),
            keys.job("job-1"),
            keys.token("0000000000000001"),
            keys.LEADER,
        ):
            with pytest.raises(PermissionDenied):
                await site_a.put_raw(key, b"{}")
        with pytest.raises(PermissionDenied):  # nor read the token hashes or the jobs
            await site_a.list_prefix(keys.TOKENS)
        with pytest.raises(PermissionDenied):
            await site_a.list_prefix(keys.JOBS)
        with pytest.raises(PermissionDenied):
            await site_a.list_prefix(keys.assignments(b.id))
        _, peers = await site_a.list_prefix(keys.AGENTS)  # the peers it probes: readable
        assert [k for k, _, _ in peers] == [keys.agent(a.id)]

    async with secure.registry(BROKER_USER) as broker:  # the broker: everything under /cpn/
        await broker.put_raw(keys.job("job-1"), b"{}")
        await broker.put_raw(keys.assignment(a.id, "job-1"), b"{}")
        with pytest.raises(PermissionDenied):
            await broker.put_raw("/elsewhere", b"{}")


async def test_watches_and_transactions_go_over_tls_on_the_users_certificate(
    secure: SecureEtcd, root: Registry, spec_of: Callable[..., SiteSpec]
) -> None:
    """sites.registry.h2grpc's watch streams and transactions: TLS with ALPN h2, the client
    certificate
    as the etcd user; etcd's refusals (in the watch stream, in a Txn's trailers) are
    PermissionDenied."""
    spec = spec_of("sec-w")
    await root.join(spec)
    await site_credentials(root, secure.pki, spec)
    async with secure.registry(BROKER_USER) as broker:
        start = await broker.revision() + 1
        await root.put_raw(keys.job("watched-1"), b"{}")
        async with asyncio.timeout(10):
            async for batch in broker.watch_batches(keys.JOBS, start_revision=start):
                assert [e.key for e in batch] == [keys.job("watched-1")]
                break
    async with secure.registry(spec.id) as site:
        with pytest.raises(PermissionDenied):
            async with asyncio.timeout(10):
                async for _ in site.watch_batches(keys.JOBS, start_revision=start):
                    pass
        # its transactions go the same way: its own key, yes; the broker's records, refused
        assert await site.commit(guards=[], puts={keys.site_status(spec.id): b"{}"})
        with pytest.raises(PermissionDenied):
            await site.commit(guards=[], puts={keys.job("watched-2"): b"{}"})


async def test_rejoining_with_other_services_changes_the_role(
    secure: SecureEtcd, root: Registry, spec_of: Callable[..., SiteSpec]
) -> None:
    chat = {"name": "chat", "model": "m", "url": "http://127.0.0.1:1/", "max_concurrency": 4}
    code = {**chat, "name": "code"}
    before = spec_of("sec-c", services=[chat])
    await root.join(before)
    await site_credentials(root, secure.pki, before)
    after = spec_of("sec-c", services=[code])
    await root.join(after)
    await site_credentials(root, secure.pki, after)
    reply = await root.auth("RoleGet", rpc.AuthRoleGetRequest(role="site-sec-c"))
    assert sorted(role_permissions(reply), key=str) == sorted(site_grants(after), key=str)
    async with secure.registry("sec-c") as site:
        await site.put_raw(keys.service("code", "sec-c"), b"{}")
        with pytest.raises(PermissionDenied):
            await site.put_raw(keys.service("chat", "sec-c"), b"{}")
    await ensure_role(root, "site-sec-c", site_grants(after))  # idempotent


async def test_the_cli_joins_a_site_with_its_credentials_and_revokes_them_on_leave(
    secure: SecureEtcd, root: Registry, site_file: Callable[..., Path]
) -> None:
    path = site_file("sec-cli")
    env_creds = str(secure.credentials(ROOT_USER))
    joined = run_cpn(
        "site", "join", str(path), "--etcd-credentials", env_creds,
        "--certs", str(secure.pki.directory),
    )  # fmt: skip
    assert joined.returncode == 0, joined.stderr
    assert "etcd user site-sec-cli" in joined.stdout
    assert str(secure.credentials("sec-cli")) in joined.stdout
    listed = run_cpn("sites", "-o", "json", "--etcd-credentials", env_creds)
    assert listed.returncode == 0, listed.stderr

    left = run_cpn("site", "leave", "sec-cli", "--etcd-credentials", env_creds)
    assert left.returncode == 0, left.stderr
    assert "removed" in left.stdout
    users = await root.auth("UserList", rpc.AuthUserListRequest())
    assert "site-sec-cli" not in list(users.users)
    with pytest.raises(RegistryError):  # its certificate names a user that is gone
        async with secure.registry("sec-cli") as gone:
            await gone.put_raw(keys.site_status("sec-cli"), b"{}")


async def test_a_revoked_sites_open_connection_is_cut_at_once_and_its_new_one_works(
    secure: SecureEtcd, root: Registry, spec_of: Callable[..., SiteSpec]
) -> None:
    """etcd reads its CRL at a handshake only: `cpn certs revoke --site --reissue --publish`
    gives the site a new etcd user for its new certificate and deletes the old user, so what
    the revoked certificate holds open (a thief's connection) is refused at its next request."""
    spec = spec_of("sec-rev")
    await root.join(spec)
    await site_credentials(root, secure.pki, spec)
    held = load_credentials(secure.credentials(spec.id))
    # the old certificate, held in memory (not following the credential file, as the agent's
    # connection does)
    stolen = Registry.from_urls(
        held.endpoints,
        tls=EtcdTls(held.ca.encode(), held.cert.encode(), held.key.encode()),
    )
    await stolen.connect()
    try:
        await stolen.put_raw(keys.site_status(spec.id), b"{}")  # its connection is open
        revoked = run_cpn(
            "certs", "revoke", "--site", spec.id, "--reissue", "--publish",
            "--dir", str(secure.pki.directory),
            "--etcd-credentials", str(secure.credentials(ROOT_USER)),
        )  # fmt: skip
        assert revoked.returncode == 0, revoked.stderr
        assert "deleted etcd users site-sec-rev:" in revoked.stdout, revoked.stdout
        with pytest.raises(RegistryError):  # the open connection: refused at once
            await stolen.put_raw(keys.site_status(spec.id), b"{}")
    finally:
        await stolen.close()
    user = load_credentials(secure.credentials(spec.id)).user
    assert user.startswith("site-sec-rev.")
    async with secure.registry(spec.id) as renewed:  # the reissued credentials: its own keys
        await renewed.put_raw(keys.site_status(spec.id), b"{}")
        with pytest.raises(PermissionDenied):
            await renewed.put_raw(keys.site_status("sec-other"), b"{}")

    async def users() -> list[str]:
        reply = await root.auth("UserList", rpc.AuthUserListRequest())
        return [u for u in reply.users if u.startswith("site-sec-rev")]

    assert await users() == [user]
    await root.join(spec)  # joined again (its services changed, say): the same, new user
    assert await site_credentials(root, secure.pki, spec) == secure.credentials(spec.id)
    assert await users() == [user]
    assert load_credentials(secure.credentials(spec.id)).user == user
    left = run_cpn(
        "site", "leave", spec.id, "--etcd-credentials", str(secure.credentials(ROOT_USER))
    )
    assert left.returncode == 0, left.stderr
    assert await users() == []


async def test_an_agent_runs_on_its_sites_credentials(
    secure: SecureEtcd,
    root: Registry,
    site_file: Callable[..., Path],
    processes: Processes,
    spec_of: Callable[..., SiteSpec],
) -> None:
    spec = spec_of("sec-agent")
    await root.join(spec)
    creds = await site_credentials(root, secure.pki, spec)
    assert creds is not None
    processes.start(
        "agent", "--site", str(site_file("sec-agent")), "--etcd-credentials", str(creds),
        "--probe-method", "tcp-connect", name="agent",
    )  # fmt: skip

    async def published() -> bool:
        snap = await root.snapshot()
        return "sec-agent" in snap.statuses

    await wait_for(published, timeout=30, interval=0.2)

    # its credentials revoked and reissued for a new etcd user: the agent goes on with the new
    # ones (it reads its credential file again when it changes), its old user gone
    revoked = run_cpn(
        "certs", "revoke", "--site", "sec-agent", "--reissue", "--publish",
        "--dir", str(secure.pki.directory),
        "--etcd-credentials", str(secure.credentials(ROOT_USER)),
    )  # fmt: skip
    assert revoked.returncode == 0, revoked.stderr
    after = (await root.get_raw(keys.site_last_seen("sec-agent")) or (b"", 0))[1]

    async def publishing() -> bool:
        got = await root.get_raw(keys.site_last_seen("sec-agent"))
        return got is not None and got[1] > after

    await wait_for(publishing, timeout=30, interval=0.2)
    await wait_for(published, timeout=5, interval=0.2)


def test_bad_credential_files_exit_2_with_one_line(secure: SecureEtcd, tmp_path: Path) -> None:
    good = yaml.safe_load(secure.credentials(ROOT_USER).read_text())
    cases = {
        "open.yaml": (good, 0o644, "readable by others"),
        "http.yaml": ({**good, "endpoints": "http://127.0.0.1:1"}, 0o600, "endpoints"),
        "nokey.yaml": ({k: v for k, v in good.items() if k != "key"}, 0o600, "key"),
        "notpem.yaml": ({**good, "ca": "hello"}, 0o600, "ca"),
    }
    for name, (doc, mode, expected) in cases.items():
        path = tmp_path / name
        path.write_text(yaml.safe_dump(doc))
        os.chmod(path, mode)
        result = run_cpn("sites", "--etcd-credentials", str(path))
        assert result.returncode == 2, (name, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert expected in result.stderr, (name, result.stderr)
        with pytest.raises(ConfigError):
            load_credentials(path)


def test_cpn_certs_makes_a_ca_once_and_signs_with_it(tmp_path: Path) -> None:
    pki_dir = tmp_path / "pki"
    first = run_cpn("certs", "init", "--dir", str(pki_dir), "--host", "etcd.example")
    assert first.returncode == 0, first.stderr
    assert "created the CA" in first.stdout
    ca = (pki_dir / "ca.pem").read_bytes()
    again = run_cpn("certs", "init", "--dir", str(pki_dir))
    assert "kept the CA" in again.stdout
    assert (pki_dir / "ca.pem").read_bytes() == ca
    issued = run_cpn("certs", "issue", "ops", "--dir", str(pki_dir))
    assert issued.returncode == 0, issued.stderr
    assert stat.S_IMODE((pki_dir / "ops-key.pem").stat().st_mode) == 0o600
    assert stat.S_IMODE(pki_dir.stat().st_mode) == 0o700

    from cryptography import x509

    cert = x509.load_pem_x509_certificate((pki_dir / "etcd.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "etcd.example" in names.get_values_for_type(x509.DNSName)
    ops = x509.load_pem_x509_certificate((pki_dir / "ops.pem").read_bytes())
    ops.verify_directly_issued_by(x509.load_pem_x509_certificate(ca))

    missing = run_cpn("certs", "issue", "ops", "--dir", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "cpn certs init" in missing.stderr


async def test_secure_etcd_is_idempotent(secure: SecureEtcd, root: Registry) -> None:
    paths = await secure_etcd(root, secure.pki)  # again, as root: nothing breaks
    assert set(paths) == {ROOT_USER, BROKER_USER}
    async with secure.registry(BROKER_USER) as broker:
        await broker.put_raw(keys.job("again"), b"{}")


async def test_brokers_lead_and_fail_over_on_the_secure_etcd_and_serve_https(
    secure: SecureEtcd, root: Registry, tmp_path: Path, processes: Processes
) -> None:
    """Broker HA as it stands (leader lease, fenced placements) on the broker's own etcd user;
    the API on HTTPS with a certificate of the CA."""
    creds = ("--etcd-credentials", str(secure.credentials(BROKER_USER)))
    pki = secure.pki.directory
    tls = (pki / "broker.pem", pki / "broker-key.pem", secure.pki.ca_path)
    a = start_api_broker("", processes, tmp_path / "a", etcd_args=creds, tls=tls)
    b = start_api_broker("", processes, tmp_path / "b", leader=False, etcd_args=creds, tls=tls)
    assert a.url.startswith("https://")
    submitted = b.post_json("/v1/jobs", {"tenant": "ai-lab", "name": "ha", "command": ["true"]})
    assert submitted.status == 201, submitted
    assert a.call("GET", f"/v1/jobs/{submitted.json()['id']}").status == 200

    untrusted = ApiBroker(a.url)  # no CA: the certificate is not trusted
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        untrusted.call("GET", "/healthz")

    processes.procs[0].kill()  # the leader dies; the other takes over within its lease's ttl
    processes.procs[0].wait(10)

    def leads() -> bool:
        return bool(b.call("GET", "/healthz").json()["leader"])

    await wait_for(leads, timeout=20, interval=0.2)
