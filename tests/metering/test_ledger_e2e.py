"""The usage ledger on a real federation (etcd, agent processes, a broker process): a job's
segments add up to the time it really held its resources, within a second, through a retry,
a broker failover (the leader SIGKILLed mid-run) and a migration (its site SIGKILLed)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from metering.ledger import Segment
from sites.model import keys
from sites.registry.client import Registry
from tests.broker.conftest import Federation

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)

# A lost site's last run is billed up to the status its agent last wrote, and an agent writes
# an unchanged status only every agent.refresh_s (30 s by default): refresh_s 0 writes every
# interval (0.5 s), so the migration below bills the lost run within TOLERANCE_S of its kill.
SITES: dict[str, dict[str, Any]] = {
    "east-a": {
        "region": "east",
        "coordinates": {"lat": 31.2, "lon": 121.4},
        "price": 3.0,
        "refresh_s": 0,
    },
    "east-b": {
        "region": "east",
        "coordinates": {"lat": 31.3, "lon": 120.6},
        "price": 2.0,
        "refresh_s": 0,
    },
}
TOLERANCE_S = 1.0


def stamped(marker: Path, body: str) -> list[str]:
    """A job command that writes when it really started and ended, per attempt."""
    return [
        "sh",
        "-c",
        f'echo "start $CPN_ATTEMPT $(date +%s.%N)" >> {marker}; {body}; rc=$?; '
        f'echo "end $CPN_ATTEMPT $(date +%s.%N)" >> {marker}; exit $rc',
    ]


def held(marker: Path) -> dict[int, list[float]]:
    """attempt -> [start, end?] as the job itself saw them."""
    out: dict[int, list[float]] = {}
    for line in marker.read_text().splitlines():
        _, attempt, at = line.split()
        out.setdefault(int(attempt), []).append(float(at))
    return out


def events(fed: Federation, job: str) -> str:
    """The job's events one per line (an assertion message pytest does not cut short)."""
    return "\n".join(f"{e['at']:.2f} {e['type']} {e['message']}" for e in fed.job(job)["events"])


async def segments(registry: Registry, job: str) -> dict[int, Segment]:
    _, kvs = await registry.list_prefix(keys.USAGE_SEGMENTS)
    found = [Segment.model_validate_json(v) for _, v, _ in kvs]
    mine = [s for s in found if s.job == job]
    by_attempt = {s.attempt: s for s in mine}
    assert len(by_attempt) == len(mine), "a run was metered twice"
    return by_attempt


