"""The jobs placed on this site: follow the assignments, run them, report on them.

The broker writes an Assignment at /cpn/v1/assignments/<site>/<job>; the Workload mirrors that
prefix and converges on it: a new assignment is allocated devices and started, a withdrawn one
(key deleted, or replaced by another attempt/fence) is stopped. Each run reports `starting`
(written before the process is launched), `running`, then a terminal state, at
/cpn/v1/reports/<site>/<job>, every report fenced by the agent lock and retried with backoff
while etcd is unavailable. An attempt runs at most once per site: at start, a job whose
attempt+fence already has a report is not run again; one left `starting`/`running` by a
crashed predecessor (whose process died with it) is reported `failed` as lost, for the broker
to retry. Long form: docs/executor.md.

A run whose assignment carries `serve` is a managed service's replica (sites.agent.replicas): it is
given a port, probed until ready, published as its own endpoint of the service here
(`replica_endpoints`: several replicas of a service may run at one site), and drained before
it is stopped when withdrawn.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from pydantic import ValidationError

from sites.agent.collectors.services import ServiceMonitor
from sites.agent.replicas import Replica, ReplicaState, free_port, in_flight, probe_ready, with_port
from sites.executors.base import JOB_ID_RE, Executor, ExecutorError, RunHandle, log_path
from sites.kits.clock import Clock
from sites.model import keys
from sites.model.assignments import Assignment, Report, RunState
from sites.model.catalog import Capacity, DeviceCatalog, normalize
from sites.model.errors import RegistryError, SitesError
from sites.model.layout import layout
from sites.model.spec import Oversubscription, SiteSpec
from sites.model.status import AgentRecord, GpuDevice, NodeUsage, ServiceEndpoint
from sites.registry.client import Registry
from sites.registry.mirror import PrefixMirror

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
KEEP_FINISHED = 200  # finished runs listed by /jobs once their assignment is gone
RETRY_MIN_S = 0.2
QUEUE_POLL_S = 1.0  # how often a run queued in the site's scheduler is looked at again
RETRY_MAX_S = 5.0
LOG_POLL_S = 0.2
LOG_CHUNK = 64 * 1024
DRAIN_POLL_S = 0.2  # how often a draining replica's in-flight count is read
REPLICA_POLL_S = 0.5  # how often the published replicas' load is read


class UnknownJob(SitesError, LookupError):
    def __init__(self, job: str, attempt: int | None = None) -> None:
        self.job = job
        what = f"job {job!r}" + ("" if attempt is None else f" attempt {attempt}")
        super().__init__(f"{what} has no run at this site")


class DoesNotFit(SitesError):
    """An assignment asks for more than the site has free (the broker should have prevented it)."""


@dataclass(frozen=True)
class SiteResources:
    """What jobs can be given: device indices per model, cores and RAM."""

    devices: Mapping[str, tuple[int, ...]]
    cpu_cores: int
    mem_gb: float
    # the site's best-effort capacity above the physical (sites.model.spec.Oversubscription):
    # best-effort runs share devices, cores and memory up to it; others never exceed the
    # physical, whatever best-effort work holds
    oversubscription: Oversubscription | None = None
    # a site that declares its nodes (sites.model.spec.Topology): node -> model -> its device
    # indices
    nodes: Mapping[str, Mapping[str, tuple[int, ...]]] = field(default_factory=dict)
    # a partitioned device's slices (sites.model.layout): model -> per index, (physical device, slot
    # id); absent for whole devices, whose index is the device's
    slots: Mapping[str, tuple[tuple[int, str], ...]] = field(default_factory=dict)


def declared_resources(spec: SiteSpec, catalog: DeviceCatalog | None = None) -> SiteResources:
    """The declared inventory as slots (sites.model.layout): positions 0..n-1 per (pseudo-)model, a
    partitioned device's slices (with the catalog) under their own names, given to the
    declared nodes in order (the first node has the lowest indices)."""
    inv = spec.inventory
    where = layout(spec, catalog)
    return SiteResources(
        devices={model: tuple(range(len(found))) for model, found in where.slots.items()},
        cpu_cores=inv.cpu_cores,
        mem_gb=inv.mem_gb,
        oversubscription=spec.oversubscription,
        nodes=where.nodes,
        slots=where.slots,
    )


@dataclass(eq=False)
class Run:
    """One attempt of one job at this site, as this agent knows it."""

    assignment: Assignment
    devices: tuple[int, ...] = ()
    log_path: Path | None = None
    state: RunState = RunState.starting
    handle: RunHandle | None = None
    started_at: float | None = None
    finished_at: float | None = None
    exit_code: int | None = None
    message: str = ""
    reason: str | None = None  # why it ended, as a word (out_of_memory)
    usage: dict[str, float] | None = None
    # NVML-measured GPU energy and utilization of its devices while it runs (`meter`)
    gpu_energy_j: float = 0.0
    gpu_util_s: float = 0.0  # utilization (0..1, averaged over its devices) x seconds
    metered_s: float = 0.0
    metered_at: float | None = None
    withdrawn: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    replica: Replica | None = None  # a managed service's replica (sites.agent.replicas)
    unready: str | None = None  # why it was stopped: not ready in time
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def job(self) -> str:
        return self.assignment.job

    @property
    def live(self) -> bool:
        return not self.state.terminal

    def same_attempt(self, assignment: Assignment) -> bool:
        a = self.assignment
        return (a.attempt, a.fence) == (assignment.attempt, assignment.fence)

    def finish(self, state: RunState, now: float, exit_code: int | None, message: str) -> None:
        self.state = state
        self.finished_at = now
        self.exit_code = exit_code
        self.message = message

    def meter(self, gpus: Sequence[GpuDevice], now: float) -> None:
        """Add what NVML says its devices drew since the last reading: power x time, and
        utilization x time (the agent calls this every publish interval). Only while it runs,
        and only when every one of its devices reports its power."""
        since, self.metered_at = self.metered_at, now
        model = self.assignment.model
        if self.state is not RunState.running or not self.devices or model is None:
            return
        mine = [g for g in gpus if g.model == model and g.index in self.devices]
        if since is None or len(mine) != len(self.devices) or now <= since:
            return
        if any(g.power_w is None for g in mine):
            return
        dt = now - since
        self.gpu_energy_j += sum(float(g.power_w or 0.0) for g in mine) * dt
        self.gpu_util_s += sum(g.util_pct for g in mine) / 100.0 / len(mine) * dt
        self.metered_s += dt

    def metered(self) -> dict[str, float]:
        """Report.usage's GPU figures from `meter`, {} when nothing was measured."""
        if not self.metered_s:
            return {}
        return {
            "gpu_energy_j": self.gpu_energy_j,
            "gpu_util_ratio": self.gpu_util_s / self.metered_s,
            "gpu_metered_s": self.metered_s,
        }

    def report(self, now: float) -> Report:
        a = self.assignment
        return Report(
            job=a.job,
            site=a.site,
            attempt=a.attempt,
            fence=a.fence,
            state=self.state,
            exit_code=self.exit_code,
            message=self.message,
            devices=self.devices,
            started_at=self.started_at,
            finished_at=self.finished_at,
            log_path=None if self.log_path is None else str(self.log_path),
            usage=self.usage,
            reason=self.reason,
            confinement=(self.handle.confinement or None) if self.handle is not None else None,
            updated_at=now,
        )

    def to_json(self) -> dict[str, Any]:
        a = self.assignment
        return {
            "job": a.job,
            "tenant": a.tenant,
            "attempt": a.attempt,
            "fence": a.fence,
            "state": self.state.value,
            "exit_code": self.exit_code,
            "message": self.message,
            "model": a.model,
            "devices": list(self.devices),
            "cpu": a.cpu,
            "mem_gb": a.mem_gb,
            "pid": None if self.handle is None else self.handle.pid,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "log_path": None if self.log_path is None else str(self.log_path),
            "withdrawn": self.withdrawn.is_set(),
            "replica": None if self.replica is None else self.replica.state.value,
        }


