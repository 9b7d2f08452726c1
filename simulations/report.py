"""Simulation results as text: a terminal summary and comparisons.

The simulator returns one JSON-serialisable `results` dict (schema "cpn.simulation/v1",
docs/simulation-report.md); this module only reads it. `summary` / `summary_text` give one
screen for a terminal; `compare_table` / `compare_text` set scenarios side by side and mark
the best value of each row where "best" has one meaning (lower delay, cost, energy, carbon;
higher SLO attainment and completed jobs). The figures they show are read and formatted by
simulations.figures, whose API this module passes on (`key_figures`, `format_duration`, ...).
Writing the reports to a folder (results.json, PNG plots, HTML pages) is simulations.plots',
which imports this module; this one does not import it, so the reading side needs no
plotting library.

How: an absent section, an empty dict or a null figure reads as "none", never as an error.
Deciding is pure: `_sections` and `key_figures` say what to show; only `write_*` write, and only
under the folder they are given.

Errors: `ReportError` (ValueError) names the field: "schema" for a dict of another schema,
"results_list" for an empty comparison, "sweep" when the sweep's values do not match the
results one to one.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from simulations.figures import (
    NONE,
    SCHEMA,
    ReportError,
    Results,
    _at,
    _check,
    _count,
    _f,
    _failures,
    _Fmt,
    _int,
    _kg,
    _kwh,
    _map,
    _ms,
    _name,
    _num,
    _number,
    _numbers,
    _or_none,
    _ranked,
    _regions,
    _short,
    _stats,
    _top_items,
    format_duration,
    format_money,
    format_percent,
    key_figures,
    overall_gpu_utilization,
    overall_slo,
    slug,
)

__all__ = [
    "SCHEMA",
    "ReportError",
    "Results",
    "compare_table",
    "compare_text",
    "format_duration",
    "format_money",
    "format_percent",
    "key_figures",
    "overall_gpu_utilization",
    "overall_slo",
    "seeds_table",
    "slug",
    "summary",
    "summary_text",
]

TOP = 8  # sites listed in the terminal summary; the HTML lists all


# -- the summary: sections of rows, shared by the terminal and the HTML -----------------------

_Rows = Sequence[tuple[str, ...]]


@dataclass(frozen=True)
class _Section:
    title: str
    rows: _Rows
    header: tuple[str, ...] | None = None  # None: (label, value) rows


def _scenario_rows(results: Results) -> _Rows:
    scenario, run = _map(results.get("scenario")), results.get("run")
    sites = _map(scenario.get("sites")).values()
    gpus = sum(_int(n) for s in sites for n in _map(_at(s, "gpus")).values())
    regions = len({str(_at(s, "region")) for s in sites})
    speed = f"{_or_none(_f(run, 'jobs_per_s'), _number)} jobs/s"
    return [
        ("scenario", _name(results)),
        ("policy", str(scenario.get("policy") or NONE)),
        ("seed", str(scenario.get("seed"))),
        ("horizon", format_duration(_f(scenario, "horizon_s"))),
        *(("file", str(file)) for file in [scenario.get("file")] if file),
        ("sites", f"{len(sites)} in {regions} regions, {gpus:,} GPUs"),
        *(("what-if", str(edit)) for edit in scenario.get("edits") or ()),
        ("run", f"{_int(run, 'events'):,} events in {format_duration(_f(run, 'wall_s'))}, {speed}"),
    ]


def _job_rows(results: Results) -> _Rows:
    jobs = _map(results.get("jobs"))
    n = {k: f"{_int(jobs, k):,}" for k in ("arrived", "completed", "failed", "migrations")}
    end = {k: f"{_int(jobs, f'{k}_at_end'):,}" for k in ("pending", "running")}
    reasons = _numbers(_at(jobs, "unplaced", "reasons"))
    unplaced = f"{_int(jobs, 'unplaced', 'count'):,}: {_top_items(reasons, 4, _count)}"
    rows = [
        ("jobs", f"{n['arrived']} arrived · {n['completed']} completed · {n['failed']} failed"),
        (
            "at end",
            f"{end['pending']} pending · {end['running']} running · {n['migrations']} migrations",
        ),
        ("queue delay", _stats(jobs.get("queue_delay_s"))),
        ("completion (JCT)", _stats(jobs.get("completion_time_s"))),
        ("unplaced", unplaced if reasons else NONE),
    ]
    if little := _map(jobs.get("littles_law")):
        queue, lw = _f(little, "mean_queue_length") or 0.0, _f(little, "lambda_w") or 0.0
        error = format_percent(_f(little, "relative_error"))
        rows.append(("Little's law", f"L {_number(queue)} vs λW {_number(lw)} (error {error})"))
    return rows


def _gpu_rows(results: Results, top: int) -> _Rows:
    use = _map(results.get("utilization"))
    per_site = {str(k): g for k, v in use.items() if (g := _f(v, "gpu")) is not None}
    if not per_site:
        return [("overall", NONE)]
    rows = [("overall", f"{format_percent(overall_gpu_utilization(results))} GPU-weighted")]
    for site, value in _ranked(per_site)[:top]:
        rows.append((site, f"{format_percent(value)} of {_int(use, site, 'gpus_total'):,} GPUs"))
    if len(per_site) > top:
        rows.append(("", f"+{len(per_site) - top} more sites"))
    return rows


_FOOTPRINT = (  # (section, total's key, format of the total, of a site's or tenant's share, unit)
    ("cost", "total_usd", format_money, format_money, "USD"),
    ("energy", "total_kwh", _kwh, _number, "kWh"),
    ("carbon", "total_kg", _kg, _number, "kg CO2e"),
)
_ELECTRICITY = ("electricity_usd", "total_usd", format_money, format_money, "USD")  # by site only


def _footprint(results: Results) -> _Section:
    rows = []
    for key, total, fmt, share, _ in (*_FOOTPRINT, _ELECTRICITY):
        tops = (
            _top_items(_numbers(_at(results, key, f"by_{by}")), 3, share)
            for by in ("site", "tenant")
        )
        rows.append((key.split("_")[0], _or_none(_f(results, key, total), fmt), *tops))
    return _Section("Cost, energy, carbon", rows, ("", "total", "top sites", "top tenants"))


def _inference(results: Results) -> _Section:
    rows: list[tuple[str, ...]] = []
    for name, r in sorted(_regions(results).items()):
        ms = (_or_none(_f(r, k), _ms) for k in ("p50_ms", "p99_ms", "slo_ms"))
        shares = (format_percent(_f(r, k)) for k in ("slo_attainment", "in_region_share"))
        rows.append(
            (name, str(r.get("service")), _or_none(_f(r, "requests"), _short), *ms, *shares)
        )
    requests = sum(_f(r, "requests") or 0.0 for r in _regions(results).values())
    rows.append(("all", "", _short(requests), "", "", "", format_percent(overall_slo(results)), ""))
    header = ("client region", "service", "requests", "p50", "p99", "SLO", "met", "in-region")
    return _Section("Inference", rows, header)


def _failures_section(results: Results) -> _Section:
    rows = [
        (
            str(f.get("site")),
            format_duration(_f(f, "down_s")),
            "not back" if (up := _f(f, "up_s")) is None else format_duration(up),
            str(_int(f, "jobs_moved")),
            str(_int(f, "jobs_failed")),
        )
        for f in _failures(results)
    ]
    header = ("site", "down at", "up at", "jobs moved", "jobs failed")
    return _Section("Failures", rows, header) if rows else _Section("Failures", [(NONE,)])


def _shares(tenants: Mapping[str, Any]) -> list[tuple[str, ...]]:
    keys = ("mean_share", "target_share", "share_last_quarter", "target_share_last_quarter")
    return [
        (
            str(name),
            f"{_f(t, 'weight') or 1.0:g}",
            *(format_percent(_f(t, k)) for k in keys),
            format_duration(_f(t, "queue_delay_mean_s")),
        )
        for name, t in tenants.items()
    ]


_SHARES = ("tenant", "weight", "share", "target", "share ¼", "target ¼", "queue delay")


def _tenancy(results: Results) -> list[_Section]:
    """Per tenant: its share of the GPUs against its weight's target (time averages over the
    horizon, and over its last quarter (¼), where they have settled) and its mean queueing
    delay, for the policy and for the baseline beside it (policy.baseline); borrowing and
    preemptions."""
    tenancy = _map(results.get("tenancy"))
    tenants = _map(tenancy.get("tenants"))
    if not tenants:
        return []
    base = _map(tenancy.get("baseline"))
    label = str(base.get("policy") or "baseline")
    policy = str(tenancy.get("policy") or NONE)
    reasons = _numbers(tenancy.get("preemptions_by_reason"))
    lost = _number(_f(tenancy, "lost_gpu_hours") or 0.0)
    summary = [
        ("policy", f"{policy}, beside {label} on the same jobs" if base else policy),
        ("fair share", f"half-life {format_duration(_f(tenancy, 'half_life_s'))}"),
        (
            "preemptions",
            f"{_int(tenancy, 'preemptions'):,}"
            + (f" ({_top_items(reasons, 3, _count)})" if reasons else "")
            + f", {lost} GPU-h of work lost"
            + ("" if tenancy.get("preemption", True) else " (preemption off)"),
        ),
    ]
    if cycles := _int(tenancy, "preemption_cycles"):
        summary.append(
            ("cycles", f"{cycles:,} instants where preemptions went round in a cycle (stopped)")
        )
    sections = [
        _Section("Tenancy", summary),
        _Section(f"Tenants under {policy}: share of the GPUs", _shares(tenants), _SHARES),
    ]
    if base:
        jobs = _map(base.get("jobs"))
        sections.append(
            _Section(
                f"Tenants under {label}, the baseline ({_int(jobs, 'completed'):,} jobs "
                f"completed, {_int(jobs, 'pending_at_end'):,} pending at end)",
                _shares(_map(base.get("tenants"))),
                _SHARES,
            )
        )
    rows = [
        (
            str(name),
            _number(_f(t, "borrowed_gpus_mean") or 0.0),
            _number(_f(t, "borrowed_gpus_max") or 0.0),
            f"{_int(t, 'preempted'):,}",
            f"{_int(t, 'preempting'):,}",
            _number(_f(t, "lost_gpu_hours") or 0.0),
        )
        for name, t in tenants.items()
    ]
    header = ("tenant", "borrowed GPUs", "max", "preempted", "preempting", "lost GPU-h")
    sections.append(_Section(f"Borrowing and preemption under {policy}", rows, header))
    return sections


def _fragmentation(results: Results, top: int) -> list[_Section]:
    """Free GPUs no waiting job could use (stranded on nodes too small for the smallest
    waiting per-node demand), time averages; none for a federation without nodes."""
    frag = _map(results.get("fragmentation"))
    if not frag:
        return []
    packing = str(_at(results, "scenario", "node_packing") or "pack")
    overall = (
        f"{format_percent(_f(frag, 'mean_fraction'))} of the waiting models' free GPUs "
        f"(peak {format_percent(_f(frag, 'peak_fraction'))}); on average "
        f"{_number(_f(frag, 'stranded_gpus_mean') or 0.0)} of "
        f"{_number(_f(frag, 'wanted_free_gpus_mean') or 0.0)} "
        f"({_number(_f(frag, 'free_gpus_mean') or 0.0)} free of any model)"
    )
    rows: list[tuple[str, ...]] = [("node packing", packing), ("stranded", overall)]
    by_site = _map(frag.get("by_site"))
    stranded = {str(k): v for k, s in by_site.items() if (v := _f(s, "stranded_gpus_mean"))}
    for site, value in _ranked(stranded)[:top]:
        share = format_percent(_f(by_site, site, "mean_fraction"))
        rows.append((site, f"{_number(value)} GPUs stranded on average ({share} of the free)"))
    return [_Section("GPU fragmentation at sites with nodes", rows)]


def _allocation(results: Results) -> list[_Section]:
    """Devices allocated and free devices the shapes seen cannot use, per model (time
    averages, simulations.allocation); none for a results file without them."""
    alloc = _map(results.get("allocation"))
    by_model = _map(alloc.get("by_model"))
    if not by_model:
        return []
    rows: list[tuple[str, ...]] = [
        (
            "all models",
            f"{format_percent(_f(alloc, 'allocated_mean'))} allocated; "
            f"{_number(_f(alloc, 'unusable_gpus_mean') or 0.0)} of "
            f"{_number(_f(alloc, 'free_gpus_mean') or 0.0)} free GPUs unusable by the shapes "
            f"seen ({format_percent(_f(alloc, 'unusable_fraction'))})",
        )
    ]
    for model in sorted(by_model):
        rows.append(
            (
                str(model),
                f"{format_percent(_f(by_model, model, 'allocated_mean'))} allocated, "
                f"{_number(_f(by_model, model, 'unusable_gpus_mean') or 0.0)} GPUs unusable",
            )
        )
    return [_Section("Allocation and unusable accelerators (time averages)", rows)]


def _sections(results: Results, top: int = TOP) -> list[_Section]:
    sections = [
        _Section("Scenario", _scenario_rows(results)),
        _Section("Jobs", _job_rows(results)),
        _Section("GPU utilization", _gpu_rows(results, top)),
        *_fragmentation(results, top),
        *_allocation(results),
        *_tenancy(results),
        _footprint(results),
        *_data(results),
    ]
    if results.get("inference") is not None:
        sections.append(_inference(results))
    sections += _services(results)
    return [*sections, _failures_section(results)]


def _data(results: Results) -> list[_Section]:
    """Datasets (simulations.staging): what staging moved and cost, time to start split into
    queueing and staging, and per dataset; none for a scenario without datasets."""
    data = _map(results.get("data"))
    if not data:
        return []
    runs = _int(data, "runs_with_inputs")
    rows: list[tuple[str, ...]] = [
        ("placement", str(data.get("placement") or "cpn")),
        *(("what-if", str(w)) for w in data.get("what_if") or ()),
        (
            "runs with inputs",
            f"{runs:,}: {_int(data, 'runs_at_data'):,} at their data "
            f"({_int(data, 'cache_hits'):,} from a cache), {_int(data, 'runs_staged'):,} staged, "
            f"{_int(data, 'runs_shared'):,} sharing a transfer",
        ),
        (
            "egress",
            f"{format_money(_f(data, 'egress_usd'))} for {_f(data, 'egress_gb') or 0.0:,.0f} GB "
            f"across regions ({_f(data, 'moved_gb') or 0.0:,.0f} GB moved); compute and the "
            f"rest {format_money(_f(data, 'compute_usd'))}",
        ),
        ("time to start", _mean_stats(data.get("time_to_start_s"))),
        ("  queueing", _mean_stats(data.get("queueing_s"))),
        ("  staging", _mean_stats(data.get("staging_s"))),
    ]
    if (cache := _f(data, "cache_gb")) is not None:
        rows.append(
            ("cache", f"{cache:,.0f} GB per site, {_int(data, 'cache_evictions'):,} evictions")
        )
    per = [
        (
            str(name),
            f"{_f(d, 'size_gb') or 0.0:,.0f}",
            ", ".join(str(s) for s in d.get("replicas") or ()),
            f"{_int(d, 'runs'):,}",
            f"{_int(d, 'staged'):,}",
            f"{_f(d, 'egress_gb') or 0.0:,.0f}",
            format_money(_f(d, "egress_usd")),
        )
        for name, d in _map(data.get("datasets")).items()
    ]
    header = ("dataset", "GB", "replicas", "runs", "staged", "egress GB", "egress")
    return [_Section("Data", rows), _Section("Datasets", per, header)]


def _mean_stats(stats: Any) -> str:
    mean = _f(stats, "mean")
    return NONE if mean is None else f"mean {format_duration(mean)} · {_stats(stats)}"


def _percent2(fraction: float | None) -> str:
    """SLO attainment near 100 % needs two decimals to tell policies apart: 98.03%."""
    return NONE if fraction is None else f"{100 * fraction:.2f}%"


def _services(results: Results) -> list[_Section]:
    """Per autoscaled service (simulations.autoscaling): each policy's replica-hours and SLO,
    then each client region's attainment and p95 under each policy."""
    out: list[_Section] = []
    for name, svc in sorted(_map(results.get("services")).items()):
        runs = {str(_at(svc, "policy")): _map(svc)}
        runs.update({str(k): _map(v) for k, v in _map(_at(svc, "baselines")).items()})
        rows = [
            (
                policy,
                _or_none(_f(r, "replica_hours"), lambda v: f"{v:,.1f}"),
                str(_int(r, "peak_replicas")),
                _percent2(_f(r, "slo_attainment")),
                f"{_percent2(_f(r, 'slo_worst'))} {r.get('slo_worst_region') or ''}".strip(),
            )
            for policy, r in runs.items()
        ]
        header = ("policy", "replica-hours", "peak replicas", "SLO met", "worst region")
        out.append(_Section(f"Service {name}", rows, header))
        clients = sorted(_map(_at(svc, "regions")))
        per_region = []
        for client in clients:
            cells = []
            for r in runs.values():
                region = _map(_at(r, "regions", client))
                p95 = _f(region, "p95_ms")
                cells.append(f"{_percent2(_f(region, 'slo_attainment'))} p95 {_or_none(p95, _ms)}")
            slo = _f(_at(svc, "regions", client), "slo_ms")
            per_region.append((client, _or_none(slo, _ms), *cells))
        out.append(
            _Section(
                f"Service {name}: SLO met and p95 per client region",
                per_region,
                ("client region", "SLO p95", *runs),
            )
        )
    return out


