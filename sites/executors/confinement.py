"""How a site confines each run of a tenant's job: identity, environment, sandbox and limits.

Decided once, at agent start (``Confiner.check``), from the site file's
``executor.confinement`` and what this host can do; the agent logs it in one line, publishes it
in the site's status (``cpn sites``) and each run's report carries it (the job's events):

- identity (sites.executors.accounts): a root agent runs each tenant as its own unprivileged
account;
- environment: an allow-list (PATH, LANG, HOME = the work dir, TMPDIR, USER), the job's own
  ``env`` and cpn's variables; nothing of the agent's;
- sandbox (sites.executors.sandbox): bubblewrap; where none can be made, ``when_unavailable``
chooses
  between refusing runs and running them unsandboxed as the tenant's account (root only);
- limits (sites.executors.cgroups): CPU, memory, processes and devices of the run's assignment.

Long form: docs/security.md.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sites.executors.accounts import Account, TenantAccounts
from sites.executors.cgroups import CgroupError, Cgroups, Limits, RunGroup
from sites.executors.sandbox import SandboxPlan, bwrap_argv, code_roots, find_bwrap
from sites.model.assignments import Assignment
from sites.model.errors import SitesError
from sites.model.spec import Confinement, NetworkPolicy, SandboxKind, WhenUnavailable

log = logging.getLogger(__name__)

__all__ = ["ConfinedRun", "Confiner", "Refused", "allowed_env", "device_nodes", "own_work_dir"]

GB = 1024**3
PROBE_TIMEOUT_S = 10.0

# the agent's own secrets, by the variables that name them (files or directories)
SECRET_ENV = ("CPN_STATE_DIR", "CPN_PKI_DIR", "CPN_CONFIG", "CPN_ETCD_CREDENTIALS",
              "CPN_ETCD_CA", "CPN_ETCD_CERT",
              "CPN_ETCD_KEY", "CPN_SITE_KEYS", "ETCD_DATA_DIR", "XDG_STATE_HOME",
              "XDG_CONFIG_HOME", "HOME")  # fmt: skip

# the device nodes of a vendor's accelerators: per device ({i}: its index), and shared ones
DEVICE_NODES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "nvidia": (("nvidia{i}",), ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")),
    "amd": (("dri/renderD{r}",), ("kfd",)),
    "intel": (("dri/renderD{r}",), ()),
    "huawei": (("davinci{i}",), ("davinci_manager", "devmm_svm", "hisi_hdc")),
}


class Refused(SitesError):
    """This site refuses runs: no sandbox can be made (``when_unavailable: refuse``)."""


@dataclass(frozen=True)
class ConfinedRun:
    """How to start one run: the sandbox's argv (or the bare command), and what it holds."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path
    account: Account
    group: RunGroup | None
    setuid: bool  # the launcher becomes the account itself (unsandboxed, root agent)
    summary: str  # for the job's events: "bwrap sandbox as uid 400123, limits: ..."
    egress: bool  # the launcher's caller sets up user-mode networking before it runs
    sandboxed: bool
    limits_text: str


def device_nodes(
    vendor: str | None, indices: Sequence[int], dev_root: Path
) -> tuple[tuple[str, str], ...]:
    """(host node, path in the sandbox) of the accelerators ``indices`` and their shared nodes.

    An NVIDIA device's index is taken as its minor number (/dev/nvidia<i>), as NVML numbers
    them on a host whose devices all belong to the agent."""
    if vendor not in DEVICE_NODES or not indices:
        return ()
    per_device, shared = DEVICE_NODES[vendor]
    names = [p.format(i=i, r=128 + i) for i in indices for p in per_device]
    names += list(shared)
    found = []
    for name in names:
        src = dev_root / name
        if src.exists():
            found.append((str(src), f"/dev/{name}"))
    if vendor == "nvidia" and (dev_root / "nvidia-caps").is_dir():  # MIG instances' capabilities
        found.append((str(dev_root / "nvidia-caps"), "/dev/nvidia-caps"))
    return tuple(found)


