"""Workload models, generators, trace replay and the Erlang C helper.

Modules: simulations.workloads, simulations.arrivals, simulations.traces, simulations.queueing.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np
import pytest
import yaml
from pydantic import TypeAdapter, ValidationError

from simulations.arrivals import Arrivals, generate
from simulations.queueing import erlang_c, mmc_waiting_time_s
from simulations.traces import load_trace
from simulations.workloads import (
    MAX_JOBS,
    PRESETS,
    BatchWorkload,
    DurationPreset,
    InferenceWorkload,
    LognormalDuration,
    TraceWorkload,
    Workload,
    WorkloadError,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "configs" / "traces" / "example.csv"
DOC = REPO / "docs" / "simulation-workloads.md"
WORKLOAD = TypeAdapter(Workload)
HOUR = 3600.0
DAY = 86400.0


def batch(**fields: Any) -> BatchWorkload:
    doc: dict[str, Any] = {
        "kind": "batch",
        "name": "jobs",
        "arrivals": {"process": "poisson", "rate_per_hour": 100.0},
    }
    doc.update(fields)
    workload = WORKLOAD.validate_python(doc)
    assert isinstance(workload, BatchWorkload)
    return workload


def write(tmp_path: Path, text: str, name: str = "t.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def only(arr: Arrivals, index: int) -> dict[str, Any]:
    """One workload's jobs, with codes turned back into names."""
    mine = arr.workload == index
    return {
        "at_s": arr.at_s[mine],
        "gpus": arr.gpus[mine],
        "duration_s": arr.duration_s[mine],
        "tenant": [arr.tenants[t] for t in arr.tenant[mine]],
        "model": [arr.models[m] if m >= 0 else None for m in arr.model[mine]],
    }


# -- models -----------------------------------------------------------------------------------


def test_duration_defaults_to_the_gpu_preset() -> None:
    assert batch(gpus={"preset": "philly"}).duration == DurationPreset(preset="philly")
    assert batch(gpus={"preset": "pai"}).duration == DurationPreset(preset="pai")
    assert batch().duration == DurationPreset(preset="helios")
    assert batch(gpus={"choices": {1: 1}}).duration == DurationPreset(preset="helios")
    given = batch(gpus={"preset": "philly"}, duration={"distribution": "fixed", "hours": 2})
    assert given.duration.model_dump()["hours"] == 2


@pytest.mark.parametrize(
    ("fields", "where", "says"),
    [
        ({"arrivals": {"process": "poisson", "rate_per_hour": -1}}, "rate_per_hour", "greater"),
        (
            {"arrivals": {"process": "poisson", "rate_per_hour": math.inf}},
            "rate_per_hour",
            "finite",
        ),
        (
            {
                "arrivals": {
                    "process": "diurnal",
                    "mean_rate_per_hour": 5,
                    "peak_hour": 25,
                    "peak_to_trough": 2,
                }
            },
            "peak_hour",
            "less than or equal to 24",
        ),
        (
            {
                "arrivals": {
                    "process": "diurnal",
                    "mean_rate_per_hour": 5,
                    "peak_hour": 3,
                    "peak_to_trough": 0.5,
                }
            },
            "peak_to_trough",
            "greater than or equal to 1",
        ),
        ({"arrivals": {"process": "bursty"}}, "arrivals", "'poisson', 'diurnal'"),
        ({"gpus": {"choices": {1: 0, 8: 0}}}, "choices", "weights must sum to more than 0"),
        ({"gpus": {"choices": {1: -1, 8: 2}}}, "choices", "weight of 1 is negative"),
        ({"gpus": {"choices": {-2: 1}}}, "choices", "GPU count -2 is outside"),
        ({"gpus": {"choices": {}}}, "choices", "give at least one GPU count"),
        ({"gpus": {"preset": "google"}}, "preset", "'philly', 'helios' or 'pai'"),
        ({"gpus": {"count": 8}}, "gpus", "give {preset: philly|helios|pai} or {choices"),
        ({"duration": {"preset": "borg"}}, "preset", "'philly', 'helios' or 'pai'"),
        ({"duration": {"distribution": "weibull"}}, "duration", "exponential|lognormal|fixed"),
        (
            {"duration": {"distribution": "lognormal", "median_hours": 2, "p99_hours": 1}},
            "lognormal",
            "p99_hours (1.0) must exceed median_hours (2.0)",
        ),
        ({"duration": {"distribution": "exponential", "mean_hours": 0}}, "mean_hours", "greater"),
        (
            {"duration": {"distribution": "fixed", "hours": 1, "max_hours": -1}},
            "max_hours",
            "greater",
        ),
        ({"tenants": {"a": 0.0}}, "tenants", "weights must sum to more than 0"),
        ({"tenants": {}}, "tenants", "give at least one tenant"),
        ({"data_regions": {"x": -1.0, "y": 2.0}}, "data_regions", "weight of 'x' is negative"),
        ({"data_size_gb": 10}, "batch", "data_size_gb needs data_regions"),
        ({"model": []}, "model", "give at least one model"),
        ({"model": ["H100", "H100"]}, "model", "listed twice"),
        ({"start_s": 100, "end_s": 50}, "batch", "end_s (50.0) must be after start_s (100.0)"),
        ({"cpu_only_cores": 0}, "cpu_only_cores", "greater than or equal to 1"),
        ({"name": ""}, "name", "at least 1 character"),
        ({"gpu": {"preset": "pai"}}, "gpu", "Extra inputs are not permitted"),
    ],
)
def test_bad_batch_workloads_name_the_field(fields: dict[str, Any], where: str, says: str) -> None:
    with pytest.raises(ValidationError) as info:
        batch(**fields)
    errors = info.value.errors()
    assert len(errors) == 1, errors
    assert where in ".".join(map(str, errors[0]["loc"]))
    assert says in errors[0]["msg"]


