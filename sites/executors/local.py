"""Executors: how a site runs the jobs the broker assigns to it (long form: docs/executor.md).

The interface is five calls; `sites.agent.workload` decides what to run, an executor only runs it:

- ``start(assignment, devices, log_path) -> RunHandle``: launch the job on the given device
  indices, output appended to ``log_path``; also persist a run record (``run.json``) so a
  restarted agent can find what its predecessor launched;
- ``wait(handle) -> RunExit``: how the run ended: its exit code (negative: killed by that
  signal) and, when the scheduler says more than the code does, why (``message``);
- ``stop(handle, grace_s)``: SIGTERM, then SIGKILL after ``grace_s``;
- ``reap(grace_s, keep) -> [RunRecord]``: at agent start, before anything runs, stop whatever
  runs recorded by a previous agent of this site still have going, and forget their records,
  except the runs named in ``keep`` (job, attempt, fence) that this executor can follow again;
- ``adopt(assignment) -> RunHandle | None``: a kept run of this very attempt, to ``wait`` on
  again (a Slurm job outlives the agent); None when there is none (a local process never is:
  it dies with its agent).

``LocalExecutor`` runs the command as a process in its own session on this host. The child gets
PR_SET_PDEATHSIG(SIGKILL), so it dies with the agent; processes it spawned itself do not inherit
that, and are killed through their process group by the next agent's ``reap()``. The prctl is
made by a few lines of Python that then exec the command (same pid), not by a ``preexec_fn``:
that runs Python in the forked child of a process full of gRPC threads, and gRPC's fork hooks
crash such a child (seen as SIGSEGV when the exec fails).

``sites.executors.slurm.SlurmExecutor`` hands the job to the site's Slurm (sbatch, squeue, scontrol,
sacct, scancel); its jobs outlive the agent, and a restarted agent adopts them.

Exceptions: ``ExecutorError`` (a ``sites.model.errors.SitesError``) when a run cannot be started.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import signal
import subprocess
from collections.abc import Collection, Mapping
from pathlib import Path

import psutil

from sites.executors.accounts import AccountError
from sites.executors.base import (
    LAUNCHING,
    RUN_RECORD,
    ExecutorError,
    RunExit,
    RunHandle,
    RunKey,
    RunRecord,
    check_job_id,
    command_argv,
    end_record,
    forget_dead_agents,
    handle_of,
    job_dir,
    job_env,
    read_record,
    write_record,
)
from sites.executors.cgroups import CgroupError
from sites.executors.confinement import ConfinedRun, Confiner, Refused
from sites.executors.launcher import launcher
from sites.executors.netns import EgressError, start_egress, with_fds
from sites.kits.clock import Clock
from sites.model.assignments import Assignment
from sites.model.catalog import DeviceCatalog
from sites.model.spec import Confinement

log = logging.getLogger(__name__)

POLL_S = 0.05
KILL_WAIT_S = 5.0  # a process in uninterruptible sleep (D) dies only when its I/O ends
# a spawn failing with these is the job's program's fault, not the site's
_PROGRAM_ERRNOS = frozenset({errno.ENOENT, errno.EACCES, errno.ENOEXEC, errno.E2BIG})


# -- layout and environment (shared by every executor) ---------------------------------------


# -- local processes ---------------------------------------------------------------------------


class LocalExecutor:
    """Runs each job as a confined process group on this host (see the module docstring)."""

    kind = "local"

    def __init__(
        self,
        *,
        work_dir: Path,
        site: str,
        catalog: DeviceCatalog,
        clock: Clock,
        confiner: Confiner | None = None,
    ) -> None:
        self.work_dir = work_dir
        self.site = site
        self._catalog = catalog
        self._clock = clock
        self.confiner = confiner or Confiner(Confinement(), site=site, work_dir=work_dir)
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._runs: dict[str, ConfinedRun] = {}
        self._nets: dict[str, asyncio.subprocess.Process] = {}  # egress: slirp4netns per run

    def confinement(self) -> str:
        """How this site confines runs, decided once (the agent logs the line at start)."""
        return self.confiner.summary if self.confiner.checked else self.confiner.check()

    async def start(
        self, assignment: Assignment, devices: tuple[int, ...], log_path: Path
    ) -> RunHandle:
        check_job_id(assignment.job)
        self.confinement()
        jdir = job_dir(self.work_dir, assignment.job)
        cwd = jdir / "work"
        vendor = None
        if assignment.model is not None and assignment.model in self._catalog:
            vendor = self._catalog.get(assignment.model).vendor
        job_vars = job_env(assignment, devices, site=self.site, vendor=vendor, base={})
        argv = command_argv(assignment.command)
        _check_program(argv[0], env={"PATH": job_vars.get("PATH", self.confiner.path)},
                       cwd=cwd)  # fmt: skip
        try:
            run = self.confiner.prepare(
                assignment, devices, vendor=vendor, job_vars=job_vars, argv=argv, cwd=cwd
            )
        except (Refused, AccountError, CgroupError, OSError) as exc:
            # a tenant with no account here is that tenant's, not the site's: its jobs alone
            # must not back the site off for everyone (broker.leader.start_backoff)
            raise ExecutorError(
                f"cannot confine the run: {exc}", site=not isinstance(exc, AccountError)
            ) from exc
        # A record before the launch, without its pid: an agent killed between the launch and
        # the full record below (its run dies with it, its first lines maybe run) leaves its
        # successor this one, which reports the attempt lost and bills it from here to the dead
        # agent's last sign of life (sites.agent.runs), instead of leaving it unbilled: the
        # chaos soak found 4 such runs in 30 minutes on a loaded host.
        try:
            write_record(
                jdir / RUN_RECORD,
                RunRecord(
                    site=self.site, job=assignment.job, attempt=assignment.attempt,
                    fence=assignment.fence, ref=LAUNCHING, pid=None, created_at=None,
                    started_at=self._clock.time(), log_path=str(log_path),
                    agent_pid=os.getpid(), assignment=assignment,
                ),
            )  # fmt: skip
        except OSError as exc:
            self._discard(run)
            raise ExecutorError(f"cannot write {jdir / RUN_RECORD}: {exc}", site=True) from exc
        try:
            proc = await self._spawn(run, log_path)
        except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the job's argv or env
            (jdir / RUN_RECORD).unlink(missing_ok=True)
            self._discard(run)
            raise ExecutorError(
                f"cannot start {argv[0]!r}: {getattr(exc, 'strerror', None) or exc}",
                site=isinstance(exc, OSError) and exc.errno not in _PROGRAM_ERRNOS,
            ) from exc
        except ExecutorError:
            (jdir / RUN_RECORD).unlink(missing_ok=True)
            self._discard(run)
            raise
        handle = RunHandle(
            job=assignment.job,
            attempt=assignment.attempt,
            fence=assignment.fence,
            ref=str(proc.pid),
            pid=proc.pid,
            log_path=log_path,
            started_at=self._clock.time(),
            confinement=run.summary,
        )
        record = RunRecord(
            site=self.site,
            job=handle.job,
            attempt=handle.attempt,
            fence=handle.fence,
            ref=handle.ref,
            pid=proc.pid,
            created_at=_create_time(proc.pid),
            started_at=handle.started_at,
            log_path=str(log_path),
            agent_pid=os.getpid(),
            assignment=assignment,
        )
        self._procs[handle.ref] = proc
        self._runs[handle.ref] = run
        try:
            write_record(jdir / RUN_RECORD, record)
        except OSError as exc:
            # without a record a crashed agent's successor could not find it: do not run it
            _signal_group(proc.pid, signal.SIGKILL)
            await proc.wait()
            self._procs.pop(handle.ref, None)
            await self._release(handle.ref)
            raise ExecutorError(f"cannot write {jdir / RUN_RECORD}: {exc}", site=True) from exc
        log.info(
            "job %s attempt %d started: pid %d, devices %s, %s",
            handle.job,
            handle.attempt,
            proc.pid,
            list(devices),
            run.summary,
        )
        return handle

    async def _spawn(self, run: ConfinedRun, log_path: Path) -> asyncio.subprocess.Process:
        """Start the launcher (which joins the run's cgroup, and drops to the tenant's account
        when there is no sandbox to do it) with the run's output appended to ``log_path``."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        procs = run.group.procs_files if run.group is not None else []
        uid = (run.account.uid, run.account.gid) if run.setuid else None
        info_r = info_w = block_r = block_w = -1
        argv = run.argv
        if run.egress:
            info_r, info_w = os.pipe()
            block_r, block_w = os.pipe()
            argv = with_fds(argv, info_fd=info_w, block_fd=block_r)
        out_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            proc = await asyncio.create_subprocess_exec(
                *launcher(argv, procs=procs, uid=uid),
                stdin=subprocess.DEVNULL,
                stdout=out_fd,
                stderr=subprocess.STDOUT,
                cwd=run.cwd,
                env=run.env,
                start_new_session=True,  # own session and process group: stop() kills it all
                pass_fds=(info_w, block_r) if run.egress else (),
            )
        finally:
            os.close(out_fd)
            for fd in (info_w, block_r):
                if fd >= 0:
                    os.close(fd)
        if run.egress:
            try:
                self._nets[str(proc.pid)] = await start_egress(info_r, block_w, run)
            except EgressError as exc:
                _signal_group(proc.pid, signal.SIGKILL)
                await proc.wait()
                raise ExecutorError(str(exc)) from exc
            finally:
                os.close(info_r)
                os.close(block_w)
        return proc

    def _discard(self, run: ConfinedRun) -> None:
        if run.group is not None:
            run.group.remove()

    async def _release(self, ref: str) -> None:
        """After a run ended: its network helper and cgroup (and what is left in it) go."""
        net = self._nets.pop(ref, None)
        if net is not None and net.returncode is None:
            net.kill()
            await net.wait()
        run = self._runs.pop(ref, None)
        if run is not None and run.group is not None:
            await asyncio.to_thread(run.group.remove)

    async def wait(self, handle: RunHandle) -> RunExit:
        proc = self._procs.get(handle.ref)
        if proc is None:
            raise ExecutorError(f"run {handle.ref} of job {handle.job} is not ours")
        run = self._runs.get(handle.ref)
        oom = 0
        try:
            code = await proc.wait()
        finally:
            if proc.returncode is not None:
                # what the job left behind in its group dies with it, as under Slurm
                _signal_group(int(handle.ref), signal.SIGKILL)
                if run is not None and run.group is not None:
                    oom = run.group.oom_kills()
                self._procs.pop(handle.ref, None)
                ended_at = self._clock.time()
                await self._release(handle.ref)
                # kept, with its end, until the next agent's reap: should this agent die before
                # the run's end is written down, the next one reports and bills it to then
                end_record(job_dir(self.work_dir, handle.job) / RUN_RECORD, handle.ref, ended_at)
        if run is not None and run.sandboxed and code > 128:
            code = -(code - 128)  # bubblewrap exits 128+n for a run killed by signal n
        if oom and run is not None:  # counted in the run's own group: there is one
            return RunExit(
                code,
                message=f"out of memory: the run used more than its memory limit "
                f"({run.limits_text}) and the kernel killed it",
                reason="out_of_memory",
            )
        return RunExit(code)

    async def stop(self, handle: RunHandle, grace_s: float) -> None:
        """SIGTERM the group, SIGKILL it after ``grace_s``; returns once it is gone."""
        pgid = int(handle.ref)
        run = self._runs.get(handle.ref)
        signalled: set[int] | None = None
        if run is not None and run.sandboxed:
            # SIGTERM to the run's own processes: bubblewrap's (outer and the namespace's init)
            # would die of it and take the run down at once, with no grace. A payload bubblewrap
            # has not forked yet is signalled when it appears, while the grace runs.
            signalled = set()
            if not _signal_sandboxed(pgid, signal.SIGTERM, signalled) and not _group_members(pgid):
                return
        elif not _signal_group(pgid, signal.SIGTERM):
            return
        if await self._wait_gone(pgid, grace_s, signalled):
            return
        log.warning("job %s (pgid %d) outlived its %.1fs grace; killing it", handle.job, pgid,
                    grace_s)  # fmt: skip
        _signal_group(pgid, signal.SIGKILL)
        if run is not None and run.group is not None:
            run.group.kill()
        if not await self._wait_gone(pgid, KILL_WAIT_S):
            log.error("job %s (pgid %d) survived SIGKILL for %.0fs", handle.job, pgid, KILL_WAIT_S)

    async def _wait_gone(
        self, pgid: int, timeout_s: float, signalled: set[int] | None = None
    ) -> bool:
        """Wait until the group is gone; with ``signalled``, SIGTERM each sandboxed process
        that appears meanwhile (those already signalled are in the set)."""
        deadline = self._clock.monotonic() + timeout_s
        while _group_members(pgid):
            if self._clock.monotonic() >= deadline:
                return False
            if signalled is not None:
                _signal_sandboxed(pgid, signal.SIGTERM, signalled)
            await self._clock.sleep(POLL_S)
        return True

    async def reap(self, grace_s: float, keep: Collection[RunKey] = ()) -> list[RunRecord]:
        """Stop every recorded run; ``keep`` is ignored: a local run cannot be adopted."""
        del keep
        found: list[tuple[Path, RunRecord]] = []
        for path in sorted((self.work_dir / "jobs").glob(f"*/{RUN_RECORD}")):
            record = read_record(path)
            if record is None:
                path.unlink(missing_ok=True)
            elif record.site == self.site:
                found.append((path, record))
        forget_dead_agents(self.work_dir)  # the runs they left were read (ended_runs)
        alive = [(p, r) for p, r in found if _leftover_alive(r)]
        for _, record in alive:
            log.warning(
                "killing leftover job %s attempt %d (pgid %s) of a previous agent",
                record.job,
                record.attempt,
                record.ref,
            )
        await asyncio.gather(*(self.stop(handle_of(r), grace_s) for _, r in alive))
        for path, _ in found:
            path.unlink(missing_ok=True)
        # whatever is left in the cgroups of earlier runs (a daemon that left its group)
        self.confinement()
        cgroups = self.confiner.cgroups
        for group in cgroups.leftovers() if cgroups is not None else []:
            if group.pids():
                log.warning("killing what is left in cgroup %s", list(group.dirs.values()))
            await asyncio.to_thread(group.remove)
        return [r for _, r in alive]

    async def adopt(self, assignment: Assignment) -> RunHandle | None:
        """Never: a local run dies with its agent (reap stopped what it left)."""
        del assignment
        return None

    async def queued(self, handle: RunHandle) -> str | None:
        """Never: the process runs from its start."""
        del handle
        return None


