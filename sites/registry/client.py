"""The federation registry client: `Registry`, the one handle every caller holds on etcd.

Every state change that matters is one etcd transaction. Values are JSON documents of the
models in sites.model.spec and sites.model.status; keys are spelled in sites.model.keys only.
What a read returns, decoded, is a sites.model.snapshot.Snapshot, which holds no etcd client.

A Registry composes the parts of the client, each a module of sites.registry over one
EtcdConnection (sites.registry.connection: the aetcd client and the error translation):
leases (grant, keep-alive streams, revoke), reads (one key, a few, whole prefixes in pages at
one revision), watch (a prefix's changes), transactions (guarded commits), lifecycle (a site's
join, cordon and leave, an agent's lock, publishes and reports) and maintenance (compaction,
members, defragmentation, etcd's Auth calls).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any

from sites.model import keys
from sites.model.assignments import Report
from sites.model.endpoints import parse_endpoints, uses_tls
from sites.model.snapshot import Snapshot
from sites.model.spec import SiteSpec
from sites.model.status import (
    AgentRecord,
    AgentSecret,
    Cordon,
    LinkStatus,
    ServiceEndpoint,
    SiteStatus,
)
from sites.registry import maintenance, paging, watch
from sites.registry.connection import TRANSPORT_ENV, EtcdConnection
from sites.registry.leases import Leases
from sites.registry.lifecycle import LeaveResult, SiteLifecycle
from sites.registry.maintenance import MemberStatus
from sites.registry.paging import Page
from sites.registry.reads import Reads
from sites.registry.security import EtcdCredentials, EtcdTls
from sites.registry.transactions import Guard, Transactions
from sites.registry.watch import Event

# The registry's vocabulary, importable from here with the handle that takes and returns it.
__all__ = [
    "DEFAULT_TIMEOUT_S",
    "TRANSPORT_ENV",
    "Event",
    "Guard",
    "LeaveResult",
    "MemberStatus",
    "Page",
    "Registry",
    "parse_endpoints",
]

DEFAULT_TIMEOUT_S = 5


class Registry:
    """An open connection to the registry. Use `async with Registry.from_urls(url) as reg:`."""

    def __init__(
        self,
        *,
        endpoints: Sequence[tuple[str, int]],
        timeout_s: int = DEFAULT_TIMEOUT_S,
        tls: EtcdTls | None = None,
    ):
        self._conn = EtcdConnection(endpoints=endpoints, timeout_s=timeout_s, tls=tls)
        self._leases = Leases(self._conn)
        self._reads = Reads(self._conn)
        self._transactions = Transactions(self._conn)
        self._sites = SiteLifecycle(self._conn, self._reads, self._leases)

    @classmethod
    def from_urls(
        cls, urls: str, *, timeout_s: int = DEFAULT_TIMEOUT_S, tls: EtcdTls | None = None
    ) -> Registry:
        """`urls` comma-separated; https:// ones need `tls` (else the system's CAs are used,
        and no client certificate is shown)."""
        if tls is None and uses_tls(urls):
            tls = EtcdTls(ca_pem=None)
        return cls(endpoints=parse_endpoints(urls), timeout_s=timeout_s, tls=tls)

    @classmethod
    def from_credentials(
        cls, creds: EtcdCredentials, *, timeout_s: int = DEFAULT_TIMEOUT_S
    ) -> Registry:
        return cls.from_urls(creds.endpoints, timeout_s=timeout_s, tls=creds.tls())

    @property
    def endpoints(self) -> list[tuple[str, int]]:
        """(host, port) of each etcd member: where watches, transactions and `members` go."""
        return self._conn.endpoints

    @endpoints.setter
    def endpoints(self, endpoints: Sequence[tuple[str, int]]) -> None:
        self._conn.endpoints = list(endpoints)

    @property
    def tls(self) -> EtcdTls | None:
        return self._conn.tls

    @property
    def url(self) -> str:
        return self._conn.url

    async def __aenter__(self) -> Registry:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Connect and check that etcd answers (a cheap read), so errors surface here."""
        await self._conn.open()

    async def close(self) -> None:
        await self._leases.close()
        self._transactions.close()
        await self._conn.close()

    # -- reads (sites.registry.reads) --------------------------------------------------------

    def iter_prefix(
        self, prefix: str, *, revision: int | None = None, page_keys: int = paging.PAGE_KEYS
    ) -> AsyncIterator[Page]:
        """The keys under `prefix` in key order, page by page, every page at ONE revision
        (Reads.iter_prefix)."""
        return self._reads.iter_prefix(prefix, revision=revision, page_keys=page_keys)

    def iter_range(
        self,
        start_key: str,
        *,
        prefix: str,
        end_key: str | None = None,
        revision: int | None = None,
        page_keys: int = paging.PAGE_KEYS,
    ) -> AsyncGenerator[Page, None]:
        """As iter_prefix, from `start_key` (included) to `end_key` (excluded), else to the
        end of `prefix` (Reads.iter_range)."""
        return self._reads.iter_range(
            start_key, prefix=prefix, end_key=end_key, revision=revision, page_keys=page_keys
        )

    async def list_prefix(
        self, prefix: str, *, page_keys: int = paging.PAGE_KEYS
    ) -> tuple[int, list[tuple[str, bytes, int]]]:
        """(revision, [(key, value, mod_revision), ...]) of every key under `prefix`, one
        consistent read however large (Reads.list_prefix)."""
        return await self._reads.list_prefix(prefix, page_keys=page_keys)

    async def snapshot(self, prefixes: Iterable[str] = keys.SNAPSHOT) -> Snapshot:
        """Everything under `prefixes`, read in pages at one revision (as list_prefix)."""
        return await self._reads.snapshot(prefixes)

    async def count_prefix(self, prefix: str) -> int:
        """How many keys are under `prefix` (a count-only read: no values travel)."""
        return await self._reads.count_prefix(prefix)

    async def changed_since(self, prefix: str, revision: int) -> bool:
        """Is a key under `prefix` last written after `revision`? (Reads.changed_since)"""
        return await self._reads.changed_since(prefix, revision)

    async def revision(self) -> int:
        """etcd's current revision (a count-only read of one key)."""
        return await self._reads.revision()

    async def get_spec(self, site: str) -> SiteSpec | None:
        return await self._reads.get_spec(site)

    async def get_many(
        self, wanted: Sequence[str], *, revision: int | None = None
    ) -> dict[str, tuple[bytes, int]]:
        """{key: (value, mod_revision)} of those of `wanted` that exist, a transaction of reads
        per GET_MANY_KEYS (Reads.get_many)."""
        return await self._reads.get_many(wanted, revision=revision)

    async def get_raw(self, key: str) -> tuple[bytes, int] | None:
        """Value and mod_revision of one key, or None."""
        return await self._reads.get_raw(key)

    # -- watches (sites.registry.watch) ------------------------------------------------------

    def watch(self, prefix: str, *, start_revision: int) -> AsyncIterator[Event]:
        """Events under `prefix` from `start_revision` on; raises RegistryError when broken.

        The caller re-lists with snapshot() and watches again after an error (a compacted
        revision or a lost stream).
        """
        return watch.events(self._conn, prefix, start_revision=start_revision)

    def watch_batches(self, prefix: str, *, start_revision: int) -> AsyncIterator[list[Event]]:
        """As `watch`, the events of each of etcd's answers together (sites.registry.watch)."""
        return watch.batches(self._conn, prefix, start_revision=start_revision)

    # -- writes -----------------------------------------------------------------------------

    async def commit(
        self,
        *,
        guards: Sequence[Guard],
        puts: Mapping[str, bytes] | None = None,
        deletes: Iterable[str] = (),
        lease_id: int | None = None,
    ) -> bool:
        """One transaction: if every guard holds, apply puts and deletes; False if one failed."""
        return await self._transactions.commit(
            guards=guards, puts=puts, deletes=deletes, lease_id=lease_id
        )

    async def delete_prefix(self, prefix: str) -> None:
        """Remove every key under `prefix` (tests and `cpn` maintenance only)."""
        await self._conn.call(lambda: self._conn.client.delete_prefix(prefix.encode()))

    async def put_raw(self, key: str, value: bytes) -> None:
        await self._conn.call(lambda: self._conn.client.put(key.encode(), value))

    # -- operator actions (sites.registry.lifecycle) -----------------------------------------

    async def join(self, spec: SiteSpec, *, now: float | None = None) -> bool:
        """Register or update a site's spec and lift any cordon; True if the site is new
        (SiteLifecycle.join)."""
        return await self._sites.join(spec, now=now)

    async def cordon(self, site: str, *, reason: str, now: float) -> None:
        await self._sites.cordon(site, reason=reason, now=now)

    async def back_off(self, site: str, cordon: Cordon) -> bool:
        """An automatic cordon, put only on a joined site not cordoned (SiteLifecycle)."""
        return await self._sites.back_off(site, cordon)

    async def lift_back_off(self, site: str, until: float) -> bool:
        """The automatic cordon ending at `until` lifted, and only it (SiteLifecycle)."""
        return await self._sites.lift_back_off(site, until)

    async def leave(self, site: str, *, now: float) -> LeaveResult:
        """Cordon the site; remove it (spec, cordon, last_seen) only if no job is assigned."""
        return await self._sites.leave(site, now=now)

    # -- agent (sites.registry.leases, sites.registry.lifecycle) -----------------------------

    async def grant_lease(self, ttl_s: int) -> int:
        return await self._leases.grant(ttl_s)

    async def keepalive(self, lease_id: int) -> int:
        """Refresh the lease; returns its TTL; raises LeaseLost if it is gone."""
        return await self._leases.keepalive(lease_id)

    async def revoke(self, lease_id: int) -> None:
        await self._leases.revoke(lease_id)

    async def acquire_agent(
        self,
        record: AgentRecord,
        *,
        is_stale: Callable[[AgentRecord], bool],
        secret: AgentSecret | None = None,
    ) -> None:
        """Take the site's agent lock under record.lease_id; AgentConflict while another live
        agent holds it (SiteLifecycle.acquire_agent)."""
        await self._sites.acquire_agent(record, is_stale=is_stale, secret=secret)

    async def write_report(
        self, record: AgentRecord, report: Report, *, late: bool = False
    ) -> None:
        """Write a job report, fenced by the agent lock like publish(); LeaseLost if not ours.
        `late`: at its late key (keys.late_report), not the job's own."""
        await self._sites.write_report(record, report, late=late)

    async def publish(
        self,
        record: AgentRecord,
        *,
        status: SiteStatus | None,
        links: Sequence[LinkStatus],
        services: Sequence[ServiceEndpoint],
        stale_links: Iterable[str] = (),
        stale_services: Iterable[tuple[str, str | None]] = (),
    ) -> None:
        """Publish what changed of the site in one transaction, guarded by the agent lock and
        the site's spec; LeaseLost if either is gone (SiteLifecycle.publish)."""
        await self._sites.publish(
            record,
            status=status,
            links=links,
            services=services,
            stale_links=stale_links,
            stale_services=stale_services,
        )

    # -- maintenance (sites.registry.maintenance; the leader's history loop) -----------------

    async def compact(self, revision: int) -> None:
        """Drop the history of every key before `revision` (etcd compaction, cluster-wide)."""
        await maintenance.compact(self._conn, revision)

    async def members(self) -> list[MemberStatus]:
        """Each live endpoint's database size, size in use and revision (etcd's Status call)."""
        return await maintenance.members(self._conn)

    async def defragment(self, endpoint: str) -> None:
        """Defragment one member's database ("host:port")."""
        await maintenance.defragment(self._conn, endpoint)

    async def snapshot_to(self, write: Callable[[bytes], None]) -> tuple[str, int]:
        """Stream a snapshot of etcd's database to `write` (maintenance.snapshot); returns the
        member it came from and the revision it holds."""
        return await maintenance.snapshot(self._conn, write)

    async def auth(self, method: str, request: Any) -> Any:
        """One call of etcd's Auth service; sites.registry.admin drives it."""
        return await maintenance.auth(self._conn, method, request)
