"""Copies of the registry's backups at the sites' data stores (docs/backup.md, "Copies at the
sites"): what the leader broker does after each backup it takes, and `cpn backup create` and
`cpn backup fetch` too.

A backup kept only on the broker's host is lost with that host. So each is put, whole, at
`copies` sites' data stores, through the agents' authenticated endpoint under a broker's grant
on `backups:federation` (sites.agent.data.backups); the agent keeps it only once its size and
sha256 match the description sent with it, and says so. Which sites (`choose`): up (an agent
holds the lease), not cordoned, with a data store; `prefer_regions` first in their order, then
the others, the broker's own `home_region` last (a disaster that takes its data center may take
them too); spread over regions within each of those, sites holding copies already first, so
that the copies stay where the older ones are.

Retention follows the local one: a backup pruned here is deleted at the sites its description
names, and each site touched keeps at most `keep` (the newest by when they were taken).

Every call to an agent raises CopyError with one line naming the site and why.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp

from broker.model.errors import BrokerError
from sites.kits.clock import Clock
from sites.kits.sealed import SealError, open_file, seal_file
from sites.model.data import BACKUPS_SCOPE, Claims, Op, mint
from sites.model.snapshot import Snapshot
from sites.model.status import SiteState
from sites.registry.backups import PARTIAL, BackupError, BackupInfo, BackupStore, sha256_of

__all__ = [
    "CopyError",
    "CopyOutcome",
    "CopyPlan",
    "Remote",
    "Shelf",
    "choose",
    "copy_out",
    "fetch",
    "listing",
    "remove",
    "shelves",
]

log = logging.getLogger(__name__)

GRANT_TTL_S = 3600.0  # a grant for one copy, listing or removal
GRANT_HEADER = "X-Cpn-Grant"  # sites.agent.data.transfer's
SHA_HEADER = "X-Cpn-Sha256"
INFO_HEADER = "X-Cpn-Backup"  # sites.agent.data.backups'
CHUNK = 1 << 20
# a copy or a fetch moves the whole registry (up to etcd's quota, GBs) over a WAN path: no limit
# on the whole, only on a stalled connection (the session's own limit is for small calls)
TRANSFER_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=120.0)


class CopyError(BrokerError):
    """A site's agent could not be reached, or refused: one line naming the site. `status`:
    the agent's HTTP status (0: unreachable)."""

    def __init__(self, where: str, message: str, status: int = 0) -> None:
        super().__init__(f"{where}: {message}")
        self.where, self.status = where, status


@dataclass(frozen=True)
class Remote:
    """A site's agent as a backup client sees it: its base URL and the credential sent."""

    where: str  # a site id, or the URL given
    url: str
    headers: Mapping[str, str]


@dataclass(frozen=True)
class Shelf:
    """A site that may keep a copy now, with what signs a broker's grant there."""

    site: str
    region: str
    url: str
    key: str  # its agent's data key (sites.model.status.AgentSecret)

    def remote(self, clock: Clock, op: Op, sub: str) -> Remote:
        claims = Claims(
            site=self.site, sub=sub, scope=BACKUPS_SCOPE, op=op, exp=clock.time() + GRANT_TTL_S
        )
        return Remote(self.site, self.url, {GRANT_HEADER: mint(self.key, claims)})


def shelves(sites: Snapshot, data_keys: Mapping[str, str]) -> list[Shelf]:
    """The sites that may keep a copy now: up, not cordoned, with a data store (a data key)."""
    out = []
    for site in sorted(sites.specs):
        key, agent = data_keys.get(site), sites.agents.get(site)
        if key is None or agent is None or sites.state(site) is not SiteState.up:
            continue
        out.append(Shelf(site, sites.specs[site].region, agent.url.rstrip("/"), key))
    return out


@dataclass(frozen=True)
class CopyPlan:
    """How many copies, and where first (broker.placement.settings.BackupSettings)."""

    copies: int = 2
    prefer_regions: tuple[str, ...] = ()
    home_region: str | None = None
    keep: int = 0  # at each site, the newest this many (0: all)
    key: bytes | None = None  # the copies sealed with it (sites.kits.sealed); None: as taken


def choose(
    candidates: Iterable[Shelf], plan: CopyPlan, count: int, holding: Collection[str] = ()
) -> list[Shelf]:
    """`count` of `candidates`, best first (module docstring)."""

    def tier(s: Shelf) -> int:
        if s.region in plan.prefer_regions:
            return plan.prefer_regions.index(s.region)
        return len(plan.prefer_regions) + (1 if s.region == plan.home_region else 0)

    ordered = sorted(candidates, key=lambda s: (tier(s), s.site not in holding, s.site))
    picked: list[Shelf] = []
    for t in sorted({tier(s) for s in ordered}):
        level = [s for s in ordered if tier(s) == t]
        regions = {s.region for s in picked}
        for s in level:  # one per region first
            if len(picked) < count and s.region not in regions:
                picked.append(s)
                regions.add(s.region)
        for s in level:
            if len(picked) < count and s not in picked:
                picked.append(s)
    return picked


