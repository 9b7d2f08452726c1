"""The simulation report: terminal summary, HTML report with PNGs, side-by-side comparisons."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest

from simulations import figures, plots, report
from simulations.pages import write_comparison, write_report
from simulations.report import (
    ReportError,
    compare_text,
    format_duration,
    format_money,
    format_percent,
    key_figures,
    overall_gpu_utilization,
    overall_slo,
    summary_text,
)

PNG = b"\x89PNG\r\n\x1a\n"
HOUR = 3600.0
SITES = {
    "gy-1": {"region": "guiyang", "gpus": {"H100": 64}, "cores": 512},
    "wh-1": {"region": "wuhan", "gpus": {"H20": 32}, "cores": 256},
    "fra-1": {"region": "frankfurt", "gpus": {}, "cores": 128},
}


def make_results(
    name: str = "baseline",
    *,
    inference: bool = True,
    failure: bool = True,
    scale: float = 1.0,
    policy: str = "cost",
) -> dict[str, Any]:
    """Results as the simulator writes them: 3 sites, 2 tenants, 2 days, hourly samples.

    `scale` multiplies delays, cost, energy and carbon, so scenarios differ predictably.
    """
    t = [i * HOUR for i in range(49)]
    wave = [0.5 + 0.5 * math.sin(i / 4) for i in range(49)]
    results: dict[str, Any] = {
        "schema": "cpn.simulation/v1",
        "scenario": {
            "name": name,
            "file": "scenarios/baseline.yaml",
            "seed": 7,
            "horizon_s": 48 * HOUR,
            "policy": policy,
            "sites": copy.deepcopy(SITES),
            "edits": ["wh-1: +16 H20"],
        },
        "run": {"wall_s": 3.2, "jobs_per_s": 375.0, "events": 123456},
        "jobs": {
            "arrived": 1200,
            "placed": 1150,
            "completed": 1100,
            "failed": 10,
            "pending_at_end": 50,
            "running_at_end": 40,
            "migrations": 3,
            "queue_delay_s": {
                "mean": 300.0 * scale,
                "p50": 42.0 * scale,
                "p95": 192.0 * scale,
                "p99": 18720.0 * scale,
                "max": 172800.0 * scale,
            },
            "queue_delay_hist": {
                "edges_s": [0.0, 1.0, 10.0, 100.0, 1000.0, 10000.0],
                "counts": [100, 300, 400, 250, 50],
            },
            "completion_time_s": {
                "mean": 5000.0,
                "p50": 3600.0 * scale,
                "p95": 20000.0,
                "p99": 86400.0 * scale,
                "max": 150000.0,
            },
            "unplaced": {"count": 50, "reasons": {"gpus": 30, "region": 12, "model": 8}},
            "by_workload": {
                "training": {"arrived": 200, "completed": 150, "queue_delay_p95_s": 900.0},
                "batch": {"arrived": 1000, "completed": 950, "queue_delay_p95_s": None},
            },
            "littles_law": {
                "arrival_rate_per_s": 0.00694,
                "mean_wait_s": 300.0,
                "mean_queue_length": 2.1,
                "lambda_w": 2.08,
                "relative_error": 0.012,
            },
        },
        "series": {
            "t_s": t,
            "pending": [int(20 * w) for w in wave],
            "running": [int(80 * w) for w in wave],
            "gpu_utilization": {"gy-1": [0.9 * w for w in wave], "wh-1": [0.4 * w for w in wave]},
            "cpu_utilization": {site: [0.3] * 49 for site in SITES},
            "site_up": {site: [True] * 49 for site in SITES},
        },
        "utilization": {
            "gy-1": {"gpu": 0.873, "cpu": 0.5, "gpus_total": 64, "cores_total": 512},
            "wh-1": {"gpu": 0.45, "cpu": 0.4, "gpus_total": 32, "cores_total": 256},
            "fra-1": {"gpu": None, "cpu": 0.3, "gpus_total": 0, "cores_total": 128},
        },
        "inference": None,
        "cost": {
            "total_usd": 12345.0 * scale,
            "by_site": {"gy-1": 8000.0 * scale, "wh-1": 3000.0 * scale, "fra-1": 1345.0 * scale},
            "by_tenant": {"acme": 9000.0 * scale, "beta": 3345.0 * scale},
        },
        "energy": {
            "total_kwh": 4567.8 * scale,
            "by_site": {"gy-1": 3000.0, "wh-1": 1200.0, "fra-1": 367.8},
            "by_tenant": {"acme": 3500.0, "beta": 1067.8},
        },
        "carbon": {
            "total_kg": 2345.6 * scale,
            "by_site": {"gy-1": 1500.0, "wh-1": 700.0, "fra-1": 145.6},
            "by_tenant": {"acme": 1800.0, "beta": 545.6},
        },
        "electricity_usd": {"total_usd": 456.0, "by_site": {"gy-1": 300.0, "wh-1": 156.0}},
        "failures": [],
    }
    if inference:
        results["inference"] = {
            "step_s": 60.0,
            "regions": {
                "beijing": {
                    "service": "llm-chat",
                    "requests": 1000.0,
                    "p50_ms": 12.0,
                    "p95_ms": 40.0,
                    "p99_ms": 80.0,
                    "slo_ms": 100.0,
                    "slo_attainment": 0.992,
                    "in_region_share": 0.8,
                    "dropped": 0.0,
                },
                "frankfurt": {
                    "service": "llm-chat",
                    "requests": 4000.0,
                    "p50_ms": 20.0,
                    "p95_ms": 90.0,
                    "p99_ms": 150.0 * scale,
                    "slo_ms": 120.0,
                    "slo_attainment": 0.9 / scale if scale >= 1 else 0.95,
                    "in_region_share": 1.0,
                    "dropped": 4.0,
                },
            },
            "series": {
                "t_s": t,
                "slo_attainment": {"beijing": [0.99] * 49, "frankfurt": [0.9] * 49},
                "site_load": {"gy-1": wave, "wh-1": [0.3] * 49, "fra-1": [1.1] * 49},
            },
        }
    if failure:
        results["failures"] = [
            {
                "site": "wh-1",
                "down_s": 10 * HOUR,
                "up_s": 15 * HOUR,
                "jobs_moved": 12,
                "jobs_failed": 2,
            },
            {"site": "fra-1", "down_s": 40 * HOUR, "up_s": None, "jobs_moved": 0, "jobs_failed": 1},
        ]
        results["series"]["site_up"]["wh-1"] = [not 10 <= i < 15 for i in range(49)]
    return results


def zero_jobs() -> dict[str, Any]:
    """A run where nothing arrived: every statistic null, every breakdown empty."""
    results = make_results("idle", inference=False, failure=False)
    nulls = dict.fromkeys(("mean", "p50", "p95", "p99", "max"))
    results["jobs"] = {
        "arrived": 0,
        "placed": 0,
        "completed": 0,
        "failed": 0,
        "pending_at_end": 0,
        "running_at_end": 0,
        "migrations": 0,
        "queue_delay_s": dict(nulls),
        "queue_delay_hist": {"edges_s": [0.0, 1.0], "counts": [0]},
        "completion_time_s": dict(nulls),
        "unplaced": {"count": 0, "reasons": {}},
        "by_workload": {},
        "littles_law": {},
    }
    results["series"] = {"t_s": [], "pending": [], "running": [], "gpu_utilization": {}}
    results["utilization"] = {}
    for key in ("cost", "energy", "carbon"):
        results[key] = {"by_site": {}, "by_tenant": {}}
    results["cost"]["total_usd"] = 0.0
    return results


def flat(text: str) -> str:
    """Whitespace collapsed, so a value rich wrapped onto two lines still reads as one."""
    return " ".join(text.split())


# -- formatting ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0 s"),
        (0.35, "350 ms"),
        (0.9996, "1.0 s"),
        (4.24, "4.2 s"),
        (9.96, "10 s"),
        (42, "42 s"),
        (59.4, "59 s"),
        (59.6, "1.0 min"),
        (192, "3.2 min"),
        (3590, "59.8 min"),
        (3599, "1.0 h"),  # 59.98 min would round to "60.0 min": the next unit reads better
        (3600, "1.0 h"),
        (18360, "5.1 h"),
        (86339, "1.0 d"),
        (172800, "2.0 d"),
        (400 * 86400, "400.0 d"),
        (-90, "-1.5 min"),
        (None, "none"),
        (math.inf, "none"),
        (math.nan, "none"),
    ],
)
def test_format_duration(seconds: float | None, text: str) -> None:
    assert format_duration(seconds) == text


def test_format_money_and_percent() -> None:
    assert format_money(12345.4) == "$12,345"
    assert format_money(4.2) == "$4.20"
    assert format_money(99.999) == "$100"
    assert format_money(-1500) == "-$1,500"
    assert format_money(None) == "none"
    assert format_percent(0.8734) == "87.3%"
    assert format_percent(1.0) == "100.0%"
    assert format_percent(None) == "none"
    # request counts in the narrow inference column
    shorts = [figures._short(v) for v in (9999, 10_000, 48_400, 999_499, 999_500, 57_024_000)]
    assert shorts == ["9,999", "10k", "48k", "999k", "1.0M", "57.0M"]


# -- aggregates ---------------------------------------------------------------------------------


def test_overall_gpu_utilization_is_gpu_weighted() -> None:
    # (0.873 * 64 + 0.45 * 32) / 96; fra-1 has no GPUs and counts for nothing
    assert overall_gpu_utilization(make_results()) == pytest.approx(0.732)
    assert overall_gpu_utilization(zero_jobs()) is None


def test_overall_slo_is_request_weighted() -> None:
    # (0.992 * 1000 + 0.9 * 4000) / 5000; a plain mean would say 0.946
    assert overall_slo(make_results()) == pytest.approx(0.9184)
    assert overall_slo(make_results(inference=False)) is None
    results = make_results()
    for region in results["inference"]["regions"].values():
        region["requests"] = 0.0
    assert overall_slo(results) is None


def test_overall_slo_counts_a_region_that_met_nothing() -> None:
    results = make_results()
    results["inference"]["regions"]["frankfurt"]["slo_attainment"] = 0.0
    assert overall_slo(results) == pytest.approx(0.1984)


# -- terminal summary ---------------------------------------------------------------------------


def test_summary_text_shows_the_figures() -> None:
    text = summary_text(make_results(), width=100)
    lines = flat(text)
    assert "1,200 arrived · 1,100 completed · 10 failed" in lines
    assert "50 pending · 40 running · 3 migrations" in lines
    assert "queue delay p50 42 s · p95 3.2 min · p99 5.2 h · max 2.0 d" in lines
    assert "completion (JCT) p50 1.0 h · p95 5.6 h · p99 1.0 d" in lines
    assert "unplaced 50: gpus 30, region 12, model 8" in lines
    assert "L 2.10 vs λW 2.08 (error 1.2%)" in lines
    assert "overall 73.2% GPU-weighted" in lines
    assert "cost $12,345 gy-1 $8,000, wh-1 $3,000, fra-1 $1,345 acme $9,000, beta $3,345" in lines
    assert "energy 4,568 kWh gy-1 3,000, wh-1 1,200, fra-1 368 acme 3,500, beta 1,068" in lines
    assert "carbon 2,346 kg CO2e gy-1 1,500, wh-1 700, fra-1 146 acme 1,800, beta 546" in lines
    assert "electricity $456 gy-1 $300, wh-1 $156" in lines
    assert "beijing llm-chat 1,000 12.0 ms 80.0 ms 100 ms 99.2% 80.0%" in lines
    assert "frankfurt llm-chat 4,000 20.0 ms 150 ms 120 ms 90.0% 100.0%" in lines
    assert "all 5,000 91.8%" in lines  # request-weighted
    assert "wh-1 10.0 h 15.0 h 12 2" in lines
    assert "fra-1 1.7 d not back 0 1" in lines
    assert "what-if wh-1: +16 H20" in lines
    assert "horizon 2.0 d file scenarios/baseline.yaml" in lines
    assert "\x1b[" not in text  # no colour codes
    assert max(len(line) for line in text.splitlines()) <= 100


def test_summary_lists_sites_by_utilization_high_to_low() -> None:
    results = make_results()
    for i in range(12):
        results["utilization"][f"x-{i:02d}"] = {"gpu": i / 100, "gpus_total": 8}
    lines = flat(summary_text(results, width=100, top=3))
    assert "gy-1 87.3% of 64 GPUs wh-1 45.0% of 32 GPUs x-11 11.0% of 8 GPUs" in lines
    assert "+11 more sites" in lines
    assert "x-10" not in lines


def test_summary_without_inference_or_failures() -> None:
    lines = flat(summary_text(make_results(inference=False, failure=False)))
    assert "Inference" not in lines
    assert lines.endswith("Failures none")


def test_summary_of_zero_jobs_says_none() -> None:
    lines = flat(summary_text(zero_jobs()))
    assert "0 arrived · 0 completed · 0 failed" in lines
    assert "queue delay none" in lines
    assert "completion (JCT) none" in lines
    assert "unplaced none" in lines
    assert "GPU utilization overall none" in lines
    assert "cost $0.00" in lines
    assert "energy none" in lines
    assert "Little's law" not in lines


def test_summary_does_not_read_names_as_markup() -> None:
    results = make_results("[bold]red[/bold] <script>")
    assert "[bold]red[/bold] <script>" in summary_text(results)


def test_the_schema_is_the_simulators() -> None:
    from simulations import results

    assert report.SCHEMA == results.SCHEMA


def test_another_schema_is_refused() -> None:
    results = make_results()
    results["schema"] = "cpn.simulation/v2"
    with pytest.raises(ReportError) as info:
        summary_text(results)
    assert info.value.field == "schema"
    assert "cpn.simulation/v2" in info.value.message
    with pytest.raises(ReportError) as info:
        write_report([], Path("unused"))  # type: ignore[arg-type]
    assert info.value.field == "schema"


# -- the HTML report ----------------------------------------------------------------------------

ALL_PNGS = {
    "gpu_utilization.png",
    "jobs.png",
    "queue_delay_hist.png",
    "footprint_by_site.png",
    "footprint_by_tenant.png",
    "inference_slo.png",
    "inference_site_load.png",
    "site_timeline.png",
}


def pngs(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("*.png")}


def test_write_report_writes_json_html_and_every_plot(tmp_path: Path) -> None:
    results = make_results()
    index = write_report(results, tmp_path / "out")
    assert results == make_results()  # not mutated
    assert index == tmp_path / "out" / "index.html"
    assert json.loads((tmp_path / "out" / "results.json").read_text()) == results
    text = (tmp_path / "out" / "results.json").read_text()
    assert text == json.dumps(results, sort_keys=True, indent=1) + "\n"
    assert pngs(tmp_path / "out") == ALL_PNGS
    for name in ALL_PNGS:
        data = (tmp_path / "out" / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 2000, name
    page = index.read_text()
    assert page.startswith("<!doctype html>")
    for name in ALL_PNGS:
        assert f'<img src="{name}"' in page
    assert '<a href="results.json">' in page
    assert "$12,345" in page and "91.8%" in page and "87.3%" in page
    assert "<th>tenant</th>" in page and "<td>acme</td>" in page
    assert "<td>training</td>" in page
    # self-contained: no external script, stylesheet, font or image
    assert "<script" not in page and "<link" not in page and "http" not in page


def test_write_report_skips_plots_without_data(tmp_path: Path) -> None:
    write_report(make_results(inference=False, failure=False), tmp_path)
    assert pngs(tmp_path) == ALL_PNGS - {
        "inference_slo.png",
        "inference_site_load.png",
        "site_timeline.png",
    }
    page = (tmp_path / "index.html").read_text()
    assert "inference_slo.png" not in page and "site_timeline.png" not in page


def test_write_report_skips_inference_plots_without_series(tmp_path: Path) -> None:
    results = make_results(failure=False)
    results["inference"]["series"] = {"t_s": [], "slo_attainment": {}, "site_load": {}}
    page = write_report(results, tmp_path).read_text()
    assert not pngs(tmp_path) & {"inference_slo.png", "inference_site_load.png"}
    assert "<td>frankfurt</td>" in page  # the per-region table stays


def test_write_report_again_removes_plots_the_new_results_lack(tmp_path: Path) -> None:
    write_report(make_results(), tmp_path)
    (tmp_path / "notes.png").write_bytes(b"mine")
    write_report(make_results(inference=False, failure=False), tmp_path)
    assert pngs(tmp_path) == ALL_PNGS - {
        "inference_slo.png",
        "inference_site_load.png",
        "site_timeline.png",
    } | {"notes.png"}  # a file the report did not write is left alone


def test_write_report_of_zero_jobs(tmp_path: Path) -> None:
    index = write_report(zero_jobs(), tmp_path)
    assert pngs(tmp_path) == set()
    page = index.read_text()
    assert "<h2>Plots</h2>" not in page
    assert "<td>none</td>" in page


def test_write_report_escapes_strings_from_the_results(tmp_path: Path) -> None:
    results = make_results('<script>alert("x")</script>')
    results["scenario"]["edits"] = ["<img src=x onerror=alert(1)>"]
    results["cost"]["by_tenant"] = {"<b>t</b>": 1.0}
    page = write_report(results, tmp_path).read_text()
    assert "<script" not in page and "<img src=x" not in page and "<b>t</b>" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    assert "&lt;b&gt;t&lt;/b&gt;" in page


def test_write_report_is_deterministic(tmp_path: Path) -> None:
    write_report(make_results(), tmp_path / "a")
    write_report(make_results(), tmp_path / "b")
    for path in sorted((tmp_path / "a").iterdir()):
        assert path.read_bytes() == (tmp_path / "b" / path.name).read_bytes(), path.name


def test_many_sites_are_drawn_as_the_busiest_and_other() -> None:
    series = {f"s{i:02d}": [i / 20] * 3 for i in range(20)}
    weights = {f"s{i:02d}": 1.0 if i < 4 else 0.0 for i in range(20)}
    weights["s00"] = 3.0
    lines = plots._top_lines(series, weights)
    assert list(lines)[:2] == ["s19", "s18"] and len(lines) == 16
    # s00..s04: weights 3, 1, 1, 1, 0 -> (0 * 3 + 0.05 + 0.1 + 0.15) / 6
    assert lines["other"] == pytest.approx([0.05] * 3)


# -- comparisons --------------------------------------------------------------------------------


def row(text: str, label: str) -> list[str]:
    """The cells of one row of compare_text, split on runs of 2+ spaces."""
    line = next(line for line in text.splitlines() if line.strip().startswith(label))
    return [cell.strip() for cell in line.strip()[len(label) :].split("  ") if cell.strip()]


def header(text: str) -> list[str]:
    """The column names of compare_text: the line above the rule."""
    lines = text.splitlines()
    above = lines[next(i for i, line in enumerate(lines) if "───" in line) - 1]
    return [cell.strip() for cell in above.split("  ") if cell.strip()]


def test_compare_text_marks_the_best_of_each_row() -> None:
    fast = make_results("fast", scale=0.5, policy="latency")
    base = make_results("base")
    slow = make_results("slow", scale=2.0, failure=False)
    text = compare_text([fast, base, slow], width=160)
    assert row(text, "policy") == ["latency", "cost", "cost"]
    assert header(text) == ["fast", "base", "slow"]
    assert row(text, "queue delay p95") == ["1.6 min *", "3.2 min", "6.4 min"]
    assert row(text, "queue delay p99") == ["2.6 h *", "5.2 h", "10.4 h"]
    assert row(text, "cost") == ["$6,172 *", "$12,345", "$24,690"]
    assert row(text, "carbon") == ["1,173 kg CO2e *", "2,346 kg CO2e", "4,691 kg CO2e"]
    # higher is better for SLO; fast's frankfurt reaches 95%, base 90%, slow 45%
    assert row(text, "SLO attainment") == ["95.8% *", "91.8%", "55.8%"]
    assert row(text, "SLO worst region") == [
        "95.0% (frankfurt) *",
        "90.0% (frankfurt)",
        "45.0% (frankfurt)",
    ]
    assert row(text, "p99 worst region") == [
        "80.0 ms (beijing) *",
        "150 ms (frankfurt)",
        "300 ms (frankfurt)",
    ]
    # all equal: no winner; no "best" defined: no mark
    assert row(text, "jobs completed") == ["1,100", "1,100", "1,100"]
    assert row(text, "GPU utilization") == ["73.2%", "73.2%", "73.2%"]
    assert row(text, "failures") == ["2", "2", "0"]
    assert "* best of the row" in text


def test_compare_ties_for_best_are_all_marked_and_none_never_wins() -> None:
    a, b = make_results("a"), make_results("b")
    c = make_results("c", inference=False)
    c["jobs"]["completed"] = 1000
    c["cost"]["total_usd"] = None
    c["scenario"]["name"] = "a"
    text = compare_text([a, b, c], width=160)
    assert header(text) == ["a", "b", "a #2"]  # a repeated name is told apart
    assert row(text, "jobs completed") == ["1,100 *", "1,100 *", "1,000"]
    assert row(text, "cost") == ["$12,345", "$12,345", "none"]
    assert row(text, "SLO attainment") == ["91.8%", "91.8%", "none"]


def test_compare_does_not_crown_a_difference_below_the_display() -> None:
    a, b = make_results("a"), make_results("b")
    b["cost"]["total_usd"] = 12345.2  # both read "$12,345"
    b["jobs"]["queue_delay_s"]["p95"] = 180.0  # "3.0 min" beats "3.2 min"
    text = compare_text([a, b], width=160)
    assert row(text, "cost") == ["$12,345", "$12,345"]
    assert row(text, "queue delay p95") == ["3.2 min", "3.0 min *"]


def test_compare_of_nothing_is_refused() -> None:
    with pytest.raises(ReportError) as info:
        compare_text([])
    assert info.value.field == "results_list"


def test_key_figures() -> None:
    figures = key_figures(make_results())
    assert figures["queue_delay_p95_s"] == 192.0
    assert figures["slo_worst"] == 0.9 and figures["slo_worst_region"] == "frankfurt"
    assert figures["p99_worst_ms"] == 150.0 and figures["p99_worst_region"] == "frankfurt"
    assert figures["failures"] == 2 and figures["jobs_completed"] == 1100
    idle = key_figures(zero_jobs())
    assert idle["queue_delay_p50_s"] is None and idle["slo_attainment"] is None
    assert idle["gpu_utilization"] is None


def test_write_comparison_with_a_sweep(tmp_path: Path) -> None:
    runs = [
        make_results("GPUs +0%", scale=2.0),
        make_results("GPUs +0%"),
        make_results("gpus-0", scale=0.5),
        make_results("", inference=False),
    ]
    index = write_comparison(runs, tmp_path, sweep=("extra GPUs", [0, 16, 32, 64]))
    slugs = ["gpus-0", "gpus-0-2", "gpus-0-3", "unnamed"]
    for slug in slugs:
        assert (tmp_path / slug / "index.html").is_file()
        assert (tmp_path / slug / "results.json").is_file()
    assert pngs(tmp_path / "gpus-0") == ALL_PNGS
    assert pngs(tmp_path / "unnamed") == ALL_PNGS - {"inference_slo.png", "inference_site_load.png"}
    assert pngs(tmp_path) == {"comparison.png", "sweep.png"}
    for name in ("comparison.png", "sweep.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG)
    records = json.loads((tmp_path / "comparison.json").read_text())
    assert [r["slug"] for r in records] == slugs
    assert [r["sweep"] for r in records] == [
        {"parameter": "extra GPUs", "value": v} for v in (0, 16, 32, 64)
    ]
    assert records[2]["cost_usd"] == pytest.approx(6172.5)
    assert records[3]["slo_attainment"] is None
    page = index.read_text()
    for slug in slugs:
        assert f'<a href="{slug}/index.html">' in page
    assert "GPUs +0% #2" in page  # a repeated name is told apart
    assert '<td class="num best">$6,172 *</td>' in page
    assert "<td>extra GPUs</td>" in page
    assert '<img src="sweep.png"' in page and '<img src="comparison.png"' in page


def test_write_comparison_without_sweep_and_with_text_values(tmp_path: Path) -> None:
    runs = [make_results("a"), make_results("b")]
    write_comparison(runs, tmp_path / "plain")
    assert pngs(tmp_path / "plain") == {"comparison.png"}
    assert "sweep" not in json.loads((tmp_path / "plain" / "comparison.json").read_text())[0]
    write_comparison(runs, tmp_path / "named", sweep=("policy", ["cost", "latency"]))
    assert (tmp_path / "named" / "sweep.png").read_bytes().startswith(PNG)


def test_write_comparison_refuses_a_sweep_of_the_wrong_length(tmp_path: Path) -> None:
    with pytest.raises(ReportError) as info:
        write_comparison([make_results()], tmp_path, sweep=("gpus", [1, 2]))
    assert info.value.field == "sweep"
    assert not (tmp_path / "baseline").exists()  # refused before writing anything