@pytest.mark.parametrize(
    ("fields", "where", "says"),
    [
        ({"requests_per_s": {"beijing": -2}}, "requests_per_s", "rate of 'beijing' is negative"),
        ({"requests_per_s": {}}, "requests_per_s", "give at least one client region"),
        ({"slo_ms": 0}, "slo_ms", "greater than 0"),
        ({"daily_curve": {"shape": "hourly", "factors": [1] * 23}}, "factors", "24 factors"),
        ({"daily_curve": {"shape": "hourly", "factors": [0] * 24}}, "factors", "sum to more"),
        ({"daily_curve": {"shape": "hourly", "factors": [-1] + [1] * 23}}, "factors", ">= 0"),
        ({"daily_curve": {"shape": "weekly"}}, "daily_curve", "'flat', 'diurnal', 'hourly'"),
    ],
)
def test_bad_inference_workloads_name_the_field(
    fields: dict[str, Any], where: str, says: str
) -> None:
    doc = {
        "kind": "inference",
        "name": "chat",
        "service": "qwen-7b",
        "slo_ms": 500,
        "requests_per_s": {"beijing": 10},
    }
    with pytest.raises(ValidationError) as info:
        WORKLOAD.validate_python({**doc, **fields})
    error = info.value.errors()[0]
    assert where in ".".join(map(str, error["loc"]))
    assert says in error["msg"]


def test_bad_trace_workload_fields() -> None:
    with pytest.raises(ValidationError, match="time_scale"):
        WORKLOAD.validate_python({"kind": "trace", "name": "t", "path": "x.csv", "time_scale": 0})
    with pytest.raises(ValidationError, match="kind"):
        WORKLOAD.validate_python({"name": "t", "path": "x.csv"})


def test_the_doc_examples_are_valid_workloads() -> None:
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 3
    kinds: set[str] = set()
    for block in blocks:
        doc = yaml.safe_load(block)
        for item in doc["workloads"]:
            kinds.add(WORKLOAD.validate_python(item).kind)
    assert kinds == {"batch", "trace", "inference"}


# -- presets ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "mean_gpus", "median_s", "mean_s"),
    [
        ("helios", 3.72, 206.0, 6651.681),
        ("philly", 1.75, 1250.0, 28329.0),
        ("pai", 1.4, 156, 5038.7),
    ],
)
def test_presets_match_their_sources(
    name: str, mean_gpus: float, median_s: float, mean_s: float
) -> None:
    p = PRESETS[name]
    assert sum(p.gpu_weights.values()) == pytest.approx(1.0)
    assert p.mean_gpus == pytest.approx(mean_gpus, rel=0.01)
    assert (p.median_s, p.mean_s) == (median_s, mean_s)
    # the lognormal's mean is the published mean
    assert math.exp(math.log(p.median_s) + p.sigma**2 / 2) == pytest.approx(p.mean_s)
    assert p.mean_gpu_hours == pytest.approx(p.mean_gpus * p.mean_s / 3600)