def summary(results: Results, *, top: int = TOP) -> Group:
    """One screen of the results for a terminal: a table per section, the `top` busiest sites."""
    tables = []
    for section in _sections(_check(results), top):
        table = Table(
            title=section.title,
            title_justify="left",
            title_style="bold cyan",
            show_header=section.header is not None,
            box=box.SIMPLE_HEAD,
            show_edge=False,
            padding=(0, 1),
        )
        columns = list(zip(*section.rows, strict=True))
        for i, name in enumerate(section.header or ("",) * len(columns)):
            right = section.header is not None and i > 0 and _numeric(columns[i])
            table.add_column(
                name,
                min_width=16 if i == 0 and not section.header else None,
                justify="right" if right else "left",
                overflow="fold",  # a figure is wrapped, never cut with an ellipsis
            )
        for row in section.rows:
            table.add_row(*map(Text, row))  # Text: a name from the results is never markup
        tables.append(table)
    return Group(*tables)


def _numeric(cells: Sequence[str]) -> bool:
    """A column of figures (right-aligned): every cell empty, "none" or starting like a number."""
    return all(not c or c == NONE or c[0] in "0123456789$-" for c in cells)


def _render(renderable: RenderableType, width: int) -> str:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None, highlight=False).print(renderable)
    return out.getvalue()


