"""The HTML pages of the simulation report and of comparisons, and the folders they are
written to (docs/simulation-report.md).

`write_report` writes one scenario's results.json, PNG plots (simulations.plots) and its
self-contained index.html; `write_comparison` writes the comparison's page, comparison.json
and each scenario's report in a folder of its own. `write_report_page` and
`write_comparison_page` write the pages alone.

How: the tables come from simulations.report (its summary's sections, the comparison's rows);
only `write_*` write, and only under the folder they are given; every string from the results
is HTML-escaped.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from simulations.figures import (
    NONE,
    ReportError,
    Results,
    _at,
    _check,
    _f,
    _int,
    _map,
    _name,
    _or_none,
    format_duration,
    format_percent,
    slug,
)
from simulations.plots import (
    _REPORT_PLOTS,
    PLOTS,
    _comparison_plots,
    _plan_plots,
    _Plot,
    _save_all,
)
from simulations.report import (
    _ELECTRICITY,
    _FOOTPRINT,
    _figures_of,
    _grid,
    _labels,
    _numeric,
    _sections,
    _unique,
)

__all__ = [
    "write_comparison",
    "write_comparison_page",
    "write_report",
    "write_report_page",
]

# -- HTML ---------------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:75em;padding:0 1em;color:#222}
h1{margin-bottom:.2em}.meta{color:#666;margin-top:0}
table{border-collapse:collapse;margin:.5em 0 1.5em}
th,td{padding:.25em .8em;border-bottom:1px solid #ddd;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
td.best{font-weight:bold;color:#176b2c}figure{margin:1.5em 0}img{max-width:100%}
figcaption{color:#666}
"""


class _Raw(str):
    """Markup built here (a link), not escaped again; every other string is."""

    __slots__ = ()


_Cells = Sequence[str | tuple[str, str]]  # a cell: text, or (text, css class)


def _cell(text: str, cls: str = "", tag: str = "td") -> str:
    body = text if isinstance(text, _Raw) else html.escape(text)
    return f"<{tag}{f' class={chr(34)}{cls}{chr(34)}' if cls else ''}>{body}</{tag}>"


def _table(header: Sequence[str], rows: Sequence[_Cells]) -> str:
    out = ["<table>"]
    if header:
        out.append("<tr>" + "".join(_cell(h, tag="th") for h in header) + "</tr>")
    for row in rows:
        out.append(
            "<tr>" + "".join(_cell(*c) if isinstance(c, tuple) else _cell(c) for c in row) + "</tr>"
        )
    return "\n".join([*out, "</table>"])


def _page(title: str, body: Sequence[str], plots: Sequence[str]) -> str:
    figures = [
        f'<figure><img src="{file}" alt="{PLOTS[file]}">'
        f"<figcaption>{PLOTS[file]}</figcaption></figure>"
        for file in plots
    ]
    return "\n".join(
        [
            '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">',
            f"<title>{html.escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>",
            f"<h1>{html.escape(title)}</h1>",
            *body,
            *(["<h2>Plots</h2>"] if plots else []),
            *figures,
            "</body>\n</html>\n",
        ]
    )


def _by_site(results: Results) -> list[_Cells]:
    specs, use = _map(_at(results, "scenario", "sites")), _map(results.get("utilization"))
    rows: list[_Cells] = []
    for site in sorted(set(map(str, specs)) | set(map(str, use))):
        gpus = ", ".join(f"{n}× {m}" for m, n in sorted(_map(_at(specs, site, "gpus")).items()))
        figures = [format_percent(_f(use, site, "gpu")), format_percent(_f(use, site, "cpu"))]
        figures += [
            _or_none(_f(results, key, "by_site", site), fmt)
            for key, _, fmt, _, _ in (*_FOOTPRINT, _ELECTRICITY)
        ]
        rows.append(
            [
                site,
                str(_at(specs, site, "region") or ""),
                gpus or NONE,
                (f"{_int(specs, site, 'cores'):,}", "num"),
                *((f, "num") for f in figures),
            ]
        )
    return rows


def _by_tenant(results: Results) -> list[_Cells]:
    tenants = sorted(
        {str(t) for key, *_ in _FOOTPRINT for t in _map(_at(results, key, "by_tenant"))}
    )
    return [
        [
            t,
            *(
                (_or_none(_f(results, key, "by_tenant", t), fmt), "num")
                for key, _, fmt, _, _ in _FOOTPRINT
            ),
        ]
        for t in tenants
    ]


def _by_workload(results: Results) -> list[_Cells]:
    workloads = _map(_at(results, "jobs", "by_workload"))
    return [
        [
            str(w),
            (f"{_int(v, 'arrived'):,}", "num"),
            (f"{_int(v, 'completed'):,}", "num"),
            (format_duration(_f(v, "queue_delay_p95_s")), "num"),
        ]
        for w, v in sorted(workloads.items())
    ]


