"""`cpn services`, `cpn service apply FILE`, `cpn service describe|delete NAME`: managed
inference services (docs/services.md), through the Python SDK (cpn.sdk, docs/sdk.md) over
/v1/services.

A file that is not a YAML mapping with a `name` exits 2 with one line; the broker's refusal of
a field (HTTP 4xx) exits 2 with its message and the field it names.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sites.model.config import read_yaml

if TYPE_CHECKING:
    from cpn.sdk.client import AsyncClient

__all__ = ["add_parsers", "describe_service"]


class ServiceFileError(ValueError):
    """A service file the CLI cannot send (cpn.cli.main exits 2 with one line)."""


def _name_of(path: str) -> str:
    data = read_yaml(Path(path))  # ConfigFileError: exit 2 with one line
    if not isinstance(data, dict):
        raise ServiceFileError(f"{path}: expected a mapping of service fields")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ServiceFileError(f"{path}: field name: a service file needs a name")
    return name


async def cmd_apply(args: argparse.Namespace) -> int:
    _name_of(args.file)  # a mapping with a name, or exit 2 naming the file
    text = Path(args.file).read_text()
    async with _client(args) as client:
        view = (await client.services.apply(text)).model_dump(mode="json")
    if args.output == "json":
        print(json.dumps(view, indent=2))
    else:
        print(f"service {view['name']} applied (generation {view['generation']})")
    return 0


async def cmd_list(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        listed = client.services.list(tenant=args.tenant or None)
        items = [s.model_dump(mode="json") async for s in listed]
    if args.output == "json":
        print(json.dumps(items, indent=2))
        return 0
    rows = [("NAME", "TENANT", "MODEL", "READY", "MIN-MAX", "STATE")]
    for s in items:
        state = "deleting" if s.get("deleting") else "active"
        replicas = f"{s['min_replicas']}-{s['max_replicas']}"
        rows.append((s["name"], s["tenant"], s["model"], str(s["ready"]), replicas, state))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0


def _ago(at: float, now: float) -> str:
    return f"{max(0.0, now - at):.0f}s ago"


def describe_service(view: dict[str, Any], now: float | None = None) -> str:
    """`cpn service describe`'s text."""
    now = time.time() if now is None else now
    spec = view["spec"]
    lines = [
        f"service {view['name']}  tenant {view['tenant']}  model {view['model']}  "
        f"generation {view['generation']}" + ("  DELETING" if view["deleting"] else ""),
        f"  replicas {spec['min_replicas']}..{spec['max_replicas']}  "
        f"slo p95 {spec['slo']['p95_ms']:g} ms  "
        f"target {spec['scaling']['target_qps_per_replica']:g} qps/replica",
        "regions (client region: desired / actual / ready):",
    ]
    for r in view["regions"]:
        region = "any" if r["region"] == "*" else r["region"]
        lines.append(f"  {region:<16} {r['desired']} / {r['actual']} / {r['ready']}")
    if not view["regions"]:
        lines.append("  none")
    lines.append("replicas:")
    for r in view["replicas"]:
        where = r["site"] or "-"
        lines.append(
            f"  {r['job']:<24} {r['state']:<9} site {where:<14} for {r['region']:<12} "
            f"gen {r.get('generation') or '-'}  {r['job_state'] or '-'}"
            + (f"  {r['reason']}" if r["state"] == "pending" else "")
        )
    if not view["replicas"]:
        lines.append("  none")
    decision = view.get("decision")
    if decision:
        lines.append(
            f"last decision ({decision['by']}, {_ago(decision['at'], now)}): "
            f"{json.dumps(decision['replicas'])} {decision['reason']}"
        )
    lines.append("events (newest first):")
    for e in view["events"][:10]:
        lines.append(f"  {_ago(e['at'], now):>8}  {e['type']:<12} {e['message']}")
    return "\n".join(lines)


async def cmd_describe(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        view = (await client.services.get(args.name)).model_dump(mode="json")
    print(json.dumps(view, indent=2) if args.output == "json" else describe_service(view))
    return 0


async def cmd_delete(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        view = (await client.services.delete(args.name)).model_dump(mode="json")
    if args.output == "json":
        print(json.dumps(view, indent=2))
    else:
        live = sum(r["state"] != "draining" for r in view["replicas"])
        print(f"service {view['name']} deleted: its {live} replica(s) drain and stop")
    return 0


def _client(args: argparse.Namespace) -> AsyncClient:
    """The SDK's client of --broker (else what cpn.config finds), imported when a command
    runs, not when `cpn --help` builds the parsers."""
    from cpn.sdk.client import AsyncClient

    return AsyncClient(args.broker, timeout_s=None)


def add_parsers(
    add: Callable[..., argparse.ArgumentParser],
    broker_arg: Callable[[argparse.ArgumentParser], None],
) -> None:
    """`cpn services` and `cpn service ...`, added with cpn.cli's `add` and `broker_arg`."""
    services = add("services", help="managed inference services (docs/services.md)")
    services.add_argument("--tenant", help="only this tenant's")
    broker_arg(services)
    services.set_defaults(func=cmd_list)

    service = add("service", help="apply, describe or delete a managed inference service")
    sub = service.add_subparsers(dest="service_command", required=True)
    apply = sub.add_parser("apply", help="create or update a service from its YAML file")
    apply.add_argument("file", metavar="FILE")
    broker_arg(apply)
    apply.set_defaults(func=cmd_apply)
    describe = sub.add_parser(
        "describe", help="desired and actual replicas per region, each replica, the events"
    )
    describe.add_argument("name", metavar="NAME")
    broker_arg(describe)
    describe.set_defaults(func=cmd_describe)
    delete = sub.add_parser("delete", help="drain and stop its replicas, then remove it")
    delete.add_argument("name", metavar="NAME")
    broker_arg(delete)
    delete.set_defaults(func=cmd_delete)
