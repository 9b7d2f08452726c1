"""The PNG plots of the simulation report and of comparisons (simulations.pages puts them on
its HTML pages).

`simulations.report` reads the results and says which figures and tables to show; this module
draws them. `_plan_plots` says what one scenario's report plots, `_comparison_plots` what a
comparison's page plots (bars of the key figures and, for a parameter sweep, lines against the
parameter; docs/simulation-report.md), and `_save_all` draws them.

How: a plot with no data is skipped rather than drawn empty (`PLOTS` names every PNG). Deciding
is pure: `_plan_plots` says what to draw; only `_save_all` writes, and only PNGs under the
folder it is given. PNGs are drawn on the Agg canvas without a Software tag, so identical
results give identical bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

# report never imports this module: the dependency runs one way
from simulations.figures import (
    NONE,
    Results,
    _at,
    _f,
    _failures,
    _floats,
    _Fmt,
    _int,
    _map,
    _num,
    _numbers,
    _or_none,
    _ranked,
    _series,
    format_duration,
    format_money,
    format_percent,
)
from simulations.report import (
    _FOOTPRINT,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.axis import Axis

__all__ = ["PLOTS"]

MAX_LINES = 15  # lines or bars in one plot; the rest are aggregated as "other"

# -- plots: a panel class per kind draws itself; a _Plot is one PNG of one or more panels -------

# Every PNG the reports write, with its caption (docs/simulation-report.md explains each).
PLOTS = {
    "gpu_utilization.png": "GPU utilization per site",
    "jobs.png": "Pending and running jobs",
    "fragmentation.png": "Free GPUs stranded for the waiting shapes (sites with nodes)",
    "queue_delay_hist.png": "Queue delay of started jobs",
    "footprint_by_site.png": "Cost, energy and carbon by site",
    "footprint_by_tenant.png": "Cost, energy and carbon by tenant",
    "inference_slo.png": "Inference SLO attainment per client region",
    "inference_site_load.png": "Inference load per site (offered / capacity)",
    "service_replicas.png": "Autoscaled services: replicas per region under each policy",
    "service_demand.png": "Autoscaled services: demand and SLO attainment per client region",
    "site_timeline.png": "Site failures",
    "tenant_shares.png": "Each tenant's share of the GPUs (dashed: its weight's target)",
    "tenant_preemption.png": "Borrowed quota and preemptions per tenant",
    "comparison.png": "Key figures by scenario",
    "sweep.png": "Key figures against the swept parameter",
}


@dataclass(frozen=True)
class _Lines:
    x: Sequence[float]
    lines: Mapping[str, Sequence[float]]
    xlabel: str
    ylabel: str = ""
    title: str = ""
    percent: bool = False
    reference: float | None = None  # a dashed horizontal line (site load 1.0 = capacity)
    xticks: Sequence[str] | None = None  # category names when a sweep's values are not numbers

    def has_data(self) -> bool:
        return bool(self.x) and any(not math.isnan(y) for ys in self.lines.values() for y in ys)

    def draw(self, ax: Axes) -> None:
        from matplotlib import colormaps

        # tab20's dark shades, then its light ones: neighbouring lines never share a hue
        cycle = (*range(0, 20, 2), *range(1, 20, 2))
        ax.set_prop_cycle(color=[colormaps["tab20"](i) for i in cycle])
        marker = "o" if len(self.x) < 20 else None
        for label, ys in self.lines.items():
            n = min(len(ys), len(self.x))
            ax.plot(self.x[:n], ys[:n], label=label, marker=marker, linewidth=1.2)
        if self.reference is not None:
            ax.axhline(self.reference, color="grey", linestyle="--", linewidth=1)
        if self.xticks is not None:
            ax.set_xticks(list(self.x), list(self.xticks))
        low, high = min(self.x), max(self.x)  # the whole range, even where a line has gaps
        pad = 0.04 * (high - low or 1.0)
        ax.set(
            title=self.title, xlabel=self.xlabel, ylabel=self.ylabel, xlim=(low - pad, high + pad)
        )
        ax.set_ylim(bottom=0)
        _percent_axis(ax.yaxis, self.percent)
        ax.grid(alpha=0.3)
        if len(self.lines) > 1:
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))


@dataclass(frozen=True)
class _Shares:
    """Each tenant's share over time (solid) and its target (dashed, the same colour)."""

    x: Sequence[float]
    shares: Mapping[str, Sequence[float]]
    targets: Mapping[str, Sequence[float]]
    xlabel: str
    title: str

    def has_data(self) -> bool:
        return bool(self.x) and any(any(ys) for ys in self.shares.values())

    def draw(self, ax: Axes) -> None:
        from matplotlib import colormaps

        for i, (tenant, ys) in enumerate(self.shares.items()):
            color = colormaps["tab10"](i % 10)
            n = min(len(ys), len(self.x))
            ax.plot(self.x[:n], ys[:n], label=tenant, color=color, linewidth=1.2)
            target = self.targets.get(tenant, ())
            m = min(len(target), len(self.x))
            ax.plot(self.x[:m], target[:m], color=color, linestyle="--", linewidth=1)
        ax.set(title=self.title, xlabel=self.xlabel, ylabel="share of the GPUs")
        ax.set_ylim(0, 1)
        _percent_axis(ax.yaxis, True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))


