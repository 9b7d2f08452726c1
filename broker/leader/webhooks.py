"""Alert notifications on the wire: the Alertmanager webhook body, and one POST of it.

The body is what Alertmanager's webhook receiver sends (version "4"), so receivers written for
Alertmanager work unchanged: one alert per notification, `status` firing or resolved,
`startsAt`/`endsAt` RFC 3339 (endsAt "0001-01-01T00:00:00Z" while firing, as Alertmanager
sends it). cpn adds `notificationId` to the body and the `Idempotency-Key` header: delivery is
at least once (docs/alerts.md), and a receiver dedupes a retry by that key.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import aiohttp

from broker.model.alert_rules import AlertRecord, Webhook

if TYPE_CHECKING:
    from broker.model.alert_rules import AlertRecord

__all__ = ["ZERO_TIME", "Delivery", "body", "post"]

ZERO_TIME = "0001-01-01T00:00:00Z"
IDEMPOTENCY_HEADER = "Idempotency-Key"


def rfc3339(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def body(notification_id: str, alert: AlertRecord, external_url: str) -> dict[str, Any]:
    """The Alertmanager webhook (version 4) body of one notification about `alert`."""
    labels = {"alertname": alert.alertname, "rule": alert.rule, "severity": alert.severity}
    labels.update(alert.labels)
    annotations = {"summary": alert.summary, "value": f"{alert.value:g}"}
    status = alert.state.value
    return {
        "version": "4",
        "groupKey": f"{{}}:{{alertname={alert.alertname!r}}}",
        "truncatedAlerts": 0,
        "status": status,
        "receiver": "cpn",
        "groupLabels": {"alertname": alert.alertname},
        "commonLabels": labels,
        "commonAnnotations": annotations,
        "externalURL": external_url,
        "notificationId": notification_id,
        "alerts": [
            {
                "status": status,
                "labels": labels,
                "annotations": annotations,
                "startsAt": rfc3339(alert.starts_at),
                "endsAt": ZERO_TIME if alert.ends_at is None else rfc3339(alert.ends_at),
                "generatorURL": f"{external_url}/v1/alerts" if external_url else "",
                "fingerprint": alert.fingerprint,
            }
        ],
    }


class Delivery(Exception):
    """A call that did not deliver: no answer, or not 2xx (the message says which)."""


async def post(
    session: aiohttp.ClientSession, hook: Webhook, notification_id: str, payload: dict[str, Any]
) -> int:
    """POST `payload` to `hook`; its 2xx status, else Delivery."""
    headers = {
        **hook.headers,
        "Content-Type": "application/json",
        IDEMPOTENCY_HEADER: notification_id,
    }
    data = json.dumps(payload).encode()
    try:
        async with session.post(
            hook.url,
            data=data,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=hook.timeout_s),
        ) as reply:
            await reply.read()
            if 200 <= reply.status < 300:
                return reply.status
            raise Delivery(f"{hook.name} answered {reply.status}")
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise Delivery(f"{hook.name} unreachable: {type(exc).__name__}: {exc}") from exc
