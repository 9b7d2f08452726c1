"""Usage reports as a person or a finance system reads them: a table, CSV, and the monthly
chargeback (a CSV per tenant, site and model, the idle capacity cost per site apart, and a PNG
chart of both). Input: the JSON of GET /v1/usage (broker.api.usage.UsageReport).
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

__all__ = ["COLUMNS", "chargeback", "month_range", "to_csv", "to_table"]

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
)
_TABLE = ("gpu_hours", "cpu_core_hours", "egress_gb", "total_usd", "energy_kwh", "co2_kg")
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
        out[column] = int(value) if column == "segments" else round(value, 6)
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


def to_table(report: Mapping[str, Any]) -> str:
    by = list(report["by"])
    header = [*by, *_TABLE]
    rows = []
    for item in report["items"]:
        row = _row(item, by)
        rows.append([str(row[d]) for d in by] + [f"{row[c]:.2f}" for c in _TABLE])
    total = _row(report["total"], [])
    rows.append(["TOTAL", *([""] * (len(by) - 1)), *(f"{total[c]:.2f}" for c in _TABLE)])
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
    """Write chargeback-<month>.csv (per tenant, site, model), idle-<month>.csv (per site) and
    chargeback-<month>.png (cost per tenant stacked by site; idle cost per site) in out_dir.
    `report` is GET /v1/usage by=tenant,site,model over the month."""
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
        per_site[item["site"]] = per_site.get(item["site"], 0.0) + float(item["total_usd"])
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
    ax.set_title(f"chargeback {month}: cost per tenant, by site")
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
