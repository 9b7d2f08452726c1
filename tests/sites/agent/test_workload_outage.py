"""A run that ends while etcd is away (sites.agent.workload): its end is taken when its
process ends, not when its reports land. The chaos soak found runs billed seconds longer than
they ran: the agent waited for its `running` report to land before it waited for the exit.

The agent's workload runs here in the test's process on the real etcd, with its confined
local executor; the registry's report writes fail for as long as the test says (etcd away for
this agent), the rest of the registry is the real one. Once the agent's own writes land
again, the run's end goes at once rather than after its backoff."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sites.agent.workload import Workload
from sites.executors.factory import make_executor
from sites.kits.clock import SystemClock
from sites.model import keys
from sites.model.assignments import Assignment, Report, RunState
from sites.model.catalog import DeviceCatalog
from sites.model.config import load_site
from sites.model.errors import RegistryUnavailable
from sites.model.status import AgentRecord
from sites.registry.client import Registry
from tests.conftest import wait_for

pytestmark = pytest.mark.e2e  # runs jobs in sandboxes (tests/tiers.py)


class ReportsAway(Registry):
    """The real registry, except that report writes fail from the moment a run's `starting`
    report lands until `away` is cleared: etcd lost for this agent's writes between the run's
    two first reports, as in the soak's etcd outages."""

    away = False
    refused = 0

    async def write_report(self, record: AgentRecord, report: Report) -> None:
        if self.away:
            self.refused += 1
            raise RegistryUnavailable("etcd away (the test's outage)")
        await super().write_report(record, report)
        self.away = report.state is RunState.starting


async def test_a_run_ending_while_its_reports_cannot_land_is_billed_its_own_time(
    registry: Registry, site_file: Callable[..., Path], tmp_path: Path
) -> None:
    site = "outage"
    catalog = DeviceCatalog.load()
    spec = load_site(site_file(site, executor={"work_dir": str(tmp_path / "work")}), catalog)
    await registry.join(spec)
    reports = ReportsAway(endpoints=registry.endpoints)
    await reports.connect()
    record = AgentRecord(
        site=site,
        instance="test",
        pid=os.getpid(),
        host="test",
        started_at=time.time(),
        url="http://127.0.0.1:9",
        lease_id=0,
    )
    await registry.put_raw(keys.agent(site), record.model_dump_json().encode())
    clock = SystemClock()
    workload = Workload(
        registry=reports,
        spec=spec,
        catalog=catalog,
        executor=make_executor(spec, catalog=catalog, clock=clock),
        clock=clock,
        record=lambda: record,
        retry_max_s=30.0,
    )
    main = asyncio.create_task(workload.run())
    try:
        job = Assignment(
            job="brief-1",
            site=site,
            tenant="t1",
            attempt=1,
            fence=3,
            command=("sh", "-c", "sleep 1"),
            assigned_at=time.time(),
        )

        async def report() -> Report | None:
            got = await registry.get_raw(keys.report(site, job.job))
            return None if got is None else Report.model_validate_json(got[0])

        async def state_is(state: RunState) -> bool:
            got = await report()
            return got is not None and got.state is state

        await registry.put_raw(keys.assignment(site, job.job), job.model_dump_json().encode())
        await wait_for(lambda: state_is(RunState.starting), timeout=20)
        await wait_for(lambda: reports.refused > 0, timeout=20)  # `running` did not land
        # the run (1 s) ends in the outage; five tries in 3 s (0.2 s, doubling), then the
        # writes wait 3.2 s more
        await wait_for(lambda: reports.refused >= 5, timeout=20)
        reports.away = False
        workload.registry_answered()  # the agent's publish landed: the end goes now
        await wait_for(lambda: state_is(RunState.succeeded), timeout=2.5)
        ended = await report()
        assert ended is not None and ended.started_at is not None
        assert ended.finished_at is not None
        ran = ended.finished_at - ended.started_at
        assert 0.9 <= ran < 2.0, ran  # not the outage's 3 s and more
    finally:
        await workload.stop()
        main.cancel()
        await asyncio.gather(main, return_exceptions=True)
        await reports.close()
