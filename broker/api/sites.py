"""GET /v1/sites: one entry per site, its rows kept current from the view's journals.

A row is rendered (JSON) once per change of its site: its spec, status, cordon, last_seen or
agent (`Snapshot.site_journal`) or one of its outgoing links (`Snapshot.link_journal`), at
most once per SITES_REFRESH_S while the sites keep changing. A page splices each row's
`last_seen_ago_s` in at answer time. At 5,000 sites every list used to render all 5,000 rows
again (0.4-0.8 s of the event loop a list, in slices: bench/JOURNAL.md, 2026-12-05);
now it renders the sites that changed since the last list, and a page costs its own rows.
The whole list is rendered again only when the set of sites changed or a prefix was listed
again (`Snapshot.layout_version`), the snapshot was replaced, or a journal dropped entries
this cache had not read yet.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import time
from operator import itemgetter

from pydantic import BaseModel, Field

from sites.model.capacity import Capacity
from sites.model.snapshot import JournalCursor, Snapshot
from sites.model.spec import Coordinates, SiteSpec
from sites.model.status import Cordon, LinkStatus, SiteState, SiteStatus, SiteView

__all__ = [
    "JOURNAL_CHUNK",
    "SITES_CHUNK",
    "SITES_REFRESH_S",
    "SiteInfo",
    "SiteRows",
    "site_info",
    "site_row",
]

SITES_REFRESH_S = 1.0
"""Rows are rendered again at most this often (s) while the sites keep changing: at 1,000
sites publishing every second every row changes every second, and rendering one costs ~50 us
of the event loop, which every other request would wait behind."""

SITES_CHUNK = 10
"""Rows are rendered this many at a time (about half a ms), yielding to the event loop
between chunks: a thousand rows cost tens of ms, which no submit or route should wait behind
whole (bench/JOURNAL.md, 2026-12-05, live_federation.py)."""

JOURNAL_CHUNK = 500
"""Journal entries read between two yields to the event loop (about a quarter of a ms)."""

_AGO = b'"last_seen_ago_s":'
_AGO_NULL = _AGO + b"null"


class SiteInfo(BaseModel):
    """One entry of GET /v1/sites."""

    id: str
    region: str
    state: SiteState
    last_seen: float | None = Field(description="unix time of the agent's last report, s")
    last_seen_ago_s: float | None = Field(
        description="seconds since last_seen when the page was answered (the rest of the "
        "entry is at most 1 s old)"
    )
    rtt_ms: dict[str, float] = Field(description="peer site -> measured round trip, ms")
    free: Capacity | None = Field(description="capacity not held by jobs; null before a report")
    capacity: Capacity | None = Field(
        default=None, description="total capacity as last reported; null before a report"
    )
    coordinates: Coordinates | None = Field(default=None, description="from the site's spec")
    nodes: dict[str, dict[str, int]] | None = Field(
        default=None,
        description="at a site that declares its nodes: node -> free devices by (pseudo-)model, "
        "as its agent last published them (docs/topology.md); null elsewhere",
    )
    confinement: str | None = Field(
        default=None,
        description="how the site confines tenants' runs, as its agent last published it "
        "(docs/security.md); null before a report",
    )
    cordon: Cordon | None = Field(
        default=None,
        description="why the site takes no new work: an operator's (leaving), or the leader's "
        "back-off from a site where attempts kept failing to start (with `until`); null: none",
    )


def site_info(site: SiteView, now: float) -> SiteInfo:
    """One entry of GET /v1/sites, from the registry's view of the site."""
    return _site_info(
        site.id, site.region, site.state, site.last_seen, site.rtt_ms, site.status, site.spec,
        now, site.cordon,
    )  # fmt: skip


def _site_info(
    site: str,
    region: str,
    state: SiteState,
    last_seen: float | None,
    rtt_ms: dict[str, float],
    status: SiteStatus | None,
    spec: SiteSpec,
    now: float | None,
    cordon: Cordon | None = None,
) -> SiteInfo:
    # every part is a validated value of the registry's view already: constructed, not
    # validated again (GET /v1/sites builds a thousand of these a second at 1,000 sites)
    return SiteInfo.model_construct(
        id=site,
        region=region,
        state=state,
        last_seen=last_seen,
        last_seen_ago_s=None if last_seen is None or now is None else round(now - last_seen, 3),
        rtt_ms=rtt_ms,
        free=None if status is None else status.free,
        capacity=None if status is None else status.capacity,
        coordinates=spec.coordinates,
        nodes=None
        if status is None or not status.nodes
        else {n.node: dict(n.free_devices) for n in status.nodes},
        confinement=None if status is None else status.confinement or None,
        cordon=cordon,
    )


# (the JSON up to last_seen_ago_s's value, the rest of it, last_seen)
_Row = tuple[bytes, bytes, float | None]


