"""The figures of a simulation's results, read and formatted for simulations.report and
simulations.plots: `key_figures` (what a comparison shows), the federation-wide means
(`overall_gpu_utilization`, `overall_slo`), the units used everywhere (`format_duration`,
`format_money`, `format_percent`) and `slug`, the reports' folder names.

How: the readers (`_map`, `_at`, `_f`, ...) take anything: an absent key, or a value of the
wrong type, reads as empty or None, never as an error, so an older or partial results dict
still renders. The names with an underscore are the report's and the plots' own, not an API.

Errors: `ReportError` (ValueError) names the field: "schema" for a dict of another schema (the
others are raised by simulations.report and simulations.plots with it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "NONE",
    "SCHEMA",
    "ReportError",
    "Results",
    "format_duration",
    "format_money",
    "format_percent",
    "key_figures",
    "overall_gpu_utilization",
    "overall_slo",
    "slug",
]

# simulations.results.SCHEMA (a test holds them equal); not imported, so reading a saved
# results.json needs nothing of the simulator
SCHEMA = "cpn.simulation/v1"
Results = Mapping[str, Any]

NONE = "none"


class ReportError(ValueError):
    """Results the report cannot read; `field` names the culprit."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


# -- reading the dict: anything absent or of the wrong type reads as empty / None ---------------


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _at(value: Any, *keys: str) -> Any:
    for key in keys:
        value = _map(value).get(key)
    return value


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _f(value: Any, *keys: str) -> float | None:
    return _num(_at(value, *keys))


def _int(value: Any, *keys: str) -> int:
    return int(_f(value, *keys) or 0)


def _floats(value: Any) -> list[float]:
    """A numeric series; a non-number becomes NaN, which a plot shows as a gap."""
    if not isinstance(value, Sequence) or isinstance(value, str):
        return []
    return [math.nan if (n := _num(v)) is None else n for v in value]


def _numbers(value: Any) -> dict[str, float]:
    return {str(k): n for k, v in _map(value).items() if (n := _num(v)) is not None}


def _series(value: Any) -> dict[str, list[float]]:
    return {str(k): ys for k, v in _map(value).items() if (ys := _floats(v))}


def _check(results: Any) -> Results:
    if not isinstance(results, Mapping) or results.get("schema") != SCHEMA:
        got = results.get("schema") if isinstance(results, Mapping) else type(results).__name__
        raise ReportError(f"expected schema {SCHEMA!r}, got {got!r}", field="schema")
    return results


def _name(results: Results) -> str:
    return str(_at(results, "scenario", "name") or "unnamed")


def _failures(results: Results) -> list[Mapping[str, Any]]:
    failures = results.get("failures")
    return [_map(f) for f in failures] if isinstance(failures, list | tuple) else []


def _regions(results: Results) -> dict[str, Mapping[str, Any]]:
    return {str(k): _map(v) for k, v in _map(_at(results, "inference", "regions")).items()}


# -- formatting ---------------------------------------------------------------------------------

# (unit, seconds per unit, decimals, the rounded value must stay below this to use the unit)
_DURATION_UNITS = (
    ("ms", 0.001, 0, 1000.0),
    ("s", 1.0, 1, 10.0),
    ("s", 1.0, 0, 60.0),
    ("min", 60.0, 1, 60.0),
    ("h", 3600.0, 1, 24.0),
    ("d", 86400.0, 1, math.inf),
)


def format_duration(seconds: float | None) -> str:
    """42 s, 3.2 min, 5.1 h, 2.0 d (and 350 ms, 4.2 s); None or not finite: "none"."""
    if seconds is None or not math.isfinite(seconds):
        return NONE
    if seconds < 0:
        return "-" + format_duration(-seconds)
    if seconds == 0:
        return "0 s"
    value, decimals, unit = next(
        (v, d, u)
        for u, size, d, below in _DURATION_UNITS
        if (v := round(seconds / size, d)) < below
    )
    return f"{value:.{decimals}f} {unit}"


def format_money(usd: float | None) -> str:
    """$12,345 from $100 up, $4.20 below; None: "none"."""
    if usd is None:
        return NONE
    sign, usd = ("-" if usd < 0 else ""), abs(usd)
    return f"{sign}${usd:,.0f}" if usd >= 99.995 else f"{sign}${usd:.2f}"


def format_percent(fraction: float | None) -> str:
    """0.873 -> 87.3%; None: "none"."""
    return NONE if fraction is None else f"{100 * fraction:.1f}%"


def _number(value: float) -> str:
    """Whole numbers with thousands separators from 100 up, three significant figures below."""
    size = abs(value)
    if size >= 99.95:
        return f"{value:,.0f}"
    return f"{value:.1f}" if size >= 9.995 else ("0" if value == 0 else f"{value:.2f}")


_Fmt = Callable[[float], str]


def _short(value: float) -> str:
    """A count in a narrow column: 5.2M, 48k, 9,999."""
    if abs(value) >= 999_500:
        return f"{value / 1e6:,.1f}M"
    return f"{value / 1e3:.0f}k" if abs(value) >= 9_999.5 else _number(value)


