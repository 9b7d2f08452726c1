"""Job pages: newest-first pages of jobs, hot and archived, for GET /v1/jobs and `cpn jobs`.

Every write of a job record also writes its `JobSummary` under
/cpn/v1/index/jobs/<inverted creation time>/<id> (broker.state.store.writes), so etcd's key
order is newest first and a page is one short range read from where the last one ended. No
sorted range is ever asked of etcd: it would read the whole range before applying a limit.

`list_page` reads the index from a `continue` position at ONE revision (the first page's,
carried in the token, as Kubernetes does), filters the summaries (state, tenant, site, created
since) and fetches only the records it returns, 100 per transaction. A page scans at most
SCAN_LIMIT index entries: a very selective filter returns fewer items than asked, with a token
to go on. A token whose revision etcd has compacted is `Expired` (410). `include=archived`
merges the hot index with the archived one (broker.leader.history moves finished jobs there),
still newest first. docs/jobs.md, "History and retention", has the long form.
"""

from __future__ import annotations

import json
import logging
import math
import zlib
from dataclasses import dataclass, field
from datetime import UTC, datetime

from broker.model.errors import Expired, InvalidRequest
from broker.model.jobs import JobRecord, JobState
from broker.state.newest import Cursor, untoken
from broker.state.newest import token as make_token
from broker.state.store import decode, position
from sites.model import keys
from sites.model.durations import parse_duration_s
from sites.model.errors import RevisionCompacted
from sites.registry.client import Registry

__all__ = [
    "DEFAULT_LIMIT",
    "MAX_LIMIT",
    "SCAN_LIMIT",
    "Expired",
    "JobPage",
    "JobQuery",
    "list_page",
    "parse_since",
]

log = logging.getLogger(__name__)

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
SCAN_LIMIT = 5000
"""Most index entries one page reads (count): a filter that matches little costs at most this."""


@dataclass(frozen=True)
class JobQuery:
    """A list's filters: each given one must match (states: any of them)."""

    states: frozenset[JobState] = frozenset()
    tenant: str | None = None
    site: str | None = None
    since: float | None = None
    include_archived: bool = False
    limit: int = DEFAULT_LIMIT

    @property
    def filtered(self) -> bool:
        return bool(self.states) or self.tenant is not None or self.site is not None


@dataclass(frozen=True)
class JobPage:
    """A page: `raw` holds each record's stored JSON as is (the API sends it without decoding
    and encoding it again); `items` decodes them."""

    raw: list[bytes]
    next: str | None = field(default=None)
    revision: int = 0

    @property
    def items(self) -> list[JobRecord]:
        return [decode(r) for r in self.raw]