def _render(sites: Snapshot, site: str, rtt: dict[str, float]) -> _Row | None:
    """`site`'s entry without its last_seen_ago_s, from the snapshot; None if it left."""
    spec = sites.specs.get(site)
    if spec is None:
        return None
    status = sites.statuses.get(site)
    seen = sites.last_seen.get(site)
    last_seen = status.published_at if status else (seen.at if seen else None)
    nearest = dict(sorted(rtt.items(), key=itemgetter(1)))
    info = _site_info(
        site, spec.region, sites.state(site), last_seen, nearest, status, spec, None,
        sites.cordons.get(site),
    )  # fmt: skip
    # the key comes after id, region, state and last_seen, whose JSON holds no bare quote
    head, found, tail = info.model_dump_json().encode().partition(_AGO_NULL)
    assert found, "SiteInfo renders last_seen_ago_s"
    return head + _AGO, tail, last_seen


def _spliced(row: _Row, now: float) -> bytes:
    head, tail, last_seen = row
    ago = b"null" if last_seen is None else repr(round(now - last_seen, 3)).encode()
    return head + ago + tail


def site_row(
    sites: Snapshot, site: str, links: dict[str, dict[str, LinkStatus]], now: float
) -> bytes | None:
    """`site`'s GET /v1/sites entry (JSON) straight from the snapshot, as site_info of its
    view (the test holds them equal) without building the view; None if it left."""
    rtt = {dst: ln.rtt_ms for dst, ln in links.get(site, {}).items() if ln.rtt_ms is not None}
    row = _render(sites, site, rtt)
    return None if row is None else _spliced(row, now)


class SiteRows:
    """The rows of GET /v1/sites, by site id, for one broker's view (a module docstring
    says how they are kept). One refresh at a time (`lock`): a request queued behind one
    reuses it."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self._snapshot: int | None = None  # id() of the snapshot these rows follow
        self._version = -1
        self._sites = JournalCursor("site")
        self._links = JournalCursor("link")
        self._at = -math.inf  # time.monotonic() of the last refresh
        self._rtt: dict[str, dict[str, float]] = {}  # src -> dst -> rtt_ms
        self._rows: dict[str, _Row] = {}
        self.ids: list[str] = []  # sorted

    async def refresh(self, sites: Snapshot) -> None:
        """Bring the rows up to `sites`, unless refreshed less than SITES_REFRESH_S ago."""
        async with self.lock:
            if id(sites) == self._snapshot and sites.version == self._version:
                return
            now = time.monotonic()
            if self._snapshot is not None and now - self._at < SITES_REFRESH_S:
                return
            self._at = now
            self._snapshot, self._version = id(sites), sites.version
            # read now: what changes while rendering is in the journals for the next refresh
            changed, links = self._sites.since(sites), self._links.since(sites)
            if changed is None or links is None:
                await self._rebuild(sites)
            else:
                await self._update(sites, changed, links)

    def page(self, after: str, limit: int, now: float) -> tuple[list[bytes], str | None]:
        """Up to `limit` rows after site id `after`, their last_seen_ago_s as of `now`, and the
        id to go on from (None on the last page)."""
        start = bisect.bisect_right(self.ids, after) if after else 0
        ids = self.ids[start : start + limit]
        rows = [_spliced(self._rows[site], now) for site in ids if site in self._rows]
        more = start + limit < len(self.ids)
        return rows, ids[-1] if more and ids else None

    async def _rebuild(self, sites: Snapshot) -> None:
        rtt: dict[str, dict[str, float]] = {}
        for (src, dst), ln in sites.links.items():
            if ln.rtt_ms is not None:
                rtt.setdefault(src, {})[dst] = ln.rtt_ms
        ids = sites.site_ids()
        rows: dict[str, _Row] = {}
        await self._render(sites, ids, rtt, rows)
        # swapped in whole: a page answered meanwhile (between the chunks) reads the old rows
        self._rtt, self._rows, self.ids = rtt, rows, ids

    async def _update(
        self, sites: Snapshot, changed: list[str], links: list[tuple[str, str]]
    ) -> None:
        # copies of what is new (a list copy is one memcpy), read JOURNAL_CHUNK at a time
        # yielding between: seconds of a thousand sites' changes are thousands of entries
        for i in range(0, len(links), JOURNAL_CHUNK):
            if i:
                await asyncio.sleep(0)
            for src, dst in links[i : i + JOURNAL_CHUNK]:
                ln = sites.links.get((src, dst))
                if ln is None or ln.rtt_ms is None:
                    self._rtt.get(src, {}).pop(dst, None)
                else:
                    self._rtt.setdefault(src, {})[dst] = ln.rtt_ms
            changed += [src for src, _ in links[i : i + JOURNAL_CHUNK]]
        await self._render(sites, sorted(set(changed)), self._rtt, self._rows)

    @staticmethod
    async def _render(
        sites: Snapshot, ids: list[str], rtt: dict[str, dict[str, float]], rows: dict[str, _Row]
    ) -> None:
        """Render `ids`' rows into `rows`, SITES_CHUNK at a time."""
        for i in range(0, len(ids), SITES_CHUNK):
            if i:
                await asyncio.sleep(0)
            for site in ids[i : i + SITES_CHUNK]:
                row = _render(sites, site, rtt.get(site, {}))
                if row is None:
                    rows.pop(site, None)
                else:
                    rows[site] = row
