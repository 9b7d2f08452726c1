"""GET /v1/alerts: the alerts firing and recently resolved, from the replica's mirror.

Any replica answers (the mirror of /cpn/v1/alerts/, no etcd read per call). Firing first, then
by rule and subject; a page at a time (`limit`, `continue`). Admin, operator and viewer tokens
without a tenant see every alert; a tenant's token sees only the alerts about its tenant
(quota, budget, pending jobs): a site or a link is nobody's tenant, and another tenant's
figures are not its business.
"""

from __future__ import annotations

import bisect
import json

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from broker.api.access import principal
from broker.api.bodies import page_response, query_limit
from broker.api.openapi import CONTINUE, Operation, Param, Reply
from broker.leader.alerts import AlertKeeper
from broker.model.alert_rules import AlertRecord, AlertState, Rule
from broker.model.errors import InvalidRequest

__all__ = ["AlertInfo", "AlertList", "alerts_operations"]

DEFAULT_LIMIT = 500
MAX_LIMIT = 5000


class AlertInfo(BaseModel):
    """One alert as the API shows it: broker.leader.alerts.AlertRecord, with its Alertmanager name
    and fingerprint."""

    rule: Rule
    subject: list[str]
    state: AlertState
    severity: str
    labels: dict[str, str]
    summary: str
    value: float
    starts_at: float = Field(description="unix s it fired")
    ends_at: float | None = Field(description="unix s it resolved; null while firing")
    alertname: str = Field(description="CpnSiteDown, CpnQuotaHigh, ... (the rules file's names)")
    fingerprint: str = Field(description="stable per rule and subject")


class AlertList(BaseModel):
    model_config = ConfigDict(frozen=True, populate_by_name=True)

    items: list[AlertInfo]
    continue_: str | None = Field(
        alias="continue", description="pass as ?continue= for the next page; null on the last"
    )


def _sort_key(record: AlertRecord) -> str:
    return f"{0 if record.state is AlertState.firing else 1}/{record.key}"


async def list_alerts(request: web.Request) -> web.Response:
    from broker.api.keys import BROKER

    keeper: AlertKeeper = request.app[BROKER].alerts
    query = request.query
    limit = query_limit(query, default=DEFAULT_LIMIT, maximum=MAX_LIMIT)
    # given empty is as wrong as any other value that is not one of them (the OpenAPI enum)
    state = query.get("state")
    if state is not None and state not in AlertState.__members__:
        raise InvalidRequest(
            f"state must be one of {', '.join(AlertState)}, got {state!r}", field="state"
        )
    rule = query.get("rule")
    if rule is not None and rule not in Rule.__members__:
        raise InvalidRequest(f"rule must be one of {', '.join(Rule)}, got {rule!r}", field="rule")
    who = principal(request)
    records = sorted(
        (
            r
            for r in keeper.records()
            if (state is None or r.state.value == state)
            and (rule is None or r.rule.value == rule)
            and (who.tenant is None or r.tenant == who.tenant)
        ),
        key=_sort_key,
    )
    order = [_sort_key(r) for r in records]
    after = query.get("continue") or ""
    start = bisect.bisect_right(order, after) if after else 0
    page = records[start : start + limit]
    more = start + limit < len(records)
    rows = [
        json.dumps(
            {**r.model_dump(mode="json"), "alertname": r.alertname, "fingerprint": r.fingerprint}
        ).encode()
        for r in page
    ]
    return page_response(rows, order[start + limit - 1] if more else None)


def alerts_operations() -> list[Operation]:
    return [
        Operation(
            "GET", "/v1/alerts", list_alerts,
            "Alerts firing and recently resolved (a tenant's token: its own tenant's)",
            "list_alerts",
            params=(
                Param("state", "query", "only firing or only resolved alerts",
                      {"type": "string", "enum": [s.value for s in AlertState]}),
                Param("rule", "query", "only this rule's alerts",
                      {"type": "string", "enum": [r.value for r in Rule]}),
                Param("limit", "query", f"at most this many (default {DEFAULT_LIMIT})",
                      {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT}),
                CONTINUE,
            ),
            replies={200: Reply("a page of alerts, firing first", AlertList)},
            errors=(400, 401, 403),
        ),
    ]  # fmt: skip
