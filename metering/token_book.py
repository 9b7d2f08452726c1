"""Inference tokens per tenant, site, model, client region and day, kept in memory from the
token ledger's day records (metering.tokens.TokenDay at /cpn/v1/usage/tokens/<day>/<tenant>/
<writer>, one per broker replica that served the tenant that day).

Every broker replica holds one `TokenBook` (inside its UsageBook, fed by the same mirror of
/cpn/v1/usage/): a TokenDay becomes one row per (model, site, client region) it sums, decoded
once into numpy columns; put again under its key (each flush rewrites it), its rows are
replaced, so a key is counted once whatever the watch delivers. `query` is a few vector passes
(metering.grouping), no etcd read; `month_to_date` is a dictionary lookup, kept up to date as
records arrive. Memory: days x tenants x writers x rows (model, site, client region) of each,
~100 bytes a row; TokenDays are already a day's sums, so nothing is rolled up (docs/metering.md,
"Inference tokens").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from datetime import UTC, date, datetime

from pydantic import ValidationError

from metering.grouping import Table, UsageRow
from metering.pieces import day_number
from metering.tokens import TokenDay, split_row_key
from sites.model import keys

__all__ = ["TOKEN_DIMENSIONS", "TOKEN_FIELDS", "TokenBook"]

log = logging.getLogger(__name__)

TOKEN_DIMENSIONS = ("tenant", "site", "model", "client_region", "day")
# the figures of a token row, as GET /v1/usage names them (TokenRow's fields, prefixed where a
# job figure could be mistaken for them)
TOKEN_FIELDS = (
    "inference_requests",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "counted_requests",
    "inference_usd",
)
_ROW_FIELDS = (  # TokenRow's, in TOKEN_FIELDS' order
    *("requests", "prompt_tokens", "completion_tokens", "cached_tokens"),
    *("counted_requests", "usd"),
)
_NAMED = ("tenant", "site", "model", "client_region")


class TokenBook:
    """TokenDays as rows of numpy columns: `on_event` per watch event, `query` per API call."""

    def __init__(self, capacity: int = 256) -> None:
        self._clear(capacity)

    def _clear(self, capacity: int) -> None:
        self._table = Table(_NAMED, TOKEN_FIELDS, capacity)  # a row per TokenDay row
        # (tenant, 'YYYY-MM') -> {key: (tokens, usd)} of its records, and their sum: summed
        # again when one changes (a month has days x writers records), never drifting
        self._months: dict[tuple[str, str], dict[str, tuple[int, float]]] = {}
        self._month_sums: dict[tuple[str, str], tuple[int, float]] = {}
        self._key_month: dict[str, tuple[str, str]] = {}

    def __len__(self) -> int:
        return len(self._table)

    # -- fed by a PrefixMirror (on_reset, on_event) ---------------------------------------------

    def on_reset(self, kvs: Iterable[tuple[str, bytes, int]]) -> None:
        """Everything under the prefix again (a re-list): the book is rebuilt from the
        TokenDay keys among `kvs` (others are skipped)."""
        self._clear(max(256, self._table.capacity))
        for key, value, _ in kvs:
            self.apply(key, value)

    def on_event(self, key: str, value: bytes | None, rev: int = 0) -> None:  # noqa: ARG002
        self.apply(key, value)

    def apply(self, key: str, value: bytes | None) -> None:
        """A TokenDay put under `key`, or deleted (value None); other keys are skipped."""
        if not key.startswith(keys.USAGE_TOKENS):
            return
        if value is None:
            self.drop(key)
            return
        try:
            record = TokenDay.model_validate_json(value)
            number = day_number(date.fromisoformat(record.day))
        except (ValidationError, ValueError):
            log.warning("ignoring a malformed token day at %s", key)
            self.drop(key)
            return
        self.add(key, record, number)

    def drop(self, key: str) -> None:
        self._table.drop(key)
        month = self._key_month.pop(key, None)
        if month is not None:
            records = self._months[month]
            del records[key]
            self._sum_month(month)

    def _sum_month(self, month: tuple[str, str]) -> None:
        records = self._months.get(month)
        if not records:
            self._months.pop(month, None)
            self._month_sums.pop(month, None)
            return
        self._month_sums[month] = (
            sum(t for t, _ in records.values()),
            sum(u for _, u in records.values()),
        )

    def add(self, key: str, record: TokenDay, number: int) -> None:
        """`record` (of UTC day `number`) under `key`, replacing what the key held."""
        self.drop(key)
        rows = []
        tokens, usd = 0, 0.0
        for name, sums in record.rows.items():
            try:
                model, site, region = split_row_key(name)
            except ValueError:
                log.warning("ignoring token row %r of %s: not model|site|region", name, key)
                continue
            names = (record.tenant, site, model, region)
            rows.append((number, names, [float(getattr(sums, f)) for f in _ROW_FIELDS]))
            tokens += sums.prompt_tokens + sums.completion_tokens
            usd += sums.usd
        self._table.put(key, rows)
        month = (record.tenant, record.day[:7])
        self._key_month[key] = month
        self._months.setdefault(month, {})[key] = (tokens, usd)
        self._sum_month(month)

    # -- read -----------------------------------------------------------------------------------

    def month_to_date(self, tenant: str, now: float) -> tuple[int, float]:
        """(prompt + completion tokens, USD) of `tenant` in the UTC month of `now`, every
        replica's records together: O(1)."""
        month = datetime.fromtimestamp(now, UTC).strftime("%Y-%m")
        return self._month_sums.get((tenant, month), (0, 0.0))

    def query(
        self,
        *,
        first_day: int,
        last_day: int,
        tenant: str | None = None,
        site: str | None = None,
        by: Sequence[str] = ("tenant",),
    ) -> list[UsageRow]:
        """TOKEN_FIELDS summed per group of `by` (TOKEN_DIMENSIONS), days first..last."""
        return self._table.query(
            first_day=first_day, last_day=last_day, tenant=tenant, site=site, by=by
        )
