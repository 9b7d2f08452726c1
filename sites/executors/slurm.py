"""The Slurm executor: a site's jobs run on its own Slurm cluster (long form: docs/slurm.md).

``start`` writes a batch script (the job's environment, then ``exec`` of its command) and submits
it with ``sbatch`` as the tenant's own Unix user (``--uid``/``--gid``, named in
``executor.confinement.accounts.tenants``), never with the agent's identity or environment
(``--export=NONE``; the script exports an allow-list): one task on one node,
``--cpus-per-task``, ``--mem``, GPUs as ``--gres=gpu:<type>:<n>`` (the catalog model's GRES
type), ``--time`` from the job's duration estimate times a margin, the tenant's account and QOS
(``executor.slurm.accounts``), the partition, ``--no-requeue`` (cpn decides about retries),
output appended to the attempt's log. The job name is ``cpn-<job>`` and the comment
``cpn:<site>:<job>:<attempt>:<fence>``: that is how a restarted agent finds its jobs again
(``reap`` / ``adopt``) and never submits an attempt twice. ``wait`` follows the job through one
``squeue`` per poll for all the site's jobs, then takes its end from ``scontrol`` / ``sacct`` and
maps the Slurm state to an exit and a reason (``slurm_exit``). ``stop`` is ``scancel`` (SIGTERM,
SIGKILL after the cluster's KillWait).

Slurm confines the job itself (its TaskPlugin: task/cgroup on the test harness's cluster).
Unlike a local process, a Slurm job outlives the agent: a crashed agent's successor adopts the
runs that are still the current attempt of an assignment, and cancels the others.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pwd
from collections.abc import Collection, Sequence
from pathlib import Path

from sites.executors import slurm_checks
from sites.executors.accounts import Account, check_named
from sites.executors.base import (
    RUN_RECORD,
    ExecutorError,
    RunExit,
    RunHandle,
    RunKey,
    RunRecord,
    check_job_id,
    handle_of,
    job_dir,
    read_record,
    remove_record,
    write_record,
)
from sites.executors.base import log_path as attempt_log_path
from sites.executors.confinement import Refused, allowed_env, input_mounts, link_inputs
from sites.executors.slurm_batch import (
    ACCOUNTS_FIELD,
    batch_script,
    comment_of,
    job_files,
    parse_comment,
    run_as,
    sbatch_args,
    unreachable_dir,
)
from sites.executors.slurm_commands import SlurmCommands, SlurmError
from sites.executors.slurm_jobs import (
    QUEUED,
    SQUEUE_FORMAT,
    TERMINAL,
    USAGE_FIELDS,
    SlurmJob,
    job_usage,
    sacct_job,
    scontrol_fields,
    slurm_exit,
    squeue_lines,
)
from sites.kits.clock import Clock
from sites.model.assignments import Assignment
from sites.model.catalog import DeviceCatalog
from sites.model.errors import ConfigError
from sites.model.spec import SiteSpec

log = logging.getLogger(__name__)

VANISHED_POLLS = 5  # polls a job may be unknown to both squeue and sacct before it is lost
STOP_POLL_S = 0.2
STOP_WAIT_S = 60.0  # beyond the grace: Slurm's KillWait, and a node slow to clean up


class SlurmExecutor:
    """Runs each job as a Slurm batch job of the site's cluster (see the module docstring)."""

    kind = "slurm"

    def __init__(
        self,
        *,
        work_dir: Path,
        spec: SiteSpec,
        catalog: DeviceCatalog,
        clock: Clock,
        commands: SlurmCommands,
    ) -> None:
        self.work_dir = work_dir
        self.site = spec.id
        self.settings = spec.executor.slurm_settings
        self.partition = spec.executor.partition
        self.commands = commands
        self._catalog = catalog
        self._clock = clock
        self._user = pwd.getpwuid(os.getuid()).pw_name
        self._root = os.geteuid() == 0
        self._path = spec.executor.confinement.path
        # tenant -> its named Unix user; ConfigError (naming the entry) when one is unusable
        self.named: dict[str, Account] = (
            check_named(
                spec.executor.confinement.accounts, field=f"site {spec.id}:{ACCOUNTS_FIELD}"
            )
            if self._root
            else {}
        )
        self._limits: str | None = None  # how the cluster confines a job, read by check()
        self._watched: set[str] = set()
        self._snapshot: dict[str, SlurmJob] = {}
        self._snapshot_at: float | None = None
        self._poll_lock = asyncio.Lock()
        # left by a previous agent, kept to adopt (several when a tenant forged a comment)
        self._orphans: dict[RunKey, list[SlurmJob]] = {}

    # -- the site file against the cluster ------------------------------------------------------

    def confinement(self) -> str:
        """How this site's jobs run, in one line (the agent logs and publishes it)."""
        if not self._root:
            return (
                "refusing jobs: the agent is not root, and only root may submit a job as a "
                "tenant's own user (sbatch --uid)"
            )
        if not self.named:
            return f"refusing jobs: no tenant has a Unix user here ({ACCOUNTS_FIELD}.tenants)"
        limits = self._limits or "limits as the cluster's TaskPlugin sets"
        return (
            f"slurm as the tenants' own users ({len(self.named)} named, sbatch --uid) and Slurm "
            f"accounts, environment allow-listed (--export=NONE), {limits}"
        )

    async def unreachable(self) -> str | None:
        """Why no Slurm controller answers here, None when one does (slurm_checks)."""
        return await slurm_checks.unreachable(self.commands)

    async def check(self, source: str) -> None:
        """ConfigError naming the field when the partition, an account or a QOS is unknown, or
        a tenant's user has no association with its account (slurm_checks); then reads how the
        cluster confines a job."""
        problems = await slurm_checks.problems(
            self.commands,
            source=source,
            site=self.site,
            partition=self.partition,
            settings=self.settings,
            named=self.named,
            root=self._root,
        )
        if problems:
            raise ConfigError(problems)
        self._limits = await slurm_checks.task_limits(self.commands)

    # -- the Executor calls ---------------------------------------------------------------------

    async def start(
        self, assignment: Assignment, devices: tuple[int, ...], log_path: Path
    ) -> RunHandle:
        del devices  # Slurm picks the GPUs; the agent's indices only count them
        a = assignment
        check_job_id(a.job)
        user = run_as(a.tenant, site=self.site, named=self.named, root=self._root)
        jdir = job_dir(self.work_dir, a.job)
        cwd = jdir / "work"
        args = sbatch_args(
            a,
            site=self.site,
            settings=self.settings,
            partition=self.partition,
            log_path=log_path,
            cwd=cwd,
            user=user,
        )
        existing = await self._find(comment_of(self.site, a.job, a.attempt, a.fence), user.name)
        if existing is not None:  # submitted already (an agent died right after sbatch)
            log.warning("job %s attempt %d is slurm job %s already", a.job, a.attempt, existing.id)
            return self._handle(a, existing.id, log_path, self._clock.time())
        script = jdir / f"attempt-{a.attempt}.sbatch"
        try:
            job_files(cwd, log_path, user)
            # Slurm confines with its own means: inputs are symlinks under the work dir
            link_inputs(input_mounts(a, cwd), cwd)
            script.write_text(
                batch_script(
                    a,
                    site=self.site,
                    base=allowed_env(user, home=cwd, path=self._path, lang="C.UTF-8"),
                )
            )
            script.chmod(0o700)  # sbatch reads it as root and hands Slurm a copy
            blocked = unreachable_dir(cwd, user)
        except Refused as exc:
            raise ExecutorError(str(exc), site=True) from exc
        except OSError as exc:
            raise ExecutorError(
                f"cannot make the files of job {a.job} in {jdir}: {exc.strerror or exc}",
                site=True,
            ) from exc
        if blocked is not None:
            raise ExecutorError(
                f"user {user.name} cannot reach {blocked} (mode {blocked.stat().st_mode & 0o777:o}"
                "): a Slurm site's work_dir must be passable by its tenants' users",
                site=True,
            )
        # sbatch's own environment: PATH and SLURM_CONF, nothing else of the agent's (no
        # SBATCH_* either); run from the job dir, the job's SLURM_SUBMIT_DIR
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "SLURM_CONF")}
        got = await self.commands.run("sbatch", *args, str(script), env=env, cwd=jdir)
        if got.returncode != 0:
            raise ExecutorError(
                f"sbatch refused job {a.job}: {got.error}", site=unreachable(got.error)
            )
        slurm_id = got.stdout.strip().split(";")[0]
        if not slurm_id.isdigit():
            raise ExecutorError(
                f"sbatch gave no job id for {a.job}: {got.stdout.strip()!r}", site=True
            )
        handle = self._handle(a, slurm_id, log_path, self._clock.time())
        self._record(handle)
        log.info("job %s attempt %d submitted: slurm job %s", a.job, a.attempt, slurm_id)
        return handle

    async def wait(self, handle: RunHandle) -> RunExit:
        slurm_id = handle.ref
        self._watched.add(slurm_id)
        unknown = 0
        try:
            while True:
                job = (await self._poll()).get(slurm_id)
                if job is None or not job.live:
                    final = await self._final(slurm_id, job)
                    if final is not None and not final.live:
                        break
                    unknown = 0 if final is not None else unknown + 1
                    if unknown >= VANISHED_POLLS:
                        return RunExit(
                            None, f"slurm job {slurm_id}: neither squeue nor sacct knows it"
                        )
                await self._clock.sleep(self.settings.poll_s)
        finally:
            self._watched.discard(slurm_id)
        remove_record(job_dir(self.work_dir, handle.job) / RUN_RECORD, slurm_id)
        ended = slurm_exit(final)
        try:
            usage = await self.usage(slurm_id)
        except SlurmError as exc:
            log.warning("no accounting for slurm job %s: %s", slurm_id, exc)
            usage = None
        return RunExit(ended.code, ended.message, usage)

    async def usage(self, slurm_id: str, tries: int = 3) -> dict[str, float] | None:
        """The job's resource-seconds from sacct (``job_usage``); None when sacct has no
        finished record of it after ``tries`` polls (no slurmdbd, or it lags)."""
        for attempt in range(tries):
            got = await self.commands.run(
                "sacct", "-n", "-P", "-X", "-j", slurm_id, "-o", USAGE_FIELDS
            )
            if got.returncode != 0:
                raise SlurmError(f"sacct: {got.error}")
            usage = job_usage(got.stdout, slurm_id, models=self.models())
            if usage is not None:
                return usage
            if attempt + 1 < tries:
                await self._clock.sleep(self.settings.poll_s)
        return None

    def models(self) -> dict[str, str]:
        """GRES type (lower case) -> catalog model."""
        models = {self.settings.gres_type(m).lower(): m for m in self._catalog.devices}
        models.update({kind.lower(): m for m, kind in self.settings.gres_types.items()})
        return models

    async def stop(self, handle: RunHandle, grace_s: float) -> None:
        """``scancel``: Slurm sends SIGTERM, then SIGKILL after the cluster's KillWait.

        Slurm's own escalation is used rather than a SIGTERM of ours, so that sacct says
        CANCELLED (a job that exits on our SIGTERM would read FAILED); the checkpoint grace at
        a Slurm site is therefore its KillWait. Returns once the job has left the queue.
        """
        slurm_id = handle.ref
        job = await self._state(slurm_id)
        if job is None or not job.live:
            return
        got = await self.commands.run("scancel", slurm_id)
        if got.returncode != 0:
            log.warning("scancel %s (job %s): %s", slurm_id, handle.job, got.error)
        if not await self._gone(slurm_id, grace_s + STOP_WAIT_S):
            log.error("job %s (slurm %s) still in the queue after scancel", handle.job, slurm_id)

    async def reap(self, grace_s: float, keep: Collection[RunKey] = ()) -> list[RunRecord]:
        """Cancel this site's Slurm jobs a previous agent left, except those in ``keep``."""
        listed = await self._list(self._submitters())
        records = self._records()
        stopped = []
        for job in listed.values():
            parsed = parse_comment(job.comment)
            if parsed is None or parsed[0] != self.site:
                continue
            key = parsed[1]
            if key in keep:
                self._orphans.setdefault(key, []).append(job)
                continue
            if not job.live:
                continue
            log.warning("cancelling leftover slurm job %s (job %s attempt %d)", job.id, *key[:2])
            record = records.get(key[0])
            handle = (
                handle_of(record) if record is not None and record.ref == job.id
                else RunHandle(key[0], key[1], key[2], job.id, None, Path(), 0.0)
            )  # fmt: skip
            await self.stop(handle, grace_s)
            if record is not None:
                stopped.append(record)
        for job_id, record in records.items():
            if record.key not in keep:
                remove_record(job_dir(self.work_dir, job_id) / RUN_RECORD, record.ref)
        return stopped

    async def queued(self, handle: RunHandle) -> str | None:
        """ "pending in Slurm: <reason>" while squeue says PENDING (or the job is requeued or
        held); None once it runs or has ended."""
        self._watched.add(handle.ref)
        job = (await self._poll()).get(handle.ref)
        if job is None or job.state not in QUEUED:
            return None
        reason = job.reason if job.reason and job.reason != "None" else "waiting"
        return f"{job.state.lower()} in Slurm: {reason}"

    async def adopt(self, assignment: Assignment) -> RunHandle | None:
        """The Slurm job of this very attempt, found by its comment (or its run record)."""
        a = assignment
        key = (a.job, a.attempt, a.fence)
        record = self._records().get(a.job)
        user = self.named.get(a.tenant)
        job = None
        for found in self._orphans.pop(key, []):
            if job is None and user is not None and found.user == user.name:
                job = found
                continue
            # not as the tenant's user (submitted before identities, or forged): not followed
            log.warning("cancelling slurm job %s of job %s: it runs as %s, not as the tenant's "
                        "user", found.id, a.job, found.user)  # fmt: skip
            await self.stop(RunHandle(a.job, a.attempt, a.fence, found.id, None, Path(), 0.0), 0)
        slurm_id = job.id if job is not None else None
        if slurm_id is None and record is not None and record.key == key:
            # aged out of squeue: sacct still knows how it ended
            if await self._final(record.ref, None) is not None:
                slurm_id = record.ref
        if slurm_id is None:
            return None
        log_path = (
            Path(record.log_path)
            if record is not None
            else attempt_log_path(self.work_dir, a.job, a.attempt)
        )
        started = record.started_at if record is not None else self._clock.time()
        handle = self._handle(a, slurm_id, log_path, started)
        if record is None or record.ref != slurm_id:
            self._record(handle)
        return handle

    # -- queries ------------------------------------------------------------------------------

    async def _poll(self) -> dict[str, SlurmJob]:
        """One squeue for every job being waited on, shared by the waiters of a poll period."""
        async with self._poll_lock:
            now = self._clock.monotonic()
            fresh = self._snapshot_at is not None and now - self._snapshot_at < (
                self.settings.poll_s / 2
            )
            if not fresh and self._watched:
                ids = ",".join(sorted(self._watched, key=int))
                got = await self.commands.run(
                    "squeue", "-h", "-t", "all", "-j", ids, "-o", SQUEUE_FORMAT
                )
                if got.returncode == 0:
                    self._snapshot = squeue_lines(got.stdout)
                elif "Invalid job id" in got.error:
                    self._snapshot = {}
                else:  # slurmctld unreachable: keep the last view, the jobs run on
                    log.warning("site %s: squeue failed: %s", self.site, got.error)
                    return {i: SlurmJob(i, "UNKNOWN") for i in self._watched}
                self._snapshot_at = self._clock.monotonic()
            return self._snapshot

    async def _state(self, slurm_id: str) -> SlurmJob | None:
        got = await self.commands.run("squeue", "-h", "-t", "all", "-j", slurm_id, "-o",
                                      SQUEUE_FORMAT)  # fmt: skip
        return squeue_lines(got.stdout).get(slurm_id) if got.returncode == 0 else None

    async def _gone(self, slurm_id: str, timeout_s: float) -> bool:
        deadline = self._clock.monotonic() + timeout_s
        while True:
            job = await self._state(slurm_id)
            if job is None or not job.live:
                return True
            if self._clock.monotonic() >= deadline:
                return False
            await self._clock.sleep(STOP_POLL_S)

    async def _final(self, slurm_id: str, seen: SlurmJob | None) -> SlurmJob | None:
        """How the job ended: scontrol while slurmctld remembers it, sacct after; None: unknown
        (a live state when it turns out to run still).

        sacct is asked too when scontrol answered, for who cancelled a job.
        """
        job = None
        got = await self.commands.run("scontrol", "show", "job", "-o", slurm_id)
        if got.returncode == 0:
            fields = scontrol_fields(got.stdout)
            state = fields.get("JobState", "")
            if state in TERMINAL:
                job = SlurmJob(
                    id=slurm_id,
                    state=state,
                    reason=fields.get("Reason", ""),
                    comment=fields.get("Comment", ""),
                    exit_code=fields.get("ExitCode", ""),
                )
            elif state:
                return SlurmJob(id=slurm_id, state=state)  # still live (squeue raced with it)
        if job is None or job.state == "CANCELLED":
            got = await self.commands.run(
                "sacct", "-n", "-P", "-X", "-j", slurm_id, "-o", "JobID,State,ExitCode,Reason"
            )
            accounted = sacct_job(got.stdout, slurm_id) if got.returncode == 0 else None
            if accounted is not None and accounted.state in TERMINAL:
                if job is None:
                    job = accounted
                elif accounted.by:
                    job = SlurmJob(**{**job.__dict__, "by": accounted.by})
        if job is None and seen is not None and not seen.live:
            job = seen  # squeue said how, nobody says the code
        return job

    async def _find(self, comment: str, user: str) -> SlurmJob | None:
        """The job of ``user`` with this very comment (one a tenant forged under its own user
        only ever stands in for its own job)."""
        for job in (await self._list([user])).values():
            if job.comment == comment and job.user == user:
                return job
        return None

    async def _list(self, users: Sequence[str]) -> dict[str, SlurmJob]:
        got = await self.commands.run(
            "squeue", "-h", "-t", "all", "-u", ",".join(users), "-o", SQUEUE_FORMAT
        )
        if got.returncode != 0:
            raise SlurmError(f"squeue: {got.error}")
        return squeue_lines(got.stdout)

    def _submitters(self) -> list[str]:
        """Whose jobs may be this site's: the tenants' users, and the agent's (earlier jobs)."""
        return sorted({self._user, *(account.name for account in self.named.values())})

    # -- run records ------------------------------------------------------------------------

    def _handle(self, a: Assignment, slurm_id: str, log_path: Path, started: float) -> RunHandle:
        user = self.named.get(a.tenant)
        account = self.settings.account_for(a.tenant)
        how = (
            f"slurm job as {user.name} (uid {user.uid})"
            + (f", account {account.account}" if account is not None else "")
            if user is not None
            else ""
        )
        return RunHandle(
            job=a.job,
            attempt=a.attempt,
            fence=a.fence,
            ref=slurm_id,
            pid=None,
            log_path=log_path,
            started_at=started,
            confinement=how,
        )

    def _record(self, handle: RunHandle) -> None:
        record = RunRecord(
            site=self.site,
            job=handle.job,
            attempt=handle.attempt,
            fence=handle.fence,
            ref=handle.ref,
            pid=None,
            created_at=None,
            started_at=handle.started_at,
            log_path=str(handle.log_path),
            agent_pid=os.getpid(),
        )
        try:
            write_record(job_dir(self.work_dir, handle.job) / RUN_RECORD, record)
        except OSError as exc:  # the comment still finds the job; the record only helps
            log.warning("cannot write the run record of %s: %s", handle.job, exc)

    def _records(self) -> dict[str, RunRecord]:
        out = {}
        for path in sorted((self.work_dir / "jobs").glob(f"*/{RUN_RECORD}")):
            record = read_record(path)
            if record is not None and record.site == self.site:
                out[record.job] = record
        return out


# what sbatch says when the site's Slurm, not the job, is the trouble (its controller down or
# unreachable, its configuration unreadable); a job sbatch refuses for what it asks (a node
# configuration, an account or QOS limit) is that job's, and never backs the site off
_UNREACHABLE = (
    "unable to contact slurm controller",
    "socket timed out",
    "connection refused",
    "could not establish a configuration source",
    "no such file or directory",
    "slurm_conf",
)


def unreachable(error: str) -> bool:
    """Whether an sbatch error is the site's Slurm being unusable, not the job's request."""
    low = error.lower()
    return any(marker in low for marker in _UNREACHABLE)
