"""The disaster drill (docs/backup.md): a backup, work run and submitted after it, every etcd
member destroyed, the registry restored from the backup while the agents and the broker keep
running; then no job ran twice, every job is finished, running once or listed as lost, and
the ledger holds exactly the runs that happened.

bench/disaster_drill.py runs it larger (CPN_DRILL_JOBS) and prints its figures.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from sites.emulation.etcd_server import EtcdCluster
from sites.model import keys
from sites.registry.client import Registry
from tests.broker.conftest import (
    BROKER_SETTINGS,
    Federation,
    federation_site,
    join_sites,
    shared_dir,
)
from tests.conftest import CONFIGS, REPO, Processes, write_admin_token

SITES = {
    "east-a": {"region": "east", "coordinates": {"lat": 31.2, "lon": 121.4}, "price": 3.0},
    "east-b": {"region": "east", "coordinates": {"lat": 31.3, "lon": 120.6}, "price": 2.0},
}
JOBS = int(os.environ.get("CPN_DRILL_JOBS", "2"))  # of each kind, before and after the backup
COLLECT_S = 20.0


def cpn(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "cpn", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done.stdout


def _federation(cluster: EtcdCluster, reg: Registry, processes: Processes, tmp: Path) -> Path:
    cfg = tmp / "configs"
    (cfg / "sites").mkdir(parents=True)
    shutil.copy(CONFIGS / "devices.yaml", cfg / "devices.yaml")
    shutil.copytree(CONFIGS / "latency", cfg / "latency")
    (cfg / "broker.yaml").write_text(yaml.safe_dump(BROKER_SETTINGS))
    regions = {"user_regions": [{"id": "user-east", "lat": 31.23, "lon": 121.47}]}
    (cfg / "regions.yaml").write_text(yaml.safe_dump(regions))
    (cfg / "tenants.yaml").write_text(yaml.safe_dump({"tenants": {}}))
    shared = shared_dir(tmp)
    for site_id, spec in SITES.items():
        doc = federation_site(site_id, {"shared": shared, **spec})
        (cfg / "sites" / f"{site_id}.yaml").write_text(yaml.safe_dump(doc))
    join_sites(cluster.url, sorted((cfg / "sites").glob("*.yaml")), cfg / "devices.yaml")
    return cfg


async def _segments(reg: Registry) -> set[tuple[str, int]]:
    """(job, attempt) of every usage segment of a run (egress segments aside)."""
    _, kvs = await reg.list_prefix(keys.USAGE_SEGMENTS)
    out = set()
    for key, _, _ in kvs:
        day, job, attempt = keys.split(key, keys.USAGE_SEGMENTS)[:3]
        if not job.endswith(".egress"):
            out.add((job, int(attempt)))
    return out


@pytest.mark.e2e
async def test_a_registry_lost_whole_comes_back_from_its_backup(
    processes: Processes, tmp_path: Path
) -> None:
    cluster = EtcdCluster(3, data_dir=tmp_path / "etcd", unsafe_no_fsync=True)
    cluster.start()
    try:
        async with Registry.from_urls(cluster.url) as reg:
            await write_admin_token(reg)
            cfg = _federation(cluster, reg, processes, tmp_path)
            fed = Federation(registry=reg, processes=processes, config_dir=cfg)
            for site_id in SITES:
                fed.start_agent(site_id)
            fed.start_broker()
            deadline = time.monotonic() + 30
            while not all(s["state"] == "up" for s in json.loads(fed.get("/v1/sites")[1])["items"]):
                assert time.monotonic() < deadline, "sites not up"
                await asyncio.sleep(0.2)
            ran = tmp_path / "shared" / "ran"

            def work(name: str, seconds: float) -> str:
                line = f'echo "$CPN_JOB_ID $CPN_ATTEMPT $CPN_SITE" >> {ran}; sleep {seconds}'
                record = fed.submit(name=name, command=["sh", "-c", line])
                return str(record["id"])

            def mark(seconds: float) -> list[str]:
                line = f'echo "$CPN_JOB_ID $CPN_ATTEMPT $CPN_SITE" >> {ran}; sleep {seconds}'
                return ["sh", "-c", line]

            # before the backup: jobs done, and jobs running that end after it; a workflow
            # whose second step waits for the first, running: it runs after the backup
            done_before = [work(f"done-before-{i}", 0) for i in range(JOBS)]
            running_before = [work(f"running-before-{i}", 6) for i in range(JOBS)]
            steps = [
                {"name": "first", "command": mark(2)},
                {"name": "second", "after": ["first"], "command": mark(0)},
            ]
            status, wf = fed.request(
                "POST", "/v1/workflows", {"name": "wf", "tenant": "t1", "steps": steps}
            )
            assert status == 201, wf
            first, second = (s["job"] for s in wf["steps"])
            for job in done_before:
                fed.wait_state(job, "SUCCEEDED")
            for job in (*running_before, first):
                fed.wait_state(job, "RUNNING")
            assert fed.job(second)["state"] == "PENDING"
            backups = tmp_path / "backups"
            taken = json.loads(
                cpn("backup", "create", "--etcd", cluster.url, "--dir", str(backups), "-o", "json")
            )
            # after it: jobs accepted, run and finished; jobs accepted and still running
            done_after = [work(f"done-after-{i}", 0) for i in range(JOBS)]
            running_after = [work(f"running-after-{i}", 8) for i in range(JOBS)]
            for job in done_after:
                fed.wait_state(job, "SUCCEEDED")
            # and a job accepted that waits: no site has its model
            waiting = fed.submit(name="waiting-after", gpu={"model": "A100-80GB", "count": 1})
            for job in running_after:
                fed.wait_state(job, "RUNNING")
            fed.wait_state(second, "SUCCEEDED")
            assert fed.job(waiting["id"])["state"] == "PENDING"
            billed_before = await _segments(reg)

            # the disaster: every member and its data gone
            started = time.monotonic()
            for i, name in enumerate(cluster.names):
                cluster.kill(i)
                shutil.rmtree(cluster.data_dir / name)
            members = [f"--member={n}={cluster._peer(i)}" for i, n in enumerate(cluster.names)]
            snapshot = str(backups / f"{taken['name']}.db")
            restore_started = time.monotonic()
            # `cpn restore --wait`: it rebuilds the members' data, then waits for them (started
            # below) and the leader's decisions, and prints what was lost
            restoring = subprocess.Popen(
                [sys.executable, "-m", "cpn", "restore", snapshot, "--data-dir",
                 str(cluster.data_dir), *members, "--collect-s", str(COLLECT_S),
                 "--wait", "60", "--etcd", cluster.url],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
            )  # fmt: skip
            assert restoring.stdout is not None
            line = await asyncio.to_thread(restoring.stdout.readline)  # every member's data
            assert line.startswith("restored "), (line, restoring.communicate())
            restore_s = time.monotonic() - restore_started
            for i in range(len(cluster.names)):
                cluster._launch(i, "existing")  # on the same ports: clients reconnect
            for i in range(len(cluster.names)):
                assert cluster._healthy(i, 30), f"member {i} did not come back"
            members_s = time.monotonic() - restore_started - restore_s
            rest, err = restoring.communicate(timeout=90)
            said = line + rest
            assert restoring.returncode == 0, (said, err)
            assert re.search(r": done; (\d+)/\1 sites reported", said), said
            assert "\nlost:" not in said, said  # nothing lost: the operator's list is empty
            rec: dict[str, Any] = json.loads(
                subprocess.run(
                    [sys.executable, "-m", "cpn", "recovery", "--etcd", cluster.url,
                     "--wait", "60", "-o", "json"],
                    capture_output=True, text=True, cwd=REPO, timeout=90, check=False,
                ).stdout
            )  # fmt: skip
            recovered_s = time.monotonic() - started
            assert rec["phase"] == "done", rec
            assert sorted(rec["reported"]) == sorted(SITES), rec  # every agent answered
            fates = {j["job"]: j for j in rec["jobs"]}
            lost = [j for j in rec["jobs"] if j["fate"] == "lost"]
            # the job that waited: re-created from the leader's view, waiting still; cancelled
            assert fates[waiting["id"]]["fate"] == "recovered", fates.get(waiting["id"])
            assert fed.job(waiting["id"])["state"] == "PENDING"
            status, _ = fed.request("POST", f"/v1/jobs/{waiting['id']}/cancel")
            assert status == 200

            accepted = [*done_before, *running_before, *done_after, *running_after, first, second]
            deadline = time.monotonic() + 40
            while True:
                states = {j: fed.job(j)["state"] for j in accepted}
                if all(s in ("SUCCEEDED", "FAILED", "CANCELLED") for s in states.values()):
                    break
                assert time.monotonic() < deadline, {
                    j: (s, fed.job(j)["events"][-3:]) for j, s in states.items() if s != "SUCCEEDED"
                }
                await asyncio.sleep(0.5)

            runs = Counter(line.split()[0] for line in ran.read_text().splitlines())
            twice = {j: n for j, n in runs.items() if n > 1}
            assert not twice, {  # no job ran twice
                j: (
                    [ln for ln in ran.read_text().splitlines() if ln.startswith(j)],
                    [f"{e['at']:.2f} {e['type']} {e['message']}" for e in fed.job(j)["events"]],
                )
                for j in twice
            }
            assert set(runs) == set(accepted)
            # nothing an agent reported was lost: every job ended as it ran, none is "lost"
            assert not lost, lost
            assert all(s == "SUCCEEDED" for s in states.values()), states
            for job in done_after:  # accepted after the backup: rebuilt from its agent's report
                assert fates[job]["fate"] == "recovered", fates.get(job)
            for job in running_after:
                assert fates[job]["fate"] == "recovered", fates.get(job)
            # the step the backup had waiting ran after it: its run taken on, its workflow whole
            assert fates[second]["fate"] == "adopted", fates.get(second)
            status, wf = fed.request("GET", f"/v1/workflows/{wf['id']}")
            assert [s["state"] for s in wf["steps"]] == ["SUCCEEDED", "SUCCEEDED"], wf
            # the ledger holds each run once: what it had, what the restore gave back
            ledger = await _segments(reg)
            ran_runs = {(job, 1) for job in accepted}
            assert ledger == ran_runs, (ledger ^ ran_runs, billed_before)
            # the audit log says why
            _, audit = await reg.list_prefix(keys.AUDIT)
            entries = [json.loads(raw) for _, raw, _ in audit]
            restored = {e["target"] for e in entries if e["actor"] == "restore"}
            assert {*done_after, *running_after, second} <= restored
            kinds = Counter(j["fate"] for j in rec["jobs"])
            figures = os.environ.get("CPN_DRILL_FIGURES")  # bench/disaster_drill.py reads them
            if figures:
                Path(figures).write_text(json.dumps({
                    "jobs": len(accepted), "after_backup": len(done_after + running_after),
                    "recovered_s": recovered_s, "restore_s": restore_s, "members_s": members_s,
                    "settled_s": (rec["closed_at"] or 0) - (rec["opened_at"] or 0),
                    "fates": dict(kinds), "lost": len(lost), "runs": sum(runs.values()),
                    "ran_twice": sum(1 for n in runs.values() if n > 1),
                    "ledger": len(ledger), "snapshot_bytes": taken["size_bytes"],
                }))  # fmt: skip
            print(
                f"drill: {len(accepted)} jobs ({JOBS} of each kind); recovered in "
                f"{recovered_s:.1f} s from the members' loss to the restore settled; settled "
                f"{dict(sorted(kinds.items()))}; lost {len(lost)}; runs {sum(runs.values())}, "
                f"ledger {len(ledger)}"
            )
    finally:
        for i in range(len(cluster.names)):
            cluster.kill(i)
        cluster.stop()
