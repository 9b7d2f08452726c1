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
import math
import os
import pwd
import re
import shlex
import shutil
import stat
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sites.executors.accounts import Account, check_named
from sites.executors.base import (
    RUN_RECORD,
    ExecutorError,
    RunExit,
    RunHandle,
    RunKey,
    RunRecord,
    check_job_id,
    command_argv,
    handle_of,
    job_dir,
    job_env,
    read_record,
    remove_record,
    write_record,
)
from sites.executors.base import log_path as attempt_log_path
from sites.executors.confinement import allowed_env, own_work_dir
from sites.kits.clock import Clock
from sites.model.assignments import Assignment
from sites.model.catalog import DeviceCatalog, split_model
from sites.model.errors import ConfigError, Problem
from sites.model.spec import SiteSpec, SlurmSettings

log = logging.getLogger(__name__)

COMMANDS = ("sbatch", "squeue", "scontrol", "scancel", "sacct", "sinfo")
COMMAND_TIMEOUT_S = 30.0
DEFAULT_CONF = "/etc/slurm/slurm.conf"  # where the client commands look without SLURM_CONF
VANISHED_POLLS = 5  # polls a job may be unknown to both squeue and sacct before it is lost
STOP_POLL_S = 0.2
STOP_WAIT_S = 60.0  # beyond the grace: Slurm's KillWait, and a node slow to clean up
SQUEUE_FORMAT = "%i|%T|%r|%u|%k"  # id, state, reason, user, comment (last: it may hold a |)
ACCOUNTS_FIELD = "executor.confinement.accounts"

# Slurm job states (squeue %T / sacct State) that are over; every other one is still live
TERMINAL = frozenset(
    {
        "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
        "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT",
    }
)  # fmt: skip

# states in which the job waits in Slurm's queue and holds nothing yet
QUEUED = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"})

WHY = {
    "CANCELLED": "cancelled in Slurm",
    "TIMEOUT": "TIMEOUT: it ran past its Slurm time limit",
    "NODE_FAIL": "NODE_FAIL: a node of its allocation failed",
    "PREEMPTED": "PREEMPTED: Slurm preempted it for another job",
    "OUT_OF_MEMORY": "OUT_OF_MEMORY: it used more memory than it asked for",
    "BOOT_FAIL": "BOOT_FAIL: its node failed to boot",
    "DEADLINE": "DEADLINE: Slurm's deadline for it passed",
    "REVOKED": "REVOKED: a sibling cluster ran it",
}


class SlurmError(ExecutorError):
    """A Slurm client command failed or could not be run; the message has its stderr."""


@dataclass(frozen=True)
class SlurmJob:
    """One line of squeue (or sacct) about a job."""

    id: str
    state: str  # JOB_STATE, e.g. RUNNING; sacct's "CANCELLED by 0" is split into `by`
    reason: str = ""
    comment: str = ""
    user: str = ""  # who it runs as (squeue %u)
    exit_code: str = ""  # "code:signal", from scontrol / sacct
    by: str = ""  # the uid that cancelled it (sacct)

    @property
    def live(self) -> bool:
        return self.state not in TERMINAL


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: str
    stderr: str

    @property
    def error(self) -> str:
        text = (self.stderr or self.stdout).strip()
        return text.splitlines()[-1] if text else f"exit status {self.returncode}"