def summary_text(results: Results, width: int = 100, *, top: int = TOP) -> str:
    """`summary` rendered as plain text (no colour): for tests, logs and `--no-color`."""
    return _render(summary(results, top=top), width)


# -- the comparison -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Row:
    key: str
    label: str
    fmt: _Fmt
    better: Literal["low", "high"] | None = None
    detail: str | None = None  # a figure named after the value: the worst region
    optional: bool = False  # left out when no scenario has the figure


_ROWS = (
    _Row("jobs_completed", "jobs completed", _count, "high"),
    _Row("pending_at_end", "pending at end", _count, "low"),
    _Row("queue_delay_p50_s", "queue delay p50", format_duration, "low"),
    _Row("queue_delay_p95_s", "queue delay p95", format_duration, "low"),
    _Row("queue_delay_p99_s", "queue delay p99", format_duration, "low"),
    _Row("jct_p50_s", "JCT p50", format_duration, "low"),
    _Row("jct_p99_s", "JCT p99", format_duration, "low"),
    # Busier GPUs are not better in themselves (a smaller federation is busier): no mark.
    _Row("gpu_utilization", "GPU utilization", format_percent),
    # free GPUs stranded for the waiting shapes, at sites with nodes (simulations.nodes)
    _Row("fragmentation", "GPU fragmentation", format_percent, "low", optional=True),
    _Row("cost_usd", "cost", format_money, "low"),
    _Row("energy_kwh", "energy", _kwh, "low"),
    _Row("carbon_kg", "carbon", _kg, "low"),
    _Row("slo_attainment", "SLO attainment", format_percent, "high"),
    _Row("slo_worst", "SLO worst region", format_percent, "high", "slo_worst_region"),
    _Row("p99_worst_ms", "p99 worst region", _ms, "low", "p99_worst_region"),
    # datasets (simulations.staging): the what-if of a replica reads these side by side
    _Row("egress_usd", "egress (staging)", format_money, "low", optional=True),
    _Row("egress_gb", "egress GB", lambda v: f"{v:,.0f}", "low", optional=True),
    _Row("queueing_mean_s", "queueing mean", format_duration, "low", optional=True),
    _Row("staging_mean_s", "staging mean", format_duration, "low", optional=True),
    _Row("time_to_start_mean_s", "time to start mean", format_duration, "low", optional=True),
    _Row("time_to_start_p95_s", "time to start p95", format_duration, "low", optional=True),
    _Row("replica_hours", "replica-hours", lambda v: f"{v:,.1f}", "low", optional=True),
    _Row(
        "service_slo_worst",
        "service SLO worst region",
        _percent2,
        "high",
        "service_slo_worst_region",
        optional=True,
    ),
    _Row("failures", "failures", _count),
)