def test_preset_jobs_follow_the_preset() -> None:
    arr = generate(
        [
            batch(
                arrivals={"process": "poisson", "rate_per_hour": 50_000}, gpus={"preset": "philly"}
            )
        ],
        horizon_s=4 * HOUR,
        seed=3,
    )
    p = PRESETS["philly"]
    assert np.median(arr.duration_s) == pytest.approx(p.median_s, rel=0.03)
    assert np.std(np.log(arr.duration_s)) == pytest.approx(p.sigma, rel=0.02)
    assert arr.gpus.mean() == pytest.approx(p.mean_gpus, rel=0.03)
    assert set(np.unique(arr.gpus)) == set(p.gpu_weights)


# -- arrivals ---------------------------------------------------------------------------------


def test_poisson_arrivals_count_and_exponential_gaps() -> None:
    rate_per_hour, hours = 3600.0, 100.0
    arr = generate(
        [batch(arrivals={"process": "poisson", "rate_per_hour": rate_per_hour})],
        horizon_s=hours * HOUR,
        seed=11,
    )
    expected = rate_per_hour * hours
    assert abs(len(arr) - expected) < 5 * math.sqrt(expected)
    gaps = np.diff(arr.at_s)
    assert gaps.mean() == pytest.approx(1.0, rel=0.01)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.01)  # CV of an exponential
    assert np.mean(gaps > 1.0) == pytest.approx(math.exp(-1), abs=0.005)
    assert arr.at_s.min() >= 0 and arr.at_s.max() < hours * HOUR


def test_diurnal_arrivals_follow_the_daily_curve() -> None:
    days, mean_per_hour, ratio = 20, 2000.0, 3.0
    w = batch(
        arrivals={
            "process": "diurnal",
            "mean_rate_per_hour": mean_per_hour,
            "peak_hour": 14.5,
            "peak_to_trough": ratio,
        }
    )
    arr = generate([w], horizon_s=days * DAY, seed=5)
    assert abs(len(arr) - days * 24 * mean_per_hour) < 5 * math.sqrt(days * 24 * mean_per_hour)
    by_hour = np.bincount(((arr.at_s / HOUR) % 24).astype(int), minlength=24)
    assert int(np.argmax(by_hour)) == 14 and int(np.argmin(by_hour)) == 2
    # an hour-wide bin averages the cosine: amplitude * sin(pi/24)/(pi/24)
    a = (ratio - 1) / (ratio + 1) * math.sin(math.pi / 24) / (math.pi / 24)
    assert by_hour[14] / by_hour[2] == pytest.approx((1 + a) / (1 - a), rel=0.04)
    expected = (
        days * mean_per_hour * (1 + a * np.cos(2 * np.pi * (np.arange(24) + 0.5 - 14.5) / 24))
    )
    assert np.max(np.abs(by_hour / expected - 1)) < 0.05


def test_window_limits_arrivals() -> None:
    arr = generate([batch(start_s=2 * HOUR, end_s=5 * HOUR)], horizon_s=4 * HOUR, seed=1)
    assert len(arr) > 0
    assert arr.at_s.min() >= 2 * HOUR and arr.at_s.max() < 4 * HOUR
    assert len(generate([batch(start_s=5 * HOUR)], horizon_s=4 * HOUR, seed=1)) == 0
    assert (
        len(
            generate(
                [batch(arrivals={"process": "poisson", "rate_per_hour": 0})], horizon_s=DAY, seed=1
            )
        )
        == 0
    )


# -- job attributes ---------------------------------------------------------------------------


def test_gpu_choices_frequencies_and_resources() -> None:
    w = batch(
        arrivals={"process": "poisson", "rate_per_hour": 100_000},
        gpus={"choices": {0: 1, 1: 2, 8: 1}},
        cpu_per_gpu=12,
        mem_gb_per_gpu=96,
        cpu_only_cores=6,
        cpu_only_mem_gb=24,
        priority=7,
    )
    arr = generate([w], horizon_s=2 * HOUR, seed=2)
    for count, share in ((0, 0.25), (1, 0.5), (8, 0.25)):
        assert np.mean(arr.gpus == count) == pytest.approx(share, abs=0.005)
    gpu = arr.gpus > 0
    assert np.array_equal(arr.cpu[gpu], arr.gpus[gpu] * 12)
    assert np.array_equal(arr.mem_gb[gpu], arr.gpus[gpu] * 96.0)
    assert set(arr.cpu[~gpu]) == {6} and set(arr.mem_gb[~gpu]) == {24.0}
    assert set(arr.priority) == {7}