def _unit(unit: str) -> _Fmt:
    return lambda value: f"{_number(value)} {unit}"


_kwh, _kg, _ms = _unit("kWh"), _unit("kg CO2e"), _unit("ms")


def _count(value: float) -> str:
    return f"{value:,.0f}"


def _or_none(value: float | None, fmt: _Fmt) -> str:
    return NONE if value is None else fmt(value)


def _ranked(values: Mapping[str, float]) -> list[tuple[str, float]]:
    return sorted(values.items(), key=lambda kv: (-kv[1], kv[0]))


def _top_items(values: Mapping[str, float], n: int, fmt: _Fmt) -> str:
    ranked = _ranked(values)
    text = ", ".join(f"{k} {fmt(v)}" for k, v in ranked[:n])
    return text + (f", +{len(ranked) - n} more" if len(ranked) > n else "")


def _stats(stats: Any) -> str:
    keys = ("p50", "p95", "p99", "max")
    parts = [f"{k} {format_duration(v)}" for k in keys if (v := _f(stats, k)) is not None]
    return " · ".join(parts) or NONE


# -- aggregates ---------------------------------------------------------------------------------


def _weighted(pairs: Sequence[tuple[float, float]]) -> float | None:
    total = sum(weight for _, weight in pairs)
    return sum(value * weight for value, weight in pairs) / total if total > 0 else None


def overall_gpu_utilization(results: Results) -> float | None:
    """Time-averaged GPU utilization over all sites, weighted by their GPUs; None without GPUs."""
    sites = _map(results.get("utilization")).values()
    return _weighted([(g, _int(s, "gpus_total")) for s in sites if (g := _f(s, "gpu")) is not None])


def overall_slo(results: Results) -> float | None:
    """SLO attainment over all client regions, weighted by requests; None without requests."""
    regions = _regions(results).values()
    return _weighted(
        [
            (a, _f(r, "requests") or 0.0)
            for r in regions
            if (a := _f(r, "slo_attainment")) is not None
        ]
    )


def _worst(results: Results, field: str, pick: Callable[..., tuple[float, str]]) -> list[Any]:
    """[value, region] of the worst client region for a per-region figure (pick: min or max)."""
    figures = [(v, k) for k, r in _regions(results).items() if (v := _f(r, field)) is not None]
    return list(pick(figures)) if figures else [None, None]


def key_figures(results: Results) -> dict[str, float | str | None]:
    """The figures a comparison shows, flat and JSON-ready (comparison.json holds a list)."""
    results = _check(results)
    jobs = results.get("jobs")
    figures: dict[str, float | str | None] = {
        "name": _name(results),
        "policy": str(_at(results, "scenario", "policy") or NONE),
        "jobs_completed": _int(jobs, "completed"),
        "pending_at_end": _int(jobs, "pending_at_end"),
        **{f"queue_delay_{p}_s": _f(jobs, "queue_delay_s", p) for p in ("p50", "p95", "p99")},
        **{f"jct_{p}_s": _f(jobs, "completion_time_s", p) for p in ("p50", "p99")},
        "gpu_utilization": overall_gpu_utilization(results),
        "fragmentation": _f(results, "fragmentation", "mean_fraction"),
        "cost_usd": _f(results, "cost", "total_usd"),
        "energy_kwh": _f(results, "energy", "total_kwh"),
        "carbon_kg": _f(results, "carbon", "total_kg"),
        "slo_attainment": overall_slo(results),
        "failures": len(_failures(results)),
    }
    figures["slo_worst"], figures["slo_worst_region"] = _worst(results, "slo_attainment", min)
    figures["p99_worst_ms"], figures["p99_worst_region"] = _worst(results, "p99_ms", max)
    # datasets (simulations.staging): what staging moved and what waiting for data cost in time
    data = results.get("data")
    if isinstance(data, Mapping):
        figures["egress_usd"] = _f(data, "egress_usd")
        figures["egress_gb"] = _f(data, "egress_gb")
        figures["staging_mean_s"] = _f(data, "staging_s", "mean")
        figures["queueing_mean_s"] = _f(data, "queueing_s", "mean")
        figures["time_to_start_mean_s"] = _f(data, "time_to_start_s", "mean")
        figures["time_to_start_p95_s"] = _f(data, "time_to_start_s", "p95")
    # autoscaled services (simulations.autoscaling), summed over the services: what a sweep of
    # their settings trades, replica-hours against the worst client region's SLO attainment
    services = [_map(v) for v in _map(results.get("services")).values()]
    if services:
        figures["replica_hours"] = sum(_f(v, "replica_hours") or 0.0 for v in services)
        worst = [
            (a, str(v.get("slo_worst_region")))
            for v in services
            if (a := _f(v, "slo_worst")) is not None
        ]
        figures["service_slo_worst"], figures["service_slo_worst_region"] = (
            min(worst) if worst else (None, None)
        )
    return figures


def slug(name: str) -> str:
    """A file-name-safe form of a scenario name (the reports' folder names)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:60] or "scenario"