# -- one agent --------------------------------------------------------------------------------


async def _error(where: str, answer: aiohttp.ClientResponse) -> CopyError:
    body = await answer.read()
    try:
        message = str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace").strip()[:200] or f"HTTP {answer.status}"
    return CopyError(where, f"{message} (HTTP {answer.status})", answer.status)


def _unreachable(remote: Remote, exc: BaseException) -> CopyError:
    return CopyError(remote.where, f"cannot reach its agent at {remote.url}: {exc or type(exc)}")


async def _chunks(path: Path) -> AsyncIterator[bytes]:
    with open(path, "rb") as f:
        while chunk := await asyncio.to_thread(f.read, CHUNK):
            yield chunk


async def push(http: aiohttp.ClientSession, remote: Remote, path: Path, info: BackupInfo) -> None:
    """Put the backup at `path` (described by `info`) at the site; CopyError unless the agent
    kept it with the same sha256."""
    sent = replace(info, copies=())
    headers = {
        **remote.headers,
        INFO_HEADER: json.dumps(sent.to_dict(), separators=(",", ":")),
        "Content-Length": str(info.size_bytes),
        "Content-Type": "application/octet-stream",
    }
    url = f"{remote.url}/data/backups/{info.name}"
    try:
        put = http.put(url, data=_chunks(path), headers=headers, timeout=TRANSFER_TIMEOUT)
        async with put as answer:
            if answer.status != 201:
                raise await _error(remote.where, answer)
            got = await answer.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise _unreachable(remote, exc) from None
    if not isinstance(got, dict) or got.get("sha256") != info.sha256:
        raise CopyError(remote.where, f"kept {info.name} with another sha256: {got}")


async def listing(http: aiohttp.ClientSession, remote: Remote) -> list[BackupInfo]:
    """The backups the site holds, oldest first."""
    try:
        async with http.get(f"{remote.url}/data/backups", headers=remote.headers) as answer:
            if answer.status != 200:
                raise await _error(remote.where, answer)
            got = await answer.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise _unreachable(remote, exc) from None
    try:
        items = [BackupInfo.from_dict(raw, remote.where) for raw in got["items"]]
    except (KeyError, TypeError, BackupError) as exc:
        raise CopyError(remote.where, f"an unreadable list of backups: {exc}") from None
    return sorted(items, key=lambda i: (i.taken_at, i.name))


async def remove(http: aiohttp.ClientSession, remote: Remote, name: str) -> bool:
    """Delete `name` at the site; False if it was not there."""
    try:
        async with http.delete(f"{remote.url}/data/backups/{name}", headers=remote.headers) as a:
            if a.status == 404:
                return False
            if a.status != 200:
                raise await _error(remote.where, a)
            return True
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise _unreachable(remote, exc) from None


async def set_readers(
    http: aiohttp.ClientSession, remote: Remote, tokens: Sequence[Mapping[str, object]]
) -> None:
    """Tell the site the admin tokens (id, sha256, expires_at) that may read its backups."""
    body = {"tokens": [dict(t) for t in tokens]}
    try:
        url = f"{remote.url}/data/backup-readers"
        async with http.put(url, json=body, headers=remote.headers) as answer:
            if answer.status != 200:
                raise await _error(remote.where, answer)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise _unreachable(remote, exc) from None


async def fetch(
    http: aiohttp.ClientSession,
    remote: Remote,
    name: str,
    store: BackupStore,
    key: bytes | None = None,
) -> BackupInfo:
    """Bring backup `name` from the site into `store`, kept once its sha256 matches the site's
    description of it (BackupError when not: nothing is kept); a sealed copy is opened with
    `key` and the snapshot within checked again."""
    infos = {i.name: i for i in await listing(http, remote)}
    info = infos.get(name)
    if info is None:
        have = ", ".join(sorted(infos)[-3:]) or "none"
        raise CopyError(remote.where, f"holds no backup {name} (its newest: {have})", 404)
    if info.sealed and key is None:
        raise BackupError(f"{name} at {remote.where} is sealed: give the backup key (--key)")
    part = store.part_path(name)
    if info.sealed:
        part = part.with_name(f"{name}.sealed{PARTIAL}")
    try:
        url = f"{remote.url}/data/backups/{name}"
        async with http.get(url, headers=remote.headers, timeout=TRANSFER_TIMEOUT) as a:
            if a.status != 200:
                raise await _error(remote.where, a)
            if a.headers.get(SHA_HEADER, info.sha256) != info.sha256:
                raise CopyError(remote.where, f"sends {name} with another sha256 than it lists")
            with open(part, "wb") as f:
                async for chunk in a.content.iter_chunked(CHUNK):
                    await asyncio.to_thread(f.write, chunk)
    except (aiohttp.ClientError, TimeoutError) as exc:
        part.unlink(missing_ok=True)
        raise _unreachable(remote, exc) from None
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    if not info.sealed or key is None:
        return await asyncio.to_thread(store.adopt, info, part)
    return await asyncio.to_thread(_unseal, store, info, part, key)


