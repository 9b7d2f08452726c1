"""Usage per tenant, site, model and day, kept in memory from the ledger's segments.

Every broker replica holds one `UsageBook`, fed by a mirror of /cpn/v1/usage/ (list once, then
the watch): its segments, and the rollups of closed days (metering.rollup), whose rows are
added as they are; a segment becomes one row per UTC day it overlaps, its time-bound
figures shared out by the hours in each day (egress and the segment count go to the day it
ended). The rows are numpy columns, so `query` is a few vector passes over them whatever the
filters: no etcd read at all, and ~10 ms for a year of 100,000 segments (bench/usage_ledger.py).
A segment put again under its key (a re-list, a repeated write) replaces its rows: a key is
counted once, whatever the watch delivers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime

from pydantic import ValidationError

from metering.grouping import Table, UsageRow
from metering.ledger import Segment
from metering.pieces import DAY_S, FIELDS, billed_model, day_number, pieces
from metering.rollup import Rollup
from metering.token_book import TOKEN_DIMENSIONS, TOKEN_FIELDS, TokenBook
from sites.model import keys

__all__ = [
    "DIMENSIONS",
    "JOB_CLIENT_REGION",
    "REPORT_DIMENSIONS",
    "REPORT_FIELDS",
    "UsageBook",
    "UsageRow",
    "report",
]

log = logging.getLogger(__name__)

DIMENSIONS = ("tenant", "site", "model", "day")  # of the jobs' rows (`query`)
# of a report (`report`): jobs' and inference tokens' rows together; `model` is what was
# billed: a job's accelerator model ('cpu': none), a request's served inference model
REPORT_DIMENSIONS = TOKEN_DIMENSIONS
JOB_CLIENT_REGION = ""  # a job's rows have no client region
# jobs' figures (total_usd: the jobs' cost), the tokens', then charge_usd: both costs
REPORT_FIELDS = (*FIELDS, *TOKEN_FIELDS, "charge_usd")


class UsageBook:
    """Segments as rows of numpy columns; `apply` per watch event, `query` per API call."""

    def __init__(self, capacity: int = 1024) -> None:
        self.tokens = TokenBook()  # the inference tokens' day records under the same prefix
        self._clear(capacity)

    def _clear(self, capacity: int) -> None:
        # a row per segment (or rollup row) and day, under the segment's or rollup's key
        self._table = Table(("tenant", "site", "model"), FIELDS, capacity)
        self.earliest: float | None = None  # the first segment's start, unix s

    def __len__(self) -> int:
        return len(self._table)

    def reset(self, kvs: Iterable[tuple[str, bytes, int]]) -> None:
        """Everything under the prefix again (a re-list): the book is rebuilt from it."""
        self._clear(max(1024, self._table.capacity))
        self.tokens.on_reset(())
        for key, value, _ in kvs:
            self.apply(key, value)

    def apply(self, key: str, value: bytes | None) -> None:
        """A segment, a rollup (metering.rollup) or a token day (metering.token_book) put
        under `key`, or deleted (value None)."""
        if key.startswith(keys.USAGE_TOKENS):
            self.tokens.apply(key, value)
            return
        self._table.drop(key)
        if value is None:
            return
        try:
            if key.startswith(keys.USAGE_ROLLUPS):
                self.add_rollup(key, Rollup.model_validate_json(value))
            else:
                self.add(key, Segment.model_validate_json(value))
        except ValidationError:
            log.warning("ignoring a malformed usage record at %s", key)

    def add(self, key: str, segment: Segment) -> None:
        group = (segment.tenant, segment.site, billed_model(segment))
        self._table.put(key, [(day, group, figures) for day, figures in pieces(segment)])
        if self.earliest is None or segment.start < self.earliest:
            self.earliest = segment.start

    def add_rollup(self, key: str, rollup: Rollup) -> None:
        self._table.put(key, [(r.day, (r.tenant, r.site, r.model), r.figures) for r in rollup.rows])
        if rollup.rows:
            start = float(min(r.day for r in rollup.rows) * DAY_S)
            if self.earliest is None or start < self.earliest:
                self.earliest = start

    def query(
        self,
        *,
        first_day: int,
        last_day: int,
        tenant: str | None = None,
        site: str | None = None,
        by: Sequence[str] = ("tenant",),
    ) -> list[UsageRow]:
        """The figures summed per group of `by` (DIMENSIONS), for days first..last inclusive."""
        return self._table.query(
            first_day=first_day, last_day=last_day, tenant=tenant, site=site, by=by
        )


def today(now: float) -> int:
    return day_number(datetime.fromtimestamp(now, UTC).date())


def _combine(
    jobs: Sequence[UsageRow], tokens: Sequence[UsageRow], by: Sequence[str]
) -> list[UsageRow]:
    merged: dict[tuple[str, ...], dict[str, float]] = {}
    for rows in (jobs, tokens):
        for row in rows:
            group = tuple(row.group.get(d, JOB_CLIENT_REGION) for d in by)
            figures = merged.setdefault(group, dict.fromkeys(REPORT_FIELDS, 0.0))
            for name, value in row.figures.items():
                figures[name] += value
    out = []
    for group, figures in sorted(merged.items()):
        figures["charge_usd"] = figures["total_usd"] + figures["inference_usd"]
        out.append(UsageRow(group=dict(zip(by, group, strict=True)), figures=figures))
    return out


def report(
    book: UsageBook,
    *,
    first_day: int,
    last_day: int,
    tenant: str | None = None,
    site: str | None = None,
    by: Sequence[str] = ("tenant",),
) -> list[UsageRow]:
    """Jobs' and inference tokens' figures (REPORT_FIELDS) per group of `by`
    (REPORT_DIMENSIONS), days first..last: a group's job figures and token figures side by
    side; by client_region, the jobs' rows are under JOB_CLIENT_REGION."""
    job_by = tuple(d for d in by if d != "client_region") or ("tenant",)
    jobs = book.query(first_day=first_day, last_day=last_day, tenant=tenant, site=site, by=job_by)
    tokens = book.tokens.query(
        first_day=first_day, last_day=last_day, tenant=tenant, site=site, by=by
    )
    return _combine(jobs, tokens, by)
