"""GET /v1/usage: the ledger summed per tenant, site, model, client region or day: the jobs'
figures and the inference tokens' side by side, with idle capacity cost.

Answered from the replica's in-memory UsageBook (metering.usage) and its TokenBook
(metering.token_book), kept by a watch on /cpn/v1/usage/: no etcd read per call. A
tenant-scoped token sees its own tenant only (asking for another is 403, field tenant); idle
cost, which is about whole sites, is shown to tokens without a tenant only.
"""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, date, datetime
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from broker.api.access import principal
from broker.api.openapi import Operation, Param, Reply
from broker.model.errors import InvalidRequest
from broker.model.jobs import NAME_RE
from broker.state.auth import Forbidden
from metering.pieces import day_number
from metering.usage import REPORT_DIMENSIONS as DIMENSIONS
from metering.usage import REPORT_FIELDS, UsageBook
from metering.usage import report as usage_report
from sites.model.snapshot import Snapshot

__all__ = ["UsageQuery", "UsageReport", "idle_costs", "parse_query", "usage_operations"]

MAX_DAYS = 3660
DEFAULT_DAYS = 30
SYNC_WAIT_S = 10.0
_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_SITE_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_MONEY = ("gpu_usd", "cpu_usd", "mem_usd")
_DATE = {"type": "string", "format": "date"}
# parse_query's `by`: names between commas, blanks around them and empty parts skipped
_DIMENSION = "(" + "|".join(DIMENSIONS) + ")"
_BY_PATTERN = rf"^[\s,]*{_DIMENSION}(\s*,[\s,]*{_DIMENSION})*[\s,]*$"


def _or_empty(pattern: str) -> dict[str, str]:
    """A string parameter matching `pattern`, or empty (taken as absent)."""
    return {"type": "string", "pattern": f"^$|{pattern}"}


class UsageQuery(BaseModel):
    model_config = ConfigDict(frozen=True)

    first: date
    last: date
    tenant: str | None = None
    site: str | None = None
    by: tuple[str, ...] = ("tenant",)


class IdleCost(BaseModel):
    """A site's capacity at list price over the window, what the ledger billed there, and the
    difference: the cost of capacity nobody used."""

    model_config = ConfigDict(frozen=True)

    site: str
    hours: float
    capacity_usd: float
    used_usd: float
    idle_usd: float


class UsageReport(BaseModel):
    model_config = ConfigDict(frozen=True, populate_by_name=True)

    from_: str = Field(alias="from", description="first UTC day, YYYY-MM-DD")
    to: str = Field(description="last UTC day, YYYY-MM-DD (inclusive)")
    tenant: str | None
    site: str | None
    by: list[str]
    fields: list[str] = Field(
        description="the figures of every item, in base units: the jobs' (total_usd: their "
        "cost), the inference tokens' (inference_requests, prompt_tokens, completion_tokens, "
        "cached_tokens: a part of prompt_tokens, counted_requests, inference_usd), and "
        "charge_usd = total_usd + inference_usd"
    )
    items: list[dict[str, Any]] = Field(description="one per group: its dimensions, figures")
    total: dict[str, float] = Field(description="every figure summed over the items")
    idle: list[IdleCost] | None = Field(
        description="per site; null for a tenant's token (it is about the whole site)"
    )


def _day(value: str, field: str) -> date:
    if not _DATE_RE.match(value):
        raise InvalidRequest(f"{field} must be a date YYYY-MM-DD, got {value!r}", field=field)
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise InvalidRequest(f"{field} is not a real date: {value!r}", field=field) from None


def parse_query(params: dict[str, str], today: date) -> UsageQuery:
    """The query's parameters, checked; each error names its parameter."""
    unknown = sorted(set(params) - {"tenant", "site", "from", "to", "by"})
    if unknown:
        raise InvalidRequest(f"unknown parameter {unknown[0]!r}", field=unknown[0])
    last = _day(params["to"], "to") if "to" in params else today
    # the default window stops at the calendar's first day (date.min), not past it (a 500)
    default_first = date.fromordinal(max(1, last.toordinal() - (DEFAULT_DAYS - 1)))
    first = _day(params["from"], "from") if "from" in params else default_first
    if first > last:
        raise InvalidRequest(f"from ({first}) is after to ({last})", field="from")
    if (last - first).days + 1 > MAX_DAYS:
        raise InvalidRequest(f"at most {MAX_DAYS} days at once", field="from")
    tenant = params.get("tenant") or None
    if tenant is not None and not re.match(NAME_RE, tenant):
        raise InvalidRequest(f"{tenant!r} is not a tenant name", field="tenant")
    site = params.get("site") or None
    if site is not None and not _SITE_RE.match(site):
        raise InvalidRequest(f"{site!r} is not a site id", field="site")
    by = tuple(part.strip() for part in params.get("by", "tenant").split(",") if part.strip())
    if not by:
        raise InvalidRequest("by names at least one of " + ", ".join(DIMENSIONS), field="by")
    for dim in by:
        if dim not in DIMENSIONS:
            raise InvalidRequest(
                f"cannot group by {dim!r} (one or more of {', '.join(DIMENSIONS)})", field="by"
            )
    if len(set(by)) != len(by):
        raise InvalidRequest("by names a dimension twice", field="by")
    return UsageQuery(first=first, last=last, tenant=tenant, site=site, by=by)