def allocate(
    assignment: Assignment, resources: SiteResources, held: Iterable[Run]
) -> tuple[int, ...]:
    """Device indices for ``assignment`` next to the live runs ``held`` (pure); DoesNotFit.

    On an oversubscribed site (resources.oversubscription) a best-effort run may share a
    device with other runs, at most ceil(ratio) runs a device, least shared first, and the
    cores and memory up to the physical x ratio; any other run counts only what other
    non-best-effort runs hold against the physical. Elsewhere every run holds what it takes."""
    live = [run for run in held if run.live]
    a = assignment
    over = resources.oversubscription
    if over is not None and a.best_effort:
        return _share(a, resources, over, live)
    # the runs whose holdings count against this one: all of them, or on an oversubscribed
    # site the non-best-effort ones (best-effort work lives above the physical)
    holding = live if over is None else [run for run in live if not run.assignment.best_effort]
    devices: tuple[int, ...] = ()
    if a.gpus > 0:
        if a.model is None:
            raise DoesNotFit(f"asks for {a.gpus} accelerator(s) but names no model")
        pool = resources.devices.get(a.model, ())
        if not pool:
            have = ", ".join(f"{len(ix)} x {m}" for m, ix in resources.devices.items()) or "none"
            raise DoesNotFit(f"site has no {a.model} devices (it has: {have})")
        taken = {i for run in holding if run.assignment.model == a.model for i in run.devices}
        if a.nodes and resources.nodes:
            devices = _on_nodes(a, a.model, resources, taken)
        else:
            free = [i for i in pool if i not in taken]
            if len(free) < a.gpus:
                raise DoesNotFit(
                    f"needs {a.gpus} x {a.model}, only {len(free)} of {len(pool)} free"
                )
            devices = tuple(free[: a.gpus])
    cpu_free = resources.cpu_cores - sum(run.assignment.cpu for run in holding)
    if a.cpu > cpu_free:
        raise DoesNotFit(f"needs {a.cpu} CPU cores, only {max(0, cpu_free)} free")
    mem_free = resources.mem_gb - sum(run.assignment.mem_gb for run in holding)
    if a.mem_gb > mem_free + 1e-9:
        raise DoesNotFit(f"needs {a.mem_gb:g} GB of memory, only {max(0.0, mem_free):g} free")
    return devices


