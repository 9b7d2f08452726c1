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
from dataclasses import dataclass
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
from sites.model.spec import SiteSpec
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
    only: frozenset[str] | None = None  # the jobs whose writes it fails (None: every job's)

    async def write_report(
        self, record: AgentRecord, report: Report, *, late: bool = False
    ) -> None:
        mine = (self.only is None or report.job in self.only) and not late
        if self.away and mine:
            self.refused += 1
            raise RegistryUnavailable("etcd away (the test's outage)")
        await super().write_report(record, report, late=late)
        if mine:
            self.away = report.state is RunState.starting


@dataclass
class Site:
    """One site's workload, in this process, on the real etcd; its report writes through a
    ReportsAway."""

    name: str
    spec: SiteSpec
    catalog: DeviceCatalog
    record: AgentRecord
    registry: Registry

    async def start(self) -> tuple[Workload, ReportsAway, asyncio.Task[None]]:
        reports = ReportsAway(endpoints=self.registry.endpoints)
        await reports.connect()
        clock = SystemClock()
        workload = Workload(
            registry=reports,
            spec=self.spec,
            catalog=self.catalog,
            executor=make_executor(self.spec, catalog=self.catalog, clock=clock),
            clock=clock,
            record=lambda: self.record,
            retry_max_s=30.0,
        )
        return workload, reports, asyncio.create_task(workload.run())

    async def report(self, job: str) -> Report | None:
        got = await self.registry.get_raw(keys.report(self.name, job))
        return None if got is None else Report.model_validate_json(got[0])

    async def state_is(self, job: str, state: RunState) -> bool:
        got = await self.report(job)
        return got is not None and got.state is state

    async def assign(self, job: str, seconds: float, attempt: int = 1) -> Assignment:
        a = Assignment(
            job=job, site=self.name, tenant="t1", attempt=attempt, fence=2 + attempt,
            command=("sh", "-c", f"sleep {seconds}"), assigned_at=time.time(),
        )  # fmt: skip
        await self.registry.put_raw(keys.assignment(self.name, job), a.model_dump_json().encode())
        return a


async def _stop(workload: Workload, reports: ReportsAway, main: asyncio.Task[None]) -> None:
    await workload.stop()
    main.cancel()
    await asyncio.gather(main, return_exceptions=True)
    await reports.close()


async def _site(
    registry: Registry, site_file: Callable[..., Path], tmp_path: Path, name: str
) -> Site:
    catalog = DeviceCatalog.load()
    spec = load_site(site_file(name, executor={"work_dir": str(tmp_path / "work")}), catalog)
    await registry.join(spec)
    record = AgentRecord(
        site=name, instance="test", pid=os.getpid(), host="test", started_at=time.time(),
        url="http://127.0.0.1:9", lease_id=0,
    )  # fmt: skip
    await registry.put_raw(keys.agent(name), record.model_dump_json().encode())
    return Site(name, spec, catalog, record, registry)


async def test_a_run_ending_while_its_reports_cannot_land_is_billed_its_own_time(
    registry: Registry, site_file: Callable[..., Path], tmp_path: Path
) -> None:
    site = await _site(registry, site_file, tmp_path, "outage")
    workload, reports, main = await site.start()
    try:
        await site.assign("brief-1", 1)
        await wait_for(lambda: site.state_is("brief-1", RunState.starting), timeout=20)
        await wait_for(lambda: reports.refused > 0, timeout=20)  # `running` did not land
        # the run (1 s) ends in the outage; five tries in 3 s (0.2 s, doubling), then the
        # writes wait 3.2 s more
        await wait_for(lambda: reports.refused >= 5, timeout=20)
        reports.away = False
        workload.registry_answered()  # the agent's publish landed: the end goes now
        await wait_for(lambda: site.state_is("brief-1", RunState.succeeded), timeout=2.5)
        ended = await site.report("brief-1")
        assert ended is not None and ended.started_at is not None
        assert ended.finished_at is not None
        ran = ended.finished_at - ended.started_at
        assert 0.9 <= ran < 2.0, ran  # not the outage's 3 s and more
    finally:
        await _stop(workload, reports, main)


async def test_an_end_that_never_reached_etcd_is_said_by_the_next_agent(
    registry: Registry, site_file: Callable[..., Path], tmp_path: Path
) -> None:
    """The agent stops (dies) while its run's end cannot land, and the broker moves on (the
    site lost: the assignment and the report taken back). The next agent says the end all the
    same, from what the first wrote down, for the leader to bill the run to it; an end that did
    land is not said again."""
    site = await _site(registry, site_file, tmp_path, "late-end")
    workload, reports, main = await site.start()
    reports.only = frozenset({"lost-1"})
    try:
        await site.assign("lost-1", 0.5)
        await site.assign("fine-1", 0.2)
        await wait_for(lambda: site.state_is("fine-1", RunState.succeeded), timeout=20)
        await wait_for(lambda: reports.refused > 0, timeout=20)  # lost-1's never land
        await asyncio.sleep(1.5)  # lost-1 ended meanwhile, written down only here
    finally:
        await _stop(workload, reports, main)
    for job in ("lost-1", "fine-1"):  # the broker moved on: its failover, its advance
        await registry.delete_prefix(keys.assignment(site.name, job))
        await registry.delete_prefix(keys.report(site.name, job))

    # a later attempt of it placed here meanwhile: its report is the job's own key, the late
    # end goes beside it (keys.late_report), with its assignment for the leader to bill from
    await site.assign("lost-1", 5.0, attempt=2)
    workload, reports, main = await site.start()
    reports.only = frozenset()  # etcd answers this agent
    try:
        late_key = keys.late_report(site.name, "lost-1", 1)

        async def late() -> Report | None:
            got = await registry.get_raw(late_key)
            return None if got is None else Report.model_validate_json(got[0])

        ended = await wait_for(late, timeout=20)
        assert ended.state is RunState.succeeded and ended.attempt == 1
        assert ended.assignment is not None and ended.assignment.attempt == 1
        assert ended.finished_at is not None and ended.started_at is not None
        assert ended.finished_at - ended.started_at < 1.5
        await wait_for(lambda: site.state_is("lost-1", RunState.running), timeout=20)
        now = await site.report("lost-1")
        assert now is not None and now.attempt == 2  # the job's own report: its new attempt
        await asyncio.sleep(0.5)
        assert await site.report("fine-1") is None  # its end had landed: not said again
        assert await registry.get_raw(keys.late_report(site.name, "fine-1", 1)) is None
    finally:
        await _stop(workload, reports, main)