class Confiner:
    """The site's confinement of runs; ``check()`` once before the first run."""

    def __init__(
        self,
        settings: Confinement,
        *,
        site: str,
        work_dir: Path,
        hide: Sequence[str] = (),
        dev_root: Path = Path("/dev"),
        field: str = "",
    ) -> None:
        self.settings = settings
        self.site = site
        self.work_dir = work_dir
        self.dev_root = dev_root
        self.root = os.geteuid() == 0
        self.accounts = TenantAccounts(
            settings.accounts, ids_path=work_dir.parent / "tenant-ids.json",
            field=field or f"site {site}:executor.confinement.accounts",
        )  # fmt: skip
        self.hide = tuple(sorted({*hide, *settings.hide, *_agent_secrets(work_dir)}))
        self.ro_paths = (*code_roots(), *settings.ro_paths)
        # a run's PATH: the site's, then the agent's Python (read-only in the sandbox, so a
        # replica may start one of cpn's stand-ins as `python -m ...`)
        python_bin = str(Path(sys.prefix) / "bin")
        parts = settings.path.split(":")
        self.path = ":".join(parts if python_bin in parts else [*parts, python_bin])
        self.bwrap: str | None = None
        self.cgroups: Cgroups | None = None
        self.refusal: str | None = None
        self.sandbox_note = ""
        self.limits_note = ""
        self.checked = False

    # -- at start ----------------------------------------------------------------------------

    def check(self) -> str:
        """Decide what this host allows; returns the one line the agent logs."""
        self.checked = True
        s = self.settings
        unwritable = self._work_dir_unwritable()
        if unwritable is not None:
            self.refusal = unwritable
            return self.summary
        if s.sandbox is not SandboxKind.none:
            why = self._probe_bwrap()
            if why is None:
                self.sandbox_note = "bwrap sandbox"
            elif s.sandbox is SandboxKind.bwrap or s.when_unavailable is WhenUnavailable.refuse:
                self.refusal = f"no sandbox can be made here ({why}); this site refuses jobs"
            elif not self.root:
                self.refusal = (
                    f"no sandbox can be made here ({why}) and the agent is not root: jobs would "
                    "run as the agent; this site refuses jobs"
                )
            else:
                self.sandbox_note = f"NO sandbox ({why})"
        elif not self.root:
            self.refusal = "sandbox: none, and the agent is not root; this site refuses jobs"
        else:
            self.sandbox_note = "NO sandbox (sandbox: none)"
        if s.network is NetworkPolicy.egress and not self.refusal:
            if self.bwrap is None:
                self.refusal = "network: egress needs the sandbox; this site refuses jobs"
            elif shutil.which("slirp4netns") is None:
                self.refusal = "network: egress needs slirp4netns (not found); refusing jobs"
        if s.limits:
            try:
                cgroups = Cgroups.detect(self.site, scope=work_dir_scope(self.work_dir))
                cgroups.check()
                self.cgroups = cgroups
                self.limits_note = f"cgroup v{cgroups.version} limits"
            except (CgroupError, OSError) as exc:
                self.limits_note = f"NO limits ({exc})"
        else:
            self.limits_note = "NO limits (limits: false)"
        return self.summary

    def _work_dir_unwritable(self) -> str | None:
        """Why no run could be given a directory here (the work dir not creatable or not
        writable: a full or read-only disk, a wrong owner), None when one can."""
        jobs = self.work_dir / "jobs"
        probe = jobs / f".probe-{os.getpid()}"
        try:
            jobs.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            why = exc.strerror or str(exc)
            return f"work dir {self.work_dir} is not writable ({why}); this site refuses jobs"
        return None

    def _probe_bwrap(self) -> str | None:
        bwrap = find_bwrap()
        if bwrap is None:
            return "bwrap not found; install the bubblewrap package"
        with tempfile.TemporaryDirectory(prefix="cpn-probe-") as tmp:
            uid = 65534 if self.root else None
            if self.root:
                os.chown(tmp, 65534, 65534)
            plan = SandboxPlan(work=Path(tmp), uid=uid, gid=uid, network=self.settings.network)
            try:
                done = subprocess.run(
                    bwrap_argv(bwrap, plan, ["/bin/true"]), capture_output=True,
                    timeout=PROBE_TIMEOUT_S, check=False, env={"PATH": self.path},
                )  # fmt: skip
            except (OSError, subprocess.TimeoutExpired) as exc:
                return f"bwrap: {exc}"
        if done.returncode != 0:
            err = done.stderr.decode(errors="replace").strip().splitlines()
            return f"bwrap: {err[-1] if err else f'exit {done.returncode}'}"
        self.bwrap = bwrap
        return None

    @property
    def summary(self) -> str:
        if self.refusal:
            return f"refusing jobs: {self.refusal}"
        who = "tenant accounts" if self.root else "the agent's uid, sandboxed"
        return f"{self.sandbox_note}, {who}, {self.limits_note}, network {self.settings.network}"

    # -- per run -----------------------------------------------------------------------------

    def prepare(
        self,
        assignment: Assignment,
        devices: Sequence[int],
        *,
        vendor: str | None,
        job_vars: Mapping[str, str],
        argv: Sequence[str],
        cwd: Path,
    ) -> ConfinedRun:
        """Make the run's work dir and cgroup and say how to start it; Refused/AccountError/
        CgroupError when it cannot be (nothing is left behind)."""
        if self.refusal:
            raise Refused(self.refusal)
        account = self.accounts.for_tenant(assignment.tenant)  # AccountError: none here
        own_work_dir(cwd, account, root=self.root)
        mounts = input_mounts(assignment, cwd)
        if self.bwrap is None:
            link_inputs(mounts, cwd)
        env = allowed_env(account, home=cwd, path=self.path,
                          lang=os.environ.get("LANG", "C.UTF-8"))  # fmt: skip
        env["TMPDIR"] = "/tmp" if self.bwrap else str(cwd)
        env.update(job_vars)
        nodes = device_nodes(vendor, devices, self.dev_root)
        group = None
        limits_text = "no limits"
        if self.cgroups is not None:
            mem_gb = assignment.mem_gb or self.settings.min_mem_gb
            limits = Limits(
                cpu=float(assignment.cpu) if assignment.cpu else 0.0,
                mem_bytes=int(mem_gb * GB),
                pids_max=self.settings.pids_max,
                devices=tuple(src for src, _ in nodes),
            )
            group = self.cgroups.create(f"{assignment.job}.{assignment.attempt}", limits)
            cpu_text = f"{assignment.cpu} cpu" if assignment.cpu else "no cpu cap"
            limits_text = f"limits {cpu_text}, {mem_gb:g} GB, {self.settings.pids_max} pids"
        # a replica must be reachable by the gateway: it keeps the host's network (security.md)
        network = NetworkPolicy.full if assignment.serve is not None else self.settings.network
        egress = network is NetworkPolicy.egress
        if self.bwrap is not None:
            plan = SandboxPlan(
                work=cwd,
                uid=account.uid if self.root else None,
                gid=account.gid if self.root else None,
                ro_paths=self.ro_paths,
                rw_paths=self.settings.rw_paths,
                hide=self.hide,
                devices=nodes,
                network=network.value,
                hostname=self.site,
                mounts=mounts,
            )
            run_argv = bwrap_argv(self.bwrap, plan, argv)
            how = "bwrap sandbox"
        else:
            run_argv = list(argv)
            how = "unsandboxed"
        summary = f"{how} as uid {account.uid}, {limits_text}, network {network}"
        return ConfinedRun(
            argv=run_argv,
            env=env,
            cwd=cwd,
            account=account,
            group=group,
            setuid=self.bwrap is None and self.root,
            summary=summary,
            egress=egress and self.bwrap is not None,
            sandboxed=self.bwrap is not None,
            limits_text=limits_text,
        )