def sliced(
    a: Assignment, devices: tuple[int, ...], resources: SiteResources, catalog: DeviceCatalog
) -> tuple[Assignment, tuple[int, ...]]:
    """What the executor is given for a run on slices of devices (sites.model.layout): the physical
    devices they are on (the visibility variable lists those) and the slices themselves in
    CPN_GPU_SLICES (MIG instance or time-slice ids) and CPN_GPU_SHARE (the share of a device
    each is); a run on whole devices, the physical indices of its positions (a partitioned
    pool's whole devices come after its partitioned ones)."""
    found = resources.slots.get(a.model or "")
    if not devices or found is None:
        return a, devices
    physical = tuple(sorted({found[i][0] for i in devices}))
    if all(not found[i][1] for i in devices):  # whole devices: their own indices
        return a, physical
    env = {
        **a.env,
        "CPN_GPU_SLICES": ",".join(found[i][1] for i in devices),
        "CPN_GPU_SHARE": f"{catalog.fraction(a.model or ''):.4g}",
    }
    return a.model_copy(update={"env": env}), physical


def _on_nodes(
    a: Assignment, model: str, resources: SiteResources, taken: set[int]
) -> tuple[int, ...]:
    """The devices of the nodes the broker chose (Assignment.nodes), share by share."""
    devices: list[int] = []
    for share in a.nodes:
        node = resources.nodes.get(share.node)
        if node is None:
            raise DoesNotFit(f"the broker chose node {share.node!r}, which this site lacks")
        free = [i for i in node.get(model, ()) if i not in taken]
        if len(free) < share.gpus:
            raise DoesNotFit(
                f"needs {share.gpus} x {model} on node {share.node}, only {len(free)} free there"
            )
        devices.extend(free[: share.gpus])
    if len(devices) != a.gpus:
        raise DoesNotFit(f"its nodes hold {len(devices)} of the {a.gpus} x {model} it asks for")
    return tuple(devices)


