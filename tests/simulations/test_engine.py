"""The simulator on small federations: queueing theory, the broker's placement and failover,
the baselines, what-if edits, determinism."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from pydantic import ValidationError

from broker.model.jobs import DataLocation, GpuRequest, JobSpec
from simulations.engine import Simulation
from simulations.jobs import job_like, unique_rows
from simulations.queueing import mmc_waiting_time_s
from simulations.scenario import load_scenario
from sites.model.errors import ConfigError


def batch(name: str = "jobs", **overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "kind": "batch",
        "name": name,
        "arrivals": {"process": "poisson", "rate_per_hour": 20},
        "gpus": {"choices": {1: 0.5, 2: 0.3, 4: 0.2}},
        "duration": {"distribution": "exponential", "mean_hours": 1.0},
        "model": "H100",
    }
    doc.update(overrides)
    return doc


def h100_site(count: int, **overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "inventory": {
            "devices": [{"model": "H100", "count": count}],
            "cpu_cores": 16 * count,
            "mem_gb": 128 * count,
        }
    }
    doc.update(overrides)
    return doc


@pytest.fixture
def scenario(
    make_configs: Callable[..., Path], write_scenario: Callable[..., Path]
) -> Callable[..., Any]:
    def make(
        sites: dict[str, dict[str, Any]],
        quotas: dict[str, int] | None = None,
        clients: bool = False,
        **doc: Any,
    ) -> Any:
        make_configs(sites, quotas=quotas, clients=clients)
        body = {"name": "t", "federation": {"configs": "configs"}, "horizon": "2d", "seed": 3}
        body.update(doc)
        return load_scenario(write_scenario(body))

    return make


def run(sc: Any, **kw: Any) -> dict[str, Any]:
    return Simulation(sc, **kw).run()


def test_mmc_matches_erlang_c_and_littles_law(scenario: Callable[..., Any]) -> None:
    # one site, c = 8 GPUs, one-GPU jobs, Poisson arrivals, exponential run times, FIFO:
    # an M/M/c queue; 300,000 six-minute jobs at 70 % load (about seven months; 3 % off)
    c, rho, mean_h, jobs = 8, 0.7, 0.1, 300_000
    lam_h = rho * c / mean_h
    sc = scenario(
        {"one": h100_site(c)},
        horizon=jobs / lam_h * 3600,
        seed=1,
        workloads=[
            batch(
                arrivals={"process": "poisson", "rate_per_hour": lam_h},
                gpus={"choices": {1: 1}},
                duration={"distribution": "exponential", "mean_hours": mean_h},
            )
        ],
    )
    res = run(sc)
    theory = mmc_waiting_time_s(c, lam_h / 3600, mean_h * 3600)
    measured = res["jobs"]["queue_delay_s"]["mean"]
    assert abs(measured / theory - 1) < 0.05, (measured, theory)
    little = res["jobs"]["littles_law"]
    assert little["relative_error"] < 1e-9
    assert little["mean_queue_length"] == pytest.approx(little["lambda_w"], rel=1e-9)
    # utilization = rho within noise, and the arrival count is the Poisson mean within 1 %
    assert res["utilization"]["one"]["gpu"] == pytest.approx(rho, rel=0.02)
    assert res["jobs"]["arrived"] == pytest.approx(jobs, rel=0.01)


def contended(scenario: Callable[..., Any], **doc: Any) -> Any:
    """Three small sites, three tenants (one with a quota), priorities, a failure."""
    body: dict[str, Any] = {
        "horizon": "3d",
        "workloads": [
            batch(
                "train",
                arrivals={
                    "process": "diurnal",
                    "mean_rate_per_hour": 14,
                    "peak_hour": 12,
                    "peak_to_trough": 3,
                },
                gpus={"choices": {1: 0.4, 2: 0.2, 4: 0.2, 8: 0.2}},
                tenants={"a": 0.5, "b": 0.3, "capped": 0.2},
                model=None,
            ),
            batch(
                "urgent",
                arrivals={"process": "poisson", "rate_per_hour": 2},
                gpus={"choices": {4: 1}},
                priority=10,
                tenants={"b": 1.0},
            ),
        ],
        "failures": [{"site": "east", "down_at": "1d", "up_at": "1d8h"}],
    }
    body.update(doc)
    a100 = {
        "inventory": {
            "devices": [{"model": "A100-80GB", "count": 16}],
            "cpu_cores": 256,
            "mem_gb": 2048,
        },
        "prices": {
            "usd_per_gpu_hour": {"A100-80GB": 1.5},
            "usd_per_core_hour": 0.02,
            "usd_per_gb_mem_hour": 0.003,
            "usd_per_gb_egress": 0.05,
        },
    }
    return scenario(
        {"east": h100_site(16), "west": h100_site(8, region="west"), "cheap": a100},
        quotas={"capped": 8},
        **body,
    )


def test_gated_retries_place_exactly_as_trying_every_job(scenario: Callable[..., Any]) -> None:
    sc = contended(scenario)
    gated, reference = run(sc), run(sc, reference=True)
    assert gated["jobs"]["pending_at_end"] > 0  # the federation really is contended
    assert gated["jobs"]["migrations"] > 0
    for key in ("jobs", "cost", "energy", "utilization", "failures"):
        assert gated[key] == reference[key], key


def test_same_seed_same_results_other_seed_differs(scenario: Callable[..., Any]) -> None:
    sc = contended(scenario)
    a, b = run(sc), run(sc)
    a.pop("run"), b.pop("run")
    assert a == b
    c = run(sc.model_copy(update={"seed": 4}))
    assert c["jobs"]["arrived"] != a["jobs"]["arrived"] or c["cost"] != a["cost"]


def test_failover_moves_jobs_and_retries_run_out(scenario: Callable[..., Any]) -> None:
    body = {
        "horizon": "1d",
        "workloads": [
            batch(
                arrivals={"process": "poisson", "rate_per_hour": 6},
                duration={"distribution": "fixed", "hours": 5},
            )
        ],
        "failures": [{"site": "east", "down_at": "6h"}, {"site": "west", "down_at": "12h"}],
    }
    sites = {"east": h100_site(64), "west": h100_site(64), "south": h100_site(64)}
    res = run(scenario(sites, **body, policy={"kind": "fast-path", "max_retries": 3}))
    moved = {f["site"]: f["jobs_moved"] for f in res["failures"]}
    assert moved["east"] > 0 and moved["west"] > 0
    assert res["jobs"]["migrations"] == moved["east"] + moved["west"]
    assert res["jobs"]["failed"] == 0
    # nothing runs on a dead site after it died: at the end everything runs at south
    assert res["series"]["site_up"]["east"][-1] is False
    assert res["series"]["gpu_utilization"]["east"][-1] == 0
    assert res["series"]["gpu_utilization"]["west"][-1] == 0

    no_retries = run(scenario(sites, **body, policy={"kind": "fast-path", "max_retries": 0}))
    assert no_retries["jobs"]["failed"] == sum(f["jobs_failed"] for f in no_retries["failures"])
    assert no_retries["jobs"]["failed"] > 0 and no_retries["jobs"]["migrations"] == 0


def test_site_back_within_grace_keeps_its_jobs(scenario: Callable[..., Any]) -> None:
    res = run(
        scenario(
            {"east": h100_site(64)},
            horizon="1d",
            workloads=[batch()],
            policy={"failover_grace_s": "10m"},
            failures=[{"site": "east", "down_at": "6h", "up_at": "6h5m"}],
        )
    )
    assert res["jobs"]["migrations"] == 0
    assert res["failures"][0]["up_s"] == pytest.approx(6 * 3600 + 300)


def test_fast_path_prefers_the_cheapest_site_baselines_do_not(
    scenario: Callable[..., Any],
) -> None:
    dear = h100_site(64, prices={"usd_per_gpu_hour": {"H100": 4.0}})
    sites = {"dear": dear, "cheap": h100_site(64)}  # file order: cheap, dear (sorted files)
    body = {
        "horizon": "1d",
        "workloads": [batch(arrivals={"process": "poisson", "rate_per_hour": 5})],
    }
    fast = run(scenario(sites, **body))
    assert fast["utilization"]["cheap"]["gpu"] > 0 and fast["utilization"]["dear"]["gpu"] == 0
    first_fit = run(scenario(sites, **body, policy={"kind": "fifo-first-fit"}))
    assert first_fit["utilization"]["dear"]["gpu"] == 0  # cheap is first in file order
    rand = run(scenario(sites, **body, policy={"kind": "random"}))
    assert rand["utilization"]["dear"]["gpu"] > 0 and rand["utilization"]["cheap"]["gpu"] > 0
    assert rand["cost"]["total_usd"] > fast["cost"]["total_usd"]


def test_strict_fifo_blocks_behind_a_big_head(scenario: Callable[..., Any]) -> None:
    # 8 GPUs; a stream of 1-GPU jobs with an occasional 8-GPU job: FIFO waits for the big one
    body = {
        "horizon": "2d",
        "workloads": [
            batch(
                arrivals={"process": "poisson", "rate_per_hour": 6},
                gpus={"choices": {1: 0.9, 8: 0.1}},
            )
        ],
    }
    fast = run(scenario({"one": h100_site(8)}, **body))
    fifo = run(scenario({"one": h100_site(8)}, **body, policy={"kind": "fifo-first-fit"}))
    by = "queue_delay_s"
    assert fifo["jobs"][by]["p50"] > fast["jobs"][by]["p50"]


def test_batch_policy_places_at_pass_times(scenario: Callable[..., Any]) -> None:
    res = run(
        scenario(
            {"a": h100_site(64), "b": h100_site(64, region="b")},
            horizon="12h",
            workloads=[batch()],
            policy={"kind": "batch", "batch_interval_s": "1h", "batch_time_limit_s": 2},
        )
    )
    jobs = res["jobs"]
    assert res["run"]["batch_passes"] == 11
    assert jobs["placed"] > 0
    # jobs wait for the next pass: up to an hour, half an hour on average
    assert 0 < jobs["queue_delay_s"]["max"] <= 3600 + 1e-6
    assert jobs["queue_delay_s"]["mean"] == pytest.approx(1800, rel=0.25)


def test_edits_change_the_answer(scenario: Callable[..., Any]) -> None:
    body = {
        "horizon": "2d",
        "workloads": [batch(arrivals={"process": "poisson", "rate_per_hour": 12})],
    }
    base = run(scenario({"one": h100_site(16)}, **body))
    more = run(
        scenario(
            {"one": h100_site(16)},
            federation={
                "configs": "configs",
                "edits": [
                    {"add_devices": {"site": "one", "model": "H100", "count": 16}},
                    {"set_prices": {"site": "*", "scale": 2.0}},
                    {"set_power": {"site": "one", "grid_kgco2_per_kwh": 0.25}},
                ],
            },
            **body,
        )
    )
    assert more["scenario"]["sites"]["one"]["gpus"] == {"H100": 32}
    assert more["jobs"]["queue_delay_s"]["p95"] < base["jobs"]["queue_delay_s"]["p95"]
    # same jobs run (more of them finish sooner); per GPU-hour they cost twice as much and
    # emit half the carbon per kWh
    rate = lambda r: r["cost"]["total_usd"] / r["energy"]["total_kwh"]  # noqa: E731
    assert rate(more) == pytest.approx(2 * rate(base), rel=1e-6)
    carbon = lambda r: r["carbon"]["total_kg"] / r["energy"]["total_kwh"]  # noqa: E731
    assert carbon(more) == pytest.approx(carbon(base) / 2, rel=1e-6)


def test_unplaceable_jobs_are_reported_with_the_reason(scenario: Callable[..., Any]) -> None:
    res = run(
        scenario(
            {"one": h100_site(16)},
            horizon="6h",
            workloads=[batch(model="H200", arrivals={"process": "poisson", "rate_per_hour": 2})],
        )
    )
    unplaced = res["jobs"]["unplaced"]
    assert unplaced["count"] == res["jobs"]["arrived"] > 0
    assert unplaced["reasons"] == {"model": unplaced["count"]}
    assert "lack H200" in unplaced["examples"]["model"]


def test_quota_holds_in_simulation(scenario: Callable[..., Any]) -> None:
    res = run(
        scenario(
            {"one": h100_site(64)},
            quotas={"capped": 4},
            horizon="1d",
            sample_s="5m",
            workloads=[batch(tenants={"capped": 1.0}, gpus={"choices": {2: 1}})],
        )
    )
    busy = [u * 64 for u in res["series"]["gpu_utilization"]["one"]]
    assert max(busy) == pytest.approx(4)
    assert res["jobs"]["unplaced"]["reasons"].get("quota", 0) > 0


def test_inference_routes_by_latency_and_moves_off_a_dead_site(
    scenario: Callable[..., Any],
) -> None:
    def svc(cap: int) -> list[dict[str, Any]]:
        return [
            {
                "name": "chat",
                "model": "qwen2.5-7b-instruct",
                "url": "http://127.0.0.1:1",
                "max_concurrency": cap,
            }
        ]

    near = {
        "region": "jing-jin-ji",
        "coordinates": {"lat": 40.8, "lon": 114.9},
        "services": svc(64),
    }
    far = {
        "region": "greater-bay-area",
        "coordinates": {"lat": 24.8, "lon": 113.6},
        "services": svc(64),
    }
    relay = {"region": "inner-mongolia", "coordinates": {"lat": 40.4, "lon": 111.8}}
    # ids match configs/clients.yaml: beijing enters at zhangjiakou or horinger (no service)
    sites = {"zhangjiakou": near, "horinger": relay, "shaoguan": far}
    res = run(
        scenario(
            sites,
            clients=True,
            horizon="1d",
            inference_step_s="10m",
            workloads=[
                batch(arrivals={"process": "poisson", "rate_per_hour": 1}, model=None),
                {
                    "kind": "inference",
                    "name": "chat",
                    "service": "chat",
                    "requests_per_s": {"beijing": 50},
                    "slo_ms": 600,
                },
            ],
            failures=[{"site": "zhangjiakou", "down_at": "12h", "up_at": "18h"}],
        )
    )
    inf = res["inference"]
    region = inf["regions"]["beijing"]
    assert region["requests"] == pytest.approx(50 * 86400, rel=1e-6)
    assert region["dropped"] == 0
    # served nearby except while zhangjiakou was down (a quarter of the day)
    assert region["in_region_share"] == pytest.approx(0.75, abs=0.03)
    series = inf["series"]["site_load"]
    t = inf["series"]["t_s"]
    during = [i for i, x in enumerate(t) if 12 * 3600 <= x < 18 * 3600]
    assert all(series["zhangjiakou"][i] == 0 for i in during)
    assert all(series["shaoguan"][i] > 0 for i in during)
    assert 0.9 < region["slo_attainment"] <= 1.0
    assert region["p50_ms"] < region["p99_ms"]


def test_inference_overload_drops_and_misses_the_slo(scenario: Callable[..., Any]) -> None:
    site = {
        "region": "jing-jin-ji",
        "coordinates": {"lat": 40.8, "lon": 114.9},
        "services": [
            {
                "name": "chat",
                "model": "qwen2.5-7b-instruct",
                "url": "http://127.0.0.1:1",
                "max_concurrency": 8,
            }
        ],
    }
    res = run(
        scenario(
            {"zhangjiakou": site},
            clients=True,
            horizon="2h",
            workloads=[
                batch(arrivals={"process": "poisson", "rate_per_hour": 1}),
                {
                    "kind": "inference",
                    "name": "chat",
                    "service": "chat",
                    "requests_per_s": {"beijing": 200},
                    "slo_ms": 500,
                },
            ],
        )
    )
    region = res["inference"]["regions"]["beijing"]
    assert region["dropped"] > 0.5 * region["requests"]
    assert region["slo_attainment"] < 0.5


@pytest.mark.parametrize(
    ("doc", "field", "text"),
    [
        ({"horizon": "soon"}, "horizon", "not a duration"),
        ({"policy": {"kind": "magic"}}, "policy.kind", "fast-path"),
        ({"failures": [{"site": "nowhere", "down_at": "1h"}]}, "failures[0].site", "nowhere"),
        (
            {"failures": [{"site": "one", "down_at": "2h", "up_at": "1h"}]},
            "failures[0]",
            "after down_at",
        ),
        (
            {"federation": {"configs": "configs", "edits": [{"remove_site": {"site": "x"}}]}},
            "federation.edits[0].remove_site",
            "'x' is not in the federation",
        ),
        (
            {
                "federation": {
                    "configs": "configs",
                    "edits": [{"add_devices": {"site": "one", "model": "H200", "count": 8}}],
                }
            },
            "federation.edits[0].add_devices",
            "no price for H200",
        ),
        (
            {
                "federation": {
                    "configs": "configs",
                    "edits": [{"remove_site": {"site": "one"}, "set_power": {"site": "one"}}],
                }
            },
            "federation.edits[0]",
            "exactly one",
        ),
        ({"workloads": []}, "workloads", "at least 1"),
    ],
)
def test_bad_scenarios_name_the_field(
    make_configs: Callable[..., Path],
    write_scenario: Callable[..., Path],
    doc: dict[str, Any],
    field: str,
    text: str,
) -> None:
    make_configs({"one": h100_site(8)})
    body: dict[str, Any] = {
        "name": "bad",
        "federation": {"configs": "configs"},
        "horizon": "1d",
        "workloads": [batch()],
    }
    body.update(doc)
    path = write_scenario(body)
    with pytest.raises(ConfigError) as err:
        load_scenario(path)
    problem = err.value.problems[0]
    assert problem.source == str(path)
    assert problem.field.startswith(field), problem
    assert text in str(problem)


def test_trace_replay_runs_each_row_as_given(scenario: Callable[..., Any], tmp_path: Path) -> None:
    (tmp_path / "trace.csv").write_text(
        "# arrival_s, gpus, duration_s, tenant\n"
        "arrival_s,gpus,duration_s,tenant,model\n"
        "0,8,3600,a,H100\n"
        "600,4,1800,b,H100\n"
        "1200,2,7200,a,H100\n"
    )
    res = run(
        scenario(
            {"one": h100_site(64)},
            horizon="1d",
            workloads=[{"kind": "trace", "name": "replay", "path": "trace.csv"}],
        )
    )
    jobs = res["jobs"]
    assert (jobs["arrived"], jobs["completed"]) == (3, 3)
    assert jobs["queue_delay_s"]["max"] == 0
    assert jobs["completion_time_s"]["p50"] == pytest.approx(3600)
    # 14 GPU-hours, each at 2.5 USD (tests/conftest.py site_doc) plus the trace workload's
    # default 8 cores (0.02 USD/h each) and 64 GB (0.003 USD/GB-h) per GPU
    per_gpu_hour = 2.5 + 8 * 0.02 + 64 * 0.003
    assert res["cost"]["total_usd"] == pytest.approx(14 * per_gpu_hour)
    assert set(res["cost"]["by_tenant"]) == {"a", "b"}


def test_job_classes_are_the_distinct_rows_np_unique_gives() -> None:
    # the engine's class keys and indices: np.unique of the columns' record array, the
    # reference it replaced (same keys, same order, same index per job)
    rng = np.random.default_rng(7)
    n = 5_000
    columns: list[npt.NDArray[Any]] = [
        rng.integers(0, 9, n),
        rng.integers(-1, 3, n),
        rng.integers(0, 3, n).astype(np.int32),
        rng.integers(-1, 2, n),
        rng.choice([1, 8, 64], n).astype(np.int32),
        rng.choice([0.0, 16.0, 32.5, -1.5], n),
        rng.integers(0, 3, n).astype(np.int32),
        rng.choice([0.0, 10.0, 2.25], n),
        rng.integers(0, 2, n).astype(np.int8),
        rng.integers(-1, 2, n),
    ]
    types = (int, int, int, int, int, float, int, float, int, int)
    keys, inverse = np.unique(np.rec.fromarrays(columns), return_inverse=True)  # type: ignore[call-overload]
    want_keys = [tuple(t(v) for t, v in zip(types, row, strict=True)) for row in keys.tolist()]
    got_index, got_keys = unique_rows(columns, types)
    assert got_keys == want_keys
    assert got_index == inverse.ravel().tolist()
    assert 100 < len(got_keys) < n  # repeats and distinct rows both
    assert unique_rows([np.array([], dtype=int)], (int,)) == ([], [])


def test_a_run_keeps_the_collector_off_and_leaves_next_to_no_cycles(
    scenario: Callable[..., Any],
) -> None:
    # Simulation.run pauses the cyclic collector for its event loop; that is safe only while
    # the events make no garbage cycles (per job, they would be thousands here)
    sc = contended(scenario)
    seen: list[bool] = []
    sim = Simulation(sc)
    sample = sim._sample

    def watched() -> None:
        seen.append(gc.isenabled())
        sample()

    sim._sample = watched  # type: ignore[method-assign]
    gc.collect()
    res = sim.run()
    assert gc.isenabled()
    assert seen and not any(seen)
    assert res["jobs"]["arrived"] > 1_000 and res["jobs"]["migrations"] > 0
    # the cycles the run left: the simulation's own objects among what a collection finds (in a
    # full run another test's threads, gRPC's or a client's, may leave garbage meanwhile)
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        ours = [
            o for o in gc.garbage
            if type(o).__module__.startswith(("simulations", "broker", "routing", "sites"))
        ]  # fmt: skip
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert len(ours) < 50, ours[:10]  # 0 when written, for 1,164 jobs


def test_each_job_is_its_class_template_copied_as_model_copy_copies_it() -> None:
    template = JobSpec(
        name="class-0",
        tenant="ai-lab",
        gpu=GpuRequest(count=2, model="H100"),
        cpu=16,
        mem_gb=64.0,
        data=DataLocation(region="east", size_gb=3.0),
        command=("simulated",),
        max_retries=2,
    )
    got = job_like(template, "j7", 2.5)
    want = template.model_copy(update={"name": "j7", "duration_hours": 2.5})
    assert got == want and got.model_dump() == want.model_dump()
    assert got.model_fields_set == want.model_fields_set
    assert template.name == "class-0" and template.duration_hours != 2.5
    with pytest.raises(ValidationError):  # frozen as the template is
        got.name = "other"  # type: ignore[misc]