def _grid(figures: Sequence[Mapping[str, Any]]) -> list[tuple[str, list[tuple[str, bool]]]]:
    """(label, [(text, best of the row)]) per row, one cell per scenario."""
    grid = [("policy", [(str(f["policy"]), False) for f in figures])]
    for row in _ROWS:
        values = [_num(f.get(row.key)) for f in figures]
        if row.optional and all(v is None for v in values):
            continue
        shown = {row.fmt(v) for v in values if v is not None}
        best = None
        # A winner needs a contest as shown: two figures or more that do not read the same (a
        # difference below the display's precision is noise, not a win).
        if row.better and len(shown) > 1:
            pick = min if row.better == "low" else max
            best = row.fmt(pick(v for v in values if v is not None))
        cells = []
        for value, f in zip(values, figures, strict=True):
            text = _or_none(value, row.fmt)
            detail = f" ({f[row.detail]})" if row.detail and value is not None else ""
            cells.append((text + detail, value is not None and text == best))
        grid.append((row.label, cells))
    return grid


def _unique(names: Sequence[str], suffix: Callable[[str, int], str]) -> list[str]:
    """The names, a repeat renamed suffix(name, 2), suffix(name, 3), ... until unused."""
    taken: list[str] = []
    for name in names:
        candidate, n = name, 1
        while candidate in taken:
            n, candidate = n + 1, suffix(name, n + 1)
        taken.append(candidate)
    return taken