def allowed_env(account: Account, *, home: Path, path: str, lang: str) -> dict[str, str]:
    """The allow-list a run's environment starts from (every executor's): the job's own env and
    cpn's variables follow; nothing of the agent's."""
    return {"PATH": path, "LANG": lang, "HOME": str(home), "USER": account.name,
            "LOGNAME": account.name}  # fmt: skip


def own_work_dir(cwd: Path, account: Account, *, root: bool) -> None:
    """The run's work dir: the tenant's, mode 0700; its job dir (logs, run.json) the agent's.
    What the agent put there (a restored checkpoint: sites.agent.data) becomes the tenant's."""
    cwd.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(cwd.parent, 0o711)  # others may pass through to their own dir, not list it
    cwd.mkdir(exist_ok=True)
    if root:
        st = cwd.stat()
        if (st.st_uid, st.st_gid) != (account.uid, account.gid):
            os.chown(cwd, account.uid, account.gid)
        me = os.geteuid()
        for path in cwd.rglob("*"):
            st = path.lstat()
            if st.st_uid == me and me != account.uid:
                os.lchown(path, account.uid, account.gid)
    os.chmod(cwd, 0o700)


def input_mounts(assignment: Assignment, cwd: Path) -> tuple[tuple[str, str], ...]:
    """(staged tree, where the job sees it) per staged input: an absolute path as it is, a
    relative one under the work dir."""
    out = []
    for item in assignment.inputs:
        if item.local is None:
            raise Refused(f"input {item.dataset} was not staged")
        dst = item.path if item.path.startswith("/") else str(cwd / item.path)
        out.append((item.local, dst))
    return tuple(out)


def link_inputs(mounts: Sequence[tuple[str, str]], cwd: Path) -> None:
    """Without a sandbox: each input as a symlink at its path under the work dir (its tree is
    read-only); an absolute path needs the sandbox (Refused)."""
    for src, dst in mounts:
        target = Path(dst)
        if not target.is_relative_to(cwd):
            raise Refused(f"an input at {dst} needs the sandbox here: give it a relative path")
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            if target.is_symlink() or target.is_file():
                target.unlink()
            else:
                raise Refused(f"{dst} exists in the work dir: an input cannot be placed there")
        target.symlink_to(src, target_is_directory=True)


def _agent_secrets(work_dir: Path) -> list[str]:
    """What a run must never see of the agent's: its state (the work dir's parent holds every
    site's runs), the files its variables name, the CLI's config."""
    found = [str(work_dir), str(work_dir.parent)]
    for name in SECRET_ENV:
        value = os.environ.get(name)
        if value and os.path.isabs(value):
            found.append(value)
    # the files the agent was started with (its site file, its etcd credentials: the client
    # key is inline there), by path
    for arg in sys.argv[1:]:
        value = arg.partition("=")[2] if arg.startswith("--") else arg
        if os.path.isabs(value) and os.path.isfile(value):
            found.append(value)
    home = Path.home()
    found += [str(home / ".config" / "cpn"), str(home / ".local" / "state" / "cpn")]
    return found


def work_dir_scope(work_dir: Path) -> str:
    """8 hex digits naming an agent's work dir, the scope of its runs' cgroups."""
    return hashlib.sha256(str(work_dir.resolve()).encode()).hexdigest()[:8]
