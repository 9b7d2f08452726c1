"""A secure control plane, end to end: certificates, etcd auth, credential files
(`cpn certs`, `cpn etcd secure`, `cpn site join` on a secure etcd, `cpn up --secure`).

    pki/ca.pem ca-key.pem              the CA (cpn.certs)
    pki/crl.pem                        what it revoked (etcd: --client-crl-file; cpn.rotation)
    pki/etcd.pem etcd-key.pem          etcd's server certificate (also its peer certificate)
    pki/broker.pem broker-key.pem      the broker API's server certificate
    pki/agent-<site>.pem, -key.pem     each site's agent's server certificate (its endpoint)
    pki/credentials/root.yaml          the operator's etcd credentials (user root)
    pki/credentials/cpn-broker.yaml    the broker's (user cpn-broker)
    pki/credentials/<site>.yaml        each site's agent's (user site-<site>), by `cpn site join`
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from cpn.certs import DEFAULT_HOSTS, Issued, Pki
from cpn.state import state_dir
from sites.emulation.etcd_server import ServerTls
from sites.model.spec import SiteSpec
from sites.registry.admin import auth_enabled, bootstrap_auth, grant_site
from sites.registry.client import Registry
from sites.registry.security import (
    BROKER_USER,
    ROOT_USER,
    EtcdCredentials,
    EtcdTls,
    write_credentials,
)

CERTS_ENV = "CPN_CERTS"


def default_pki_dir() -> Path:
    """$CPN_CERTS, else the state directory's pki/ (where `cpn up --secure` keeps it)."""
    env = os.environ.get(CERTS_ENV)
    return Path(env) if env else state_dir() / "pki"


def credentials_dir(pki: Pki) -> Path:
    return pki.directory / "credentials"


def init_pki(pki: Pki, hosts: Sequence[str] | None = None) -> ServerTls:
    """The CA (unless it exists) and the certificates of etcd and of the broker's API for
    `hosts` (made again when hosts are given, else only where missing; default: loopback);
    what etcd is started with."""
    pki.init()
    for name, client in (("etcd", True), ("broker", False)):
        if hosts or not (pki.directory / f"{name}.pem").exists():
            pki.issue(name, hosts=hosts or DEFAULT_HOSTS, server=True, client=client)
    if not pki.crl_path.exists():  # etcd refuses every client while its CRL file is missing
        pki.write_crl()
    return ServerTls(
        cert_file=pki.directory / "etcd.pem",
        key_file=pki.directory / "etcd-key.pem",
        ca_file=pki.ca_path,
        crl_file=pki.crl_path,
    )


def credentials_for(pki: Pki, user: str, endpoints: str, *, name: str | None = None) -> Path:
    """Issue `user` a client certificate (CN = user) and write its credential file,
    credentials/<name or user>.yaml."""
    issued = pki.issue(f"user-{user}", common_name=user)
    creds = EtcdCredentials(
        endpoints=endpoints,
        user=user,
        ca=pki.ca_pem().decode(),
        cert=issued.cert_pem.decode(),
        key=issued.key_pem.decode(),
    )
    path = credentials_dir(pki) / f"{name or user}.yaml"
    write_credentials(path, creds)
    issued.key_path.unlink()  # the credential file holds the key now; one copy only
    issued.cert_path.unlink()
    return path


async def bootstrap(url: str, pki: Pki) -> dict[str, Path]:
    """`secure_etcd` on the etcd at `url` (TLS, auth possibly still off), connected with a
    short-lived root certificate of `pki` that is deleted afterwards."""
    root = pki.issue("bootstrap-root", common_name=ROOT_USER)
    tls = EtcdTls(pki.ca_pem(), root.cert_pem, root.key_pem)
    try:
        async with Registry.from_urls(url, tls=tls) as registry:
            return await secure_etcd(registry, pki)
    finally:
        root.cert_path.unlink(missing_ok=True)
        root.key_path.unlink(missing_ok=True)


async def secure_etcd(registry: Registry, pki: Pki) -> dict[str, Path]:
    """On an etcd with TLS reached as root (or with auth still off): create root and the
    broker's user, enable auth, and write both credential files; {user: path}."""
    paths = {u: credentials_for(pki, u, registry.url) for u in (ROOT_USER, BROKER_USER)}
    await bootstrap_auth(registry)
    return paths


async def site_credentials(registry: Registry, pki: Pki, spec: SiteSpec) -> Path | None:
    """On a secure etcd: the site's own user and role, and its credential file; None when
    etcd has no auth (nothing to issue)."""
    if registry.tls is None or not await auth_enabled(registry):
        return None
    user = await grant_site(registry, spec)
    return credentials_for(pki, user, registry.url, name=spec.id)


WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


def agent_certificate(pki: Pki, site: str, addresses: Sequence[str | None]) -> Issued:
    """The server certificate of `site`'s agent endpoint, agent-<site>.pem: its SANs are the
    hosts of `addresses` (host:port: where it listens, where peers reach it, e.g. the WAN
    emulation's front) and loopback; a wildcard listen address names no host."""
    hosts = [*DEFAULT_HOSTS]
    for address in addresses:
        if address is None:
            continue
        host = address.rsplit(":", 1)[0].strip("[]")
        if host not in WILDCARD_HOSTS and host not in hosts:
            hosts.append(host)
    return pki.issue(f"agent-{site}", hosts=hosts, server=True, client=False)