def _labels(figures: Sequence[Mapping[str, Any]]) -> list[str]:
    """Scenario names told apart: a repeated name becomes "name #2", "name #3"."""
    return _unique([str(f["name"]) for f in figures], lambda s, n: f"{s} #{n}")


def _figures_of(results_list: Sequence[Results]) -> list[dict[str, float | str | None]]:
    if not results_list:
        raise ReportError("nothing to compare", field="results_list")
    return [key_figures(r) for r in results_list]


def compare_table(results_list: Sequence[Results]) -> Table:
    """Scenarios side by side, one column each; the best value of a row ends in " *"."""
    figures = _figures_of(results_list)
    table = Table(box=box.SIMPLE_HEAD, title="Scenarios compared", caption="* best of the row")
    table.add_column("")
    for name in _labels(figures):
        table.add_column(Text(name), justify="right", overflow="fold")
    for label, cells in _grid(figures):
        row = [Text(t + " *", style="bold green") if best else Text(t) for t, best in cells]
        table.add_row(Text(label), *row)
    return table


def compare_text(results_list: Sequence[Results], width: int = 120) -> str:
    """`compare_table` rendered as plain text."""
    return _render(compare_table(results_list), width)


# -- over several seeds (simulations.spread) ----------------------------------------------------


def _amount(value: float) -> str:
    """A count, or a mean of counts: 1,373 and 0 whole, 0.67 and 27.4 not."""
    return f"{value:,.0f}" if value.is_integer() else _number(value)


