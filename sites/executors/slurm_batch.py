"""What the Slurm executor submits (pure, but for `job_files` and `unreachable_dir`, which make
and check the job's files): sbatch's options for an assignment, the batch script, the GRES of
its devices, its time limit, the comment a restarted agent finds its jobs by, and the Unix user
it runs as. docs/slurm.md has the long form.
"""

from __future__ import annotations

import math
import os
import shlex
import stat
from collections.abc import Mapping
from pathlib import Path

from sites.executors.accounts import Account
from sites.executors.base import ExecutorError, RunKey, command_argv, job_env
from sites.executors.confinement import own_work_dir
from sites.model.assignments import Assignment
from sites.model.catalog import split_model
from sites.model.spec import SlurmSettings

ACCOUNTS_FIELD = "executor.confinement.accounts"


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