def idle_costs(book: UsageBook, sites: Snapshot, query: UsageQuery, now: float) -> list[IdleCost]:
    """Per site in `sites`: capacity x list price over the window (from the first metered
    run, up to now), minus what the ledger billed there for devices, cores and memory."""
    start = datetime.combine(query.first, datetime.min.time(), UTC).timestamp()
    # the last day's end, as seconds: its next midnight may be past the calendar (9999-12-31)
    end = datetime.combine(query.last, datetime.min.time(), UTC).timestamp() + 86400.0
    if book.earliest is not None:
        start = max(start, book.earliest)
    end = min(end, now)
    hours = max(0.0, end - start) / 3600
    used = {
        row.group["site"]: sum(row.figures[name] for name in _MONEY)
        for row in book.query(
            first_day=day_number(query.first), last_day=day_number(query.last), by=("site",)
        )
    }
    out = []
    for site_id, spec in sorted(sites.specs.items()):
        if query.site is not None and site_id != query.site:
            continue
        p, inv = spec.prices, spec.inventory
        hourly = inv.cpu_cores * p.usd_per_core_hour + inv.mem_gb * p.usd_per_gb_mem_hour
        hourly += sum(pool.count * p.usd_per_gpu_hour.get(pool.model, 0.0) for pool in inv.devices)
        capacity = hourly * hours
        spent = used.get(site_id, 0.0)
        out.append(
            IdleCost(
                site=site_id,
                hours=round(hours, 6),
                capacity_usd=capacity,
                used_usd=spent,
                idle_usd=max(0.0, capacity - spent),
            )
        )
    return out


def report(book: UsageBook, sites: Snapshot | None, query: UsageQuery, now: float) -> UsageReport:
    rows = usage_report(
        book,
        first_day=day_number(query.first),
        last_day=day_number(query.last),
        tenant=query.tenant,
        site=query.site,
        by=query.by,
    )
    total = dict.fromkeys(REPORT_FIELDS, 0.0)
    for row in rows:
        for name, value in row.figures.items():
            total[name] += value
    return UsageReport(
        from_=query.first.isoformat(),
        to=query.last.isoformat(),
        tenant=query.tenant,
        site=query.site,
        by=list(query.by),
        fields=list(REPORT_FIELDS),
        items=[{**row.group, **row.figures} for row in rows],
        total=total,
        idle=None if sites is None else idle_costs(book, sites, query, now),
    )


async def usage(request: web.Request) -> web.Response:
    from broker.api.keys import BROKER

    broker = request.app[BROKER]
    now = broker.clock.time()
    query = parse_query(dict(request.query), datetime.fromtimestamp(now, UTC).date())
    who = principal(request)
    if who.tenant is not None:
        if query.tenant is not None and query.tenant != who.tenant:
            raise Forbidden(
                f"a {who.role.value} token of tenant {who.tenant} sees its own usage only, "
                f"not {query.tenant}'s",
                field="tenant",
            )
        query = query.model_copy(update={"tenant": who.tenant})
    try:
        await asyncio.wait_for(broker.usage_mirror.synced.wait(), SYNC_WAIT_S)
    except TimeoutError:
        body = {"error": {"code": "unavailable", "message": "usage is loading", "field": None}}
        return web.json_response(body, status=503)
    sites = broker.view().sites if who.tenant is None else None
    answer = report(broker.usage, sites, query, now)
    return web.json_response(answer.model_dump(mode="json", by_alias=True))


def usage_operations() -> list[Operation]:
    return [
        Operation(
            "GET", "/v1/usage", usage, "Usage, cost, energy, carbon and inference tokens per "
            "tenant, site, model, client region or day (the ledger)", "usage",
            params=(
                Param("tenant", "query", "only this tenant (a tenant's token: its own); "
                      "empty: every tenant", _or_empty(NAME_RE)),
                Param("site", "query", "only this site; empty: every site",
                      _or_empty(_SITE_RE.pattern)),
                Param("from", "query", "first UTC day, YYYY-MM-DD (default: 30 days to `to`); "
                      f"not after `to`, at most {MAX_DAYS} days before it (not expressible in "
                      "JSON Schema: a 400 names from otherwise)", _DATE),
                Param("to", "query", "last UTC day, YYYY-MM-DD, inclusive (default: today)",
                      _DATE),
                Param("by", "query", "group by one or more of tenant, site, model, "
                      "client_region, day (comma-separated; default tenant), each once (a "
                      "name twice is a 400, not expressible in JSON Schema); model: a job's "
                      "accelerator model, an inference request's served model",
                      {"type": "string", "pattern": _BY_PATTERN}),
            ),
            replies={200: Reply("the figures per group, their total, idle cost", UsageReport)},
            errors=(400, 401, 403, 503),
        ),
    ]  # fmt: skip