def _report_html(results: Results, plots: Sequence[_Plot]) -> str:
    body = []
    for section in _sections(results, top=len(_map(results.get("utilization")))):
        columns = list(zip(*section.rows, strict=True))
        num = [bool(section.header) and i > 0 and _numeric(c) for i, c in enumerate(columns)]
        rows = [
            [(c, "num" if n else "") for c, n in zip(r, num, strict=True)] for r in section.rows
        ]
        body += [f"<h2>{html.escape(section.title)}</h2>", _table(section.header or (), rows)]
    for title, header, cells in (
        (
            "Sites",
            [
                "site",
                "region",
                "GPUs",
                "cores",
                "GPU util",
                "CPU util",
                "cost",
                "energy",
                "carbon",
                "electricity",
            ],
            _by_site(results),
        ),
        ("Tenants", ["tenant", "cost", "energy", "carbon"], _by_tenant(results)),
        (
            "Workloads",
            ["workload", "arrived", "completed", "queue delay p95"],
            _by_workload(results),
        ),
    ):
        if cells:
            body += [f"<h2>{title}</h2>", _table(header, cells)]
    body.append('<p class="meta">Every figure: <a href="results.json">results.json</a></p>')
    return _page(f"cpn simulation: {_name(results)}", body, [p.file for p in plots])


def write_report_page(results: Results, out_dir: Path) -> Path:
    """The PNG plots and index.html of checked `results` in `out_dir`; returns index.html."""
    plots = _plan_plots(results)
    _save_all(plots, out_dir, _REPORT_PLOTS)
    index = out_dir / "index.html"
    index.write_text(_report_html(results, plots), encoding="utf-8")
    return index


# -- the comparison page ------------------------------------------------------------------------


def write_comparison_page(
    figures: Sequence[Mapping[str, Any]],
    out_dir: Path,
    *,
    slugs: Sequence[str],
    sweep: tuple[str, Sequence[float | str]] | None,
) -> Path:
    """comparison.png, sweep.png and index.html in `out_dir`, a column per `key_figures` entry
    linking to out_dir/<slug>/index.html; returns index.html."""
    labels = _labels(figures)
    plots = _comparison_plots(figures, labels, sweep)
    _save_all(plots, out_dir, ("comparison.png", "sweep.png"))

    links = [
        _Raw(f'<a href="{html.escape(s)}/index.html">{html.escape(lb)}</a>')
        for s, lb in zip(slugs, labels, strict=True)
    ]
    rows: list[_Cells] = [[sweep[0], *((str(v), "num") for v in sweep[1])]] if sweep else []
    for label, cells in _grid(figures):
        rows.append([label, *((t + " *", "num best") if best else (t, "num") for t, best in cells)])
    note = (
        '<p class="meta">* best of the row. A name links to that scenario\'s full report; '
        'the figures are in <a href="comparison.json">comparison.json</a>.</p>'
    )
    title = f"cpn simulation: {len(figures)} scenarios compared"
    index = out_dir / "index.html"
    index.write_text(
        _page(title, [note, _table(["", *links], rows)], [p.file for p in plots]),
        encoding="utf-8",
    )
    return index


# -- the folders: results.json / comparison.json beside the pages ----------------------------


def _dump(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, sort_keys=True, indent=1) + "\n", encoding="utf-8")


def write_report(results: Results, out_dir: Path) -> Path:
    """results.json, the PNG plots and index.html in `out_dir` (created); returns index.html."""
    results = _check(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    _dump(out_dir / "results.json", results)
    return write_report_page(results, out_dir)


def write_comparison(
    results_list: Sequence[Results],
    out_dir: Path,
    *,
    sweep: tuple[str, Sequence[float | str]] | None = None,
) -> Path:
    """The comparison page, comparison.json and each scenario's report in out_dir/<slug>/.

    With `sweep=(parameter, values)`, one value per result in the same order, the key figures
    are also plotted against the parameter. Returns out_dir/index.html.
    """
    figures = _figures_of(results_list)
    if sweep is not None and len(sweep[1]) != len(figures):
        raise ReportError(f"{len(sweep[1])} sweep values for {len(figures)} results", field="sweep")
    names = [str(f["name"]) for f in figures]
    slugs = _unique([slug(n) for n in names], lambda s, n: f"{s}-{n}")
    out_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for i, (results, folder) in enumerate(zip(results_list, slugs, strict=True)):
        write_report(results, out_dir / folder)
        extra = {"sweep": {"parameter": sweep[0], "value": sweep[1][i]}} if sweep else {}
        records.append({**figures[i], "slug": folder, **extra})
    _dump(out_dir / "comparison.json", records)
    return write_comparison_page(figures, out_dir, slugs=slugs, sweep=sweep)
