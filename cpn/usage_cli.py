"""`cpn usage [chargeback]`, `cpn alerts [rules]`: what the federation used, cost and emitted
(GET /v1/usage; a month's chargeback CSV and PNG by metering.chargeback; docs/metering.md),
and the alerts firing and resolved lately (GET /v1/alerts; the rules as a Prometheus file;
docs/alerts.md). The broker is asked through the Python SDK (cpn.sdk, docs/sdk.md).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from cpn import render
from cpn.cli_base import BrokerArg, UsageError
from sites.kits.clock import SystemClock
from sites.model.config import config_dir

__all__ = ["add_parsers", "cmd_alerts", "cmd_usage"]


async def cmd_usage(args: argparse.Namespace) -> int:
    """`cpn usage`: the ledger summed (GET /v1/usage); `cpn usage chargeback`: a month's
    chargeback CSV and PNG (metering.chargeback)."""
    from metering import chargeback

    window = {"from": getattr(args, "from_", None), "to": getattr(args, "to", None)}
    by = getattr(args, "by", None) or "tenant"
    if args.usage_command == "chargeback":
        if args.month is None:
            raise UsageError("cpn usage chargeback needs --month YYYY-MM")
        first, last = chargeback.month_range(args.month)
        window = {"from": first.isoformat(), "to": last.isoformat()}
        by = chargeback.CHARGEBACK_BY
    from cpn.sdk.client import AsyncClient  # here: `cpn --help` does without the SDK's models

    async with AsyncClient(args.broker, timeout_s=None) as client:
        answer = await client.usage.get(
            tenant=args.tenant or None,
            site=args.site or None,
            from_=window["from"] or None,
            to=window["to"] or None,
            by=by,
        )
    report = answer.model_dump(mode="json", by_alias=True)
    if args.usage_command == "chargeback":
        for path in chargeback.chargeback(report, args.month, Path(args.out)):
            print(path)
    elif args.output == "json":
        print(json.dumps(report, indent=2))
    elif args.output == "csv":
        print(chargeback.to_csv(report), end="")
    else:
        print(chargeback.to_table(report))
    return 0


async def cmd_alerts(args: argparse.Namespace) -> int:
    """`cpn alerts`: firing and recently resolved alerts (GET /v1/alerts); `cpn alerts rules`:
    the same rules as a Prometheus alerting-rules file, from configs/broker.yaml."""
    if args.alerts_command == "rules":
        from broker.leader.alert_export import rules_yaml
        from broker.placement.settings import load_settings

        where = Path(args.config_dir) if args.config_dir else config_dir()
        print(rules_yaml(load_settings(where / "broker.yaml").alerts), end="")
        return 0
    from cpn.sdk.client import AsyncClient

    async with AsyncClient(args.broker, timeout_s=None) as client:
        listed = client.alerts.list(state=args.state or None)
        rows = [alert.model_dump(mode="json") async for alert in listed]
    if args.output == "json":
        print(json.dumps(rows, indent=2))
        return 0
    now = SystemClock().time()
    print(
        render.table(
            ("STATE", "ALERT", "SEVERITY", "SUBJECT", "SINCE", "SUMMARY"),
            [
                (
                    r["state"],
                    r["alertname"],
                    r["severity"],
                    "/".join(r["subject"]),
                    render.ago(now - (r["ends_at"] or r["starts_at"])),
                    r["summary"],
                )
                for r in rows
            ],
        )
    )
    return 0


def add_parsers(add: Callable[..., argparse.ArgumentParser], broker_arg: BrokerArg) -> None:
    """`cpn usage` and `cpn alerts`, added with cpn.cli's `add` and `broker_arg`."""
    usage = add("usage", help="usage, cost, energy, carbon and inference tokens (docs/metering.md)")
    usage.add_argument("--tenant", help="only this tenant (a tenant's token: its own)")
    usage.add_argument("--site", help="only this site")
    usage.add_argument("--from", dest="from_", metavar="DATE", help="first UTC day, YYYY-MM-DD")
    usage.add_argument("--to", metavar="DATE", help="last UTC day, YYYY-MM-DD (inclusive)")
    usage.add_argument(
        "--by",
        metavar="DIM[,DIM]",
        help="group by tenant, site, model, client_region, day (default tenant); model: a "
        "job's accelerator, an inference request's model (token columns shown when any)",
    )
    usage.add_argument("--month", metavar="YYYY-MM", help="chargeback: the month")
    usage.add_argument("--out", default=".", metavar="DIR", help="chargeback: where to write")
    usage.add_argument(
        "usage_command", nargs="?", choices=("chargeback",), help="chargeback: a month's CSV+PNG"
    )
    broker_arg(usage, ("table", "csv", "json"))
    usage.set_defaults(func=cmd_usage)

    alerts = add("alerts", help="alerts firing and resolved lately (docs/alerts.md)")
    alerts.add_argument("--state", choices=("firing", "resolved"), help="only these")
    alerts.add_argument("--config-dir", metavar="DIR", help="rules: the configs/ directory")
    alerts.add_argument(
        "alerts_command", nargs="?", choices=("rules",), help="rules: a Prometheus rules file"
    )
    broker_arg(alerts)
    alerts.set_defaults(func=cmd_alerts)
