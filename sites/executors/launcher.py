"""The first process of every local run: it ties the run to the agent and its cgroups.

It sets PR_SET_PDEATHSIG(SIGKILL) (the run dies with the agent, its parent), joins the run's
cgroups before anything of the job runs (so nothing escapes them), drops to the tenant's
account when asked (a root agent without a sandbox: groups, gid, uid, then no_new_privs), then
becomes the job, or the sandbox that starts it (same pid). It is a few lines of shell and
util-linux's setpriv (or, without setpriv, of Python) that exec, not a ``preexec_fn``: that runs
Python in the forked child of a process full of gRPC threads, and gRPC's fork hooks crash such a
child.

The death signal only fires for a parent that dies after it was set, so whether the agent is
still the parent is checked *after* it is set, and set again after a change of uid (which
clears it: prctl(2)): an agent SIGKILLed at any instant of the launch leaves no run behind
(before, a run forked just before its agent died ran to its end with no agent: docs/chaos.md).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Sequence

__all__ = ["SETPRIV", "drop_to", "launcher"]

_LAUNCHER = """\
import ctypes, json, os, signal, sys
libc = ctypes.CDLL(None)
def tie():
    # the death signal, then the parent: an agent gone before it was set left init our parent
    libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != int(sys.argv[1]):
        os._exit(137)
tie()
spec = json.loads(sys.argv[2])
# the environment the run was given, as execve passed it (Python's start adds LC_CTYPE); read
# before a drop, after which this process's /proc files are root's
with open("/proc/self/environ", "rb") as f:
    env = dict(v.split(b"=", 1) for v in f.read().split(b"\\0") if b"=" in v)
try:
    for path in spec.get("procs", ()):
        with open(path, "w") as f:
            f.write(str(os.getpid()))
    if spec.get("uid") is not None:
        os.setgroups([])
        os.setgid(spec["gid"])
        os.setuid(spec["uid"])
        if os.getuid() != spec["uid"] or os.geteuid() != spec["uid"]:
            os._exit(126)
        tie()  # a change of uid cleared the death signal (prctl(2))
        libc.prctl(38, 1, 0, 0, 0)
except OSError as exc:
    print(f"cpn: cannot confine the run: {exc}", file=sys.stderr)
    os._exit(126)
try:
    os.execvpe(sys.argv[3], sys.argv[3:], env)
except OSError as exc:
    print(f"cpn: cannot start {sys.argv[3]!r}: {exc.strerror}", file=sys.stderr)
    os._exit(127)
"""


# The same in a POSIX shell and util-linux's setpriv (about 2 ms of CPU where Python's start
# takes 20): checks the agent is its parent, joins the cgroups, then setpriv drops to the
# account and sets the parent-death signal (after the drop: setpriv sets it last) and execs
# _RECHECK_SH, which checks again that the agent is its parent: one that died between the first
# check and the death signal is caught there. $1: the agent's pid, $2: how many cgroup.procs
# files follow.
_LAUNCHER_SH = """\
[ "$PPID" = "$1" ] || exit 137
n=$2; shift 2
while [ "$n" -gt 0 ]; do
  echo $$ > "$1" || { echo "cpn: cannot confine the run: cannot join cgroup $1" >&2; exit 126; }
  shift; n=$((n - 1))
done
exec "$@"
"""

# run by setpriv once the death signal is set: $1 the agent's pid, then the job's argv
_RECHECK_SH = '[ "$PPID" = "$1" ] || exit 137; shift; exec "$@"'

SETPRIV = shutil.which("setpriv")
SH = "/bin/sh"


def drop_to(uid: int, gid: int) -> list[str]:
    """setpriv's options that make a root process ``uid``:``gid`` for good: no supplementary
    groups, no capabilities in any set, no_new_privs (a setuid program cannot raise it)."""
    return [f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--no-new-privs",
            "--inh-caps=-all", "--bounding-set=-all"]  # fmt: skip


def launcher(
    argv: list[str], *, procs: Sequence[str] = (), uid: tuple[int, int] | None = None
) -> list[str]:
    """argv wrapped so the run dies with the agent (its parent), in its cgroups. Linux only."""
    if sys.platform != "linux":
        return argv
    if SETPRIV is not None and os.path.exists(SH):
        drop = drop_to(*uid) if uid is not None else []
        agent = str(os.getpid())
        return [SH, "-c", _LAUNCHER_SH, "cpn-launch", agent, str(len(procs)), *procs,
                SETPRIV, "--pdeathsig", "KILL", *drop, "--",
                SH, "-c", _RECHECK_SH, "cpn-launch", agent, *argv]  # fmt: skip
    spec = json.dumps({
        "procs": list(procs),
        "uid": None if uid is None else uid[0],
        "gid": None if uid is None else uid[1],
    })  # fmt: skip
    return [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(os.getpid()), spec, *argv]
