"""What a tenant used and what it cost, through /v1/usage (docs/metering.md)."""

from __future__ import annotations

from datetime import date

from cpn.sdk.models import UsageReport
from cpn.sdk.transport import Transport, parse

__all__ = ["AsyncUsage"]


class AsyncUsage:
    def __init__(self, transport: Transport) -> None:
        self._t = transport

    async def get(
        self,
        *,
        tenant: str | None = None,
        site: str | None = None,
        from_: date | str | None = None,
        to: date | str | None = None,
        by: str | tuple[str, ...] | list[str] = ("tenant",),
    ) -> UsageReport:
        """Usage, cost, energy, carbon and inference tokens per group (`by`: tenant, site,
        model, client_region, day) over UTC days `from_`..`to` (default: the last 30)."""
        params: dict[str, str] = {}
        if tenant:
            params["tenant"] = tenant
        if site:
            params["site"] = site
        if from_ is not None:
            params["from"] = from_.isoformat() if isinstance(from_, date) else from_
        if to is not None:
            params["to"] = to.isoformat() if isinstance(to, date) else to
        params["by"] = by if isinstance(by, str) else ",".join(by)
        return parse(UsageReport, await self._t.request("GET", "/v1/usage", params=params))
