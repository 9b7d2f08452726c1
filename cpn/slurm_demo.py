"""`cpn up --slurm`: the demo federation plus one site, ``slurm-lab``, on a local Slurm.

``slurm_demo(config_dir, run_dir)`` starts a single-machine Slurm (sites.emulation.slurm_cluster:
munged,
MariaDB, slurmdbd, slurmctld, slurmd on their own ports, 4 placeholder H100s as GRES), writes a
copy of the config directory with the site's file added, and yields that copy for `cpn up` to
run; on exit it stops the daemons. A job file to watch it with is written beside it.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from cpn.launcher import Launcher, LaunchSettings
from cpn.state import state_dir
from sites.emulation.slurm_cluster import LocalSlurm, SlurmStartError, missing
from sites.model.errors import ConfigError, Problem

SITE = "slurm-lab"
REGION = "slurm-lab"
ACCOUNT = "cpn"


FIRST_UID = 390_001  # the demo's tenant users: outside the default uid_range of local sites


def site_doc(
    cluster: LocalSlurm, work_dir: Path, users: dict[str, str] | None = None
) -> dict[str, Any]:
    """The demo site's file: its capacity comes from Slurm; the inventory is what it declares;
    each tenant's jobs run as its user (``users``: tenant -> Unix user)."""
    return {
        "id": SITE,
        "region": REGION,
        "country": "CN",
        "provider": "on-prem",
        "coordinates": {"lat": 31.23, "lon": 121.47},
        "labels": {"scheduler": "slurm"},
        "inventory": {
            "devices": [{"model": "H100", "count": 4}],
            "cpu_cores": cluster.cpus,
            "mem_gb": cluster.mem_mb // 1024,
            "storage_tb": 1,
        },
        "prices": {
            "usd_per_gpu_hour": {"H100": 2.0},
            "usd_per_core_hour": 0.01,
            "usd_per_gb_mem_hour": 0.001,
            "usd_per_gb_egress": 0.05,
        },
        "power": {"pue": 1.3, "usd_per_kwh": 0.1, "grid_kgco2_per_kwh": 0.5, "assumed": True},
        "executor": {
            "kind": "slurm",
            "partition": cluster.partition,
            "work_dir": str(work_dir),
            "slurm": {
                "default_account": {"account": ACCOUNT},
                "gres_types": {"H100": "h100"},
                "poll_s": 1.0,
                "conf": str(cluster.conf),
            },
            "confinement": {"accounts": {"tenants": dict(users or {})}},
        },
    }


@contextmanager
def tenant_users(cluster: LocalSlurm, tenants: list[str]) -> Iterator[dict[str, str]]:
    """A Unix user per demo tenant (``cpnlab-<tenant>``, no home, no shell), associated with
    the demo's Slurm account, for the run of the demo; removed afterwards (docs/slurm.md)."""
    made: list[str] = []
    users: dict[str, str] = {}
    try:
        uid = FIRST_UID
        for tenant in tenants:
            name = f"cpnlab-{tenant}"[:32]
            try:
                pwd.getpwnam(name)  # left by an interrupted demo: ours by its name
                subprocess.run(["userdel", name], check=True, capture_output=True)
            except KeyError:
                pass
            while _taken(uid):
                uid += 1
            made_user = subprocess.run(
                ["useradd", "--no-create-home", "--user-group", "--uid", str(uid),
                 "--shell", "/usr/sbin/nologin", name],
                check=False, capture_output=True, text=True,
            )  # fmt: skip
            if made_user.returncode != 0:
                why = made_user.stderr.strip() or f"exit {made_user.returncode}"
                raise ConfigError([Problem("--slurm", "", f"cannot add user {name}: {why}")])
            uid += 1
            made.append(name)
            cluster.associate(name)
            users[tenant] = name
        yield users
    finally:
        for name in made:
            cluster.run("scancel", "--user", name, check=False)
            cluster.dissociate(name)
            subprocess.run(["userdel", name], check=False, capture_output=True)


def _taken(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        try:
            grp.getgrgid(uid)
        except KeyError:
            return False
    return True


def demo_tenants(config_dir: Path) -> list[str]:
    """The tenants of the demo's tenancy file, ai-lab (the example job's) first."""
    path = config_dir / "tenants.yaml"
    doc = yaml.safe_load(path.read_text()) if path.exists() else {}
    names = sorted((doc or {}).get("tenants") or {})
    return ["ai-lab", *(n for n in names if n != "ai-lab")]


JOB = {
    "name": "hello-slurm",
    "tenant": "ai-lab",
    "gpu": {"model": "H100", "count": 1},
    "cpu": 1,
    "mem_gb": 1,
    "duration_hours": 0.1,
    "allowed_regions": [REGION],
    "command": ["sh", "-c", "echo on $CPN_SITE as slurm job $SLURM_JOB_ID; sleep 20; echo done"],
}


@contextmanager
def slurm_demo(config_dir: Path, run_dir: Path) -> Iterator[Path]:
    """A local Slurm and a config dir that adds the site on it; stopped on exit."""
    absent = missing()
    if absent:
        raise ConfigError(
            [Problem("--slurm", "", f"Slurm is not installed ({', '.join(absent)}); "
                     "run: sudo .ci/install-slurm")]
        )  # fmt: skip
    if os.geteuid() != 0:
        raise ConfigError([Problem("--slurm", "", "a local slurmd must run as root")])
    run_dir.mkdir(parents=True, exist_ok=True)
    cluster = LocalSlurm(root=run_dir / "slurm", cluster="cpnlab", accounts=(ACCOUNT,))
    stack = ExitStack()
    try:
        cluster.start()
    except SlurmStartError as exc:
        raise ConfigError([Problem("--slurm", "", str(exc).splitlines()[0])]) from exc
    # the jobs' dir: their users must pass through its parents (the state dir may be 0700)
    work = Path(tempfile.mkdtemp(prefix="cpn-slurm-lab-", dir="/var/tmp"))
    work.chmod(0o711)
    try:
        users = stack.enter_context(tenant_users(cluster, demo_tenants(config_dir)))
        cfg = run_dir / "configs"
        shutil.rmtree(cfg, ignore_errors=True)
        shutil.copytree(config_dir, cfg)
        doc = site_doc(cluster, work, users)
        (cfg / "sites" / f"{SITE}.yaml").write_text(
            "# cpn up --slurm: a site on the local Slurm (docs/slurm.md)\n"
            + yaml.safe_dump(doc, sort_keys=False)
        )
        job = run_dir / "hello-slurm.yaml"
        job.write_text(yaml.safe_dump(JOB, sort_keys=False))
        print(
            f"cpn up --slurm: site {SITE} runs on a local Slurm (SLURM_CONF={cluster.conf});\n"
            f"  watch a job go through it: cpn submit {job}; squeue; cpn logs <job>",
            flush=True,
        )
        yield cfg
    finally:
        stack.close()
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)


def run_with_slurm(settings: LaunchSettings) -> int:
    """`cpn up --slurm`: the launcher on a config dir that adds slurm-lab, on a local Slurm."""
    with slurm_demo(settings.config_dir, state_dir() / "slurm-demo") as cfg:
        only = (*settings.only, SITE) if settings.only else ()
        return Launcher(replace(settings, config_dir=cfg, only=only)).run()