def _share(
    a: Assignment, resources: SiteResources, over: Oversubscription, live: Sequence[Run]
) -> tuple[int, ...]:
    """A best-effort run's devices, cores and memory on an oversubscribed site (allocate)."""
    devices: tuple[int, ...] = ()
    if a.gpus > 0:
        if a.model is None:
            raise DoesNotFit(f"asks for {a.gpus} accelerator(s) but names no model")
        pool = resources.devices.get(a.model, ())
        per_device = math.ceil(over.gpu_ratio(a.model))
        holders = dict.fromkeys(pool, 0)
        for run in live:
            if run.assignment.model == a.model:
                for i in run.devices:
                    if i in holders:
                        holders[i] += 1
        open_ = sorted((n, i) for i, n in holders.items() if n < per_device)
        if len(open_) < a.gpus:
            raise DoesNotFit(
                f"needs {a.gpus} x {a.model}, only {len(open_)} of {len(pool)} may take "
                f"another best-effort run ({per_device} a device)"
            )
        devices = tuple(sorted(i for _, i in open_[: a.gpus]))
    cpu_free = int(resources.cpu_cores * over.cpu) - sum(run.assignment.cpu for run in live)
    if a.cpu > cpu_free:
        raise DoesNotFit(f"needs {a.cpu} CPU cores, only {max(0, cpu_free)} free")
    mem_free = resources.mem_gb * over.mem_gb - sum(run.assignment.mem_gb for run in live)
    if a.mem_gb > mem_free + 1e-9:
        raise DoesNotFit(f"needs {a.mem_gb:g} GB of memory, only {max(0.0, mem_free):g} free")
    return devices


