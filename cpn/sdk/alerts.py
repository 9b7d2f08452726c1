"""Alerts firing and recently resolved, through /v1/alerts (docs/alerts.md): a tenant's token
sees its own tenant's (quota, budget, pending jobs)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from cpn.sdk.models import Alert, AlertPage
from cpn.sdk.transport import Transport, parse

__all__ = ["AsyncAlerts"]

PAGE_SIZE = 500


class AsyncAlerts:
    def __init__(self, transport: Transport) -> None:
        self._t = transport

    async def list(
        self, *, state: str | None = None, rule: str | None = None
    ) -> AsyncIterator[Alert]:
        """Alerts, firing first, then by rule and subject, fetched a page at a time as the
        iteration goes; `state` firing or resolved, `rule` one rule's (site_down, quota, ...)."""
        params = {"limit": str(PAGE_SIZE)}
        if state:
            params["state"] = state
        if rule:
            params["rule"] = rule
        while True:
            page = parse(AlertPage, await self._t.request("GET", "/v1/alerts", params=params))
            for alert in page.items:
                yield alert
            if not page.continue_:
                return
            params["continue"] = page.continue_
