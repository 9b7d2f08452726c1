"""The jobs placed on this site: follow the assignments, run them, report on them.

The broker writes an Assignment at /cpn/v1/assignments/<site>/<job>; the Workload mirrors that
prefix and converges on it: a new assignment is allocated devices (sites.agent.fit) and started
as a Run (sites.agent.runs), a withdrawn one
(key deleted, or replaced by another attempt/fence) is stopped. Each run reports `starting`
(written before the process is launched), `running`, then a terminal state, at
/cpn/v1/reports/<site>/<job>, every report fenced by the agent lock and retried with backoff
while etcd is unavailable. An attempt runs at most once per site: at start, a job whose
attempt+fence already has a report is not run again; one left `starting`/`running` by a
crashed predecessor (whose process died with it) is reported `failed` as lost, for the broker
to retry; the runs that ended here in the last day are known again from what each wrote down
when it ended (sites.agent.runs.journal), so none runs twice even once its report is gone.
Long form: docs/executor.md.

After a restore of the registry from a backup (docs/backup.md), the site's assignments hold a
restore mark (keys.restore_mark) in the same read as the restored assignments: while it is
there nothing is started or stopped for the assignments' sake, every run this agent knows
(ended ones too: KEEP_FINISHED_S) is reported again with its assignment, and `restored` names
the restore, which the agent's status then carries; the leader broker decides each run's fate
and removes the mark, and the agent converges on the assignments again.

A run whose assignment carries `serve` is a managed service's replica (sites.agent.replicas,
kept by sites.agent.serving): it is given a port, probed until ready, published as its own
endpoint of the service here (`replica_endpoints`: several replicas of a service may run at one
site), and drained before it is stopped when withdrawn.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from sites.agent.data.errors import DataError
from sites.agent.fit import (
    DoesNotFit,
    SiteResources,
    allocate,
    declared_resources,
    held_capacity,
    held_devices,
    node_usage,
    sliced,
)
from sites.agent.metrics import AgentMetrics
from sites.agent.replicas import ReplicaState
from sites.agent.runs import (
    JobLog,
    Run,
    UnknownJob,
    ended_runs,
    exit_message,
    journal,
    mark_reported,
)
from sites.agent.serving import Serving
from sites.executors.base import (
    JOB_ID_RE,
    Executor,
    ExecutorError,
    RunHandle,
    job_dir,
    log_path,
)
from sites.kits.clock import Clock
from sites.model import keys
from sites.model.assignments import EXECUTOR_REFUSED, Assignment, Report, RunState
from sites.model.capacity import Capacity
from sites.model.catalog import DeviceCatalog
from sites.model.data import StagingProgress
from sites.model.errors import RegistryError
from sites.model.recovery import RestoreMark
from sites.model.spec import SiteSpec
from sites.model.status import AgentRecord, GpuDevice, NodeUsage, ServiceEndpoint
from sites.registry.client import Registry
from sites.registry.mirror import PrefixMirror

if TYPE_CHECKING:
    from sites.agent.data.plane import DataPlane

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
KEEP_FINISHED = 200  # finished runs listed by /jobs once their assignment is gone
# ... and kept at least this long (at most KEEP_FINISHED_MAX): a restore from a backup brings
# back assignments of runs that ended since it was taken; this agent knows they ran (never
# twice), and reports them again so that the ledger bills them (docs/backup.md). A day covers
# the leader's hourly backups many times over.
KEEP_FINISHED_S = 86400.0
KEEP_FINISHED_MAX = 20_000
# after a restore, the runs that ended since the backup was taken (by the backup's clock, so
# with this margin for the clocks' difference) are reported again, and every live one
RESTORE_CLOCK_SKEW_S = 600.0
RETRY_MIN_S = 0.2
# at its start, an agent reports again the ends of runs that never reached the registry (no
# mark that their report landed) from this far back, this many at most
LATE_END_S = 3600.0
LATE_ENDS_MAX = 500
QUEUE_POLL_S = 1.0  # how often a run queued in the site's scheduler is looked at again
RETRY_MAX_S = 5.0
LAST_CHECKPOINT_S = 60.0  # a withdrawn run's last checkpoint sync, at most
SEQ_PER_ATTEMPT = 1_000_000_000  # checkpoint numbers: attempt x this + the sync's number


class Workload:
    """Runs this site's assignments with an executor; see the module docstring."""

    def __init__(
        self,
        *,
        registry: Registry,
        spec: SiteSpec,
        catalog: DeviceCatalog,
        executor: Executor,
        clock: Clock,
        record: Callable[[], AgentRecord | None],
        resources: Callable[[], SiteResources] | None = None,
        stop_grace_s: float = STOP_GRACE_S,
        retry_max_s: float = RETRY_MAX_S,
        replica_host: str = "127.0.0.1",
        settle_s: float = 1.0,
        data: DataPlane | None = None,
        metrics: AgentMetrics | None = None,
        on_restored: Callable[[], None] | None = None,
    ) -> None:
        self.registry = registry
        self.data = data  # stages inputs and checkpoints, saves outputs (sites.agent.data)
        self._metrics = metrics
        self.spec = spec
        self.site = spec.id
        self.catalog = catalog
        self.executor = executor
        self.clock = clock
        self.stop_grace_s = stop_grace_s
        self._record = record
        self._resources = resources or (lambda: declared_resources(spec, catalog))
        self._retry_max_s = retry_max_s
        self._mirror = PrefixMirror(
            registry=registry, prefix=keys.assignments(self.site), on_change=self._on_change
        )
        self._dirty = asyncio.Event()
        self._runs: dict[str, Run] = {}  # job -> its current (or last) run here
        self._reported: dict[str, Report] = {}  # job -> last report known to be in etcd
        self._parsed: dict[str, tuple[bytes, Assignment | None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._main: asyncio.Task[Any] | None = None
        self._closing = asyncio.Event()
        # set (and replaced) when the registry answers the agent again: report writes waiting
        # out a backoff go at once (`registry_answered`)
        self._answered = asyncio.Event()
        # a restore of the registry (module docstring): its mark, and the restore whose runs
        # were all reported again
        self._mark: RestoreMark | None = None
        self.restored: str | None = None
        self._rereporting: asyncio.Task[None] | None = None
        self._on_restored = on_restored or (lambda: None)
        self._serving = Serving(
            site=self.site,
            runs=self._runs.values,
            executor=executor,
            clock=clock,
            closing=self._closing,
            host=replica_host,
            settle_s=settle_s,
            stop_grace_s=stop_grace_s,
        )

    # -- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Read reports, reap (or adopt) leftovers, then follow the assignments until cancelled.

        A run a previous agent left going that is still this job's current attempt (its
        assignment unchanged, its report not terminal) is adopted when the executor can follow
        it again (a Slurm job); every other leftover is stopped before anything starts.
        """
        self._main = asyncio.current_task()
        self._reported = await self._load_reports()
        ended = self._recall()
        resumable = [
            a
            for a in self._resumable(await self._list_assignments())
            if not (a.job in ended and ended[a.job].same_attempt(a))
        ]
        keep = {(a.job, a.attempt, a.fence) for a in resumable}
        for record in await self.executor.reap(self.stop_grace_s, keep):
            log.warning(
                "stopped leftover run of job %s attempt %d from a previous agent",
                record.job,
                record.attempt,
            )
        for assignment in resumable:
            await self._adopt(assignment)
        late = 0
        now = self.clock.time()
        for run in ended.values():
            prior = self._reported.get(run.job)
            if prior is not None and not prior.state.terminal and run.same_attempt_as(prior):
                # it ended, and the agent stopped before the registry had its end: say it now
                self._spawn(self._write(run), f"report {run.job}")
            elif (
                prior is None
                and not run.reported
                and now - (run.finished_at or 0.0) < LATE_END_S
                and late < LATE_ENDS_MAX
            ):
                # its end never reached etcd, and the broker has moved on (its site was lost
                # meanwhile): said now all the same, the leader bills the run to it
                # (broker.ops.usage_segments.amend_lost) and drops the report
                late += 1
                self._spawn(self._write(run, late=True), f"late end {run.job}")
        if late:
            log.info("%d runs' ends that never reached the registry reported now", late)
        async with asyncio.TaskGroup() as group:
            group.create_task(self._mirror.run(), name=f"workload {self.site} assignments")
            group.create_task(self._reconcile_loop(), name=f"workload {self.site} reconcile")
            group.create_task(self._serving.follow_loads(), name=f"workload {self.site} replicas")

    def _recall(self) -> dict[str, Run]:
        """The runs a previous agent here wrote down as ended (sites.agent.runs.journal) in the
        last KEEP_FINISHED_S: known again, so none runs twice, and reported after a restore."""
        runs = ended_runs(self.executor.work_dir, self.clock.time() - KEEP_FINISHED_S)
        latest = {run.job: run for run in runs}  # oldest first: the latest attempt stays
        for job, run in latest.items():
            self._runs.setdefault(job, run)
        if latest:
            log.info(
                "%d runs that ended here in the last %.0f h known again",
                len(latest),
                KEEP_FINISHED_S / 3600,
            )
        return latest

    async def _list(self, prefix: str, what: str) -> list[tuple[str, bytes, int]]:
        """Everything under `prefix`, retried with backoff until etcd answers."""
        delay = RETRY_MIN_S
        while True:
            try:
                return (await self.registry.list_prefix(prefix))[1]
            except RegistryError as exc:
                log.warning("cannot read %s (%s); retrying in %.1fs", what, exc, delay)
                await self.clock.sleep(delay)
                delay = min(delay * 2, self._retry_max_s)

    async def _list_assignments(self) -> list[Assignment]:
        kvs = await self._list(keys.assignments(self.site), "assignments")
        mark = keys.restore_mark(self.site)
        parsed = (self._parse(key, raw) for key, raw, _ in kvs if key != mark)
        return [a for a in parsed if a is not None]

    def _resumable(self, assignments: Iterable[Assignment]) -> list[Assignment]:
        """Assignments whose attempt a previous agent reported starting or running."""
        out = []
        for a in assignments:
            prior = self._reported.get(a.job)
            if prior is not None and (prior.attempt, prior.fence) == (a.attempt, a.fence):
                if not prior.state.terminal:
                    out.append(a)
        return out

    async def _adopt(self, assignment: Assignment) -> None:
        """Follow a run a previous agent started, when the executor still has it going."""
        handle = await self.executor.adopt(assignment)
        if handle is None:
            return  # _start reports it lost
        prior = self._reported[assignment.job]
        run = Run(
            assignment=assignment,
            devices=prior.devices,
            log_path=handle.log_path,
            state=RunState.running,
            handle=handle,
            started_at=prior.started_at or handle.started_at,
        )
        self._runs[assignment.job] = run
        log.info(
            "job %s attempt %d: adopted run %s of a previous agent",
            assignment.job,
            assignment.attempt,
            handle.ref,
        )
        run.task = self._spawn(self._execute(run), f"job {assignment.job}")

    async def stop(self) -> None:
        """Graceful agent stop: SIGTERM every job (SIGKILL after the grace), report nothing.

        Ready replicas of managed services are drained first (out of routing, then what they
        have in flight finishes, sites.agent.replicas), while the agent still publishes. The agent
        then revokes its lease; the broker sees the site go down and moves the jobs.
        """
        self._closing.set()
        main = self._main
        if main is not None and not main.done():
            main.cancel()
            await asyncio.gather(main, return_exceptions=True)
        await self._serving.drain_ready()
        live = [run for run in self._runs.values() if run.live and run.handle is not None]
        await asyncio.gather(
            *(self.executor.stop(run.handle, self.stop_grace_s) for run in live if run.handle)
        )
        tasks = list(self._tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=2.0)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        now = self.clock.time()
        for run in self._runs.values():
            if run.live:
                run.finish(RunState.stopped, now, run.exit_code, "the agent stopped")
        await self._serving.close()

    # -- what the agent publishes and serves --------------------------------------------------

    def runs(self) -> list[Run]:
        return sorted(self._runs.values(), key=lambda run: run.job)

    def meter(self, gpus: Sequence[GpuDevice], now: float) -> None:
        """One NVML reading for every running job (Run.meter)."""
        for run in self._runs.values():
            if run.live:
                run.meter(gpus, now)

    def held_devices(self) -> dict[str, frozenset[int]]:
        """The device indices held by live runs, per model (sites.agent.fit.held_devices)."""
        return held_devices(self._runs.values())

    def node_usage(self) -> tuple[NodeUsage, ...]:
        """What each declared node has free now (the agent publishes it; () without nodes)."""
        return node_usage(self._runs.values(), self._resources().nodes, self.spec.topology)

    def held(self) -> Capacity:
        """Capacity held by live runs: their devices per model, cores and memory."""
        return held_capacity(self._runs.values(), self.catalog)

    def log(self, job: str, attempt: int | None = None) -> JobLog:
        """The log of ``job``'s attempt (default: the current run's, else the latest on disk)."""
        if not JOB_ID_RE.fullmatch(job):
            raise UnknownJob(job, attempt)
        run = self._runs.get(job)
        if attempt is None:
            if run is not None:
                attempt = run.assignment.attempt
            else:
                attempt = max(self._attempts_on_disk(job), default=None)
                if attempt is None:
                    raise UnknownJob(job)
        if run is not None and run.assignment.attempt != attempt:
            run = None
        path = log_path(self.executor.work_dir, job, attempt)
        if run is None and not path.exists():
            raise UnknownJob(job, attempt)
        return JobLog(job=job, attempt=attempt, path=path, run=run)

    def _attempts_on_disk(self, job: str) -> list[int]:
        found = []
        for path in log_path(self.executor.work_dir, job, 1).parent.glob("attempt-*.log"):
            number = path.stem.removeprefix("attempt-")
            if number.isdigit():
                found.append(int(number))
        return found

    # -- converging on the assignments --------------------------------------------------------

    def _on_change(self, _: dict[str, bytes]) -> None:
        self._dirty.set()

    async def _reconcile_loop(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            if self._closing.is_set():
                return
            self._reconcile(self._desired())

    def _desired(self) -> dict[str, Assignment]:
        desired: dict[str, Assignment] = {}
        parsed: dict[str, tuple[bytes, Assignment | None]] = {}
        mark: RestoreMark | None = None
        for key, raw in self._mirror.items.items():
            if key == keys.restore_mark(self.site):
                mark = self._parse_mark(key, raw)
                continue
            cached = self._parsed.get(key)
            assignment = (
                cached[1] if cached is not None and cached[0] == raw else self._parse(key, raw)
            )
            parsed[key] = (raw, assignment)
            if assignment is not None:
                desired[assignment.job] = assignment
        self._parsed = parsed
        if self._mark is not None and mark is None:
            log.info(
                "the registry's restore %s is settled; following the assignments again",
                self._mark.generation,
            )
        self._mark = mark
        return desired

    def _parse_mark(self, key: str, raw: bytes) -> RestoreMark:
        try:
            return RestoreMark.model_validate_json(raw)
        except ValidationError:  # a mark it cannot read still holds the runs as they are
            log.warning("malformed restore mark at %s", key)
            return RestoreMark(generation="?", restored_at=0.0, snapshot_revision=0)

    async def _rereport(self, mark: RestoreMark) -> None:
        """Every run known here reported again, with its assignment; then `restored`."""
        since = (mark.snapshot_taken_at or 0.0) - RESTORE_CLOCK_SKEW_S
        runs = [r for r in self._runs.values() if r.live or (r.finished_at or since) >= since]
        log.warning(
            "the registry was restored from a backup (revision %d, restore %s): reporting "
            "the %d runs this agent knows again",
            mark.snapshot_revision,
            mark.generation,
            len(runs),
        )
        await asyncio.gather(*(self._write(run) for run in runs))
        self.restored = mark.generation
        self._on_restored()

    def _parse(self, key: str, raw: bytes) -> Assignment | None:
        parts = keys.split(key, keys.assignments(self.site))
        try:
            assignment = Assignment.model_validate_json(raw)
        except ValidationError as exc:
            log.warning("ignoring malformed assignment at %s: %s", key, exc.errors()[0]["msg"])
            return None
        if parts != [assignment.job] or assignment.site != self.site:
            log.warning(
                "ignoring assignment at %s: it names job %r at site %r",
                key,
                assignment.job,
                assignment.site,
            )
            return None
        return assignment

    def _reconcile(self, desired: dict[str, Assignment]) -> None:
        """Decide and act, without awaiting: stop what is withdrawn, start what is new; while
        the registry's restore is being settled, report the runs again instead (module
        docstring)."""
        mark = self._mark
        if mark is not None:
            busy = self._rereporting is not None and not self._rereporting.done()
            if mark.generation != self.restored and not busy:
                self._rereporting = self._spawn(self._rereport(mark), "restore")
            return
        for job, run in self._runs.items():
            wanted = desired.get(job)
            if (
                run.live
                and not run.withdrawn.is_set()
                and (wanted is None or not run.same_attempt(wanted))
            ):
                run.withdrawn.set()
                log.info("job %s attempt %d withdrawn; stopping it", job, run.assignment.attempt)
                self._spawn(self._withdraw(run), f"stop {job}")
        for job, assignment in sorted(desired.items()):
            current = self._runs.get(job)
            if current is not None and (current.live or current.same_attempt(assignment)):
                continue  # running, stopping for a successor, or this very attempt already ran
            self._start(assignment)
        self._prune(desired)

    def _start(self, assignment: Assignment) -> None:
        job = assignment.job
        now = self.clock.time()
        prior = self._reported.get(job)
        attempt = (assignment.attempt, assignment.fence)
        if prior is not None and (prior.attempt, prior.fence) == attempt:
            if prior.state.terminal:
                return  # this attempt already ran here; never run it twice
            run = Run(assignment=assignment, devices=prior.devices, started_at=prior.started_at)
            run.log_path = None if prior.log_path is None else Path(prior.log_path)
            run.finish(
                RunState.failed,
                now,
                None,
                "lost: the agent restarted while this attempt ran; exit status unknown",
            )
        else:
            run = Run(assignment=assignment)
            try:
                run.devices = allocate(assignment, self._resources(), self._runs.values())
            except DoesNotFit as exc:
                if self._freed_by_stopping(assignment):
                    # a preemption or a move: the runs it replaces are still stopping; the
                    # reconcile after they end (_dirty) starts it
                    log.info("job %s waits for stopping runs to free its capacity", job)
                    return
                run.finish(
                    RunState.failed, now, None, f"not run: does not fit at site {self.site}: {exc}"
                )
            else:
                run.log_path = log_path(self.executor.work_dir, job, assignment.attempt)
        self._runs[job] = run
        if run.state is RunState.failed:
            log.warning("job %s attempt %d: %s", job, assignment.attempt, run.message)
        run.task = self._spawn(self._execute(run), f"job {job}")

    def _freed_by_stopping(self, assignment: Assignment) -> bool:
        """Would the assignment fit once the withdrawn runs still stopping have ended?"""
        runs = self._runs.values()
        if not any(run.live and run.withdrawn.is_set() for run in runs):
            return False
        staying = [run for run in runs if not run.withdrawn.is_set()]
        try:
            allocate(assignment, self._resources(), staying)
        except DoesNotFit:
            return False
        return True

    def _prune(self, desired: Mapping[str, Assignment]) -> None:
        gone = [job for job in self._reported if job not in desired]
        for job in gone:  # a new placement always has a new fence, so this is safe to forget
            del self._reported[job]
        finished = sorted(
            (run for job, run in self._runs.items() if not run.live and job not in desired),
            key=lambda run: run.finished_at or 0.0,
        )
        now = self.clock.time()
        extra = max(0, len(finished) - KEEP_FINISHED)
        for i, run in enumerate(finished[:extra]):
            recent = now - (run.finished_at or 0.0) < KEEP_FINISHED_S
            if recent and len(finished) - i <= KEEP_FINISHED_MAX:
                break  # kept: it may come back with a restore (KEEP_FINISHED_S)
            del self._runs[run.job]

    # -- one run ------------------------------------------------------------------------------

    async def _execute(self, run: Run) -> None:
        try:
            await self._run(run)
            if self.data is not None:
                self.data.release(run.job)
        except Exception as exc:
            # a bug here must not leave the run holding its devices, nor go unreported
            log.exception("job %s attempt %d: agent error", run.job, run.assignment.attempt)
            if run.live:
                run.finish(RunState.failed, self.clock.time(), None, f"agent error: {exc!r}")
                await self._write(run)
        finally:
            self._dirty.set()  # a successor assignment of this job may be waiting for us

    async def _run(self, run: Run) -> None:
        a = run.assignment
        if run.handle is not None:  # adopted from a previous agent: it runs already
            await self._follow(run, run.handle)
            return
        if run.state.terminal:  # did not fit, or lost with a previous agent
            await self._write(run)
            return
        await self._write(run)  # `starting` is in etcd before anything runs
        if self._closing.is_set():
            return
        if run.withdrawn.is_set():
            run.finish(RunState.stopped, self.clock.time(), None, "withdrawn before it started")
            await self._write(run)
            return
        if run.log_path is None:  # allocated runs always have one
            raise ExecutorError(f"job {a.job}: no log path")
        a, devices = sliced(a, run.devices, self._resources(), self.catalog)
        if a.serve is not None:
            a, run.replica = self._serving.replica(a, a.serve)
        if a.inputs or a.checkpoint is not None:
            staged = await self._stage(run, a)
            if staged is None:
                return  # failed or withdrawn while staging: reported
            a = staged
        try:
            handle = await self.executor.start(a, devices, run.log_path)
        except ExecutorError as exc:
            run.finish(RunState.failed, self.clock.time(), None, str(exc))
            if exc.site:  # the leader counts it against the site (broker.leader.start_backoff)
                run.reason = EXECUTOR_REFUSED
            log.warning("job %s attempt %d: %s", a.job, a.attempt, exc)
            await self._write(run)
            return
        run.handle = handle
        run.started_at = handle.started_at
        run.state = RunState.running
        if a.checkpoint is not None and a.checkpoint.store is not None and self.data is not None:
            self._spawn(self._checkpoints(run, a), f"checkpoints {a.job}")
        await self._follow(run, handle)

    # -- data that follows the work (sites.agent.data, docs/data.md) ------------------------------

    def _work(self, job: str) -> Path:
        return job_dir(self.executor.work_dir, job) / "work"

    async def _stage(self, run: Run, a: Assignment) -> Assignment | None:
        """Pull the run's inputs and its last checkpoint (reporting `staging` with progress);
        the assignment to start, with the inputs' trees and the checkpoint's path, or None when
        staging failed or the run was withdrawn meanwhile (reported)."""
        data = self.data
        if data is None:
            run.finish(
                RunState.failed,
                self.clock.time(),
                None,
                f"not run: site {self.site} has no data store for its inputs or checkpoints",
            )
            await self._write(run)
            return None
        run.state = RunState.staging
        changed = asyncio.Event()

        def progress(p: StagingProgress) -> None:
            run.staging = p
            changed.set()

        first = next((i for i in a.inputs if i.sources), None)
        run.staging = StagingProgress(
            bytes_done=0,
            bytes_total=sum(i.bytes for i in a.inputs if i.sources),
            source=first.sources[0].site if first is not None else None,
            what=first.dataset if first is not None else "checkpoint",
        )
        writer = self._spawn(self._staging_reports(run, changed), f"staging {a.job}")
        ckpt = a.checkpoint
        try:
            inputs, egress = await data.stage_inputs(a, progress)
            run.pulled(egress)
            update: dict[str, object] = {"inputs": inputs}
            if ckpt is not None:
                work = self._work(a.job)
                target = work / ckpt.path
                target.mkdir(parents=True, exist_ok=True)
                if ckpt.restore and ckpt.store is not None:
                    mark, egress = await data.restore_checkpoint(a, target, progress)
                    run.pulled(egress)
                    run.restored = run.checkpoint = mark
                    update["resume"] = mark is not None
                update["checkpoint_path"] = str(target)
        except (DataError, OSError) as exc:  # fails this run, not the agent
            self._count("stagings", result="failed")
            log.warning("job %s attempt %d: staging failed: %s", a.job, a.attempt, exc)
            run.finish(RunState.failed, self.clock.time(), None, f"staging failed: {exc}")
            data.release(a.job)
            await self._write(run)
            return None
        finally:
            writer.cancel()
        run.staging = None
        self._count("stagings", result="pulled" if run.egress else "held")
        if self._metrics is not None:
            for source, size in run.egress.items():
                self._metrics.data_pulled.labels(self.site, source).inc(size)
        if run.withdrawn.is_set() or self._closing.is_set():
            data.release(a.job)
            run.finish(RunState.stopped, self.clock.time(), None, "withdrawn while staging")
            await self._write(run)
            return None
        run.state = RunState.starting
        return a.model_copy(update=update)

    async def _staging_reports(self, run: Run, changed: asyncio.Event) -> None:
        """While staging: the run's progress in its report, at most once a second."""
        await self._write(run)
        while True:
            await changed.wait()
            changed.clear()
            await self._write(run)
            await self.clock.sleep(1.0)

    async def _checkpoints(self, run: Run, a: Assignment) -> None:
        """Sync the run's checkpoint directory to its durable replica every interval while it
        runs; each complete one goes into the run's report."""
        data, ckpt = self.data, a.checkpoint
        if data is None or ckpt is None:  # (the caller checked; for mypy)
            return
        target = self._work(a.job) / ckpt.path
        while run.state is RunState.running and not run.withdrawn.is_set():
            await self.clock.sleep(ckpt.interval_s)
            if run.state is not RunState.running or run.withdrawn.is_set():
                return
            await self._sync(run, a, target)

    async def _sync(self, run: Run, a: Assignment, target: Path) -> None:
        data = self.data
        if data is None:
            return
        run.syncs += 1
        seq = a.attempt * SEQ_PER_ATTEMPT + run.syncs  # later attempts sort after earlier ones
        try:
            mark = await data.sync_checkpoint(a, target, seq)
        except (DataError, OSError) as exc:
            log.warning("job %s: checkpoint not synced: %s", a.job, exc)
            return
        if mark is not None:
            run.checkpoint = mark
            self._count("checkpoints_synced")
            if run.state is RunState.running:
                await self._write(run)

    async def _last_checkpoint(self, run: Run) -> None:
        """One more sync after a withdrawn run exited (bounded: the move waits for it)."""
        a = run.assignment
        ckpt = a.checkpoint
        if ckpt is None or ckpt.store is None or self.data is None:
            return
        target = self._work(a.job) / ckpt.path
        try:
            async with asyncio.timeout(LAST_CHECKPOINT_S):
                await self._sync(run, a, target)
        except TimeoutError:
            log.warning(
                "job %s: its last checkpoint did not sync in %.0fs", a.job, LAST_CHECKPOINT_S
            )

    def _count(self, name: str, **labels: str) -> None:
        if self._metrics is not None:
            getattr(self._metrics, name).labels(self.site, *labels.values()).inc()

    async def _save_outputs(self, run: Run) -> str | None:
        """Save a succeeded run's outputs; the reason it could not, or None."""
        a = run.assignment
        if not a.outputs:
            return None
        if self.data is None:
            return f"site {self.site} has no data store for its outputs"
        made = []
        for spec in a.outputs:
            src = self._work(a.job) / spec.path
            if not src.exists():
                return f"output {spec.path} was not written"
            try:
                made.append(await self.data.save_output(a, spec, src))
            except (DataError, OSError) as exc:
                return f"output {spec.path} not saved: {exc}"
        run.outputs = tuple(made)
        return None

    async def _follow(self, run: Run, handle: RunHandle) -> None:
        """Report the run running (after its wait in the site's own queue), wait for its end,
        report that."""
        a = run.assignment
        if self._closing.is_set():  # the agent began stopping while this one started
            await self.executor.stop(handle, self.stop_grace_s)
        elif run.withdrawn.is_set():
            self._spawn(self._withdraw(run), f"stop {a.job}")
        else:
            await self._while_queued(run, handle)
        # The `running` report lands while the run goes on: with etcd away it is retried, and
        # the run's end is still taken when the process ends, not when etcd is back (a run
        # ending in an outage was billed until the outage ended). Its retries pick up the
        # end, and the terminal write below waits for them (one write of a run at a time).
        self._spawn(self._write(run), f"report {a.job}")
        if run.replica is not None and not (self._closing.is_set() or run.withdrawn.is_set()):
            self._spawn(self._serving.await_ready(run, handle), f"ready {a.job}")
        ended = await self.executor.wait(handle)
        exited_at = self.clock.time()  # what is billed: saving the outputs is not the run
        if run.replica is not None:
            run.replica.move(ReplicaState.stopped)
        if self._closing.is_set():
            return  # graceful agent stop: nothing more is reported (docs/executor.md)
        code = ended.code
        if run.withdrawn.is_set():
            state, message = RunState.stopped, "stopped: the assignment was withdrawn"
            # preempted or moved: what it saved in its grace is what the next run resumes from
            await self._last_checkpoint(run)
        elif run.unready is not None:
            state, message = RunState.failed, run.unready
        elif ended.ok:
            state, message = RunState.succeeded, ""
            unsaved = await self._save_outputs(run)
            if unsaved is not None:
                state, message = RunState.failed, unsaved
        else:
            state = RunState.failed
            message = ended.message or (
                "exit status unknown" if code is None else exit_message(code)
            )
        usage = {**run.metered(), **(ended.usage or {})}  # the scheduler's own figures win
        run.usage = usage or None
        run.reason = ended.reason
        run.finish(state, exited_at, code, message)
        log.info("job %s attempt %d %s (exit %s): %s", a.job, a.attempt, state.value, code, message)
        await self._write(run)

    async def _while_queued(self, run: Run, handle: RunHandle) -> None:
        """While the site's scheduler keeps the run in its queue (Slurm PENDING), report it
        `starting` with the scheduler's reason, each new reason once; it starts running (and
        is billed) when the scheduler starts it."""
        reason = await self.executor.queued(handle)
        if reason is None:
            return
        run.state = RunState.starting
        while reason is not None and not (self._closing.is_set() or run.withdrawn.is_set()):
            if reason != run.message:
                run.message = reason
                log.info("job %s attempt %d: %s", run.job, run.assignment.attempt, reason)
                await self._write(run)
            await self.clock.sleep(QUEUE_POLL_S)
            reason = await self.executor.queued(handle)
        run.state, run.message = RunState.running, ""
        run.started_at = self.clock.time()

    async def _withdraw(self, run: Run) -> None:
        if run.replica is not None:
            await self._serving.drain(run, run.replica)
        if run.handle is not None:
            await self.executor.stop(run.handle, self.stop_grace_s)

    def replica_endpoints(self, now: float) -> list[ServiceEndpoint]:
        """The endpoints of the replicas ready or draining here, for the agent to publish
        (sites.agent.serving)."""
        return self._serving.endpoints(now)

    async def _write(self, run: Run, *, late: bool = False) -> None:
        """Write the run's report (an ended run's written down first: sites.agent.runs.journal);
        retried with backoff until it lands or the agent stops; one write of a run at a time.
        `late`: an end the broker never had, said at its late key with its assignment
        (keys.late_report), where a later attempt's report cannot overwrite it."""
        async with run.write_lock:
            await self._write_now(run, late=late)

    async def _write_now(self, run: Run, *, late: bool = False) -> None:
        delay = RETRY_MIN_S
        while not self._closing.is_set():
            report = run.report(self.clock.time())  # the run's latest state, on every try
            if report.state.terminal and not run.journaled:
                try:
                    journal(self.executor.work_dir, run, report)
                    run.journaled = True
                except OSError as exc:
                    log.warning("job %s: its end not written down: %s", run.job, exc)
            if self._mark is not None or late:  # what the broker rebuilds or bills a run from
                report = report.model_copy(update={"assignment": run.assignment})
            record = self._record()
            if record is not None:
                try:
                    await self.registry.write_report(record, report, late=late)
                except RegistryError as exc:
                    log.warning(
                        "report of job %s (%s) not written: %s; retrying in %.1fs",
                        run.job,
                        report.state.value,
                        exc,
                        delay,
                    )
                else:
                    if not late:
                        self._reported[run.job] = report
                    if report.state.terminal and not run.reported:
                        try:
                            mark_reported(self.executor.work_dir, run)
                        except OSError as exc:
                            log.warning("job %s: its report not marked written: %s", run.job, exc)
                    return
            await self._back_off(delay)
            delay = min(delay * 2, self._retry_max_s)

    def registry_answered(self) -> None:
        """The agent's publish or keepalive landed: etcd is back. Report writes waiting out a
        backoff try again now: a run's end that waited up to `retry_max_s` more could be
        overtaken by the site's next sign of life, and a lost site is billed to that."""
        self._answered.set()
        self._answered = asyncio.Event()

    async def _back_off(self, delay: float) -> None:
        answered = asyncio.ensure_future(self._answered.wait())
        slept = asyncio.ensure_future(self.clock.sleep(delay))
        try:
            await asyncio.wait((answered, slept), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (answered, slept):
                task.cancel()

    async def _load_reports(self) -> dict[str, Report]:
        kvs = await self._list(keys.reports(self.site), "reports")
        reports: dict[str, Report] = {}
        for key, raw, _ in kvs:
            if keys.LATE in key.rsplit("/", 1)[-1]:
                continue  # a late end said before (keys.late_report), not the job's report
            try:
                report = Report.model_validate_json(raw)
            except ValidationError:
                log.warning("ignoring malformed report at %s", key)
                continue
            reports[report.job] = report
        return reports

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=f"workload {self.site} {name}")
        self._tasks.add(task)
        task.add_done_callback(self._guard)
        return task

    def _guard(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s crashed", task.get_name(), exc_info=task.exception())
