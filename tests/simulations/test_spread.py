"""Results over several seeds and their spread: simulations.spread (the statistics, the key
figures of a run) and `cpn simulate --seeds` (the runs, the table, seeds.json, bad input)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from simulations.cli import simulate_main
from simulations.engine import Simulation
from simulations.figures import ReportError, format_duration
from simulations.scenario import load_scenario
from simulations.spread import (
    FIGURES,
    Spread,
    over_seeds,
    seed_figures,
    spread,
    t_quantile,
    within_noise,
)
from tests.simulations.test_engine import batch, h100_site

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "scenarios" / "demo-week.yaml"


def demo(seed: int) -> dict[str, Any]:
    """demo-week cut to six hours (its outage at 2 d left out): batch jobs and inference."""
    sc = load_scenario(DEMO, {"horizon": 6 * 3600, "failures": [], "seed": seed})
    results: dict[str, Any] = Simulation(sc).run()
    return results


@pytest.fixture(scope="module")
def demo_runs() -> list[dict[str, Any]]:
    return [demo(1), demo(2)]


# -- the statistics -----------------------------------------------------------------------


def test_spread_of_known_values() -> None:
    s = spread([1.0, 2.0, 3.0, 4.0, 5.0])
    assert s is not None
    assert (s.n, s.mean, s.low, s.high) == (5, 3.0, 1.0, 5.0)
    assert s.stdev == pytest.approx(math.sqrt(2.5))  # sample: divides by n - 1
    assert s.half_width == pytest.approx(2.7764 * math.sqrt(2.5) / math.sqrt(5))


def test_two_seeds_take_t_with_one_degree_of_freedom() -> None:
    s = spread([1.0, 3.0])
    assert s is not None and s.stdev == pytest.approx(math.sqrt(2))
    # t(0.975, 1) = 12.706, not the normal 1.96: two seeds say little
    assert s.half_width == pytest.approx(12.7062)
    assert t_quantile(2) == 4.3027 and t_quantile(4) == 2.7764
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_quantile(0)


def _t_cdf(x: float, df: int, steps: int = 4000) -> float:
    """Student's t CDF at x > 0 by Simpson's rule on its density."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def pdf(t: float) -> float:
        return math.exp(log_c - (df + 1) / 2 * math.log1p(t * t / df))

    h = x / steps
    odd = sum(pdf((2 * i - 1) * h) for i in range(1, steps // 2 + 1))
    even = sum(pdf(2 * i * h) for i in range(1, steps // 2))
    return 0.5 + h / 3 * (pdf(0.0) + 4 * odd + 2 * even + pdf(x))


@pytest.mark.parametrize("df", [*range(1, 31), 31, 40, 60, 120, 1000])
def test_t_quantiles_are_the_975th_percentile(df: int) -> None:
    # the table for df <= 30, the Cornish-Fisher expansion beyond
    assert _t_cdf(t_quantile(df), df) == pytest.approx(0.975, abs=2e-5)


def test_one_seed_has_no_noise_estimate() -> None:
    s = spread([7.5])
    assert s == Spread(n=1, mean=7.5, stdev=0.0, low=7.5, high=7.5, half_width=None)
    assert s.describe() == "7.5 (1 seed, no spread)"


def test_none_entries_are_left_out() -> None:
    assert spread([None, 2.0, None, 4.0]) == spread([2.0, 4.0])
    assert spread([]) is None and spread([None, None]) is None
    with pytest.raises(ValueError, match="finite"):
        spread([1.0, math.nan])
    with pytest.raises(ValueError, match="finite"):
        spread([math.inf, 1.0])


def test_describe_formats_every_number() -> None:
    s = spread([1.9 * 3600, 2.4 * 3600, 2.9 * 3600])
    assert s is not None
    assert s.describe(format_duration) == "2.4 h ± 1.2 h (1.9 h–2.9 h, 3 seeds)"
    assert s.describe() == "8,640 ± 4,471.5 (6,840–10,440, 3 seeds)"


def test_within_noise_when_the_intervals_overlap() -> None:
    a, b = spread([10.0, 11.0, 12.0]), spread([11.5, 12.5, 13.5])
    assert a is not None and b is not None
    assert within_noise(a, b) and within_noise(b, a)


def test_beyond_noise_when_the_intervals_are_apart() -> None:
    a, b = spread([10.0, 10.1, 9.9, 10.0]), spread([12.0, 12.1, 11.9, 12.0])
    assert a is not None and b is not None and a.half_width is not None
    assert a.half_width < 0.2
    assert not within_noise(a, b) and not within_noise(b, a)


def test_one_seed_is_never_called_noise() -> None:
    one, many = spread([5.0]), spread([4.0, 5.0, 6.0])
    assert one is not None and many is not None
    # no estimate of the noise: not even an equal mean is within it
    assert not within_noise(one, one)
    assert not within_noise(one, many) and not within_noise(many, one)


# -- the figures of a run -----------------------------------------------------------------


def test_seed_figures_read_a_real_run(demo_runs: list[dict[str, Any]]) -> None:
    results = demo_runs[0]
    figures = seed_figures(results)
    assert tuple(figures) == FIGURES
    jobs = results["jobs"]
    assert figures["queue_delay_p50_s"] == jobs["queue_delay_s"]["p50"]
    assert figures["queue_delay_p95_s"] == jobs["queue_delay_s"]["p95"]
    assert figures["jobs_completed"] == jobs["completed"] > 100
    assert figures["jobs_unplaced"] == jobs["unplaced"]["count"]
    assert figures["cost_usd"] == results["cost"]["total_usd"] > 0
    assert 0 < (figures["gpu_utilization"] or 0) < 1
    regions = results["inference"]["regions"].values()
    worst = min(r["slo_attainment"] for r in regions if r["slo_attainment"] is not None)
    assert figures["inference_slo_worst"] == worst

    # no inference: no SLO figure; another schema: refused, naming the field
    assert seed_figures({**results, "inference": None})["inference_slo_worst"] is None
    with pytest.raises(ReportError) as err:
        seed_figures({"schema": "other"})
    assert err.value.field == "schema"


def test_over_seeds_gathers_the_figures_and_their_spread(
    demo_runs: list[dict[str, Any]],
) -> None:
    doc = over_seeds(demo_runs, scenario="demo-week")
    assert doc["scenario"] == "demo-week" and doc["seeds"] == [1, 2]
    assert [f["seed"] for f in doc["per_seed"]] == [1, 2]
    completed = [float(r["jobs"]["completed"]) for r in demo_runs]
    assert completed[0] != completed[1]  # another seed, other jobs
    s = doc["spread"]["jobs_completed"]
    assert s == {
        "n": 2,
        "mean": sum(completed) / 2,
        "stdev": pytest.approx(abs(completed[0] - completed[1]) / math.sqrt(2)),
        "low": min(completed),
        "high": max(completed),
        "half_width": pytest.approx(12.7062 * abs(completed[0] - completed[1]) / 2),
    }
    assert json.loads(json.dumps(doc)) == doc  # JSON-ready


# -- cpn simulate --seeds -----------------------------------------------------------------


def tiny(make_configs: Callable[..., Path], write_scenario: Callable[..., Path]) -> Path:
    """Two sites of 8 H100s, half a day of batch jobs: busy enough to queue."""
    make_configs({"east": h100_site(8), "west": h100_site(8, region="west")})
    return write_scenario(
        {
            "name": "tiny",
            "federation": {"configs": "configs"},
            "horizon": "12h",
            "seed": 9,
            "workloads": [batch(arrivals={"process": "poisson", "rate_per_hour": 12})],
        },
        "tiny.yaml",
    )


def test_simulate_seeds_prints_the_spread_and_writes_seeds_json(
    make_configs: Callable[..., Path],
    write_scenario: Callable[..., Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tiny(make_configs, write_scenario)
    out = tmp_path / "out"
    argv = [str(path), "--seeds", "1,2", "--no-progress", "--workers", "1", "--out", str(out)]
    assert simulate_main(argv) == 0
    printed = capsys.readouterr().out
    assert "tiny: over 2 seeds (1, 2)" in printed
    for label in ("mean ± 95 %", "stdev", "min – max", "queue delay p95", "jobs completed"):
        assert label in printed, label
    assert "SLO worst region" not in printed  # no inference in this scenario
    assert f"seeds: {out / 'seeds.json'}" in printed

    doc = json.loads((out / "seeds.json").read_text())
    assert doc["scenario"] == "tiny" and doc["seeds"] == [1, 2]
    assert set(doc["spread"]) == set(FIGURES) and doc["spread"]["inference_slo_worst"] is None
    # each seed's report as a comparison writes it, and its figures are seeds.json's
    for seed, figures in zip((1, 2), doc["per_seed"], strict=True):
        results = json.loads((out / f"tiny-seed-{seed}" / "results.json").read_text())
        assert results["scenario"]["seed"] == seed
        assert results["scenario"]["name"] == f"tiny seed {seed}"
        assert results["scenario"]["file"] == str(path)
        assert figures == {"seed": seed, **seed_figures(results)}
    completed = [f["jobs_completed"] for f in doc["per_seed"]]
    assert completed[0] != completed[1]
    assert doc["spread"]["jobs_completed"]["mean"] == sum(completed) / 2
    assert (out / "index.html").exists() and (out / "comparison.json").exists()


def test_simulate_seeds_json_prints_the_document(
    make_configs: Callable[..., Path],
    write_scenario: Callable[..., Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tiny(make_configs, write_scenario)
    out = tmp_path / "out"
    argv = [str(path), "--seeds", "3-4", "--horizon", "6h", "--json", "--no-progress"]
    assert simulate_main([*argv, "--workers", "1", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((out / "seeds.json").read_text())
    assert printed["seeds"] == [3, 4]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--seeds", "x"], "argument --seeds: expected seeds such as 1,2,3 or 1-5"),
        (["--seeds", "3-1"], "argument --seeds: the range '3-1' is empty"),
        (["--seeds", ""], "argument --seeds: expected seeds such as 1,2,3 or 1-5"),
        (["--seeds=-1,2"], "argument --seeds: expected seeds such as 1,2,3 or 1-5"),
        (["--seeds", "-1,2"], "argument --seeds: expected one argument"),
        (["--seeds", "1,2,1"], "argument --seeds: seed 1 is given twice"),
        (["--seeds", "1-3,2"], "argument --seeds: seed 2 is given twice"),
        (["--seeds", "4"], "argument --seeds: give at least two seeds"),
        (["--seeds", "1,2", "--seed", "3"], "--seeds: not with --seed"),
        (
            ["--seeds", "1,2", "--sweep", "policy.kind=fast-path,random"],
            "--seeds: not with --sweep",
        ),
        (["SECOND", "--seeds", "1,2"], "--seeds takes exactly one scenario file"),
    ],
)
def test_bad_seeds_exit_2_with_one_line(
    make_configs: Callable[..., Path],
    write_scenario: Callable[..., Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    path = tiny(make_configs, write_scenario)
    out = tmp_path / "out"
    argv = [str(path) if a == "SECOND" else a for a in extra]
    assert simulate_main([str(path), *argv, "--no-progress", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cpn simulate: error: ") and message in err
    assert err.count("\n") == 1
    assert not out.exists()  # nothing run, nothing written
