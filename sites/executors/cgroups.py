"""A cgroup per run: CPU, memory, process and device limits, and an OOM verdict.

One group per run, ``cpn-<site>-<scope>/<job>.<attempt>``, under the agent's own cgroup (the
scope names the agent's work dir: an agent restarted on the same work dir reaps what its
predecessor left, and never the runs of another agent of a site of the same name on the host,
as two test federations, or two federations' demos, would have): on cgroup v2
one directory in the unified tree, on v1 (and hybrid hosts, whose unified tree has no
controllers) one directory in each of the memory, cpu, pids and devices hierarchies. The run's
first process joins the groups itself before it becomes the job (sites.executors.local's launcher),
so nothing the job does escapes them. Limits:

- memory: the run's ``mem_gb`` (``memory.max`` / ``memory.limit_in_bytes``, and swap bounded
  as well where the kernel accounts it); a run over it is killed by the kernel's OOM killer,
  which the group's counters (``memory.events`` / ``memory.oom_control``: ``oom_kill``) show;
- cpu: ``cpu`` cores of CFS quota (``cpu.max`` / ``cpu.cfs_quota_us``);
- pids: ``pids.max``;
- devices (v1): only the standard pseudo-devices and the run's own accelerators (v2 has no
  devices file; the sandbox's /dev, which holds only those nodes, is the boundary there).

Exceptions: ``CgroupError`` when a group cannot be made (the run is not started).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from sites.model.errors import SitesError

log = logging.getLogger(__name__)

__all__ = ["CgroupError", "Cgroups", "Limits", "RunGroup"]

ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "cpu", "pids", "devices")
CFS_PERIOD_US = 100_000
# char devices every run may open: null, zero, full, random, urandom, tty, ptmx, pts
STANDARD_DEVICES = ("c 1:3 rwm", "c 1:5 rwm", "c 1:7 rwm", "c 1:8 rwm", "c 1:9 rwm",
                    "c 5:0 rwm", "c 5:2 rwm", "c 136:* rwm")  # fmt: skip


class CgroupError(SitesError):
    """A run's cgroup could not be made or limited."""


@dataclass(frozen=True)
class Limits:
    cpu: float  # cores; 0: no CPU limit
    mem_bytes: int  # 0: no memory limit
    pids_max: int
    devices: tuple[str, ...] = ()  # host paths of the device nodes the run may open


@dataclass
class RunGroup:
    """The directories of one run's group (one per v1 hierarchy, one on v2)."""

    version: int
    dirs: dict[str, Path] = field(default_factory=dict)  # controller ("" on v2) -> directory

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def _dir(self, controller: str) -> Path | None:
        return self.dirs.get("" if self.version == 2 else controller)

    def pids(self) -> list[int]:
        found: set[int] = set()
        for d in self.dirs.values():
            with contextlib.suppress(OSError, ValueError):
                found.update(int(x) for x in (d / "cgroup.procs").read_text().split())
        return sorted(found)

    def oom_kills(self) -> int:
        """How many processes the OOM killer took in this group."""
        d = self._dir("memory")
        if d is None:
            return 0
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            text = (d / name).read_text()
        except OSError:
            return 0
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def kill(self, sig: signal.Signals = signal.SIGKILL) -> int:
        """Signal every process of the group; how many were signalled."""
        n = 0
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
                n += 1
        return n

    def remove(self, timeout_s: float = 5.0) -> bool:
        """Kill what is left and remove the directories; False when one stays."""
        deadline = time.monotonic() + timeout_s
        while self.pids():
            self.kill()
            if time.monotonic() > deadline:
                log.error("cgroup %s: processes survive SIGKILL", self.dirs)
                return False
            time.sleep(0.01)
        ok = True
        for d in self.dirs.values():
            try:
                d.rmdir()
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.warning("cannot remove cgroup %s: %s", d, exc)
                ok = False
        return ok