@dataclass(frozen=True)
class _Bars:
    title: str
    values: Mapping[str, float | None]  # in display order, top to bottom; None shows "none"
    fmt: _Fmt

    def has_data(self) -> bool:
        return any(v is not None for v in self.values.values())

    def draw(self, ax: Axes) -> None:
        values = list(self.values.values())
        bars = ax.barh(range(len(values)), [v or 0.0 for v in values], color="tab:blue")
        ax.bar_label(bars, [_or_none(v, self.fmt) for v in values], padding=3, fontsize="small")
        ax.set_yticks(range(len(values)), list(self.values))
        ax.invert_yaxis()
        ax.margins(x=0.3)
        ax.set_title(self.title)
        _percent_axis(ax.xaxis, self.fmt is format_percent)


@dataclass(frozen=True)
class _Hist:
    edges: Sequence[float]
    counts: Sequence[float]

    def has_data(self) -> bool:
        shaped = len(self.edges) == len(self.counts) + 1
        return shaped and sum(self.counts) > 0 and max(self.edges) > 0

    def draw(self, ax: Axes) -> None:
        ax.stairs(self.counts, self.edges, fill=True, alpha=0.7)
        if self.edges[0] <= 0:  # log-spaced from 0: linear up to the first bin's end, then log
            ax.set_xscale("symlog", linthresh=min(e for e in self.edges if e > 0))
        else:
            ax.set_xscale("log")
        ax.set(xlabel="queue delay (s)", ylabel="jobs")
        ax.grid(alpha=0.3)


@dataclass(frozen=True)
class _Timeline:
    down: Mapping[str, Sequence[tuple[float, float]]]  # site -> [(down_s, up_s)]
    horizon_s: float

    def has_data(self) -> bool:
        return bool(self.down)

    def draw(self, ax: Axes) -> None:
        divisor, unit = _time_unit(self.horizon_s)
        for row, spans in enumerate(self.down.values()):
            ax.broken_barh([(0, self.horizon_s / divisor)], (row - 0.35, 0.7), color="tab:green")
            down = [(start / divisor, (end - start) / divisor) for start, end in spans]
            ax.broken_barh(down, (row - 0.35, 0.7), color="tab:red")
        ax.set_yticks(range(len(self.down)), list(self.down))
        ax.invert_yaxis()
        ax.set(xlabel=f"virtual time ({unit}); green up, red down")


