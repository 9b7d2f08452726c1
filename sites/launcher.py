"""The first process of every local run: it ties the run to the agent and its cgroups.

It sets PR_SET_PDEATHSIG(SIGKILL) (the run dies with the agent, its parent), checks the agent
did not die first, joins the run's cgroups before anything of the job runs (so nothing escapes
them), drops to the tenant's account when asked (a root agent without a sandbox: groups, gid,
uid, then no_new_privs), then becomes the job, or the sandbox that starts it (same pid). It is
a few lines of Python that exec, not a ``preexec_fn``: that runs Python in the forked child of
a process full of gRPC threads, and gRPC's fork hooks crash such a child.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

__all__ = ["launcher"]

_LAUNCHER = """\
import ctypes, json, os, signal, sys
libc = ctypes.CDLL(None)
libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)
if os.getppid() != int(sys.argv[1]):
    os._exit(137)
spec = json.loads(sys.argv[2])
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
        libc.prctl(38, 1, 0, 0, 0)
except OSError as exc:
    print(f"cpn: cannot confine the run: {exc}", file=sys.stderr)
    os._exit(126)
try:
    os.execvp(sys.argv[3], sys.argv[3:])
except OSError as exc:
    print(f"cpn: cannot start {sys.argv[3]!r}: {exc.strerror}", file=sys.stderr)
    os._exit(127)
"""


def launcher(
    argv: list[str], *, procs: Sequence[str] = (), uid: tuple[int, int] | None = None
) -> list[str]:
    """argv wrapped so the run dies with the agent (its parent), in its cgroups. Linux only."""
    if sys.platform != "linux":
        return argv
    spec = json.dumps({
        "procs": list(procs),
        "uid": None if uid is None else uid[0],
        "gid": None if uid is None else uid[1],
    })  # fmt: skip
    return [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(os.getpid()), spec, *argv]
