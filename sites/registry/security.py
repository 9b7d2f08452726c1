"""etcd with TLS and authentication: the credential file, the TLS channel, and the users and
roles that let each site write only its own keys (long form: docs/auth.md).

A credential file is what an agent, a broker or an operator's CLI is given to reach a secure
etcd (`--etcd-credentials FILE` or $CPN_ETCD_CREDENTIALS), YAML with mode 0600:

    endpoints: https://10.0.0.1:2379,https://10.0.0.2:2379
    user: site-beijing-a        # the CN of `cert`: etcd takes the user from it
    ca: |                       # the CA that signed etcd's server certificate
      -----BEGIN CERTIFICATE-----
    cert: |                     # this user's client certificate ...
    key: |                      # ... and its private key

etcd runs with ``--client-cert-auth``: a client certificate signed by the CA is required to
connect at all, and once auth is enabled its common name is the user whose roles are checked.
There is no password to expire (etcd's simple tokens last five minutes) or to show in `ps`.

Users and roles (`bootstrap_auth`, `grant_site`):

    root         role root                  the operator (`cpn site join`, tokens bootstrap)
    cpn-broker   role cpn-broker            read and write under /cpn/
    site-<id>    role site-<id>             its own status, last_seen, agent lock and secret,
                                            links, reports and service endpoints; reads the
                                            peers' agent records, its spec, its assignments,
                                            the published CRL
"""

from __future__ import annotations

import asyncio
import os
import ssl
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aetcd
import aetcd.client
import aetcd.utils
import aetcd.watcher
import grpc
import yaml
from aetcd import rpc
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from sites.kits.private import write_private
from sites.model import keys
from sites.model.config import validation_problems
from sites.model.endpoints import parse_endpoints, uses_tls
from sites.model.errors import ConfigError, Problem
from sites.model.spec import SiteSpec

__all__ = [
    "BROKER_USER",
    "ROOT_USER",
    "EtcdCredentials",
    "EtcdTls",
    "Grant",
    "TlsClient",
    "load_credentials",
    "site_grants",
    "site_user",
    "write_credentials",
]

ROOT_USER = "root"
BROKER_USER = "cpn-broker"
CREDENTIALS_ENV = "CPN_ETCD_CREDENTIALS"

# etcd's authpb.Permission.Type
READ, WRITE, READWRITE = 0, 1, 2


@dataclass(frozen=True)
class EtcdTls:
    """TLS material for the gRPC channel: the CA to trust (None: the system's roots) and the
    client's own certificate and key (None: no client certificate)."""

    ca_pem: bytes | None
    cert_pem: bytes | None = None
    key_pem: bytes | None = None
    source: Path | None = None
    """The credential file they were read from: a connection re-reads it when it changes (a
    renewed certificate, `cpn certs rotate`), for the connections it opens next."""

    def channel_credentials(self) -> Any:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem, private_key=self.key_pem, certificate_chain=self.cert_pem
        )

    def ssl_context(self) -> ssl.SSLContext:
        """The same trust and client certificate for sites.registry.h2grpc's channels (ALPN
        "h2")."""
        context = ssl.create_default_context(
            cadata=None if self.ca_pem is None else self.ca_pem.decode()
        )
        if self.cert_pem is not None and self.key_pem is not None:
            # ssl reads a certificate chain only from files: a private directory, removed at once
            with tempfile.TemporaryDirectory(prefix="cpn-tls-") as tmp:
                cert, key = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
                write_private(cert, self.cert_pem.decode())
                write_private(key, self.key_pem.decode())
                context.load_cert_chain(cert, key)
        context.set_alpn_protocols(["h2"])
        return context