def _percent_axis(axis: Axis, percent: bool) -> None:
    from matplotlib.ticker import PercentFormatter

    if percent:
        axis.set_major_formatter(PercentFormatter(xmax=1))


_Panel = _Lines | _Bars | _Hist | _Timeline | _Shares


@dataclass(frozen=True)
class _Plot:
    """One PNG: its panels laid out in `ncols` columns of `size` inches each."""

    file: str
    panels: Sequence[_Panel]
    ncols: int = 1
    size: tuple[float, float] = (9.0, 3.8)


def _service_plots(results: Results) -> list[_Plot]:
    """Replicas per region under each policy (one panel each), then demand and SLO attainment
    per client region, for every autoscaled service (simulations.autoscaling)."""
    replicas: list[_Panel] = []
    demand: list[_Panel] = []
    for name, svc in sorted(_map(results.get("services")).items()):
        runs = {str(_at(svc, "policy")): svc, **_map(_at(svc, "baselines"))}
        for policy, run in runs.items():
            series = _at(run, "series")
            xs, xlabel = _time_axis(_floats(_at(series, "t_s")))
            lines = _top_lines(_series(_at(series, "replicas")), {})
            replicas.append(_Lines(xs, lines, xlabel, "replicas", title=f"{name}: {policy}"))
        series = _at(svc, "series")
        xs, xlabel = _time_axis(_floats(_at(series, "t_s")))
        demand.append(
            _Lines(xs, _top_lines(_series(_at(series, "demand")), {}), xlabel, "req/s", name)
        )
        demand.append(
            _Lines(
                xs,
                _top_lines(_series(_at(series, "slo_attainment")), {}),
                xlabel,
                "SLO attainment",
                f"{name}: {_at(svc, 'policy')}",
                percent=True,
            )
        )
    if not replicas:
        return []
    return [
        _Plot("service_replicas.png", replicas, size=(9.0, 3.0)),
        _Plot("service_demand.png", demand, size=(9.0, 3.0)),
    ]


def _with_data(plots: Sequence[_Plot]) -> list[_Plot]:
    """The plots with their empty panels dropped, less those left with none."""
    return [replace(p, panels=ps) for p in plots if (ps := [x for x in p.panels if x.has_data()])]


