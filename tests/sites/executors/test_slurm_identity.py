"""Who a job at a Slurm site runs as, what it sees of the agent, and how Slurm confines it,
attacked from the job's side: real Slurm (tests/sites/conftest.py), real agent and broker, the
tenants' real Unix users (tests/sites/executors/test_slurm.py ``tenant_users``).
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from sites.emulation.slurm_cluster import LocalSlurm
from tests.broker.conftest import Federation
from tests.conftest import run_cpn
from tests.sites.executors.test_slurm import (  # noqa: F401 - the fixtures
    SITE,
    TENANT_USERS,
    site_work,
    slurm_federation,
    slurm_tenants,
    tenant_users,
    wait_for_state,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

# what the job prints: its identity, then its whole environment, each line marked
WHOAMI = (
    "echo uid=$(id -u) gid=$(id -g) user=$(id -un); pwd | sed 's/^/cwd=/'; env | sed 's/^/env:/'"
)
# a job over its --mem: first where Slurm put it (its memory cgroup, and the limit of its job's)
HOG = (
    "cg=$(awk -F: '$2 == \"memory\" {print $3}' /proc/self/cgroup); echo cgroup=$cg; "
    "echo limit=$(cat /sys/fs/cgroup/memory${cg%%/step_*}/memory.limit_in_bytes); "
    "python3 -c 'b = bytearray(512 << 20); print(\"allocated\", len(b))'"
)


def log_of(fed: Federation, job: str) -> str:
    got = run_cpn("logs", job, "--broker", fed.broker_url)
    assert got.returncode == 0, got.stderr
    return got.stdout


def test_a_slurm_job_runs_as_its_tenants_user_with_nothing_of_the_agents(
    slurm_federation: Callable[..., Federation],  # noqa: F811
    local_slurm: LocalSlurm,
    site_work: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    marker = f"cpn-secret-{secrets.token_hex(8)}"
    monkeypatch.setenv("CPN_SECRET_MARKER", marker)  # in the agent's environment
    monkeypatch.setenv("SBATCH_EXPORT", "ALL")  # sbatch would read it: the agent must not pass it
    fed = slurm_federation()
    user, uid = TENANT_USERS["acme"]
    gid = pwd.getpwnam(user).pw_gid
    whoami = fed.submit(name="whoami", tenant="acme", cpu=1, mem_gb=0.25, max_retries=0,
                        env={"MINE": "kept"}, command=["sh", "-c", WHOAMI])  # fmt: skip
    # gamma has a Slurm account (the default) but no Unix user: refused, never run as root
    nobody = fed.submit(name="nobody", tenant="gamma", cpu=1, mem_gb=0.25, max_retries=0,
                        command=["id"])  # fmt: skip
    done = fed.wait_state(whoami["id"], "SUCCEEDED", "FAILED", timeout=60)
    assert done["state"] == "SUCCEEDED", done["events"]
    out = log_of(fed, whoami["id"])
    assert f"uid={uid} gid={gid} user={user}" in out, out  # not 0, not the agent's
    assert uid not in (0, os.getuid())
    env = dict(
        line.removeprefix("env:").split("=", 1)
        for line in out.splitlines()
        if line.startswith("env:") and "=" in line
    )
    assert marker not in out  # no variable of the agent's, under any name
    leaked = {"CPN_SECRET_MARKER", "CPN_STATE_DIR", "CPN_ETCD", "SBATCH_EXPORT"} & set(env)
    assert not leaked, env
    job_dir = site_work / "jobs" / whoami["id"]
    assert env["HOME"] == str(job_dir / "work") and env["USER"] == user, env  # not root's
    assert env["MINE"] == "kept" and env["CPN_TENANT"] == "acme" and env["CPN_SITE"] == SITE
    assert env["SLURM_JOB_USER"] == user and env["SLURM_JOB_ACCOUNT"] == "acme"
    assert f"cwd={job_dir / 'work'}" in out and env["SLURM_SUBMIT_DIR"] == str(job_dir)
    # its files: the work dir and the log are the user's alone, the job dir the agent's
    work = (job_dir / "work").stat()
    assert (work.st_uid, stat.S_IMODE(work.st_mode)) == (uid, 0o700)
    log = (job_dir / "attempt-1.log").stat()
    assert (log.st_uid, stat.S_IMODE(log.st_mode)) == (uid, 0o600)
    assert (job_dir.stat().st_uid, stat.S_IMODE(job_dir.stat().st_mode)) == (0, 0o711)
    refused = fed.wait_state(nobody["id"], "FAILED", timeout=30)
    messages = " ".join(e.get("message") or "" for e in refused["events"])
    assert (
        f"tenant 'gamma' has no Unix user at Slurm site {SITE}: name one in "
        "executor.confinement.accounts.tenants"
    ) in messages, refused["events"]
    assert not any(r["JobName"] == f"cpn-{nobody['id']}" for r in sacct_all(local_slurm))
    # how: on the job's events, and the site's one line (cpn sites)
    running = next(e for e in done["events"] if e["type"] == "running")
    assert f"(slurm job as {user} (uid {uid}), account acme)" in running["message"]
    (site,) = json.loads(fed.get("/v1/sites")[1])["items"]
    assert site["confinement"].startswith("slurm as the tenants' own users (2 named"), site
    cgroups = local_slurm.task_plugin == "task/cgroup"
    limits = "limits by Slurm's task/cgroup" if cgroups else "no limits on the nodes"
    assert limits in site["confinement"], site


def test_slurm_confines_a_job_to_its_memory_with_cgroups(
    slurm_federation: Callable[..., Federation],  # noqa: F811
    local_slurm: LocalSlurm,
) -> None:
    if local_slurm.task_plugin != "task/cgroup":
        pytest.skip(f"slurmd cannot use task/cgroup here: {local_slurm.cgroup_error}")
    fed = slurm_federation()
    _, uid = TENANT_USERS["beta"]
    hog = fed.submit(name="hog", tenant="beta", cpu=1, mem_gb=0.125, max_retries=0,
                     command=["sh", "-c", HOG])  # fmt: skip
    failed = fed.wait_state(hog["id"], "FAILED", "SUCCEEDED", timeout=60)
    assert failed["state"] == "FAILED", failed["events"]
    slurm_id = wait_for_state(local_slurm, hog["id"], "OUT_OF_MEMORY")["JobID"]
    why = failed["events"][-1]["message"]
    assert "OUT_OF_MEMORY: it used more memory than it asked for" in why, failed["events"]
    out = log_of(fed, hog["id"])
    # the job's own memory cgroup, made by Slurm's task/cgroup, limited to its --mem (128M)
    assert f"/uid_{uid}/job_{slurm_id}/" in out, out
    assert f"limit={128 << 20}" in out, out
    assert "allocated" not in out


def sacct_all(slurm: LocalSlurm) -> list[dict[str, str]]:
    out = slurm.run("sacct", "-n", "-P", "-X", "-a", "-o", "JobID,JobName,User").stdout
    return [dict(zip(("JobID", "JobName", "User"), line.split("|"), strict=True))
            for line in out.splitlines()]  # fmt: skip