def test_lognormal_median_and_p99_are_recovered() -> None:
    w = batch(
        arrivals={"process": "poisson", "rate_per_hour": 100_000},
        duration={"distribution": "lognormal", "median_hours": 2, "p99_hours": 30},
    )
    d = generate([w], horizon_s=2 * HOUR, seed=4).duration_s / HOUR
    assert np.median(d) == pytest.approx(2.0, rel=0.02)
    assert np.quantile(d, 0.99) == pytest.approx(30.0, rel=0.05)
    assert isinstance(w.duration, LognormalDuration)


def test_exponential_fixed_and_capped_durations() -> None:
    rate = {"process": "poisson", "rate_per_hour": 100_000}
    exp = batch(arrivals=rate, duration={"distribution": "exponential", "mean_hours": 3})
    d = generate([exp], horizon_s=HOUR, seed=1).duration_s
    assert d.mean() == pytest.approx(3 * HOUR, rel=0.02) and d.min() > 0
    fixed = batch(arrivals=rate, duration={"distribution": "fixed", "hours": 1.5})
    assert set(generate([fixed], horizon_s=HOUR, seed=1).duration_s) == {1.5 * HOUR}
    capped = batch(arrivals=rate, duration={"preset": "philly", "max_hours": 1})
    d = generate([capped], horizon_s=HOUR, seed=1).duration_s
    assert d.max() == HOUR
    p = PRESETS["philly"]
    longer = 1 - NormalDist(math.log(p.median_s), p.sigma).cdf(math.log(HOUR))
    assert np.mean(d == HOUR) == pytest.approx(longer, abs=0.01)  # P(philly run > 1 h)


def test_models_tenants_and_data_regions() -> None:
    w = batch(
        arrivals={"process": "poisson", "rate_per_hour": 50_000},
        model=["H100", "H20"],
        tenants={"ai-lab": 3, "startup": 1},
        data_regions={"yangtze-delta": 1, "jing-jin-ji": 0},
        data_size_gb=250,
    )
    arr = generate([w, batch(name="any")], horizon_s=HOUR, seed=8)
    mine = arr.workload == 0
    assert arr.models == ("H100", "H20")
    assert np.mean(arr.model[mine] == 0) == pytest.approx(0.5, abs=0.01)
    assert np.mean([arr.tenants[t] == "ai-lab" for t in arr.tenant[mine]]) == pytest.approx(
        0.75, abs=0.01
    )
    assert {arr.regions[r] for r in arr.data_region[mine]} == {"yangtze-delta"}
    assert set(arr.data_size_gb[mine]) == {250.0}
    other = arr.workload == 1
    assert set(arr.model[other]) == {-1} and set(arr.data_region[other]) == {-1}
    assert set(arr.data_size_gb[other]) == {0.0}
    assert arr.tenants == ("ai-lab", "startup", "default")
    assert arr.workloads == ("jobs", "any")


def test_arrivals_are_sorted_typed_and_read_only() -> None:
    arr = generate([batch(), batch(name="b", gpus={"preset": "pai"})], horizon_s=DAY, seed=1)
    assert np.all(np.diff(arr.at_s) >= 0)
    dtypes = {
        "at_s": np.float64,
        "gpus": np.int32,
        "duration_s": np.float64,
        "cpu": np.int32,
        "mem_gb": np.float64,
        "priority": np.int32,
        "data_size_gb": np.float64,
        "model": np.int16,
        "tenant": np.int16,
        "data_region": np.int16,
        "workload": np.int16,
    }
    for name, dtype in dtypes.items():
        column = getattr(arr, name)
        assert column.dtype == dtype and len(column) == len(arr), name
        with pytest.raises(ValueError, match="read-only"):
            column[0] = 0
    assert set(arr.workload) == {0, 1}
    assert np.all(arr.duration_s > 0)


def test_inference_workloads_are_skipped() -> None:
    chat = WORKLOAD.validate_python(
        {
            "kind": "inference",
            "name": "chat",
            "service": "qwen-7b",
            "requests_per_s": {"beijing": 5},
            "slo_ms": 300,
        }
    )
    with_it = generate([chat, batch()], horizon_s=DAY, seed=1)
    without = generate([batch()], horizon_s=DAY, seed=1)
    assert with_it.workloads == ("jobs",)
    assert np.array_equal(with_it.at_s, without.at_s)


