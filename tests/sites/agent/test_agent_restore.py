"""An agent's memory of its runs (sites.agent.runs.journal) and its part in a restore of the
registry (sites.agent.workload, docs/backup.md), as a real process on a real etcd: a run that
ended is never run again by a restarted agent, and a restore mark makes the agent hold its
runs and report them again with their assignments."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sites.model import keys
from sites.model.assignments import Assignment, Report, RunState
from sites.model.recovery import RestoreMark
from sites.model.status import SiteStatus
from sites.registry.client import Registry
from tests.conftest import Processes, wait_for
from tests.sites.agent.test_agent import join, start_agent

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)


async def _report(registry: Registry, site: str, job: str) -> Report | None:
    got = await registry.get_raw(keys.report(site, job))
    return Report.model_validate_json(got[0]) if got else None


async def test_an_ended_run_is_remembered_across_a_restart_and_a_restore(
    registry: Registry, processes: Processes, site_file: Callable[..., Path], tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o1777)
    shared.chmod(0o1777)
    ran = shared / "ran"
    file = site_file(
        "keeper",
        executor={"confinement": {"rw_paths": [str(shared)]}, "work_dir": str(tmp_path / "work")},
    )
    await join(registry, file)
    agent = await start_agent(processes, registry, file, "keeper")

    def assignment(job: str, seconds: float) -> Assignment:
        line = f'echo "$CPN_JOB_ID" >> {ran}; sleep {seconds}'
        return Assignment(
            job=job,
            site="keeper",
            tenant="t1",
            attempt=1,
            fence=7,
            command=("sh", "-c", line),
            assigned_at=time.time(),
        )

    done, live = assignment("done-1", 0), assignment("live-1", 30)
    for a in (done, live):
        await registry.put_raw(keys.assignment("keeper", a.job), a.model_dump_json().encode())

    async def states(want: dict[str, RunState]) -> bool:
        got = {job: await _report(registry, "keeper", job) for job in want}
        return all(r is not None and r.state is want[j] for j, r in got.items())

    await wait_for(
        lambda: states({"done-1": RunState.succeeded, "live-1": RunState.running}), timeout=20
    )
    # the broker took the end in (the report gone); the agent dies and comes back: the
    # assignment of the run that ended is still there (as in a registry restored from a backup)
    await registry.delete_prefix(keys.report("keeper", "done-1"))
    agent.kill()
    agent.wait()
    await start_agent(processes, registry, file, "keeper")
    # the run that was going died with its agent: reported lost once the assignments are read
    await wait_for(lambda: states({"live-1": RunState.failed}), timeout=20)
    assert ran.read_text().split().count("done-1") == 1  # the one that ended: not run again

    # a restore mark: the runs are held (the one without an assignment is not stopped) and
    # every run known here is reported again with its assignment, then the status says so
    other = assignment("live-2", 30)
    await registry.put_raw(keys.assignment("keeper", "live-2"), other.model_dump_json().encode())
    await wait_for(lambda: states({"live-2": RunState.running}), timeout=20)
    mark = RestoreMark(generation="g1", restored_at=time.time(), snapshot_revision=1)
    await registry.put_raw(keys.restore_mark("keeper"), mark.model_dump_json().encode())
    await registry.delete_prefix(keys.assignment("keeper", "live-2"))  # the backup lacks it

    async def restored() -> bool:
        got = await registry.get_raw(keys.site_status("keeper"))
        return got is not None and SiteStatus.model_validate_json(got[0]).restored == "g1"

    await wait_for(restored, timeout=20)
    again = await _report(registry, "keeper", "done-1")
    assert again is not None and again.state is RunState.succeeded
    assert again.assignment == done  # what the broker rebuilds a lost job from
    held = await _report(registry, "keeper", "live-2")
    assert held is not None and held.state is RunState.running and held.assignment == other
    # the mark removed: the run the registry has no assignment for is stopped
    await registry.delete_prefix(keys.restore_mark("keeper"))
    await wait_for(lambda: states({"live-2": RunState.stopped}), timeout=20)
    assert ran.read_text().split().count("done-1") == 1