async def test_segments_add_up_through_retry_failover_and_migration(
    make_federation: Callable[..., Federation], registry: Registry, tmp_path: Path
) -> None:
    fed = make_federation(SITES)
    retry_log, long_log, move_log = (tmp_path / "shared" / n for n in ("retry", "long", "move"))
    # fails its first run after 1 s, succeeds on the second
    flaky = fed.submit(
        name="flaky",
        cpu=2,
        mem_gb=4,
        max_retries=2,
        command=stamped(retry_log, 'sleep 1; [ "$CPN_ATTEMPT" -gt 1 ]'),
    )
    long = fed.submit(name="long", cpu=3, mem_gb=8, command=stamped(long_log, "sleep 3"))
    fed.wait_state(long["id"], "RUNNING")
    await asyncio.sleep(0.5)
    assert fed.broker is not None
    fed.kill(fed.broker)  # the leader dies mid-run; the job ends while no broker leads
    fed.start_broker()
    done = fed.wait_state(long["id"], "SUCCEEDED", "FAILED", timeout=30)
    assert done["state"] == "SUCCEEDED", done["events"]
    assert fed.wait_state(flaky["id"], "SUCCEEDED", "FAILED", timeout=30)["state"] == "SUCCEEDED"

    # the failover: one segment, as long as the run
    long_segs = await segments(registry, long["id"])
    assert set(long_segs) == {1}, events(fed, long["id"])
    (start, end) = held(long_log)[1]
    seg = long_segs[1]
    assert seg.reason == "succeeded"
    assert abs(seg.seconds - (end - start)) < TOLERANCE_S, (seg.seconds, end - start)
    assert seg.cpu_core_s == 3 * seg.seconds and seg.mem_gb_s == 8 * seg.seconds
    assert seg.cpu_usd == seg.cpu_core_s / 3600 * 0.01  # the site's list price
    assert seg.energy_method == "catalog" and seg.energy_kwh > 0 and seg.co2_kg > 0

    # the retry: one segment per run, each as long as that run
    flaky_segs = await segments(registry, flaky["id"])
    assert [flaky_segs[a].reason for a in sorted(flaky_segs)] == ["failed", "succeeded"]
    for attempt, (start, end) in held(retry_log).items():
        assert abs(flaky_segs[attempt].seconds - (end - start)) < TOLERANCE_S

    # the migration: the lost site bills up to when it was last seen, the next site the rest
    move = fed.submit(
        name="mover",
        gpu={"model": "H100", "count": 4},
        checkpoint_path="/ckpt/mover",
        command=stamped(move_log, "sleep 2"),
    )
    first = fed.wait_state(move["id"], "RUNNING")["placement"]["site"]
    await asyncio.sleep(1.0)
    killed_at = time.time()
    fed.kill(fed.agents[first])
    moved = fed.wait_state(move["id"], "SUCCEEDED", "FAILED", timeout=60)
    assert moved["state"] == "SUCCEEDED", moved["events"]
    move_segs = await segments(registry, move["id"])
    assert set(move_segs) == {1, 2}, events(fed, move["id"])
    lost, rerun = move_segs[1], move_segs[2]
    assert (lost.site, lost.reason, lost.model, lost.gpus) == (first, "site_lost", "H100", 4)
    started = held(move_log)[1][0]
    assert abs(lost.seconds - (killed_at - started)) < TOLERANCE_S, (lost.seconds, killed_at)
    assert lost.gpu_s == 4 * lost.seconds
    assert rerun.site != first and rerun.reason == "succeeded"
    (start, end) = held(move_log)[2]
    assert abs(rerun.seconds - (end - start)) < TOLERANCE_S

    # a cancel ends the run with the write that withdraws it
    stop = fed.submit(name="stopper", cpu=1, mem_gb=1, command=["sleep", "30"])
    running_at = time.time()
    fed.wait_state(stop["id"], "RUNNING")
    await asyncio.sleep(0.5)
    assert fed.request("POST", f"/v1/jobs/{stop['id']}/cancel")[0] == 200
    cancelled_at = time.time()
    (seg,) = (await segments(registry, stop["id"])).values()
    assert seg.reason == "withdrawn" and 0 < seg.seconds <= cancelled_at - running_at + 0.1

    # the API sums the same segments
    status, body = fed.get("/v1/usage?by=tenant,site")
    reply = json.loads(body)
    assert status == 200
    all_segs = [
        s for j in (flaky, long, move, stop) for s in (await segments(registry, j["id"])).values()
    ]
    assert len(all_segs) == 6
    total = sum(s.total_usd for s in all_segs)
    assert abs(reply["total"]["total_usd"] - total) < 1e-9
    assert reply["total"]["segments"] == 6
    assert {(i["tenant"], i["site"]) for i in reply["items"]} <= {
        ("t1", "east-a"),
        ("t1", "east-b"),
    }


async def test_a_run_killed_over_its_memory_is_billed_and_told_out_of_memory(
    make_federation: Callable[..., Federation], registry: Registry
) -> None:
    """A job that allocates more than its mem_gb is killed by its cgroup, inside its sandbox:
    FAILED with the reason in its events, and its segment ends `out_of_memory`."""
    from sites.executors.cgroups import CgroupError, Cgroups

    try:
        Cgroups.detect("probe").check()
    except (CgroupError, OSError) as exc:
        import pytest

        pytest.skip(f"no cgroups here: {exc}")
    fed = make_federation(SITES)
    hog = "b = []\nwhile True: b.append(bytearray(16 << 20))"
    job = fed.submit(name="hog", cpu=1, mem_gb=0.125, max_retries=0,
                     command=["python3", "-c", hog])  # fmt: skip
    done = fed.wait_state(job["id"], "FAILED", "SUCCEEDED", timeout=60)
    assert done["state"] == "FAILED", done["events"]
    failed = [e for e in done["events"] if e["type"] == "failed"]
    assert failed and "out of memory" in failed[-1]["message"], done["events"]
    running = [e for e in done["events"] if e["type"] == "running"]
    assert running and "bwrap sandbox" in running[-1]["message"], done["events"]
    (seg,) = (await segments(registry, job["id"])).values()
    assert seg.reason == "out_of_memory", seg


