"""The bubblewrap sandbox a run starts in: its argv, and whether bubblewrap works here.

What a run sees (docs/security.md):

- the host's system read-only: /usr, /bin, /sbin, /lib*, /etc, /opt, plus the Python the agent
  runs and cpn's code (a replica may be one of cpn's stand-ins), plus the site's ``ro_paths``;
  nothing else of the host: no /home, /root, /var, /srv, /mnt, the agent's state dir, the
  other runs' dirs. The agent's own secrets (its credentials, state and config, the etcd data
  dir, the CLI's config) are hidden even where they lie under one of those (``hide``);
- its own work dir, read-write, at the same path (its HOME);
- a private /tmp and /dev/shm (tmpfs, charged to the run's memory group), a /dev with only the
  pseudo-devices and the run's own accelerators, its own /proc;
- its own pid, IPC, UTS and cgroup namespaces (it sees only its own processes and can signal
  nothing else), and, for network policies other than ``full``, its own network namespace.

An agent that is root runs bubblewrap as root, without a user namespace, and the run becomes
the tenant's account inside, with no capabilities and no_new_privs (util-linux's setpriv): a
root bubblewrap can bind what the tenant could not reach itself, and the uid is the host's
real uid, so files the run writes are the tenant's. An agent that is not root runs bubblewrap
in a user namespace: the run keeps the agent's uid, and the sandbox is what keeps it from the
agent's files.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sites.executors.launcher import SETPRIV, drop_to

__all__ = ["SandboxPlan", "bwrap_argv", "code_roots", "find_bwrap", "system_roots"]

SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")
# resolv.conf often points here
RUNTIME_FILES = ("/run/systemd/resolve", "/run/resolvconf")


@dataclass(frozen=True)
class SandboxPlan:
    """What one run's sandbox holds (absolute host paths)."""

    work: Path
    uid: int | None  # root agents: the account the run becomes; None: the agent's own uid
    gid: int | None
    ro_paths: tuple[str, ...] = ()
    rw_paths: tuple[str, ...] = ()
    hide: tuple[str, ...] = ()
    devices: tuple[tuple[str, str], ...] = ()  # (host node, path in the sandbox)
    network: str = "full"  # full | egress | none
    hostname: str = "cpn"
    mounts: tuple[tuple[str, str], ...] = ()  # (host tree, path in the sandbox), read-only


def find_bwrap() -> str | None:
    return shutil.which("bwrap") or (
        "/usr/bin/bwrap" if os.access("/usr/bin/bwrap", os.X_OK) else None
    )


def code_roots() -> tuple[str, ...]:
    """The agent's Python and cpn's code: what a run needs to start one of cpn's stand-ins."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    here = Path(__file__).resolve().parents[2]  # the directory holding the packages
    roots.add(str(here))
    return tuple(sorted(r for r in roots if r and r != "/"))


@functools.cache
def system_roots() -> tuple[tuple[str, str | None], ...]:
    """(path, symlink target or None) for each system directory present on this host."""
    found: list[tuple[str, str | None]] = []
    for path in SYSTEM:
        if os.path.islink(path):
            found.append((path, os.readlink(path)))
        elif os.path.isdir(path):
            found.append((path, None))
    return tuple(found)


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _parents(
    path: str, made: set[str], bound: Sequence[str] = (), masked: Sequence[str] = ()
) -> list[str]:
    """Its ancestors as directories anyone may pass through (bubblewrap running as root would
    make them 0700, and the run's account could not reach what is mounted below). Those inside
    a bound host tree are there already (read-only), except below a hidden one's empty dir."""
    args: list[str] = []
    parts = Path(path).parts[1:-1]
    for i in range(len(parts)):
        parent = "/" + "/".join(parts[: i + 1])
        if parent in made or _under(parent, SYSTEM):
            continue
        if _under(parent, bound) and not any(parent.startswith(m + "/") for m in masked):
            continue
        made.add(parent)
        args += ["--perms", "0755", "--dir", parent]
    return args


def bwrap_argv(bwrap: str, plan: SandboxPlan, command: Sequence[str]) -> list[str]:
    """bubblewrap's argv for ``command`` in the sandbox ``plan`` describes."""
    argv = [bwrap, "--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--hostname", plan.hostname]  # fmt: skip
    if plan.uid is None:  # not root: a user namespace, the agent's uid inside
        argv += ["--unshare-user", "--disable-userns"]
    if plan.network != "full":
        argv.append("--unshare-net")
    bound: list[str] = []
    for path, target in system_roots():
        if target is not None:
            argv += ["--symlink", target, path]
        else:
            argv += ["--ro-bind", path, path]
            bound.append(path)
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/dev/shm", "--tmpfs", "/tmp",
             "--tmpfs", "/run", "--tmpfs", "/var"]  # fmt: skip
    made = {"/tmp", "/run", "/var", "/dev", "/dev/shm", "/proc"}  # mounted above: left as they are
    for path in (*RUNTIME_FILES, *plan.ro_paths):
        real = os.path.realpath(path)
        if not _under(real, bound) and os.path.exists(real):
            argv += _parents(real, made, bound)
            argv += ["--ro-bind", real, real]
            bound.append(real)
    for path in plan.rw_paths:  # shared scratch: the file system's permissions decide
        real = os.path.realpath(path)
        if os.path.isdir(real) and not _under(real, bound):
            argv += _parents(real, made, bound)
            argv += ["--bind", real, real]
            bound.append(real)
    # the agent's secrets under a bound directory: an empty dir or /dev/null over each (after
    # every bind, so nothing an operator opens up uncovers one)
    masked: list[str] = []
    for path in sorted({os.path.realpath(p) for p in plan.hide}):
        if not _under(path, bound) or not os.path.exists(path):
            continue
        if os.path.isdir(path):
            argv += ["--tmpfs", path]
            masked.append(path)
        else:
            argv += ["--ro-bind", "/dev/null", path]
    work = str(plan.work)
    argv += _parents(work, made, bound, masked)
    argv += ["--bind", work, work]
    for src, dst in plan.mounts:  # the job's inputs, over the work dir's paths or their own
        if not _under(dst, (work,)):
            argv += _parents(dst, made, bound, masked)
        argv += ["--ro-bind", src, dst]
    for src, dst in plan.devices:
        argv += ["--dev-bind", src, dst]
    argv += ["--chdir", work]
    argv.append("--")
    if plan.uid is not None:
        gid = plan.gid if plan.gid is not None else plan.uid
        argv += [SETPRIV or "/usr/bin/setpriv", *drop_to(plan.uid, gid), "--"]
    argv += list(command)
    return argv