class SlurmCommands:
    """Runs the Slurm client commands (from ``bin_dir`` or PATH, with ``SLURM_CONF``)."""

    def __init__(self, *, bin_dir: str | None = None, conf: str | None = None) -> None:
        self.bin_dir = bin_dir
        self.conf = conf

    @classmethod
    def from_settings(cls, settings: SlurmSettings) -> SlurmCommands:
        return cls(bin_dir=settings.bin_dir, conf=settings.conf)

    def path(self, name: str) -> str | None:
        if self.bin_dir:
            return shutil.which(name, path=self.bin_dir)
        return shutil.which(name)

    def missing(self, names: Sequence[str] = COMMANDS) -> list[str]:
        return [name for name in names if self.path(name) is None]

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        if self.conf:
            env["SLURM_CONF"] = self.conf
        return env

    async def run(
        self,
        name: str,
        *args: str,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> Completed:
        """Run one command (in ``env`` plus SLURM_CONF, default os.environ); SlurmError when it
        cannot be run or takes too long (not on rc)."""
        program = self.path(name)
        if program is None:
            raise SlurmError(f"{name} not found" + (f" in {self.bin_dir}" if self.bin_dir else ""))
        try:
            proc = await asyncio.create_subprocess_exec(
                program,
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self.env(env),
                cwd=cwd,
            )
        except OSError as exc:
            raise SlurmError(f"cannot run {name}: {exc.strerror or exc}") from exc
        try:
            out, err = await asyncio.wait_for(proc.communicate(), COMMAND_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise SlurmError(f"{name} did not answer within {COMMAND_TIMEOUT_S:.0f}s") from None
        code = proc.returncode if proc.returncode is not None else -1
        return Completed(code, out.decode(errors="replace"), err.decode(errors="replace"))


def comment_of(site: str, job: str, attempt: int, fence: int) -> str:
    return f"cpn:{site}:{job}:{attempt}:{fence}"


def parse_comment(comment: str) -> tuple[str, RunKey] | None:
    """``cpn:<site>:<job>:<attempt>:<fence>`` -> (site, (job, attempt, fence)); else None."""
    parts = comment.split(":")
    if len(parts) != 5 or parts[0] != "cpn" or not parts[3].isdigit() or not parts[4].isdigit():
        return None
    return parts[1], (parts[2], int(parts[3]), int(parts[4]))


def time_limit_min(assignment: Assignment, settings: SlurmSettings) -> int | None:
    """Minutes of ``--time``: the duration estimate times the margin, at least the floor."""
    if assignment.duration_s is None:
        return None
    minutes = math.ceil(assignment.duration_s * settings.time_margin / 60)
    return max(settings.min_time_limit_min, minutes)


def run_as(tenant: str, *, site: str, named: Mapping[str, Account], root: bool) -> Account:
    """The Unix user ``tenant``'s jobs are submitted as (pure); ExecutorError when there is none.

    Slurm runs a job as a user its nodes know (a passwd entry), so only the named accounts of
    ``executor.confinement.accounts.tenants`` serve (a uid from ``uid_range`` has no entry), and
    only root may submit for another user (sbatch ``--uid``).
    """
    if not root:
        raise ExecutorError(
            f"refusing jobs at Slurm site {site}: the agent is not root, and only root may "
            "submit a job as a tenant's own user (sbatch --uid)"
        )
    account = named.get(tenant)
    if account is None:
        raise ExecutorError(
            f"tenant {tenant!r} has no Unix user at Slurm site {site}: name one in "
            f"{ACCOUNTS_FIELD}.tenants (a uid_range gives no user that Slurm's nodes know)"
        )
    return account


def job_files(cwd: Path, log_path: Path, user: Account) -> None:
    """The job dir (the agent's, 0711: passable, not listable), its work dir ``cwd`` (the user's,
    0700) and the attempt's log (the user's, 0600: Slurm writes it as the user, the agent reads
    it as root). The user cannot replace either: the job dir is not theirs."""
    own_work_dir(cwd, user, root=True)  # only a root agent submits (run_as)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        os.fchown(fd, user.uid, user.gid)
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def unreachable_dir(path: Path, user: Account) -> Path | None:
    """The first directory on the way to ``path`` (itself included) that ``user`` may not pass,
    by its mode bits (ACLs are not read); None when the user reaches it."""
    groups = set(os.getgrouplist(user.name, user.gid))
    for directory in (*reversed(path.parents), path):
        st = directory.stat()
        if st.st_uid == user.uid:
            bit = stat.S_IXUSR
        elif st.st_gid in groups:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return directory
    return None


def sbatch_args(
    assignment: Assignment,
    *,
    site: str,
    settings: SlurmSettings,
    partition: str | None,
    log_path: Path,
    cwd: Path,
    user: Account,
) -> list[str]:
    """sbatch's options for ``assignment`` run as ``user`` (pure); ExecutorError for a tenant
    with no Slurm account.

    ``--export=NONE``: nothing of sbatch's environment reaches the job but SLURM_* (and sbatch
    runs with PATH and SLURM_CONF only); the batch script exports the job's variables.
    """
    a = assignment
    account = settings.account_for(a.tenant)
    if account is None:
        raise ExecutorError(
            f"tenant {a.tenant!r} has no Slurm account at site {site} "
            "(add it to executor.slurm.accounts, or set executor.slurm.default_account)"
        )
    args = [
        "--parsable",
        f"--job-name=cpn-{a.job}",
        f"--comment={comment_of(site, a.job, a.attempt, a.fence)}",
        f"--output={log_path}",
        "--open-mode=append",
        f"--chdir={cwd}",
        "--nodes=1",
        "--ntasks=1",
        f"--cpus-per-task={max(1, a.cpu)}",
        "--no-requeue",
        f"--account={account.account}",
        f"--uid={user.name}",
        f"--gid={user.gid}",
        "--export=NONE",
    ]
    if account.qos:
        args.append(f"--qos={account.qos}")
    if partition:
        args.append(f"--partition={partition}")
    if a.mem_gb > 0:
        args.append(f"--mem={math.ceil(a.mem_gb * 1024)}M")
    if a.gpus > 0:
        if a.model is None:
            raise ExecutorError(f"job {a.job} asks for {a.gpus} GPU(s) but names no model")
        args.append(gres(a.model, a.gpus, settings))
    minutes = time_limit_min(a, settings)
    if minutes is not None:
        args.append(f"--time={minutes}")
    return args


def gres(model: str, count: int, settings: SlurmSettings) -> str:
    """The --gres option for `count` devices of `model`. A slice (sites.model.catalog) without its
    own entry in `gres_types`: a time slice is Slurm's GPU sharing, ``shard`` (gres.conf
    Name=shard); a MIG instance the type ``<model>_<profile>`` in lower case, as an operator
    names it in gres.conf (map another name in gres_types)."""
    base, part = split_model(model)
    if part is not None and model not in settings.gres_types:
        if part.startswith("ts") and part[2:].isdigit():
            return f"--gres=shard:{count}"
        return f"--gres=gpu:{base.lower()}_{part}:{count}"
    return f"--gres=gpu:{settings.gres_type(model)}:{count}"


def batch_script(
    assignment: Assignment, *, site: str, base: Mapping[str, str] | None = None
) -> str:
    """The script sbatch runs: ``base`` (``sites.executors.confinement.allowed_env``), the job's
    env and
    cpn's variables, then exec of the command.

    Nothing else of the agent's reaches the job (sbatch ``--export=NONE``); SLURM_EXPORT_ENV=ALL
    lets the job's own srun steps inherit this environment (NONE would reach them too). Slurm
    picks the GPUs, so CPN_DEVICES names Slurm's indices, read at run time.
    """
    env = job_env(assignment, (), site=site, vendor=None, base=base or {})
    env.pop("CUDA_VISIBLE_DEVICES", None)  # Slurm sets it for the GPUs it gives the job
    env.pop("CPN_DEVICES", None)
    lines = [
        "#!/bin/sh",
        f"# cpn job {assignment.job} attempt {assignment.attempt} at site {site}"
        " (written by the cpn agent, sites/executors/slurm.py)",
    ]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted(env.items())]
    lines.append("export SLURM_EXPORT_ENV=ALL")
    if assignment.gpus and assignment.model:
        model = shlex.quote(assignment.model)
        lines.append(f'export CPN_DEVICES={model}:"${{SLURM_JOB_GPUS:-$CUDA_VISIBLE_DEVICES}}"')
    else:
        lines.append("export CPN_DEVICES=")
    lines.append("exec " + shlex.join(command_argv(assignment.command)))
    return "\n".join(lines) + "\n"


def slurm_exit(job: SlurmJob) -> RunExit:
    """A finished Slurm job as a RunExit: its code, and why when the state says more (pure)."""
    code, _, sig = job.exit_code.partition(":")
    exit_code = int(code) if code.isdigit() else None
    signal_no = int(sig) if sig.isdigit() else 0
    if job.state == "COMPLETED" and exit_code in (0, None):
        return RunExit(0)
    if job.state == "FAILED" or job.state == "COMPLETED":
        if signal_no:
            return RunExit(-signal_no)
        return RunExit(exit_code if exit_code is not None else None)
    why = WHY.get(job.state, f"{job.state} in Slurm")
    if job.state == "CANCELLED" and job.by:
        why += f" by uid {job.by}"
    if job.reason and job.reason not in ("None", "NonZeroExitCode"):
        why += f" ({job.reason})"
    code_out = -signal_no if signal_no else exit_code
    return RunExit(code_out if code_out != 0 else None, f"slurm job {job.id}: {why}")


USAGE_FIELDS = "JobID,State,ElapsedRaw,AllocTRES,ConsumedEnergyRaw"


def job_usage(text: str, slurm_id: str, *, models: Mapping[str, str]) -> dict[str, float] | None:
    """sacct's line of a finished job -> resource-seconds (pure); None unless it is finished.

    ``elapsed_s``; ``cpu_core_s``, ``mem_gb_s`` and ``gpu_s:<catalog model>`` are what was
    allocated times the elapsed time (Slurm charges the allocation, not the use); ``energy_j``
    is ConsumedEnergyRaw, only where the cluster measures energy (AcctGatherEnergyType).
    """
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) != 5 or parts[0] != slurm_id:
            continue
        if parts[1].split(" ")[0] not in TERMINAL or not parts[2].isdigit():
            return None
        elapsed = float(parts[2])
        usage = {"elapsed_s": elapsed}
        for item in parts[3].split(","):
            key, _, value = item.partition("=")
            if key == "cpu":
                usage["cpu_core_s"] = float(value) * elapsed
            elif key == "mem":
                usage["mem_gb_s"] = round(_mem_gb(value) * elapsed, 3)
            elif key.startswith("gres/gpu:"):
                kind = key.split(":", 1)[1].lower()
                model = models.get(kind, kind)
                usage[f"gpu_s:{model}"] = float(value) * elapsed
        energy = parts[4].strip()
        if energy.isdigit() and int(energy) > 0:
            usage["energy_j"] = float(energy)
        return usage
    return None


