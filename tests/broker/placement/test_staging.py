"""Placement of jobs with inputs (broker.placement.staging): the fast path and the batch plan
price moving a dataset the same way, a deadline counts the transfer, no holder is 'data'."""

from __future__ import annotations

import dataclasses
import math
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from broker.model.jobs import JobSpec
from broker.placement import place as pl
from broker.placement.staging import DataView, transfer_hours
from broker.plan import batch
from broker.plan.solver import solve
from sites.model.spec import Prices

NOW = datetime(2026, 11, 30, tzinfo=UTC)
DIGEST = "d" * 64
GB = 1_000_000_000


def offer(site: str, region: str, price: float) -> pl.SiteOffer:
    return pl.SiteOffer(
        id=site, region=region, country="CN", up=True, cordoned=False,
        free_gpus={"H100": 8}, free_cpu=256, free_mem_gb=4096, gpu_mem_gb={"H100": 80.0},
        prices=Prices(usd_per_gpu_hour={"H100": price}, usd_per_gb_egress=0.05),
    )  # fmt: skip


def federation(holders: dict[str, frozenset[str]], mbps: float = 1000.0) -> pl.Federation:
    """'far' holds the data (dear GPUs, another region); 'near' is cheap; 'twin' is in far's
    region, a bit cheaper than far."""
    view = DataView(holders=lambda d: holders.get(d, frozenset()), bandwidth=lambda s, d: mbps)
    return pl.Federation(
        sites=(offer("far", "eu", 3.0), offer("near", "east", 2.0), offer("twin", "eu", 2.9)),
        data=view,
    )


def spec(size: int, **more: Any) -> JobSpec:
    doc: dict[str, Any] = {
        "name": "j", "tenant": "t", "command": ["true"], "gpu": {"model": "H100", "count": 8},
        "duration_hours": 1.0,
        "inputs": [{"dataset": "t/d@1", "path": "/data/d", "digest": DIGEST, "bytes": size}],
    }  # fmt: skip
    doc.update(more)
    return JobSpec.model_validate(doc)


def place(job: JobSpec, fed: pl.Federation) -> pl.Decision | pl.Unschedulable:
    return pl.place(job, fed, now=NOW, usage=pl.TenantUsage(), groups=pl.GroupState({}, {}))


def test_a_large_dataset_keeps_the_job_at_its_data_a_small_one_moves() -> None:
    fed = federation({DIGEST: frozenset({"far"})})
    # 2 TB: 100 USD of egress and ~4.4 h of transfer outweigh 8 USD of cheaper GPUs
    big = place(spec(2000 * GB), fed)
    assert isinstance(big, pl.Decision) and big.site == "far"
    assert "inputs held here" in big.reason
    # 1 GB: 0.05 USD and seconds: the cheap site wins and says where the data comes from
    small = place(spec(1 * GB), fed)
    assert isinstance(small, pl.Decision) and small.site == "near"
    assert "inputs staged from far: egress 0.05 USD" in small.reason
    # the estimate is kept apart: the ledger bills the bytes the run pulls, not it
    idle = transfer_hours(GB, 1000.0) * small.breakdown.compute_usd
    assert small.staging_usd == pytest.approx(0.05 + idle)
    assert small.placement().staging_usd == pytest.approx(0.05 + idle, abs=1e-6)
    assert small.breakdown.egress_usd == pytest.approx(small.staging_usd)
    assert big.staging_usd == 0.0 and big.placement().staging_usd is None
    # within the data's region moving is free but not instant: twin (2.9) still beats far (3.0)
    fed_same = federation({DIGEST: frozenset({"far"})}, mbps=100_000.0)
    twin = place(spec(50 * GB, denied_regions=["east"]), fed_same)
    assert isinstance(twin, pl.Decision) and twin.site == "twin"