class EtcdCredentials(BaseModel):
    """The credential file's content (see the module's doc)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoints: str = Field(min_length=1, description="https:// URLs, comma-separated")
    user: str = Field(min_length=1, description="the etcd user (the certificate's CN)")
    ca: str = Field(min_length=1, description="PEM of the CA that signed etcd's certificate")
    cert: str = Field(min_length=1, description="PEM of the user's client certificate")
    key: str = Field(min_length=1, description="PEM of the client certificate's key")

    @field_validator("endpoints")
    @classmethod
    def _https(cls, value: str) -> str:
        parse_endpoints(value)
        if not uses_tls(value):
            raise ValueError("a credential file's endpoints are https:// (etcd with TLS)")
        return value

    @field_validator("ca", "cert", "key")
    @classmethod
    def _pem(cls, value: str) -> str:
        if "-----BEGIN " not in value:
            raise ValueError("expected a PEM block (-----BEGIN ...)")
        return value

    _source: Path | None = PrivateAttr(default=None)

    def model_post_init(self, context: Any) -> None:
        if isinstance(context, dict) and isinstance(context.get("source"), Path):
            self._source = context["source"]

    def tls(self) -> EtcdTls:
        """The TLS material, and the file it came from (load_credentials's)."""
        return EtcdTls(self.ca.encode(), self.cert.encode(), self.key.encode(), self._source)


def load_credentials(path: Path) -> EtcdCredentials:
    """Read and check a credential file; ConfigError naming the file and field if unusable."""
    source = str(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as exc:
        raise ConfigError([Problem(source, "", exc.strerror or str(exc))]) from None
    if mode & 0o077:
        raise ConfigError(
            [Problem(source, "", f"readable by others (mode {oct(mode & 0o777)}); chmod 600")]
        )
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([Problem(source, "", f"not YAML: {exc}")]) from None
    if not isinstance(doc, dict):
        raise ConfigError([Problem(source, "", "expected a mapping (endpoints, user, ...)")])
    try:
        return EtcdCredentials.model_validate(doc, context={"source": path})
    except ValidationError as exc:
        raise ConfigError(validation_problems(source, exc)) from None


def credentials_from_env() -> Path | None:
    value = os.environ.get(CREDENTIALS_ENV)
    return Path(value) if value else None


def write_credentials(path: Path, creds: EtcdCredentials) -> None:
    """Write a credential file atomically with mode 0600."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    header = f"# cpn etcd credentials of {creds.user}: keep private (mode 0600)\n"
    write_private(path, header + yaml.safe_dump(creds.model_dump(), sort_keys=False))


class TlsClient(aetcd.Client):  # type: ignore[misc]
    """aetcd's client over a TLS channel: aetcd itself opens only insecure channels. The
    connect below is aetcd 1.0's with `secure_channel` in place of `insecure_channel`; `renew`
    swaps the channel for one with a renewed certificate."""

    channel: Any  # aetcd's, untyped: set by connect()
    metadata: Any

    def __init__(self, *, tls: EtcdTls, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._tls = tls
        self._retired: list[Any] = []  # channels replaced by renew(): closed with the client

    def _secure_channel(self) -> Any:
        return rpc.secure_channel(
            f"{self._host}:{self._port}",
            self._tls.channel_credentials(),
            options=self._options.items(),
        )

    def _stubs(self) -> None:
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = aetcd.watcher.Watcher(
            rpc.WatchStub(self.channel),
            timeout=self._timeout,
            metadata=self.metadata,
        )

    def renew(self, tls: EtcdTls) -> None:
        """Present `tls` (a renewed certificate) from now on: calls made next go over a new
        channel; the old one's calls and streams go on (its handshake was with a certificate
        still valid) and it is closed with the client."""
        self._tls = tls
        if self.channel is not None and self._connected.is_set():
            self._retired.append(self.channel)
            self.channel = self._secure_channel()
            self._stubs()

    async def close(self) -> None:
        await super().close()
        retired, self._retired = self._retired, []
        for channel in retired:
            await channel.close()

    @aetcd.client._handle_errors  # type: ignore[untyped-decorator]  # noqa: SLF001
    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # type: ignore[has-type]
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            self.channel = self._secure_channel()
            if self._username is not None and self._password is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                resp = await self.auth_stub.Authenticate(
                    rpc.AuthenticateRequest(name=self._username, password=self._password),
                    timeout=self._timeout,
                )
                self.metadata = (("token", resp.token),)
            self._stubs()
            self._connected.set()
        finally:
            self._is_connecting = False


def make_client(
    host: str, port: int, *, timeout: float, tls: EtcdTls | None, server_name: str | None = None
) -> aetcd.Client:
    """aetcd's client, over TLS when `tls` is given. `server_name` is the name checked in the
    servers' certificates when the target is a list of addresses (`ipv4:a:1,b:2`, which has
    no one host name of its own): the first endpoint's host, so every member's certificate
    must name it too (the development CA's name 127.0.0.1 and localhost on each)."""
    if tls is None:
        return aetcd.Client(host=host, port=port, timeout=timeout)
    options = {"grpc.ssl_target_name_override": server_name} if server_name else None
    return TlsClient(host=host, port=port, timeout=timeout, tls=tls, options=options)


# -- users and roles -----------------------------------------------------------------------


@dataclass(frozen=True)
class Grant:
    """One permission of a role: `kind` READ, WRITE or READWRITE on one key, or on every key
    under it when `prefix`."""

    kind: int
    key: str
    prefix: bool = False

    def range_end(self) -> bytes:
        return aetcd.utils.prefix_range_end(self.key.encode()) if self.prefix else b""


def site_user(site: str) -> str:
    return f"site-{site}"


def site_grants(spec: SiteSpec) -> list[Grant]:
    """What the agent of `spec` may do, and nothing more (the key layout is sites.model.keys)."""
    site = spec.id
    grants = [
        Grant(READ, keys.AGENTS, prefix=True),  # the peers it probes
        Grant(READ, f"{keys.SITES}{site}/", prefix=True),  # its spec and cordon
        Grant(READWRITE, keys.site_status(site)),
        Grant(READWRITE, keys.site_last_seen(site)),
        Grant(READWRITE, keys.agent(site)),
        Grant(READWRITE, keys.agent_secret(site)),  # the bearer of its /jobs: the broker reads it
        Grant(READWRITE, f"{keys.LINKS}{site}/", prefix=True),
        Grant(READWRITE, keys.reports(site), prefix=True),
        Grant(READ, keys.assignments(site), prefix=True),
        Grant(READWRITE, keys.data_replicas(site), prefix=True),  # what its data store holds
        Grant(READ, keys.data_orders(site), prefix=True),  # replications the broker asks of it
        Grant(READ, keys.CRL),  # the certificates its peers may no longer present
        Grant(READ, keys.SCHEMA),  # the registry's layout, checked at its start
    ]
    grants += [Grant(READWRITE, keys.service(s.name, site)) for s in spec.services]
    # the managed replicas the broker places here, whatever service they are of
    grants.append(Grant(READWRITE, keys.site_replicas(site), prefix=True))
    return grants


BROKER_GRANTS = (Grant(READWRITE, "/cpn/", prefix=True),)


def permission(grant: Grant) -> Any:
    return rpc.Permission(permType=grant.kind, key=grant.key.encode(), range_end=grant.range_end())


def role_permissions(role: Any) -> list[Grant]:
    """The grants of an AuthRoleGet answer, to compare with what a role should have."""
    out = []
    for perm in role.perm:
        key, end = bytes(perm.key), bytes(perm.range_end)
        prefix = bool(end) and end == aetcd.utils.prefix_range_end(key)
        out.append(Grant(int(perm.permType), key.decode(), prefix))
    return out


def missing(have: Sequence[Grant], want: Sequence[Grant]) -> tuple[list[Grant], list[Grant]]:
    """(grants to add, grants to revoke) to turn `have` into `want`."""
    return [g for g in want if g not in have], [g for g in have if g not in want]


# -- applying them -------------------------------------------------------------------------