def _mem_gb(value: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)", value)
    if match is None:
        return 0.0
    scale = {"K": 1 / 1024**2, "M": 1 / 1024, "": 1 / 1024, "G": 1.0, "T": 1024.0}
    return float(match.group(1)) * scale[match.group(2)]


def _squeue_lines(text: str) -> dict[str, SlurmJob]:
    """squeue's lines in SQUEUE_FORMAT, by job id."""
    jobs = {}
    for line in text.splitlines():
        parts = line.split("|", 4)
        if len(parts) == 5:
            jobs[parts[0]] = SlurmJob(
                id=parts[0], state=parts[1], reason=parts[2], user=parts[3], comment=parts[4]
            )
    return jobs


def _sacct_job(text: str, slurm_id: str) -> SlurmJob | None:
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) >= 4 and parts[0] == slurm_id:
            state, _, by = parts[1].partition(" by ")
            return SlurmJob(
                id=slurm_id, state=state, exit_code=parts[2], reason=parts[3], by=by.strip()
            )
    return None


def _scontrol_fields(text: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S*)", text))


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
        """Why no Slurm controller answers here (the client commands installed, no cluster
        configured or slurmctld down), None when one does. A missing slurm.conf is told at
        once: the commands would retry reading it for a minute each."""
        conf = self.commands.env().get("SLURM_CONF") or DEFAULT_CONF
        if not Path(conf).is_file():
            return f"slurm executor: no Slurm configuration at {conf}"
        got = await self.commands.run("sinfo", "-h", "-o", "%R")
        if got.returncode == 0:
            return None
        return (
            f"slurm executor: no Slurm controller answers ({got.error.strip() or 'sinfo failed'})"
        )

    async def check(self, source: str) -> None:
        """ConfigError naming the field when the partition, an account or a QOS is unknown."""
        problems: list[Problem] = []
        if self.partition:
            got = await self.commands.run("scontrol", "show", "partition", "-o", self.partition)
            if got.returncode != 0:
                listing = await self.commands.run("sinfo", "-h", "-o", "%R")
                have = ", ".join(sorted(set(listing.stdout.split()))) or "none"
                problems.append(
                    Problem(
                        source,
                        "executor.partition",
                        f"Slurm has no partition {self.partition!r} (it has: {have})",
                    )
                )
        wanted = dict(self.settings.accounts)
        if self.settings.default_account is not None:
            wanted["*"] = self.settings.default_account
        if wanted and self.commands.path("sacctmgr") is not None:
            accounts = await self._names("account", "Account")
            qos = await self._names("qos", "Name")
            for tenant, mapping in sorted(wanted.items()):
                where = (
                    "executor.slurm.default_account"
                    if tenant == "*"
                    else f"executor.slurm.accounts.{tenant}"
                )
                if accounts is not None and mapping.account.lower() not in accounts:
                    problems.append(
                        Problem(
                            source,
                            f"{where}.account",
                            f"Slurm has no account {mapping.account!r} "
                            f"(it has: {', '.join(sorted(accounts)) or 'none'})",
                        )
                    )
                if qos is not None and mapping.qos and mapping.qos.lower() not in qos:
                    problems.append(
                        Problem(
                            source,
                            f"{where}.qos",
                            f"Slurm has no QOS {mapping.qos!r} "
                            f"(it has: {', '.join(sorted(qos)) or 'none'})",
                        )
                    )
        problems += await self._check_users(source)
        if problems:
            raise ConfigError(problems)
        self._limits = await self._task_limits()

    async def _check_users(self, source: str) -> list[Problem]:
        """Each named user must hold an association with its tenant's Slurm account, or sbatch
        refuses its jobs; tenants with an account and no user are told once, in the log."""
        unnamed = sorted(set(self.settings.accounts) - set(self.named))
        if unnamed and self._root:
            log.warning(
                "site %s: tenants with a Slurm account but no Unix user (%s.tenants), whose jobs "
                "are refused: %s", self.site, ACCOUNTS_FIELD, ", ".join(unnamed),
            )  # fmt: skip
        if not self.named or self.commands.path("sacctmgr") is None:
            return []
        got = await self.commands.run(
            "sacctmgr", "-n", "-P", "show", "association", "format=User,Account"
        )
        if got.returncode != 0:
            log.warning("site %s: cannot list Slurm associations: %s", self.site, got.error)
            return []
        pairs = {
            (user, account.lower())
            for user, _, account in (line.partition("|") for line in got.stdout.splitlines())
        }
        problems = []
        for tenant, user in sorted(self.named.items()):
            mapping = self.settings.account_for(tenant)
            if mapping is not None and (user.name, mapping.account.lower()) not in pairs:
                problems.append(
                    Problem(
                        source,
                        f"{ACCOUNTS_FIELD}.tenants.{tenant}",
                        f"Slurm user {user.name!r} has no association with account "
                        f"{mapping.account!r} (sacctmgr add user {user.name} "
                        f"account={mapping.account})",
                    )
                )
        return problems

    async def _task_limits(self) -> str | None:
        """What limits the cluster puts on a job, from its TaskPlugin (scontrol show config)."""
        got = await self.commands.run("scontrol", "show", "config")
        if got.returncode != 0:
            return None
        found = re.search(r"^TaskPlugin\s*=\s*(\S+)", got.stdout, re.MULTILINE)
        if found is None:
            return None
        plugin = found.group(1)
        if "task/cgroup" in plugin:
            return f"limits by Slurm's {plugin} (CPUs, memory, devices)"
        return f"no limits on the nodes (TaskPlugin={plugin})"

    async def _names(self, entity: str, column: str) -> set[str] | None:
        """Names sacctmgr lists (lower case); None when accounting cannot be asked."""
        got = await self.commands.run("sacctmgr", "-n", "-P", "show", entity, f"format={column}")
        if got.returncode != 0:
            log.warning("site %s: cannot list Slurm %s: %s", self.site, entity, got.error)
            return None
        return {line.strip().lower() for line in got.stdout.splitlines() if line.strip()}

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
            script.write_text(
                batch_script(
                    a,
                    site=self.site,
                    base=allowed_env(user, home=cwd, path=self._path, lang="C.UTF-8"),
                )
            )
            script.chmod(0o700)  # sbatch reads it as root and hands Slurm a copy
            blocked = unreachable_dir(cwd, user)
        except OSError as exc:
            raise ExecutorError(
                f"cannot make the files of job {a.job} in {jdir}: {exc.strerror or exc}"
            ) from exc
        if blocked is not None:
            raise ExecutorError(
                f"user {user.name} cannot reach {blocked} (mode {blocked.stat().st_mode & 0o777:o}"
                "): a Slurm site's work_dir must be passable by its tenants' users"
            )
        # sbatch's own environment: PATH and SLURM_CONF, nothing else of the agent's (no
        # SBATCH_* either); run from the job dir, the job's SLURM_SUBMIT_DIR
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "SLURM_CONF")}
        got = await self.commands.run("sbatch", *args, str(script), env=env, cwd=jdir)
        if got.returncode != 0:
            raise ExecutorError(f"sbatch refused job {a.job}: {got.error}")
        slurm_id = got.stdout.strip().split(";")[0]
        if not slurm_id.isdigit():
            raise ExecutorError(f"sbatch gave no job id for {a.job}: {got.stdout.strip()!r}")
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
                    self._snapshot = _squeue_lines(got.stdout)
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
        return _squeue_lines(got.stdout).get(slurm_id) if got.returncode == 0 else None

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
            fields = _scontrol_fields(got.stdout)
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
            accounted = _sacct_job(got.stdout, slurm_id) if got.returncode == 0 else None
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
        return _squeue_lines(got.stdout)

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