def test_the_deadline_counts_the_transfer() -> None:
    fed = federation({DIGEST: frozenset({"far"})}, mbps=100.0)
    hours = transfer_hours(200 * GB, 100.0)  # 4.4 h at 100 Mbit/s
    deadline = NOW + timedelta(hours=1.0 + hours / 2)
    got = place(spec(200 * GB, deadline=deadline.isoformat(), allowed_regions=["east"]), fed)
    assert isinstance(got, pl.Unschedulable)
    assert "deadline" in got.reasons
    # at the data, the same deadline is met
    ok = place(spec(200 * GB, deadline=deadline.isoformat()), fed)
    assert isinstance(ok, pl.Decision) and ok.site == "far"


def test_an_input_no_live_site_holds_is_the_data_filter() -> None:
    got = place(spec(GB), federation({}))
    assert isinstance(got, pl.Unschedulable)
    assert set(got.reasons) == {"data"}
    assert "no live site holds a complete replica" in got.message


def test_the_batch_plan_prices_inputs_as_the_fast_path() -> None:
    fed = federation({DIGEST: frozenset({"far"})})
    jobs = [batch.Pending("big-x", spec(2000 * GB)), batch.Pending("small-x", spec(GB))]
    problem = batch.to_problem(jobs, fed, now=NOW, groups=pl.GroupState({}, {}))
    result = solve(problem, time_limit_s=5)
    where = {job_id: a.site for job_id, a in result.assignments.items()}
    assert where == {"big-x": "far", "small-x": "near"}
    decided = {p.id: d for p, d in batch.decisions(result, problem, jobs, fed)}
    assert decided["big-x"].staging_usd == 0.0
    assert decided["small-x"].staging_usd == pytest.approx(decided["small-x"].breakdown.egress_usd)
    assert decided["small-x"].staging_usd > 0.05


def test_waiting_for_a_busy_holder_is_weighed_against_staging() -> None:
    view = DataView(
        holders=lambda d: frozenset({"far"}) if d == DIGEST else frozenset(),
        bandwidth=lambda s, d: 1000.0,
    )
    busy = dataclasses.replace(offer("far", "eu", 3.0), free_gpus={"H100": 0})
    fed = pl.Federation(sites=(busy, offer("near", "east", 2.0)), data=view)
    job = spec(2000 * GB)
    staged = place(job, fed)
    assert isinstance(staged, pl.Decision) and staged.site == "near"  # far is full now
    assert staged.staging_usd > 100  # 100 USD of egress and ~4.4 h of transfer
    soon = NOW.timestamp() + 600

    def wait(ends: list[tuple[float, str | None, int, int]]) -> pl.Wait | None:
        return pl.wait_for_holder(
            job, fed, staged, now=NOW, usage=pl.TenantUsage(), groups=pl.GroupState({}, {}),
            ends=lambda site: ends if site == "far" else [],
        )  # fmt: skip

    # far frees its 8 H100 in 10 minutes: 24 USD there + 10 min at its 24 USD/h beats staging
    waited = wait([(soon, "H100", 8, 0)])
    assert waited is not None and waited.site == "far"
    assert waited.hours == pytest.approx(1 / 6) and waited.cost_usd == pytest.approx(28.0)
    assert waited.reason.startswith("waits for far, which holds its inputs (room in about 10 min")
    # in 20 hours: the wait costs more than moving the data now
    assert wait([(NOW.timestamp() + 20 * 3600, "H100", 8, 0)]) is None
    # in 5 hours: cheaper priced at far's rate (24 + 5 x 24 < staging's), but the 2 TB would
    # arrive at near in 4.4 h: a wait never starts the job later than staging would
    assert wait([(NOW.timestamp() + 5 * 3600, "H100", 8, 0)]) is None
    assert wait([(NOW.timestamp() + 4 * 3600, "H100", 8, 0)]) is not None
    # a job that has waited 4.3 h already does not wait another 10 min: the data would have
    # been there by then
    assert pl.wait_for_holder(
        job, fed, staged, now=NOW, usage=pl.TenantUsage(), groups=pl.GroupState({}, {}),
        ends=lambda site: [(soon, "H100", 8, 0)] if site == "far" else [], waited_hours=4.3,
    ) is None  # fmt: skip
    # what ends must be of the model, and enough of it; work without an estimate never ends
    assert wait([(soon, "A100-80GB", 8, 0)]) is None
    assert wait([(soon, "H100", 4, 0)]) is None
    assert wait([(math.inf, "H100", 8, 0)]) is None
    assert wait([(soon, "H100", 4, 0), (soon + 600, "H100", 4, 0)]) is not None
    # a queue: what frees in 10 min went to the job that chose to wait before this one, and
    # the next 8 H100 free only in 20 h: this one moves the data
    queue = [(soon, "H100", 8, 0), (NOW.timestamp() + 20 * 3600, "H100", 8, 0)]
    first = wait(queue)
    assert first is not None and (first.model, first.amount) == ("H100", 8)
    second = pl.wait_for_holder(
        job, fed, staged, now=NOW, usage=pl.TenantUsage(), groups=pl.GroupState({}, {}),
        ends=lambda site: queue if site == "far" else [],
        queued=lambda site, model: 8 if (site, model) == ("far", "H100") else 0,
    )  # fmt: skip
    assert second is None
    # a decision that stages nothing is never second-guessed
    held = place(spec(2000 * GB), federation({DIGEST: frozenset({"far"})}))
    assert isinstance(held, pl.Decision) and held.staging_usd == 0
    assert pl.wait_for_holder(
        spec(2000 * GB), federation({DIGEST: frozenset({"far"})}), held, now=NOW,
        usage=pl.TenantUsage(), groups=pl.GroupState({}, {}), ends=lambda site: [],
    ) is None  # fmt: skip