# Two sites whose agents' clocks are off (CPN_FAULT_CLOCK_SKEW_S, docs/chaos.md): one 3 s
# ahead of the broker's, one 2 s behind; each the only site with its model, so a job goes
# where its model is.
SKEWED: dict[str, dict[str, Any]] = {
    "ahead": {"region": "east", "coordinates": {"lat": 31.2, "lon": 121.4}, "price": 3.0,
              "model": "H100", "refresh_s": 0},
    "behind": {"region": "east", "coordinates": {"lat": 31.3, "lon": 120.6}, "price": 2.0,
               "model": "L40S", "refresh_s": 0},
}  # fmt: skip
SKEW_S = {"ahead": 3.0, "behind": -2.0}


async def test_a_site_whose_clock_is_off_is_billed_what_its_runs_ran(
    make_federation: Callable[..., Federation],
    registry: Registry,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run's length is read on one clock: the site's when it reported both ends (a site 3 s
    ahead used to bill a 2 s run 0 s: its start was its own, its end clamped to the broker's),
    the broker's when the broker ended it (a cancel: from its own `running` event)."""
    from sites.kits.clock import FAULT_CLOCK_SKEW_ENV

    fed = make_federation(SKEWED, agents=False)
    for site, skew in SKEW_S.items():
        monkeypatch.setenv(FAULT_CLOCK_SKEW_ENV, str(skew))
        fed.start_agent(site)
    monkeypatch.delenv(FAULT_CLOCK_SKEW_ENV)
    deadline = time.monotonic() + 30
    while not all(s["state"] == "up" for s in json.loads(fed.get("/v1/sites")[1])["items"]):
        assert time.monotonic() < deadline, fed.get("/v1/sites")
        await asyncio.sleep(0.1)
    logs = {site: tmp_path / "shared" / f"ran-{site}" for site in SKEW_S}
    models = {site: spec["model"] for site, spec in SKEWED.items()}
    done = {
        site: fed.submit(
            name=f"on-{site}",
            gpu={"model": models[site], "count": 1},
            command=stamped(logs[site], "sleep 2"),
        )
        for site in SKEW_S
    }
    for site, job in done.items():
        record = fed.wait_state(job["id"], "SUCCEEDED", "FAILED", timeout=30)
        assert record["state"] == "SUCCEEDED" and record["placement"]["site"] == site, record
        (seg,) = (await segments(registry, job["id"])).values()
        (start, end) = held(logs[site])[1]
        assert seg.clock == "site" and abs(seg.seconds - (end - start)) < TOLERANCE_S, (
            site, seg.seconds, end - start,
        )  # fmt: skip
        # the site's own times, each off by its skew
        assert abs(seg.start - SKEW_S[site] - start) < TOLERANCE_S, (site, seg.start, start)
    for site, model in models.items():
        gpu = {"model": model, "count": 1}
        job = fed.submit(name=f"cancel-{site}", gpu=gpu, command=["sleep", "60"])
        fed.wait_state(job["id"], "RUNNING")
        running_at = time.time()
        await asyncio.sleep(1.5)
        assert fed.request("POST", f"/v1/jobs/{job['id']}/cancel")[0] == 200
        cancelled_at = time.time()
        (seg,) = (await segments(registry, job["id"])).values()
        assert seg.reason == "withdrawn" and seg.clock == "broker", seg
        # the broker's running event came at most a pass before the test saw RUNNING
        assert cancelled_at - running_at - 0.1 <= seg.seconds <= cancelled_at - running_at + 1.0, (
            site, seg.seconds, cancelled_at - running_at,
        )  # fmt: skip