_SPREAD_ROWS: tuple[tuple[str, str, _Fmt], ...] = (
    ("queue_delay_p50_s", "queue delay p50", format_duration),
    ("queue_delay_p95_s", "queue delay p95", format_duration),
    ("jobs_completed", "jobs completed", _amount),
    ("jobs_unplaced", "jobs waiting at the end", _amount),
    ("cost_usd", "cost", format_money),
    ("gpu_utilization", "GPU utilization", format_percent),
    ("inference_slo_worst", "SLO worst region", _percent2),
)


def seeds_table(document: Mapping[str, Any]) -> Table:
    """simulations.spread.over_seeds's document as a table: per figure the mean ± the 95 %
    half-width, the standard deviation and the range; a figure no seed has is left out."""
    seeds = [str(s) for s in document.get("seeds") or ()]
    name = document.get("scenario") or "unnamed"
    table = Table(
        box=box.SIMPLE_HEAD,
        title=Text(f"{name}: over {len(seeds)} seeds ({', '.join(seeds)})"),
        caption="±: the 95 % confidence interval of the mean (Student's t)",
    )
    for name in ("", "mean ± 95 %", "stdev", "min – max"):
        table.add_column(name, justify="right" if name else "left")
    spreads = _map(document.get("spread"))
    for key, label, fmt in _SPREAD_ROWS:
        s = _map(spreads.get(key))
        mean, n = _f(s, "mean"), _int(s, "n")
        if mean is None:
            continue
        half = _f(s, "half_width")
        table.add_row(
            label + (f" ({n} seeds)" if n != len(seeds) else ""),
            f"{fmt(mean)} ± {_or_none(half, fmt)}",
            _or_none(_f(s, "stdev"), fmt),
            f"{_or_none(_f(s, 'low'), fmt)} – {_or_none(_f(s, 'high'), fmt)}",
        )
    return table