def test_a_staged_copy_serves_the_other_readers_so_hot_data_is_staged_not_waited_for() -> None:
    def fed_keeping(keeps: float) -> pl.Federation:
        view = DataView(
            holders=lambda d: frozenset({"far"}) if d == DIGEST else frozenset(),
            bandwidth=lambda s, d: 1000.0,
            keeps=lambda site: keeps,
        )
        busy = dataclasses.replace(offer("far", "eu", 3.0), free_gpus={"H100": 0})
        return pl.Federation(sites=(busy, offer("near", "east", 2.0)), data=view)

    job = spec(2000 * GB)
    fed = fed_keeping(math.inf)
    staged = place(job, fed)
    assert isinstance(staged, pl.Decision) and staged.site == "near" and staged.staging_usd > 100
    # far frees its H100 in an hour: alone, the job waits (24 + 24 USD against staging's ~150)
    in_an_hour = [(NOW.timestamp() + 3600, "H100", 8, 0)]

    def wait(fed: pl.Federation, others: int) -> pl.Wait | None:
        return pl.wait_for_holder(
            job, fed, staged, now=NOW, usage=pl.TenantUsage(), groups=pl.GroupState({}, {}),
            ends=lambda site: in_an_hour if site == "far" else [],
            readers=lambda digest: others if digest == DIGEST else 0,
        )  # fmt: skip

    assert wait(fed, 0) is not None
    # the share of the staging each reader bears: by bytes, 1 / (1 + the others)
    view = fed.data
    assert view is not None
    assert view.copy_share(job, "near", lambda d: 4) == pytest.approx(0.2)
    assert view.copy_share(job, "far", lambda d: 4) == 1.0  # held there: nothing moved
    # four other live jobs read it: the copy at near serves them, and a wait of an hour is
    # longer than this job's fifth of the 4.4 h transfer: it stages
    assert wait(fed, 4) is None
    assert wait(fed, 2) is not None  # a third of it (1.5 h) is longer than the wait
    # ... and when near's store cannot keep 2 TB, the copy would not stay for them: it waits
    small = fed_keeping(1000 * GB)
    assert small.data is not None and small.data.copy_share(job, "near", lambda d: 4) == 1.0
    assert wait(small, 4) is not None
