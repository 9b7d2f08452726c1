"""Usage reports as a person or a finance system reads them: a table, CSV, and the monthly
chargeback (a CSV per tenant, site, model, client region and day, the idle capacity cost per
site apart, and a PNG chart of both). Input: the JSON of GET /v1/usage
(broker.api.usage.UsageReport).

A row carries the jobs' figures and the inference tokens' side by side (`model` is a job's
accelerator model or a request's inference model; a job's client region is empty); the CSV
always has every column, the table shows the token columns when the window has any inference
request.
"""

from __future__ import annotations

import csv
import io
import re
from calendar import monthrange
from collections.abc import Mapping, Sequence
from datetime import date
from pathlib import Path
from typing import Any

__all__ = ["CHARGEBACK_BY", "COLUMNS", "chargeback", "month_range", "to_csv", "to_table"]

# (column, field, divisor): hours for a person, the ledger keeps seconds
COLUMNS: tuple[tuple[str, str, float], ...] = (
    ("gpu_hours", "gpu_s", 3600.0),
    ("cpu_core_hours", "cpu_core_s", 3600.0),
    ("mem_gb_hours", "mem_gb_s", 3600.0),
    ("gpu_usd", "gpu_usd", 1.0),
    ("cpu_usd", "cpu_usd", 1.0),
    ("mem_usd", "mem_usd", 1.0),
    ("egress_gb", "egress_gb", 1.0),
    ("egress_usd", "egress_usd", 1.0),
    ("total_usd", "total_usd", 1.0),
    ("energy_kwh", "energy_kwh", 1.0),
    ("co2_kg", "co2_kg", 1.0),
    ("segments", "segments", 1.0),
    # inference tokens (metering.token_book); cached_tokens is a part of prompt_tokens
    ("prompt_tokens", "prompt_tokens", 1.0),
    ("completion_tokens", "completion_tokens", 1.0),
    ("cached_tokens", "cached_tokens", 1.0),
    ("inference_requests", "inference_requests", 1.0),
    ("counted_requests", "counted_requests", 1.0),
    ("inference_usd", "inference_usd", 1.0),
    # what the tenant is charged: total_usd (jobs) + inference_usd
    ("charge_usd", "charge_usd", 1.0),
)
_COUNTS = frozenset(
    {"segments", "prompt_tokens", "completion_tokens", "cached_tokens"}
    | {"inference_requests", "counted_requests"}
)
# CHARGEBACK_BY: the monthly chargeback's rows
CHARGEBACK_BY = "tenant,site,model,client_region,day"
_TABLE = (
    "gpu_hours",
    "cpu_core_hours",
    "egress_gb",
    "egress_usd",
    "total_usd",
    "energy_kwh",
    "co2_kg",
)
# (header, column) of the token columns, shown when the window has inference requests
_TOKEN_TABLE = (
    ("prompt", "prompt_tokens"),
    ("completion", "completion_tokens"),
    ("cached", "cached_tokens"),
    ("requests", "inference_requests"),
    ("inference_usd", "inference_usd"),
    ("charge_usd", "charge_usd"),
)
_MONTH_RE = re.compile(r"^(\d{4})-(\d{2})$")


def month_range(month: str) -> tuple[date, date]:
    """'2026-11' -> (2026-11-01, 2026-11-30); ValueError naming the month otherwise."""
    match = _MONTH_RE.match(month)
    if not match or not 1 <= int(match[2]) <= 12:
        raise ValueError(f"--month must be YYYY-MM, got {month!r}")
    year, mon = int(match[1]), int(match[2])
    return date(year, mon, 1), date(year, mon, monthrange(year, mon)[1])


def _row(item: Mapping[str, Any], by: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {dim: item[dim] for dim in by}
    for column, name, divisor in COLUMNS:
        value = float(item.get(name, 0.0)) / divisor
        out[column] = int(round(value)) if column in _COUNTS else round(value, 6)
    return out


def to_csv(report: Mapping[str, Any]) -> str:
    by = list(report["by"])
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, [*by, *(c for c, _, _ in COLUMNS)], lineterminator="\n")
    writer.writeheader()
    for item in report["items"]:
        writer.writerow(_row(item, by))
    return buffer.getvalue()


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def _cell(row: Mapping[str, Any], column: str) -> str:
    value = row[column]
    return str(value) if column in _COUNTS else f"{value:.2f}"


