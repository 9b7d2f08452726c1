"""The agent's endpoint on HTTPS (`cpn agent --tls-cert`, `cpn up --secure`): its /data routes
served by the real AgentServer with a certificate of a development PKI (cpn.certs), staged from by
a peer's data plane that trusts the federation's CA, and refused to clients that do not."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from cpn.certs import Pki
from cpn.secure import agent_certificate
from sites.agent.data.errors import StagingError
from sites.agent.data.links import LinkLimits
from sites.agent.data.plane import DataPlane
from sites.agent.data.store import DataStore
from sites.agent.data.transfer import Stager
from sites.agent.server import AgentServer
from sites.agent.settings import AgentSettings
from sites.kits.clock import SystemClock
from sites.kits.tls import PeerTrust, client_context, peer_connector, server_context
from sites.model.assignments import Assignment
from sites.model.data import Source, StageInput
from sites.model.errors import ConfigError
from sites.model.spec import SiteSpec
from tests.conftest import site_doc
from tests.sites.agent.data.conftest import LIMIT, grant, put_blobs

FILES = {"a.bin": secrets.token_bytes(200_000), "b/c.txt": b"hello\n" * 1000}


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    pki = Pki(tmp_path / "pki")
    pki.init()
    return pki


MakePlane = Callable[..., Awaitable[DataPlane]]


@pytest.fixture
async def make_plane(tmp_path: Path) -> AsyncIterator[MakePlane]:
    planes: list[DataPlane] = []

    async def make(site: str, **kw: Any) -> DataPlane:
        spec = SiteSpec.model_validate(
            site_doc(site, data={"store": str(tmp_path / f"{site}-store")})
        )
        plane = DataPlane(spec=spec, registry=None, clock=SystemClock(), retry_window_s=0.5, **kw)
        await plane.open()
        planes.append(plane)
        return plane

    yield make
    for plane in planes:
        await plane.close()


@dataclass(frozen=True)
class HttpsAgent:
    server: AgentServer
    digest: str  # the object of FILES it holds
    key: str  # its data key, as its AgentSecret holds it

    def source(self) -> Source:
        scope = f"obj:{self.digest}"
        return Source(site="site-a", url=self.server.url, grant=grant(self.key, "site-a", scope))


@pytest.fixture
async def https_agent(pki: Pki, make_plane: MakePlane) -> AsyncIterator[HttpsAgent]:
    """Site a's agent server on HTTPS, its store holding FILES."""
    plane = await make_plane("site-a")
    digest = put_blobs(plane.store, FILES).digest
    server = AgentServer(
        bearer="b", clock=SystemClock(), metrics=CollectorRegistry(),
        health=lambda: ({}, True), workload=lambda: None, data=plane,
    )  # fmt: skip
    cert = agent_certificate(pki, "site-a", ["127.0.0.1:0"])
    await server.start(
        listen="127.0.0.1:0", advertise=None, probe_listen=None, probe_advertise=None,
        ssl_context=server_context(cert.cert_path, cert.key_path),
    )  # fmt: skip
    assert plane.key is not None
    yield HttpsAgent(server, digest, plane.key)
    await server.close()


async def test_a_peer_that_trusts_the_federations_ca_stages_over_https(
    pki: Pki, https_agent: HttpsAgent, make_plane: MakePlane
) -> None:
    server, digest = https_agent.server, https_agent.digest
    assert server.url.startswith("https://127.0.0.1:")
    assert server.probe_url.startswith("http://")  # timing bytes only: stays plain
    plane = await make_plane("site-x", peer_trust=PeerTrust(pki.ca_path, None))
    inp = StageInput(dataset="acme/d@1", digest=digest, bytes=sum(map(len, FILES.values())),
                     path="/data/d", sources=(https_agent.source(),))  # fmt: skip
    job = Assignment(job="j", site="site-x", tenant="acme", attempt=1, fence=1,
                     command=("true",), assigned_at=time.time(), inputs=(inp,))  # fmt: skip
    staged, egress = await plane.stage_inputs(job, lambda _: None)
    local = staged[0].local
    assert local is not None
    assert {p: (Path(local) / p).read_bytes() for p in FILES} == FILES
    assert [e.source for e in egress] == ["site-a"]


async def stager(tmp_path: Path, name: str, trust: PeerTrust | None) -> Stager:
    return Stager(
        store=DataStore(tmp_path / name, LIMIT), clock=SystemClock(),
        limits=LinkLimits(default_mbps=None, per_site_mbps={}, clock=SystemClock()),
        trust=trust, retry_window_s=0.3, backoff_initial_s=0.05,
    )  # fmt: skip


@pytest.mark.parametrize("trust", ["system CAs", "another CA"])
async def test_a_client_without_the_federations_ca_is_refused(
    trust: str, https_agent: HttpsAgent, tmp_path: Path
) -> None:
    server, digest = https_agent.server, https_agent.digest
    peer_trust = None
    if trust == "another CA":
        other = Pki(tmp_path / "other-pki")
        other.init()
        peer_trust = PeerTrust(other.ca_path, None)
    pulling = await stager(tmp_path, "pull", peer_trust)
    try:
        with pytest.raises(StagingError, match="certificate verify failed"):
            await pulling.stage(digest, [https_agent.source()], lambda _: None)
        assert not pulling.store.has(digest)
    finally:
        await pulling.close()
    async with aiohttp.ClientSession(connector=peer_connector(peer_trust)) as http:
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await http.get(f"{server.url}/data/manifests/{digest}")


async def test_no_plain_http_on_the_https_endpoint(https_agent: HttpsAgent) -> None:
    server, digest = https_agent.server, https_agent.digest
    plain = server.url.replace("https://", "http://")
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientError):
            async with http.get(f"{plain}/data/manifests/{digest}") as resp:
                await resp.read()


def test_agent_certificate_names_every_address_peers_reach_it_at(pki: Pki) -> None:
    from cryptography import x509

    cert = agent_certificate(pki, "s", ["127.0.1.3:7000", "127.0.2.3:7000", "0.0.0.0:1", None])
    sans = x509.load_pem_x509_certificate(cert.cert_pem).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    hosts = {str(ip) for ip in sans.value.get_values_for_type(x509.IPAddress)}
    assert hosts == {"127.0.0.1", "::1", "127.0.1.3", "127.0.2.3"}
    assert sans.value.get_values_for_type(x509.DNSName) == ["localhost"]


def test_tls_settings_name_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="tls_cert and tls_key go together"):
        AgentSettings(listen="127.0.0.1:0", interval_s=1, tls_cert=tmp_path / "c.pem")
    with pytest.raises(ConfigError, match=r"c\.pem / \S+k\.pem: cannot load: No such file"):
        server_context(tmp_path / "c.pem", tmp_path / "k.pem")
    with pytest.raises(ConfigError, match=r"ca\.pem: cannot load the CA"):
        client_context(tmp_path / "ca.pem")