def _unseal(store: BackupStore, info: BackupInfo, sealed: Path, key: bytes) -> BackupInfo:
    """The sealed copy checked as the site describes it, opened, and kept as the snapshot."""
    plain = store.part_path(info.name)
    try:
        size, found = sealed.stat().st_size, sha256_of(sealed)
        if size != info.size_bytes or found != info.sha256:
            raise BackupError(
                f"the copy of {info.name} has {size} bytes, sha256 {found[:12]}..., its "
                f"description says {info.size_bytes}, {info.sha256[:12]}...: damaged on its way"
            )
        try:
            open_file(sealed, plain, key, info.name.encode())
        except SealError as exc:
            raise BackupError(str(exc)) from None
    finally:
        sealed.unlink(missing_ok=True)
    within = replace(
        info, sealed=False, sha256=info.plain_sha256, size_bytes=info.plain_size_bytes,
        plain_sha256="", plain_size_bytes=0,
    )  # fmt: skip
    return store.adopt(within, plain)


# -- after a backup ---------------------------------------------------------------------------


@dataclass
class CopyOutcome:
    """What one round of copying did: the sites holding the backup (checked), those that
    failed and why, and what retention deleted where."""

    name: str
    copies: tuple[str, ...] = ()
    failed: dict[str, str] = field(default_factory=dict)
    pruned: dict[str, list[str]] = field(default_factory=dict)
    short: str = ""  # fewer sites up with a data store than copies asked: not a failure


async def copy_out(
    http: aiohttp.ClientSession,
    store: BackupStore,
    info: BackupInfo,
    *,
    candidates: Sequence[Shelf],
    plan: CopyPlan,
    readers: Sequence[Mapping[str, object]],
    clock: Clock,
    sub: str = "broker",
    pruned: Mapping[str, Collection[str]] | None = None,
) -> CopyOutcome:
    """Bring `info` (in `store`) to `plan.copies` sites, counting those its description names
    already; then retention at the sites touched (`pruned`: backups removed here, name ->
    the sites their descriptions named). Records the copies in its description."""
    out = CopyOutcome(name=info.name, copies=info.copies)
    need = plan.copies - len(info.copies)
    if need > 0:
        free = [s for s in candidates if s.site not in info.copies]
        chosen = choose(free, plan, need, holding=_holding(store))
        if len(chosen) < need:
            out.short = (
                f"{len(chosen) + len(info.copies)} of {plan.copies} copies: no more sites are "
                "up with a data store"
            )
        path, sent = store.path(info.name), info
        if chosen and plan.key is not None:
            path = path.with_name(f"{info.name}.sealed{PARTIAL}")
            sent = await asyncio.to_thread(_seal, store, info, path, plan.key)
        try:
            for shelf in chosen:
                remote = shelf.remote(clock, "write", sub)
                try:
                    await set_readers(http, remote, readers)
                    await push(http, remote, path, sent)
                except CopyError as exc:
                    out.failed[shelf.site] = str(exc)
                    continue
                out.copies = (*out.copies, shelf.site)
        finally:
            if sent is not info:
                path.unlink(missing_ok=True)
        if out.copies != info.copies:
            await asyncio.to_thread(store.record_copies, info.name, out.copies)
    by_site = {s.site: s for s in candidates}
    for name, sites in (pruned or {}).items():
        for site in sites:
            holder = by_site.get(site)
            if holder is None:
                continue  # down now: the per-site retention below catches it later
            try:
                if await remove(http, holder.remote(clock, "write", sub), name):
                    out.pruned.setdefault(site, []).append(name)
            except CopyError as exc:
                log.warning("backup %s not removed: %s", name, exc)
    if plan.keep:
        for site in out.copies:
            holder = by_site.get(site)
            if holder is not None:
                await _keep_newest(http, holder.remote(clock, "write", sub), plan.keep, out)
    return out


async def _keep_newest(
    http: aiohttp.ClientSession, remote: Remote, keep: int, out: CopyOutcome
) -> None:
    try:
        held = await listing(http, remote)
        for old in held[: max(0, len(held) - keep)]:
            if await remove(http, remote, old.name):
                out.pruned.setdefault(remote.where, []).append(old.name)
    except CopyError as exc:
        log.warning("retention of the backups at %s: %s", remote.where, exc)


def _seal(store: BackupStore, info: BackupInfo, dst: Path, key: bytes) -> BackupInfo:
    """The backup sealed into `dst` (bound to its name), and the description of what is sent."""
    seal_file(store.path(info.name), dst, key, info.name.encode())
    return replace(
        info, sealed=True, sha256=sha256_of(dst), size_bytes=dst.stat().st_size,
        plain_sha256=info.sha256, plain_size_bytes=info.size_bytes,
    )  # fmt: skip


def _holding(store: BackupStore) -> set[str]:
    return {site for info in store.backups() for site in info.copies}
