"""The site-lifecycle transactions: an operator's join, cordon and leave of a site, and an
agent's take of its site's lock, its publishes and its job reports, each one etcd transaction
that checks what it depends on (the site's spec, the agent lock, no job still assigned).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import aetcd.utils
from pydantic import BaseModel

from sites.model import keys
from sites.model.assignments import Report
from sites.model.errors import AgentConflict, Conflict, LeaseLost, NotJoined
from sites.model.snapshot import decode_value
from sites.model.spec import SiteSpec
from sites.model.status import (
    AgentRecord,
    AgentSecret,
    Cordon,
    LastSeen,
    LinkStatus,
    PriceHistory,
    ServiceEndpoint,
    SiteStatus,
)
from sites.registry.connection import EtcdConnection
from sites.registry.leases import Leases
from sites.registry.reads import Reads

log = logging.getLogger(__name__)


def _encode(value: BaseModel) -> bytes:
    return value.model_dump_json().encode()


def _automatic(raw: bytes, until: float | None = None) -> bool:
    """Whether a cordon's value is an automatic one (ending at `until`, when given)."""
    try:
        cordon = Cordon.model_validate_json(raw)
    except ValueError:
        return False
    return cordon.until is not None and (until is None or cordon.until == until)


@dataclass(frozen=True)
class LeaveResult:
    removed: bool
    pending_assignments: int