def _save(plot: _Plot, out_dir: Path) -> None:
    # A bare Figure on the Agg canvas rather than pyplot after matplotlib.use("Agg"): the same
    # headless PNG, without switching the backend of the caller's process (a notebook) and
    # without pyplot's registry of open figures, so there is no figure left to close.
    from matplotlib.figure import Figure

    ncols = min(plot.ncols, len(plot.panels))
    nrows = -(-len(plot.panels) // ncols)
    fig = Figure(figsize=(plot.size[0] * ncols, plot.size[1] * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, panel in zip(axes, plot.panels, strict=False):
        panel.draw(ax)
    for ax in axes[len(plot.panels) :]:
        ax.remove()
    fig.suptitle(PLOTS[plot.file])
    fig.savefig(out_dir / plot.file, dpi=100, format="png", metadata={"Software": None})


_REPORT_PLOTS = tuple(file for file in PLOTS if file not in ("comparison.png", "sweep.png"))


def _save_all(plots: Sequence[_Plot], out_dir: Path, kinds: Sequence[str]) -> None:
    """Draw the plots; a plot of `kinds` left from an earlier report in `out_dir` is removed, so
    the folder never shows a figure the results do not have."""
    for file in set(kinds) - {plot.file for plot in plots}:
        (out_dir / file).unlink(missing_ok=True)
    for plot in plots:
        _save(plot, out_dir)


def _time_unit(t_max: float) -> tuple[float, str]:
    for divisor, unit, below in ((1.0, "s", 120.0), (60.0, "min", 7200.0), (3600.0, "h", 172800.0)):
        if t_max < below:
            return divisor, unit
    return 86400.0, "d"


def _time_axis(t: Sequence[float]) -> tuple[list[float], str]:
    divisor, unit = _time_unit(max(t, default=0.0))
    return [v / divisor for v in t], f"virtual time ({unit})"


def _top_lines(
    series: Mapping[str, Sequence[float]], weights: Mapping[str, float]
) -> dict[str, Sequence[float]]:
    """The MAX_LINES busiest series (by mean); the rest become one weighted-mean "other"."""
    means = {
        k: sum(f) / len(f)
        for k, ys in series.items()
        if (f := [y for y in ys if not math.isnan(y)])
    }
    ranked = [k for k, _ in _ranked(means)] + sorted(set(series) - set(means))
    kept: dict[str, Sequence[float]] = {k: series[k] for k in ranked[:MAX_LINES]}
    if rest := ranked[MAX_LINES:]:
        total = sum(weights.get(k, 1.0) for k in rest) or 1.0
        columns = zip(*(series[k] for k in rest), strict=False)
        w = [weights.get(k, 1.0) for k in rest]
        kept["other"] = [sum(y * wk for y, wk in zip(c, w, strict=True)) / total for c in columns]
    return kept


def _top_bars(values: Mapping[str, float]) -> dict[str, float]:
    ranked = _ranked(values)
    rest = sum(v for _, v in ranked[MAX_LINES:])
    return dict(ranked[:MAX_LINES]) | ({"other": rest} if len(ranked) > MAX_LINES else {})


def _plan_plots(results: Results) -> list[_Plot]:
    """The report's plots that have data, in page order; nothing is drawn yet."""
    series = _map(results.get("series"))
    t = _floats(series.get("t_s"))
    x, xlabel = _time_axis(t)
    gpus = {
        str(k): float(_int(v, "gpus_total")) for k, v in _map(results.get("utilization")).items()
    }
    gpu = _top_lines(_series(series.get("gpu_utilization")), gpus)
    jobs = {k: ys for k in ("pending", "running") if (ys := _floats(series.get(k)))}
    hist = _at(results, "jobs", "queue_delay_hist")
    plots = [
        _Plot("gpu_utilization.png", [_Lines(x, gpu, xlabel, percent=True)]),
        _Plot("jobs.png", [_Lines(x, jobs, xlabel, "jobs")]),
        _Plot(
            "fragmentation.png",
            [
                _Lines(
                    x,
                    {"stranded": ys} if (ys := _floats(series.get("fragmentation"))) else {},
                    xlabel,
                    "of free GPUs",
                    percent=True,
                )
            ],
        ),
        _Plot(
            "queue_delay_hist.png",
            [_Hist(_floats(_at(hist, "edges_s")), _floats(_at(hist, "counts")))],
        ),
    ]
    for by in ("site", "tenant"):
        bars = [
            _Bars(f"{key} ({unit})", _top_bars(_numbers(_at(results, key, f"by_{by}"))), fmt)
            for key, _, _, fmt, unit in _FOOTPRINT
        ]
        height = 1.2 + 0.3 * max(len(b.values) for b in bars)
        plots.append(_Plot(f"footprint_by_{by}.png", bars, ncols=3, size=(4.5, height)))
    if results.get("inference") is not None:
        inference = _at(results, "inference", "series")
        xi, xlabel_i = _time_axis(_floats(_at(inference, "t_s")))
        slo = _Lines(
            xi, _series(_at(inference, "slo_attainment")), xlabel_i, "SLO attainment", percent=True
        )
        load = _top_lines(_series(_at(inference, "site_load")), {})
        plots.append(_Plot("inference_slo.png", [slo]))
        plots.append(
            _Plot("inference_site_load.png", [_Lines(xi, load, xlabel_i, "load", reference=1.0)])
        )
    plots += _tenancy_plots(results, x, xlabel)
    plots += _service_plots(results)
    horizon = _f(results, "scenario", "horizon_s") or max(t, default=0.0)
    down: dict[str, list[tuple[float, float]]] = {}
    for f in _failures(results):
        if (start := _f(f, "down_s")) is not None:
            end = _f(f, "up_s")
            down.setdefault(str(f.get("site")), []).append((start, horizon if end is None else end))
    horizon = max([horizon] + [end for spans in down.values() for _, end in spans])
    plots.append(
        _Plot("site_timeline.png", [_Timeline(down, horizon)], size=(9.0, 1.2 + 0.45 * len(down)))
    )
    return _with_data(plots)


def _tenancy_plots(results: Results, x: Sequence[float], xlabel: str) -> list[_Plot]:
    """Shares against targets (the policy's and the baseline's), borrowing, preemptions."""
    tenancy = _map(results.get("tenancy"))
    if not tenancy:
        return []
    series = _map(tenancy.get("series"))
    policy = str(tenancy.get("policy") or NONE)
    panels = [
        _Shares(x, _series(series.get("share")), _series(series.get("target")), xlabel, policy)
    ]
    base = _map(tenancy.get("baseline"))
    if base:
        theirs = _map(base.get("series"))
        label = f"{base.get('policy') or 'baseline'} (baseline)"
        panels.append(
            _Shares(x, _series(theirs.get("share")), _series(theirs.get("target")), xlabel, label)
        )
    borrowed = _Lines(
        x, _series(series.get("borrowed_gpus")), xlabel, "GPUs above quota", "borrowed"
    )
    preempted = _Lines(
        x, _series(series.get("preempted")), xlabel, "jobs (cumulative)", "preempted"
    )
    return [
        _Plot("tenant_shares.png", panels, ncols=2, size=(7.0, 4.0)),
        _Plot("tenant_preemption.png", [borrowed, preempted], ncols=2, size=(7.0, 3.6)),
    ]


# -- the comparison's plots ----------------------------------------------------------------


def _charted(figures: Sequence[Mapping[str, Any]]) -> list[tuple[str, list[float | None], _Fmt]]:
    """(title, a value per scenario, label format) of each figure the comparison plots show."""
    delays = [_num(f["queue_delay_p95_s"]) for f in figures]
    div, unit = _time_unit(max((d for d in delays if d is not None), default=0.0))
    return [
        (
            f"queue delay p95 ({unit})",
            [None if d is None else d / div for d in delays],
            lambda v: format_duration(v * div),
        ),
        ("cost (USD)", [_num(f["cost_usd"]) for f in figures], format_money),
        ("SLO attainment", [_num(f["slo_attainment"]) for f in figures], format_percent),
        ("GPU utilization", [_num(f["gpu_utilization"]) for f in figures], format_percent),
    ]


def _comparison_plots(
    figures: Sequence[Mapping[str, Any]],
    labels: Sequence[str],
    sweep: tuple[str, Sequence[float | str]] | None,
) -> list[_Plot]:
    charted = _charted(figures)
    bars = [_Bars(title, dict(zip(labels, ys, strict=True)), fmt) for title, ys, fmt in charted]
    plots = [_Plot("comparison.png", bars, ncols=2, size=(6.0, 1.2 + 0.4 * len(labels)))]
    if sweep is not None:
        parameter, values = sweep
        numeric = all(_num(v) is not None for v in values)
        x = [float(v) if numeric else float(i) for i, v in enumerate(values)]
        order = sorted(range(len(x)), key=x.__getitem__)  # a line runs left to right
        ticks = None if numeric else [str(v) for v in values]
        lines = [
            _Lines(
                [x[i] for i in order],
                {title: [_nan(ys[i]) for i in order]},
                parameter,
                title=title,
                percent=fmt is format_percent,
                xticks=ticks,
            )
            for title, ys, fmt in charted
        ]
        plots.append(_Plot("sweep.png", lines, ncols=2, size=(6.0, 3.6)))
    return _with_data(plots)


def _nan(value: float | None) -> float:
    return math.nan if value is None else value