def to_table(report: Mapping[str, Any]) -> str:
    by = list(report["by"])
    total = _row(report["total"], [])
    columns = list(_TABLE)
    header = [*by, *_TABLE]
    if total["inference_requests"]:
        columns += [c for _, c in _TOKEN_TABLE]
        header += [h for h, _ in _TOKEN_TABLE]
    rows = []
    for item in report["items"]:
        row = _row(item, by)
        rows.append([str(row[d]) or "-" for d in by] + [_cell(row, c) for c in columns])
    rows.append(["TOTAL", *([""] * (len(by) - 1)), *(_cell(total, c) for c in columns)])
    text = f"usage {report['from']} .. {report['to']}"
    if report.get("tenant"):
        text += f", tenant {report['tenant']}"
    text += "\n" + _table(header, rows)
    idle = report.get("idle")
    if idle:
        text += "\n\nidle capacity (capacity x list price - used)\n" + _table(
            ["site", "hours", "capacity_usd", "used_usd", "idle_usd"],
            [
                [
                    i["site"],
                    f"{i['hours']:.1f}",
                    f"{i['capacity_usd']:.2f}",
                    f"{i['used_usd']:.2f}",
                    f"{i['idle_usd']:.2f}",
                ]
                for i in idle
            ],
        )
    return text


def chargeback(report: Mapping[str, Any], month: str, out_dir: Path) -> list[Path]:
    """Write chargeback-<month>.csv (per tenant, site, model, client region and day: jobs and
    inference tokens), idle-<month>.csv (per site) and chargeback-<month>.png (what each
    tenant is charged, jobs and tokens, stacked by site; idle cost per site) in out_dir.
    `report` is GET /v1/usage by=CHARGEBACK_BY (or any grouping with tenant and site) over
    the month."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    csv_path = out_dir / f"chargeback-{month}.csv"
    csv_path.write_text(to_csv(report))
    written.append(csv_path)
    idle = report.get("idle") or []
    if report.get("idle") is not None:
        idle_path = out_dir / f"idle-{month}.csv"
        buffer = io.StringIO()
        fields = ["site", "hours", "capacity_usd", "used_usd", "idle_usd"]
        writer = csv.DictWriter(buffer, fields, lineterminator="\n")
        writer.writeheader()
        for entry in idle:
            writer.writerow({f: entry[f] for f in fields})
        idle_path.write_text(buffer.getvalue())
        written.append(idle_path)

    cost: dict[str, dict[str, float]] = {}
    for item in report["items"]:
        per_site = cost.setdefault(item["tenant"], {})
        per_site[item["site"]] = per_site.get(item["site"], 0.0) + float(
            item.get("charge_usd", item["total_usd"])
        )
    tenants = sorted(cost)
    sites = sorted({s for per in cost.values() for s in per})
    fig, axes = plt.subplots(1, 2 if idle else 1, figsize=(12 if idle else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    left = [0.0] * len(tenants)
    for site in sites:
        values = [cost[t].get(site, 0.0) for t in tenants]
        ax.barh(tenants, values, left=left, label=site)
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.set_xlabel("USD")
    ax.set_title(f"chargeback {month}: jobs and tokens per tenant, by site")
    if sites:
        ax.legend(fontsize="small")
    if not tenants:
        ax.text(0.5, 0.5, "no usage", ha="center", va="center", transform=ax.transAxes)
    if idle:
        ax2 = axes[0][1]
        names = [i["site"] for i in idle]
        ax2.barh(names, [i["used_usd"] for i in idle], label="used")
        ax2.barh(
            names,
            [i["idle_usd"] for i in idle],
            left=[i["used_usd"] for i in idle],
            label="idle",
            color="lightgray",
        )
        ax2.set_xlabel("USD")
        ax2.set_title("capacity cost per site: used and idle")
        ax2.legend(fontsize="small")
    fig.tight_layout()
    png_path = out_dir / f"chargeback-{month}.png"
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    written.append(png_path)
    return written