class SiteLifecycle:
    """The site-lifecycle transactions of one registry (see the module docstring)."""

    def __init__(self, conn: EtcdConnection, reads: Reads, leases: Leases) -> None:
        self._conn = conn
        self._reads = reads
        self._leases = leases

    async def join(self, spec: SiteSpec, *, now: float | None = None) -> bool:
        """Register or update a site's spec and lift any cordon; True if the site is new.

        When its prices or power figures change (or it is new), the change goes into the
        site's PriceHistory in the same transaction, from `now`: the ledger bills each part
        of a run at the prices then in force."""
        at = time.time() if now is None else now
        tx = self._conn.tx
        key = keys.site_spec(spec.id).encode()
        prices_key = keys.site_prices(spec.id).encode()
        for _ in range(5):
            got = await self._reads.get_many([key.decode(), prices_key.decode()])
            spec_got, prices_got = got.get(key.decode()), got.get(prices_key.decode())
            history = PriceHistory()
            if prices_got is not None:
                history = decode_value(PriceHistory, prices_got[0], prices_key.decode()) or history
            elif spec_got is not None:  # joined before price histories were kept: its prices
                old = decode_value(SiteSpec, spec_got[0], key.decode())  # so far hold from 0
                if old is not None:
                    history = history.after(old, 0.0)
            new_history = history.after(spec, at)
            ops = [tx.put(key, _encode(spec))]
            if new_history is not history or prices_got is None:
                ops.append(tx.put(prices_key, _encode(new_history)))
            if spec_got is not None:
                ops.append(tx.delete(keys.site_cordon(spec.id).encode()))
            guard = tx.version(key) == 0 if spec_got is None else tx.mod(key) == spec_got[1]
            ok, _ = await self._conn.transaction(compare=[guard], success=ops)
            if ok:
                return spec_got is None
        raise Conflict(f"site {spec.id!r} kept changing while it was joined; try again")

    async def cordon(self, site: str, *, reason: str, now: float) -> None:
        tx = self._conn.tx
        spec_key = keys.site_spec(site).encode()
        ok, _ = await self._conn.transaction(
            compare=[tx.version(spec_key) > 0],
            success=[
                tx.put(keys.site_cordon(site).encode(), _encode(Cordon(since=now, reason=reason)))
            ],
        )
        if not ok:
            raise NotJoined(site)

    async def back_off(self, site: str, cordon: Cordon) -> bool:
        """Put an automatic cordon (one with `until`: broker.leader.start_backoff) while the
        site is joined and not cordoned already; False when it was not put."""
        tx = self._conn.tx
        key = keys.site_cordon(site).encode()
        ok, _ = await self._conn.transaction(
            compare=[tx.version(keys.site_spec(site).encode()) > 0, tx.version(key) == 0],
            success=[tx.put(key, _encode(cordon))],
        )
        return bool(ok)

    async def lift_back_off(self, site: str, until: float) -> bool:
        """Delete the site's automatic cordon that ends at `until`, and only that one (an
        operator's cordon put since stays); False when there was none to delete."""
        key = keys.site_cordon(site)
        got = await self._reads.get_raw(key)
        if got is None or not _automatic(got[0], until):
            return False
        tx = self._conn.tx
        ok, _ = await self._conn.transaction(
            compare=[tx.mod(key.encode()) == got[1]], success=[tx.delete(key.encode())]
        )
        return bool(ok)

    async def leave(self, site: str, *, now: float) -> LeaveResult:
        """Cordon the site; remove it (spec, cordon, last_seen) only if no job is assigned.

        Removal is one transaction that checks the assignments prefix is empty, so a job placed
        concurrently is never orphaned.
        """
        tx = self._conn.tx
        existing = await self._reads.get_raw(keys.site_cordon(site))
        if existing is None or _automatic(existing[0]):  # a back-off ends; leaving does not
            await self.cordon(site, reason="leaving", now=now)
        prefix = keys.assignments(site).encode()
        end = aetcd.utils.prefix_range_end(prefix)
        ok, _ = await self._conn.transaction(
            compare=[
                tx.version(prefix, range_end=end) == 0,
                tx.version(keys.site_spec(site).encode()) > 0,
            ],
            success=[
                tx.delete(keys.site_spec(site).encode()),
                tx.delete(keys.site_cordon(site).encode()),
                tx.delete(keys.site_last_seen(site).encode()),
            ],
        )
        if ok:
            return LeaveResult(removed=True, pending_assignments=0)
        pending = await self._reads.count_prefix(keys.assignments(site))
        if not pending and await self._reads.get_spec(site) is None:
            raise NotJoined(site)
        return LeaveResult(removed=False, pending_assignments=pending)

    async def acquire_agent(
        self,
        record: AgentRecord,
        *,
        is_stale: Callable[[AgentRecord], bool],
        secret: AgentSecret | None = None,
    ) -> None:
        """Take the site's agent lock (/cpn/v1/agents/<site>) under record.lease_id.

        `secret`, the bearer of the agent's /jobs endpoints, goes in with it under the same lease.
        Fails with AgentConflict while another live agent holds it. A record whose process is
        known dead (`is_stale`, e.g. same host and no such pid) is taken over at once instead of
        waiting for its lease to expire, revoking the dead agent's lease (its keys go with it).
        """
        tx = self._conn.tx
        site = record.site
        key = keys.agent(site).encode()
        spec_key = keys.site_spec(site).encode()
        take = [tx.put(key, _encode(record), lease=record.lease_id)]
        if secret is not None:
            take.append(
                tx.put(keys.agent_secret(site).encode(), _encode(secret), lease=record.lease_id)
            )
        for _ in range(3):
            ok, responses = await self._conn.transaction(
                compare=[tx.version(key) == 0, tx.version(spec_key) > 0],
                success=take,
                failure=[tx.get(key), tx.get(spec_key)],
            )
            if ok:
                return
            holder_kvs, spec_kvs = responses
            if not spec_kvs:
                raise NotJoined(site)
            if not holder_kvs:
                continue  # released in between; try again
            raw, meta = holder_kvs[0]
            holder = decode_value(AgentRecord, raw, key.decode())
            if holder is not None and not is_stale(holder):
                since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.started_at))
                raise AgentConflict(
                    f"site {site!r} already has a live agent (pid {holder.pid} on "
                    f"{holder.host}, {holder.url}, since {since}); stop it first"
                )
            log.warning("taking over site %s from a dead agent (%s)", site, holder)
            if holder is not None:
                await self._leases.revoke(holder.lease_id)
            await self._delete_if_unchanged(key, int(meta.mod_revision))
        raise Conflict(f"could not take the agent lock of site {site!r}: it keeps changing")

    async def write_report(
        self, record: AgentRecord, report: Report, *, late: bool = False
    ) -> None:
        """Write a job report, fenced by the agent lock like publish(); LeaseLost if not ours.
        `late`: at its late key (keys.late_report), not the job's own."""
        tx = self._conn.tx
        akey = keys.agent(record.site).encode()
        key = (
            keys.late_report(report.site, report.job, report.attempt)
            if late
            else keys.report(report.site, report.job)
        )
        ok, _ = await self._conn.transaction(
            compare=[tx.value(akey) == _encode(record)],
            success=[tx.put(key.encode(), _encode(report))],
        )
        if not ok:
            raise LeaseLost(f"site {record.site!r}: this agent no longer holds the agent lock")

    async def _delete_if_unchanged(self, key: bytes, mod_revision: int) -> bool:
        tx = self._conn.tx
        ok, _ = await self._conn.transaction(
            compare=[tx.mod(key) == mod_revision], success=[tx.delete(key)]
        )
        return ok

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
        """Publish what changed of the site in one transaction.

        `status` (with the site's last_seen) is written when given; each of `links` and
        `services` is written.

        An endpoint with a `job` (a managed service's replica) goes to its own key
        (keys.service_replica), any other to the site's (keys.service); `stale_services` are
        the (service, job or None) endpoints published before and gone now, deleted.

        Guarded by the agent lock and the site's spec: if the agent key is no longer ours (lease
        expired, another agent took over) or the site has left, nothing is written and LeaseLost
        is raised.
        """
        tx = self._conn.tx
        site = record.site
        lease = record.lease_id
        akey = keys.agent(site).encode()
        ops = []
        if status is not None:
            ops += [
                tx.put(keys.site_status(site).encode(), _encode(status), lease=lease),
                tx.put(
                    keys.site_last_seen(site).encode(),
                    _encode(LastSeen(at=status.published_at, instance=record.instance)),
                ),
            ]
        ops += [tx.put(keys.link(site, ln.dst).encode(), _encode(ln), lease=lease) for ln in links]
        ops += [
            tx.put(
                keys.service_endpoint(ep.service, site, ep.job).encode(), _encode(ep), lease=lease
            )
            for ep in services
        ]
        ops += [tx.delete(keys.link(site, dst).encode()) for dst in stale_links]
        ops += [
            tx.delete(keys.service_endpoint(svc, site, job).encode()) for svc, job in stale_services
        ]
        ok, _ = await self._conn.transaction(
            compare=[
                tx.value(akey) == _encode(record),
                tx.version(keys.site_spec(site).encode()) > 0,
            ],
            success=ops,
        )
        if not ok:
            raise LeaseLost(f"site {site!r}: this agent no longer holds the agent lock")