def parse_since(text: str, now: float) -> float:
    """`since` as unix seconds: an RFC 3339 time or date, unix seconds, or a duration ago."""
    value = text.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise InvalidRequest(f"since {text!r} is not a finite time", field="since")
        return seconds
    try:
        return now - parse_duration_s(value)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequest(
            f"since {text!r} is not a time (RFC 3339, unix seconds) or a duration ago ('24h')",
            field="since",
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


async def list_page(registry: Registry, query: JobQuery, token: str | None = None) -> JobPage:
    """One page of jobs, newest first (see the module docstring)."""
    revision, after = untoken(token) if token else (None, None)
    page_keys = 2000 if query.filtered else min(500, query.limit + 1)
    prefixes = _indexes(query)
    try:
        if revision is None:
            revision = await registry.revision()
        cursors = [
            Cursor(registry, p, after=after, revision=revision, page_keys=page_keys, archived=a)
            for p, a in prefixes
        ]
        try:
            picked, last, more = await _scan(cursors, query)
        finally:
            for cursor in cursors:
                await cursor.close()
        raw = await _records(registry, picked, revision)
    except RevisionCompacted as exc:
        if token is None:
            raise
        raise Expired(
            "this continue token's revision has been compacted: list again from the first page"
        ) from exc
    return JobPage(
        raw=raw,
        next=make_token(revision, last) if more and last is not None else None,
        revision=revision,
    )


def _indexes(query: JobQuery) -> list[tuple[str, bool]]:
    """The indexes a query reads, (prefix, archived): a tenant's own (the others' jobs are not
    even read); with states, only those states' (a finished state's own index, and the live
    one for unfinished states), so a filter that matches few jobs reads few entries. The
    finished states' entries are empty (the key is the match), so a `site` filter, which needs
    the summary, reads the tenant's (or the whole) index instead."""
    tenant = query.tenant
    if not query.states or query.site is not None:  # the state indexes hold no site
        hot, old = (
            (keys.JOB_INDEX, keys.HISTORY_INDEX)
            if tenant is None
            else (keys.tenant_jobs(tenant), keys.tenant_history(tenant))
        )
        return [(hot, False), (old, True)] if query.include_archived else [(hot, False)]
    out = []
    for state in sorted(s for s in query.states if s.terminal):
        out.append((keys.state_jobs(state, tenant), False))
        if query.include_archived:
            out.append((keys.state_jobs(state, tenant, archived=True), True))
    if any(not s.terminal for s in query.states):
        out.append((keys.live_jobs(tenant), False))  # filtered by state as it is read
    return out


async def _scan(
    cursors: list[Cursor], query: JobQuery
) -> tuple[list[tuple[str, bool]], str | None, bool]:
    """Walk the cursors merged in key order: ([(job id, archived)], last suffix, more left).

    Every buffered entry before the smallest `read_to` of the cursors is in order already, so
    it is merged and filtered in one tight loop; then only the cursor holding that bound back
    reads on. An index with nothing near the head (the archived jobs, on a first page) is not
    read further than the others' entries need: each wider window it read costs etcd a count
    of every key in it.
    """
    stop = None if query.since is None else position(query.since) + "/\xff"
    # Entries are compact JSON in one field order (JobSummary.model_dump_json), and tenant,
    # site and state are names (no quote or backslash can occur in them), so a filter is an
    # exact byte match and no entry is parsed: 5,000 entries cost a few milliseconds.
    states = [b'"state":' + json.dumps(s.value).encode() for s in query.states]
    needles = [
        b'"' + name + b'":' + json.dumps(value).encode()
        for name, value in ((b"tenant", query.tenant), (b"site", query.site))
        if value is not None
    ]
    picked: list[tuple[str, bool]] = []
    last: str | None = None
    scanned = 0
    while True:
        reading = [c for c in cursors if not c.done]
        bound = min((c.read_to for c in reading if c.read_to is not None), default=None)
        chunk = [e for c in cursors for e in c.take(bound)]
        if len(cursors) > 1:
            chunk.sort(key=lambda e: e[0])
        if not chunk and not reading:
            return picked, last, False
        if not chunk and stop is not None and bound is not None and bound > stop:
            return picked, last, False  # nothing left before `since`
        for suffix, value, archived in chunk:
            if stop is not None and suffix > stop:
                return picked, last, False
            if len(picked) >= query.limit or scanned >= SCAN_LIMIT:
                return picked, last, True
            scanned += 1
            last = suffix
            if not value or (
                (not states or any(s in value for s in states)) and all(n in value for n in needles)
            ):  # an empty entry is a state index's: its key matched the filter already
                picked.append((suffix.partition("/")[2], archived))
        if reading:
            await min(reading, key=lambda c: c.read_to or "").step()


async def _records(
    registry: Registry, picked: list[tuple[str, bool]], revision: int
) -> list[bytes]:
    """The stored JSON of each picked job, in order (archived ones decompressed)."""
    hot = [keys.job(job_id) for job_id, archived in picked if not archived]
    old = [keys.archived_job(job_id) for job_id, archived in picked if archived]
    got = await registry.get_many(hot, revision=revision) if hot else {}
    if old:
        got.update(await registry.get_many(old, revision=revision))
    out = []
    for job_id, archived in picked:
        raw = got.get(keys.archived_job(job_id) if archived else keys.job(job_id))
        if raw is None:
            continue  # written with its index entry, so only a record deleted by hand
        try:
            out.append(zlib.decompress(raw[0]) if archived else raw[0])
        except zlib.error:
            log.warning("skipping unreadable archived record %s", job_id)
    return out