# -- determinism ------------------------------------------------------------------------------


def test_same_seed_same_jobs_other_seed_other_jobs() -> None:
    ws = [
        batch(gpus={"preset": "philly"}, model=["H100", "H20"]),
        batch(
            name="d",
            arrivals={
                "process": "diurnal",
                "mean_rate_per_hour": 80,
                "peak_hour": 9,
                "peak_to_trough": 4,
            },
        ),
    ]
    one = generate(ws, horizon_s=3 * DAY, seed=42)
    two = generate(ws, horizon_s=3 * DAY, seed=42)
    for name in ("at_s", "gpus", "duration_s", "model", "tenant", "workload"):
        assert np.array_equal(getattr(one, name), getattr(two, name)), name
    other = generate(ws, horizon_s=3 * DAY, seed=43)
    assert len(other) != len(one) or not np.array_equal(other.at_s, one.at_s)
    assert not np.array_equal(other.duration_s[:50], one.duration_s[:50])
    negative = generate(ws, horizon_s=3 * DAY, seed=-1)
    assert len(negative) > 0 and not np.array_equal(negative.at_s[:50], one.at_s[:50])


def test_adding_a_workload_leaves_the_others_unchanged() -> None:
    first = batch(name="first", gpus={"preset": "helios"}, model=["H100", "A100-80GB"])
    second = batch(name="second", arrivals={"process": "poisson", "rate_per_hour": 500})
    alone = only(generate([first], horizon_s=2 * DAY, seed=9), 0)
    after = only(generate([first, second], horizon_s=2 * DAY, seed=9), 0)
    before = only(generate([second, first], horizon_s=2 * DAY, seed=9), 1)
    for name in alone:
        assert np.array_equal(alone[name], after[name]), name
        assert np.array_equal(alone[name], before[name]), name