# -- process helpers ---------------------------------------------------------------------------


def _signal_sandboxed(pgid: int, sig: signal.Signals, done: set[int] | None = None) -> bool:
    """Signal the processes a sandbox runs, not bubblewrap's own two; False when none.

    With ``done``, the pids already signalled are skipped and those signalled now are added.
    """
    try:
        outer = psutil.Process(pgid)
        inner = outer.children()
        spare = {outer.pid, *(p.pid for p in inner)}
        targets = [p for p in outer.children(recursive=True) if p.pid not in spare]
    except psutil.Error:
        return False
    sent = False
    for p in targets:
        if done is not None:
            if p.pid in done:
                continue
            done.add(p.pid)
        try:
            os.kill(p.pid, sig)
            sent = True
        except (ProcessLookupError, PermissionError):
            continue
    return sent


def _check_program(program: str, *, env: Mapping[str, str], cwd: Path) -> None:
    """Fail early, with a clear message, for a program that cannot be executed."""
    if os.sep in program:
        path = Path(program) if os.path.isabs(program) else cwd / program
        ok = path.is_file() and os.access(path, os.X_OK)
    else:
        ok = shutil.which(program, path=env.get("PATH", os.defpath)) is not None
    if not ok:
        raise ExecutorError(f"cannot start {program!r}: no such executable")


def _signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to the process group; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        log.warning("no permission to signal process group %d", pgid)
        return False
    return True


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of the group; zombies answer signal 0, so look closer."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return []
    if _running(pgid):
        return [pgid]  # the leader still runs: no need to scan every process
    members = []
    for proc in psutil.process_iter(["status"]):
        if proc.info.get("status") in (None, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            continue
        try:
            if os.getpgid(proc.pid) == pgid:
                members.append(proc.pid)
        except OSError:
            continue
    return members


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def _create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _leftover_alive(record: RunRecord) -> bool:
    """Does the recorded run still have processes? A reused pid is somebody else's; a run
    recorded before its launch (LAUNCHING) died with the agent that launched it, if it ran."""
    if record.ref == LAUNCHING:
        return False
    pgid = int(record.ref)
    if record.pid is not None:
        created = _create_time(record.pid)
        if created is not None and record.created_at is not None:
            if abs(created - record.created_at) > 0.5:
                return False  # the pid now names another process (and so no group of ours)
    return bool(_group_members(pgid))