@dataclass(frozen=True)
class JobLog:
    """One attempt's log file; ``run`` is set while this agent knows the attempt's run."""

    job: str
    attempt: int
    path: Path
    run: Run | None

    @property
    def live(self) -> bool:
        return self.run is not None and self.run.live

    async def chunks(
        self, *, clock: Clock, offset: int = 0, follow: bool = False, poll_s: float = LOG_POLL_S
    ) -> AsyncIterator[bytes]:
        """The log from ``offset``; with ``follow``, keep tailing until the run has ended."""
        while not self.path.exists():
            if not (follow and self.live):
                return
            await clock.sleep(poll_s)
        # local reads of a bounded chunk are fast enough for the loop; no thread needed
        with open(self.path, "rb") as f:
            f.seek(offset)
            while True:
                was_live = self.live  # sampled before reading: output precedes the exit
                data = f.read(LOG_CHUNK)
                if data:
                    yield data
                    continue
                if not (follow and was_live):
                    return
                await clock.sleep(poll_s)


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
    ) -> None:
        self.registry = registry
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
        # replicas (sites.agent.replicas): where they listen, how long a draining one waits for the
        # brokers to see it draining, and the published ones' load
        self.replica_host = replica_host
        self.settle_s = settle_s
        self._replica_loads = ServiceMonitor((), by_url=True)

    # -- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Read reports, reap (or adopt) leftovers, then follow the assignments until cancelled.

        A run a previous agent left going that is still this job's current attempt (its
        assignment unchanged, its report not terminal) is adopted when the executor can follow
        it again (a Slurm job); every other leftover is stopped before anything starts.
        """
        self._main = asyncio.current_task()
        self._reported = await self._load_reports()
        resumable = self._resumable(await self._list_assignments())
        keep = {(a.job, a.attempt, a.fence) for a in resumable}
        for record in await self.executor.reap(self.stop_grace_s, keep):
            log.warning(
                "stopped leftover run of job %s attempt %d from a previous agent",
                record.job,
                record.attempt,
            )
        for assignment in resumable:
            await self._adopt(assignment)
        async with asyncio.TaskGroup() as group:
            group.create_task(self._mirror.run(), name=f"workload {self.site} assignments")
            group.create_task(self._reconcile_loop(), name=f"workload {self.site} reconcile")
            group.create_task(self._replica_loop(), name=f"workload {self.site} replicas")

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
        parsed = (self._parse(key, raw) for key, raw, _ in kvs)
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
        serving = [
            run for run in self._runs.values()
            if run.live and run.replica is not None and run.replica.state is ReplicaState.ready
        ]  # fmt: skip
        await asyncio.gather(*(self._drain(run, run.replica) for run in serving if run.replica))
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
        await self._replica_loads.close()

    # -- what the agent publishes and serves --------------------------------------------------

    def runs(self) -> list[Run]:
        return sorted(self._runs.values(), key=lambda run: run.job)

    def meter(self, gpus: Sequence[GpuDevice], now: float) -> None:
        """One NVML reading for every running job (Run.meter)."""
        for run in self._runs.values():
            if run.live:
                run.meter(gpus, now)

    def held_devices(self) -> dict[str, frozenset[int]]:
        held: dict[str, set[int]] = {}
        for run in self._runs.values():
            if run.live and run.devices and run.assignment.model is not None:
                held.setdefault(run.assignment.model, set()).update(run.devices)
        return {model: frozenset(ix) for model, ix in held.items()}

    def node_usage(self) -> tuple[NodeUsage, ...]:
        """What each declared node has free now (the agent publishes it; () without nodes)."""
        nodes = self._resources().nodes
        if not nodes:
            return ()
        held = self.held_devices()
        cores: dict[str, int] = {}
        mem: dict[str, float] = {}
        for run in self._runs.values():
            if not run.live:
                continue
            for share in run.assignment.nodes:
                cores[share.node] = cores.get(share.node, 0) + share.cpu
                mem[share.node] = mem.get(share.node, 0.0) + share.mem_gb
        topology = self.spec.topology
        sizes: dict[str, tuple[int, float, str | None]] = {}
        if topology is not None:
            for group in topology.nodes:
                for i, name in enumerate(group.node_names()):
                    sizes[name] = (group.cpu_cores, group.mem_gb, group.island_of(i))
        out = []
        for name, devices in nodes.items():
            cpu, gb, island = sizes.get(name, (0, 0.0, None))
            free = {m: len(set(ix) - held.get(m, frozenset())) for m, ix in devices.items()}
            out.append(
                NodeUsage(
                    node=name,
                    island=island,
                    free_devices=free,
                    free_cpu=max(0, cpu - cores.get(name, 0)),
                    free_mem_gb=round(max(0.0, gb - mem.get(name, 0.0)), 6),
                )
            )
        return tuple(out)

    def held(self) -> Capacity:
        """Capacity held by live runs: their devices per model, cores and memory."""
        live = [run for run in self._runs.values() if run.live]
        return normalize(
            devices={model: len(ix) for model, ix in self.held_devices().items()},
            cpu_cores=sum(run.assignment.cpu for run in live),
            mem_gb=sum(run.assignment.mem_gb for run in live),
            storage_tb=0.0,
            catalog=self.catalog,
        )

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
        for key, raw in self._mirror.items.items():
            cached = self._parsed.get(key)
            assignment = (
                cached[1] if cached is not None and cached[0] == raw else self._parse(key, raw)
            )
            parsed[key] = (raw, assignment)
            if assignment is not None:
                desired[assignment.job] = assignment
        self._parsed = parsed
        return desired

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
        """Decide and act, without awaiting: stop what is withdrawn, start what is new."""
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
        for run in finished[: max(0, len(finished) - KEEP_FINISHED)]:
            del self._runs[run.job]

    # -- one run ------------------------------------------------------------------------------

    async def _execute(self, run: Run) -> None:
        try:
            await self._run(run)
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
            host = self.replica_host
            port = a.serve.port or free_port(host)
            run.replica = Replica(job=a.job, serve=a.serve, host=host, port=port)
            a = with_port(a, host, port)
        try:
            handle = await self.executor.start(a, devices, run.log_path)
        except ExecutorError as exc:
            run.finish(RunState.failed, self.clock.time(), None, str(exc))
            log.warning("job %s attempt %d: %s", a.job, a.attempt, exc)
            await self._write(run)
            return
        run.handle = handle
        run.started_at = handle.started_at
        run.state = RunState.running
        await self._follow(run, handle)

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
        await self._write(run)
        if run.replica is not None and not (self._closing.is_set() or run.withdrawn.is_set()):
            self._spawn(self._await_ready(run, handle), f"ready {a.job}")
        ended = await self.executor.wait(handle)
        if run.replica is not None:
            run.replica.move(ReplicaState.stopped)
        if self._closing.is_set():
            return  # graceful agent stop: nothing more is reported (docs/executor.md)
        code = ended.code
        if run.withdrawn.is_set():
            state, message = RunState.stopped, "stopped: the assignment was withdrawn"
        elif run.unready is not None:
            state, message = RunState.failed, run.unready
        elif ended.ok:
            state, message = RunState.succeeded, ""
        else:
            state = RunState.failed
            message = ended.message or (
                "exit status unknown" if code is None else _exit_message(code)
            )
        usage = {**run.metered(), **(ended.usage or {})}  # the scheduler's own figures win
        run.usage = usage or None
        run.reason = ended.reason
        run.finish(state, self.clock.time(), code, message)
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
            await self._drain(run, run.replica)
        if run.handle is not None:
            await self.executor.stop(run.handle, self.stop_grace_s)

    # -- replicas (sites.agent.replicas)
    # --------------------------------------------------------------

    async def _await_ready(self, run: Run, handle: RunHandle) -> None:
        """Probe until the replica is ready; stop it when it is not within its timeout."""
        replica = run.replica
        if replica is None:
            return
        serve = replica.serve
        await self.clock.sleep(serve.readiness_initial_delay_s)
        deadline = self.clock.monotonic() + serve.readiness_timeout_s
        async with aiohttp.ClientSession() as session:
            while run.live and replica.state is ReplicaState.starting:
                if run.withdrawn.is_set() or self._closing.is_set():
                    return
                if await probe_ready(session, replica):
                    replica.move(ReplicaState.ready)
                    log.info("job %s: replica of %s ready at %s", run.job, serve.service,
                             replica.url)  # fmt: skip
                    return
                if self.clock.monotonic() >= deadline:
                    run.unready = (
                        f"not ready within {serve.readiness_timeout_s:g} s: "
                        f"{serve.readiness_path} never answered 2xx"
                    )
                    log.warning("job %s: %s; stopping it", run.job, run.unready)
                    await self.executor.stop(handle, self.stop_grace_s)
                    return
                await self.clock.sleep(serve.readiness_period_s)

    async def _drain(self, run: Run, replica: Replica) -> None:
        """Out of routing first, then wait for what it has in flight (module docstring of
        sites.agent.replicas); a replica not ready yet serves nothing and stops at once."""
        if replica.state is not ReplicaState.ready:
            return
        replica.move(ReplicaState.draining)
        started = self.clock.monotonic()
        deadline = started + max(replica.serve.drain_timeout_s, self.settle_s)
        log.info("job %s: replica of %s draining", run.job, replica.serve.service)
        await self.clock.sleep(self.settle_s)  # the brokers see it draining: nothing new comes
        monitor = ServiceMonitor(())
        try:
            while run.live and self.clock.monotonic() < deadline:
                left = await in_flight(monitor, replica)
                if left == 0:
                    break
                await self.clock.sleep(DRAIN_POLL_S)
        finally:
            await monitor.close()
        log.info("job %s: replica drained after %.1f s", run.job, self.clock.monotonic() - started)

    def _published_replicas(self) -> list[Replica]:
        """The replicas published here, ready or draining, by job: each has an endpoint of its
        own (several replicas of one service may run at a site)."""
        out = [
            run.replica
            for run in self._runs.values()
            if run.live
            and run.replica is not None
            and run.replica.state in (ReplicaState.ready, ReplicaState.draining)
        ]
        return sorted(out, key=lambda r: (r.serve.service, r.job))

    def replica_endpoints(self, now: float) -> list[ServiceEndpoint]:
        """The endpoints of the replicas ready or draining here, for the agent to publish: each
        with its own address and its own model server's load (read by URL)."""
        loads = self._replica_loads.loads
        return [r.endpoint(self.site, loads.get(r.url), now) for r in self._published_replicas()]

    async def _replica_loop(self) -> None:
        while True:
            published = self._published_replicas()
            self._replica_loads.services = tuple(r.as_service() for r in published)
            await self._replica_loads.poll()
            await self.clock.sleep(REPLICA_POLL_S)

    async def _write(self, run: Run) -> None:
        """Write the run's report; retried with backoff until it lands or the agent stops."""
        delay = RETRY_MIN_S
        while not self._closing.is_set():
            report = run.report(self.clock.time())
            record = self._record()
            if record is not None:
                try:
                    await self.registry.write_report(record, report)
                except RegistryError as exc:
                    log.warning(
                        "report of job %s (%s) not written: %s; retrying in %.1fs",
                        run.job,
                        report.state.value,
                        exc,
                        delay,
                    )
                else:
                    self._reported[run.job] = report
                    return
            await self.clock.sleep(delay)
            delay = min(delay * 2, self._retry_max_s)

    async def _load_reports(self) -> dict[str, Report]:
        kvs = await self._list(keys.reports(self.site), "reports")
        reports: dict[str, Report] = {}
        for key, raw, _ in kvs:
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


def _exit_message(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with {code}"