class Cgroups:
    """The site's run groups under the agent's own cgroup (``parent`` per controller)."""

    def __init__(
        self, *, version: int, parents: dict[str, Path], site: str, scope: str = ""
    ) -> None:
        self.version = version
        self.parents = parents  # controller ("" on v2) -> the agent's group
        self.site = site
        self.dir_name = f"cpn-{site}-{scope}" if scope else f"cpn-{site}"

    @classmethod
    def detect(
        cls, site: str, root: Path = ROOT, proc_cgroup: Path | None = None, scope: str = ""
    ) -> Cgroups:
        """The host's layout; CgroupError when runs cannot be limited here (and why)."""
        lines = (proc_cgroup or Path("/proc/self/cgroup")).read_text().splitlines()
        paths: dict[str, str] = {}
        for line in lines:
            _, controllers, path = line.split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                paths[name] = path.lstrip("/")
        if (root / "cgroup.controllers").exists():  # pure v2: the unified tree at the root
            parent = root / paths.get("", "")
            enabled = (root / "cgroup.controllers").read_text().split()
            missing = [c for c in ("memory", "cpu", "pids") if c not in enabled]
            if missing:
                raise CgroupError(f"cgroup v2 without the {', '.join(missing)} controller(s)")
            return cls(version=2, parents={"": parent}, site=site, scope=scope)
        parents: dict[str, Path] = {}
        for name in V1_CONTROLLERS:
            mount = root / name
            if not (mount / "cgroup.procs").exists():
                if name == "memory":
                    raise CgroupError("no cgroup memory controller is mounted")
                continue
            parents[name] = mount / paths.get(name, "")
        return cls(version=1, parents=parents, site=site, scope=scope)

    def _site_dirs(self) -> dict[str, Path]:
        return {c: p / self.dir_name for c, p in self.parents.items()}

    def check(self) -> None:
        """Make the site's group in each hierarchy (v2: with its controllers on), or say why not."""
        for controller, d in self._site_dirs().items():
            try:
                d.mkdir(exist_ok=True)
                if self.version == 2:
                    _enable_v2(self.parents[controller], d)
                probe = d / f"probe-{os.getpid()}"  # that runs' groups can be made there too
                probe.mkdir(exist_ok=True)
                probe.rmdir()
            except OSError as exc:
                raise CgroupError(f"cannot make cgroup {d}: {exc.strerror or exc}") from exc

    def create(self, name: str, limits: Limits) -> RunGroup:
        """A new group for one run, limited; CgroupError (nothing left behind) when it fails."""
        group = RunGroup(version=self.version)
        try:
            for controller, site_dir in self._site_dirs().items():
                d = site_dir / name
                if d.exists():  # a leftover of a run of the same name: emptied and made anew
                    RunGroup(version=self.version, dirs={controller: d}).remove()
                d.mkdir(parents=True)
                group.dirs[controller] = d
                self._limit(controller, d, limits)
        except OSError as exc:
            group.remove()
            raise CgroupError(f"cannot limit run {name}: {exc.strerror or exc}") from exc
        return group

    def _limit(self, controller: str, d: Path, limits: Limits) -> None:
        if self.version == 2:
            if limits.mem_bytes:
                _write(d / "memory.max", str(limits.mem_bytes))
                _write(d / "memory.swap.max", "0", optional=True)
            quota = int(limits.cpu * CFS_PERIOD_US)
            _write(d / "cpu.max", f"{quota} {CFS_PERIOD_US}" if quota else "max")
            _write(d / "pids.max", str(limits.pids_max))
            return
        if controller == "memory" and limits.mem_bytes:
            _write(d / "memory.limit_in_bytes", str(limits.mem_bytes))
            # with swap accounting, memory + swap is bounded too (else a run pages out)
            _write(d / "memory.memsw.limit_in_bytes", str(limits.mem_bytes), optional=True)
            _write(d / "memory.swappiness", "0", optional=True)
        elif controller == "cpu" and limits.cpu:
            _write(d / "cpu.cfs_period_us", str(CFS_PERIOD_US))
            _write(d / "cpu.cfs_quota_us", str(int(limits.cpu * CFS_PERIOD_US)))
        elif controller == "pids":
            _write(d / "pids.max", str(limits.pids_max))
        elif controller == "devices":
            _write(d / "devices.deny", "a")
            for rule in STANDARD_DEVICES:
                _write(d / "devices.allow", rule)
            for path in limits.devices:
                _write(d / "devices.allow", _device_rule(path))

    def leftovers(self) -> list[RunGroup]:
        """The groups of runs a previous agent of this site left (reap removes them)."""
        names: set[str] = set()
        for site_dir in self._site_dirs().values():
            with contextlib.suppress(OSError):
                names.update(p.name for p in site_dir.iterdir() if p.is_dir())
        return [self.group(name) for name in sorted(names)]

    def group(self, name: str) -> RunGroup:
        dirs = {c: d / name for c, d in self._site_dirs().items() if (d / name).is_dir()}
        return RunGroup(version=self.version, dirs=dirs)


def _enable_v2(parent: Path, site_dir: Path) -> None:
    """Turn memory, cpu and pids on for the site's runs (the parent's and the site's subtree).

    A v2 group with processes cannot hand controllers down; an agent in such a group (not
    systemd-delegated) moves itself into a leaf of its own first."""
    want = "+memory +cpu +pids"
    try:
        _write(parent / "cgroup.subtree_control", want)
    except OSError:
        leaf = parent / "cpn-agent"
        leaf.mkdir(exist_ok=True)
        for pid in (parent / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                _write(leaf / "cgroup.procs", pid)
        _write(parent / "cgroup.subtree_control", want)
    _write(site_dir / "cgroup.subtree_control", want)


def _device_rule(path: str) -> str:
    st = os.stat(path)
    kind = "c" if (st.st_mode & 0o170000) == 0o020000 else "b"
    return f"{kind} {os.major(st.st_rdev)}:{os.minor(st.st_rdev)} rwm"


def _write(path: Path, value: str, *, optional: bool = False) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except FileNotFoundError:
        if not optional:
            raise
    except OSError:
        if not optional:
            raise