def test_changing_one_attribute_leaves_the_other_draws() -> None:
    a = generate([batch(tenants={"x": 1, "y": 1})], horizon_s=DAY, seed=3)
    b = generate([batch(tenants={"x": 1, "y": 9}, model=["H100", "H20"])], horizon_s=DAY, seed=3)
    for name in ("at_s", "gpus", "duration_s"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


# -- traces -----------------------------------------------------------------------------------


def test_load_the_example_trace() -> None:
    trace = load_trace(EXAMPLE)
    assert len(trace) == 50
    assert (trace.arrival_s[0], trace.gpus[0], trace.duration_s[0]) == (164.4, 1, 2856.0)
    assert trace.model[0] == -1 and trace.tenants[trace.tenant[0]] == "default"
    assert trace.cpu[0] == -1 and math.isnan(trace.mem_gb[0])
    assert (trace.priority[0], trace.data_size_gb[0]) == (10, 200.0)
    assert trace.regions[trace.data_region[0]] == "yangtze-delta"
    assert trace.models[trace.model[1]] == "H100"
    assert not np.all(np.diff(trace.arrival_s) >= 0)  # the file is not sorted


def test_trace_replay_scales_offsets_and_fills_defaults(tmp_path: Path) -> None:
    write(
        tmp_path,
        "arrival_s,gpus,duration_s,cpu,mem_gb,tenant,model\n"
        "30,2,100,,,,H100\n"
        "0,0,50,3,,ops,\n"
        "10,1,10,,7.5,ops,\n",
    )
    w = WORKLOAD.validate_python(
        {
            "kind": "trace",
            "name": "t",
            "path": "t.csv",
            "time_scale": 2,
            "duration_scale": 3,
            "offset_s": 100,
            "cpu_per_gpu": 5,
            "mem_gb_per_gpu": 10,
            "cpu_only_mem_gb": 4,
        }
    )
    arr = generate([w], horizon_s=1000, seed=0, base_dir=tmp_path)
    assert list(arr.at_s) == [100, 120, 160]
    assert list(arr.gpus) == [0, 1, 2]
    assert list(arr.duration_s) == [150, 30, 300]
    assert list(arr.cpu) == [3, 5, 10]
    assert list(arr.mem_gb) == [4.0, 7.5, 20.0]
    assert [arr.tenants[t] for t in arr.tenant] == ["ops", "ops", "default"]
    assert list(arr.model) == [-1, -1, 0] and arr.models == ("H100",)
    cut = generate([w], horizon_s=150, seed=0, base_dir=tmp_path)
    assert list(cut.at_s) == [100, 120]
    early = w.model_copy(update={"offset_s": -25.0})
    # rows at -25 and -5 s fall before the start and are dropped
    assert list(generate([early], horizon_s=1000, seed=0, base_dir=tmp_path).at_s) == [35.0]


def test_trace_repeat_replays_until_the_horizon(tmp_path: Path) -> None:
    write(tmp_path, "arrival_s,gpus,duration_s\n0,1,5\n10,2,5\n20,4,5\n")
    w = TraceWorkload(name="r", path=str(tmp_path / "t.csv"), repeat=True)
    arr = generate([w], horizon_s=100, seed=0)
    # period = last arrival + mean gap = 30 s
    assert list(arr.at_s) == [0, 10, 20, 30, 40, 50, 60, 70, 80, 90]
    assert list(arr.gpus) == [1, 2, 4, 1, 2, 4, 1, 2, 4, 1]
    slow = generate(
        [w.model_copy(update={"time_scale": 2.0, "offset_s": 5.0})], horizon_s=100, seed=0
    )
    assert list(slow.at_s) == [5, 25, 45, 65, 85]
    once = generate([w.model_copy(update={"repeat": False})], horizon_s=100, seed=0)
    assert list(once.at_s) == [0, 10, 20]


def test_trace_repeat_needs_a_trace_that_spans_time(tmp_path: Path) -> None:
    write(tmp_path, "arrival_s,gpus,duration_s\n0,1,5\n0,2,5\n")
    w = TraceWorkload(name="r", path="t.csv", repeat=True)
    with pytest.raises(WorkloadError, match="workload 'r': repeat: .*all arrivals at 0 s"):
        generate([w], horizon_s=100, seed=0, base_dir=tmp_path)


def test_trace_repeat_refuses_an_absurd_job_count(tmp_path: Path) -> None:
    write(tmp_path, "arrival_s,gpus,duration_s\n0,1,5\n0.001,2,5\n")
    w = TraceWorkload(name="r", path="t.csv", repeat=True)
    with pytest.raises(WorkloadError, match="at most 50,000,000 per workload"):
        generate([w], horizon_s=365 * DAY, seed=0, base_dir=tmp_path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "t.csv: empty trace: no header row"),
        ("# only a comment\n\n", "t.csv: empty trace: no header row"),
        ("arrival_s,gpus,duration_s\n", "t.csv: the trace has a header but no jobs"),
        (
            "arrival_s,gpus,duration_s,user\n0,1,5,bob\n",
            "t.csv:1: unknown column(s) 'user' (known: arrival_s, gpus",
        ),
        ("0,1,5\n", "t.csv:1: unknown column(s) '0', '1', '5'"),
        ("arrival_s,duration_s\n0,5\n", "t.csv:1: missing required column(s) 'gpus'"),
        ("arrival_s,gpus,gpus,duration_s\n0,1,1,5\n", "t.csv:1: column 'gpus' appears twice"),
        (
            "# a trace\narrival_s,gpus,duration_s\n0,1,5\n\n# note\n9,abc,5\n",
            "t.csv:6: gpus: 'abc' is not an integer",
        ),
        ("arrival_s,gpus,duration_s\n0,1.5,5\n", "t.csv:2: gpus: '1.5' is not an integer"),
        ("arrival_s,gpus,duration_s\n0,1,soon\n", "t.csv:2: duration_s: 'soon' is not a number"),
        ("arrival_s,gpus,duration_s\n0,1,inf\n", "t.csv:2: duration_s: 'inf' is not a number"),
        ("arrival_s,gpus,duration_s\n0,1,0\n", "t.csv:2: duration_s: '0' must be > 0"),
        ("arrival_s,gpus,duration_s\n-3,1,5\n", "t.csv:2: arrival_s: '-3' must be >= 0"),
        ("arrival_s,gpus,duration_s\n0,-1,5\n", "t.csv:2: gpus: '-1' must be >= 0"),
        ("arrival_s,gpus,duration_s,mem_gb\n0,1,5,-2\n", "t.csv:2: mem_gb: '-2' must be >= 0"),
        ("arrival_s,gpus,duration_s\n0,,5\n", "t.csv:2: gpus: empty, but the column is required"),
        (
            "arrival_s,gpus,duration_s\n0,1,5\n1,2\n",
            "t.csv:3: expected 3 cells (arrival_s, gpus, duration_s), found 2",
        ),
        ('arrival_s,gpus,duration_s,model\n0,1,5,"H1\n00"\n', "t.csv:2: a quoted cell spans"),
        (
            "arrival_s,gpus,duration_s,cpu\n0,1,5,9999999999\n",
            "t.csv:2: cpu: '9999999999' is not an integer",
        ),
    ],
)
def test_bad_trace_files_name_the_line_and_column(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(WorkloadError) as info:
        load_trace(path)
    assert str(info.value).startswith(str(tmp_path) + "/")
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_or_unreadable_trace_files(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match=r"nope\.csv: trace file not found"):
        load_trace(tmp_path / "nope.csv")
    with pytest.raises(WorkloadError, match="is a directory"):
        load_trace(tmp_path)
    (tmp_path / "bin.csv").write_bytes(b"arrival_s,gpus,duration_s\n0,1,\xff\n")
    with pytest.raises(WorkloadError, match=r"bin\.csv: not UTF-8 text"):
        load_trace(tmp_path / "bin.csv")
    w = TraceWorkload(name="gone", path="traces/gone.csv")
    with pytest.raises(WorkloadError, match=re.escape(str(tmp_path / "traces" / "gone.csv"))):
        generate([w], horizon_s=DAY, seed=0, base_dir=tmp_path)


def test_example_trace_through_generate() -> None:
    w = TraceWorkload(name="example", path="traces/example.csv", repeat=True)
    arr = generate([w, batch()], horizon_s=DAY, seed=0, base_dir=REPO / "configs")
    mine = arr.workload == 0
    assert np.sum(mine) > 150  # the six-hour trace replays about four times in a day
    assert np.all(np.diff(arr.at_s) >= 0)
    assert "H100" in arr.models and "default" in arr.tenants and "ai-lab" in arr.tenants


# -- generate errors --------------------------------------------------------------------------


def test_generate_refuses_bad_requests() -> None:
    with pytest.raises(WorkloadError, match="workload name 'jobs' is used twice"):
        generate([batch(), batch()], horizon_s=DAY, seed=0)
    with pytest.raises(WorkloadError, match="horizon_s must be a finite number > 0"):
        generate([batch()], horizon_s=0, seed=0)
    huge = batch(arrivals={"process": "poisson", "rate_per_hour": 1e12})
    with pytest.raises(WorkloadError, match=f"at most {MAX_JOBS:,} per workload"):
        generate([huge], horizon_s=DAY, seed=0)
    empty = generate([], horizon_s=DAY, seed=0)
    assert len(empty) == 0 and empty.workloads == ()


def test_a_million_jobs() -> None:
    w = batch(
        arrivals={"process": "poisson", "rate_per_hour": 1_000_000},
        tenants={"a": 1, "b": 1},
        model=["H100", "H20", "H800"],
    )
    arr = generate([w], horizon_s=HOUR, seed=1)
    assert abs(len(arr) - 1_000_000) < 5_000
    assert all(len(getattr(arr, c)) == len(arr) for c in ("gpus", "duration_s", "tenant", "model"))
    assert np.all(np.diff(arr.at_s) >= 0)
    assert set(np.unique(arr.model)) == {0, 1, 2}


# -- inference --------------------------------------------------------------------------------


def inference(curve: dict[str, Any]) -> InferenceWorkload:
    w = WORKLOAD.validate_python(
        {
            "kind": "inference",
            "name": "chat",
            "service": "qwen-7b",
            "requests_per_s": {"beijing": 40.0, "shanghai": 10.0},
            "daily_curve": curve,
            "slo_ms": 800,
        }
    )
    assert isinstance(w, InferenceWorkload)
    return w


def test_flat_curve() -> None:
    w = inference({"shape": "flat"})
    assert w.rate_per_s("beijing", 12345.0) == 40.0
    assert w.rate_per_s("tokyo", 0.0) == 0.0


def test_diurnal_curve_has_daily_mean_one_and_peaks_at_peak_hour() -> None:
    w = inference({"shape": "diurnal", "peak_hour": 20, "peak_to_trough": 4})
    t = np.arange(0, DAY, 60.0)
    f = w.daily_curve.factor_array(t)
    assert f.mean() == pytest.approx(1.0, abs=1e-9)
    assert t[np.argmax(f)] == 20 * HOUR and t[np.argmin(f)] == 8 * HOUR
    assert f.max() / f.min() == pytest.approx(4.0)
    assert w.rate_per_s("beijing", 20 * HOUR) == pytest.approx(40 * f.max())
    assert w.rate_per_s("shanghai", 3 * DAY + 20 * HOUR) == pytest.approx(10 * f.max())
    assert [w.daily_curve.factor(x) for x in t[::97]] == pytest.approx(list(f[::97]))


def test_hourly_curve_is_normalised() -> None:
    factors = [1.0] * 12 + [3.0] * 12
    w = inference({"shape": "hourly", "factors": factors})
    assert w.rate_per_s("beijing", 0.0) == pytest.approx(40 * 0.5)
    assert w.rate_per_s("beijing", 13.5 * HOUR) == pytest.approx(40 * 1.5)
    assert w.rate_per_s("beijing", DAY + 13.5 * HOUR) == pytest.approx(40 * 1.5)
    t = np.arange(0, DAY, 60.0)
    assert w.daily_curve.factor_array(t).mean() == pytest.approx(1.0)


# -- queueing ---------------------------------------------------------------------------------


def erlang_c_exact(c: int, a: Fraction) -> Fraction:
    top = a**c / math.factorial(c) * c / (c - a)
    return top / (sum(a**k / math.factorial(k) for k in range(c)) + top)


def erlang_c_logs(c: int, a: float) -> float:
    """P(wait) summed in log space (lgamma), independent of the recurrence."""
    logs = [k * math.log(a) - math.lgamma(k + 1) for k in range(c)]
    top = c * math.log(a) - math.lgamma(c + 1) + math.log(c / (c - a))
    peak = max(max(logs), top)
    rest = sum(math.exp(x - peak) for x in logs)
    return math.exp(top - peak) / (rest + math.exp(top - peak))


@pytest.mark.parametrize("rho", [0.0, 0.1, 0.5, 0.95])
def test_erlang_c_single_server_is_rho(rho: float) -> None:
    assert erlang_c(1, rho) == pytest.approx(rho)


def test_erlang_c_known_values() -> None:
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(3, 2.0) == pytest.approx(4 / 9)  # textbook: 3 servers, 2 Erlangs
    assert erlang_c(50, 45.0) == pytest.approx(float(erlang_c_exact(50, Fraction(45))), rel=1e-12)
    assert erlang_c(10, 8.0) == pytest.approx(float(erlang_c_exact(10, Fraction(8))), rel=1e-12)


def test_erlang_c_is_stable_for_ten_thousand_servers() -> None:
    value = erlang_c(10_000, 9_900.0)
    assert value == pytest.approx(erlang_c_logs(10_000, 9_900.0), rel=1e-9)
    # Halfin-Whitt: beta = (c - a)/sqrt(c) = 1 gives about 1/(1 + Phi(1)/phi(1)) = 0.2234
    assert value == pytest.approx(0.2234, rel=0.03)
    assert erlang_c(10_000, 5_000.0) < 1e-100


def test_erlang_c_refuses_an_unstable_queue() -> None:
    with pytest.raises(ValueError, match="utilisation 1 >= 1"):
        erlang_c(4, 4.0)
    with pytest.raises(ValueError, match="c must be an integer >= 1"):
        erlang_c(0, 0.5)
    with pytest.raises(ValueError, match="offered_load"):
        erlang_c(2, -1.0)


def test_mmc_waiting_time() -> None:
    assert mmc_waiting_time_s(1, 0.5, 1.0) == pytest.approx(1.0)  # rho/(mu - lambda)
    assert mmc_waiting_time_s(2, 1.0, 1.0) == pytest.approx(1 / 3)
    assert mmc_waiting_time_s(3, 0.0, 2.0) == 0.0
    # 3 servers, 2 Erlangs, 0.1 s service: C = 4/9, W_q = C * s / (c - a)
    assert mmc_waiting_time_s(3, 20.0, 0.1) == pytest.approx(4 / 9 * 0.1 / 1)
    with pytest.raises(ValueError, match=">= 1"):
        mmc_waiting_time_s(2, 2.0, 1.0)
    with pytest.raises(ValueError, match="mean_service_s"):
        mmc_waiting_time_s(2, 1.0, 0.0)
