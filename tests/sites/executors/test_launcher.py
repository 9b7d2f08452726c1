"""The launcher (sites.executors.launcher): a run dies with its agent, whenever the agent dies.

A stand-in agent (a small Python process, as the executor's: it wraps a command with
`launcher` and spawns it) is SIGKILLed at a chosen step of the launch, and the run must not
live on. The window the chaos soak found (docs/chaos.md): the shell checked that the agent was
its parent, then joined the cgroups, then setpriv set the death signal; an agent killed between
the check and the death signal left the run going with no agent. A FIFO given as a cgroup.procs
file holds the launch inside that window for as long as the test likes (its write blocks until
a reader opens it), so the kill lands there every time. A uid change clears the death signal
(prctl(2)), so the runs dropped to a tenant's account are killed once running as well.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

ROOT = os.geteuid() == 0
NOBODY = (65534, 65534)

# the stand-in agent: argv[1] a JSON spec {"python": bool, "procs": [...], "uid": [u, g] | null,
# "argv": [...]}, argv[2] where to write the run's pid; stdout is the run's
AGENT = """\
import json, os, subprocess, sys, time
import sites.executors.launcher as launcher
spec = json.loads(sys.argv[1])
if spec["python"]:
    launcher.SETPRIV = None
uid = tuple(spec["uid"]) if spec["uid"] else None
argv = launcher.launcher(spec["argv"], procs=spec["procs"], uid=uid)
proc = subprocess.Popen(argv, env={"PATH": "/usr/bin:/bin", "CPN_RUN": "1"}, cwd="/",
                        start_new_session=True)
with open(sys.argv[2] + ".part", "w") as f:
    f.write(str(proc.pid))
os.replace(sys.argv[2] + ".part", sys.argv[2])
time.sleep(120)
"""

# the job: says it ran (its pid, uid, capabilities and environment), then stays
JOB = [
    "/bin/sh",
    "-c",
    'echo "ran $$ $(id -u)"; grep CapEff /proc/self/status; env | sort; exec sleep 60',
]

PATHS = [
    pytest.param(False, marks=pytest.mark.skipif(shutil.which("setpriv") is None,
                                                 reason="needs util-linux's setpriv")),
    True,
]  # fmt: skip
PATH_IDS = ["setpriv", "python"]
# each test runs on both launch paths, as the agent's own account and as a tenant's
BY_PATH = pytest.mark.parametrize("python", PATHS, ids=PATH_IDS)
BY_UID = pytest.mark.parametrize(
    "uid",
    [None, pytest.param(NOBODY, marks=pytest.mark.skipif(not ROOT, reason="drops as root"))],
    ids=["same-uid", "tenant-uid"],
)


def _alive(pid: int) -> bool:
    """Running, or stopped; not gone and not a zombie (an orphan's reaper may be slow)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _wait(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@contextlib.contextmanager
def agent(
    tmp_path: Path, *, python: bool, procs: list[str], uid: tuple[int, int] | None
) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    """A stand-in agent that launched JOB: (the agent, the run's pid, the run's output)."""
    out = tmp_path / "out"
    pid_file = tmp_path / "pid"
    spec = {"python": python, "procs": procs, "uid": uid, "argv": JOB}
    with open(out, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-c", AGENT, json.dumps(spec), str(pid_file)],
            stdout=sink, stderr=subprocess.STDOUT, cwd=REPO,
        )  # fmt: skip
    run = 0
    try:
        _wait(lambda: pid_file.exists() or proc.poll() is not None, 20, "the launch")
        assert pid_file.exists(), out.read_text()
        run = int(pid_file.read_text())
        yield proc, run, out
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if run and _alive(run):  # what a failed test left: the run we started
            with contextlib.suppress(ProcessLookupError):
                os.kill(run, signal.SIGKILL)


@pytest.mark.e2e
@BY_PATH
@BY_UID
def test_an_agent_killed_inside_the_launch_leaves_no_run(
    tmp_path: Path, python: bool, uid: tuple[int, int] | None
) -> None:
    """Killed after the launcher's first check and before the death signal: the run never
    becomes the job (the check after the death signal finds the agent gone)."""
    joined = tmp_path / "joined"  # a plain file: written means the first check passed
    gate = tmp_path / "gate"  # a FIFO: the launch waits here until the test opens it
    os.mkfifo(gate)
    with agent(tmp_path, python=python, procs=[str(joined), str(gate)], uid=uid) as (
        proc, run, out,
    ):  # fmt: skip
        _wait(lambda: joined.exists() and joined.read_text().strip() == str(run), 20,
              "the launcher to pass its first check")  # fmt: skip
        proc.kill()  # the agent dies inside the window
        proc.wait()
        # let the launch go on (the reader stays open until the run is gone or ran: a write
        # into a FIFO no one reads would kill it with SIGPIPE, for the wrong reason)
        fd = os.open(gate, os.O_RDONLY | os.O_NONBLOCK)
        try:
            _wait(lambda: not _alive(run) or "ran" in out.read_text(), 20, "the run to end")
        finally:
            os.close(fd)
        assert "ran" not in out.read_text(), f"the run outlived its agent:\n{out.read_text()}"
        assert not _alive(run)


@pytest.mark.e2e
@BY_PATH
@BY_UID
def test_a_running_job_dies_with_its_agent_and_has_nothing_of_it(
    tmp_path: Path, python: bool, uid: tuple[int, int] | None
) -> None:
    """A job running (as the tenant's account, when dropped: a uid change clears the death
    signal, set again after it) dies with its agent; it is the launcher's own pid, with the
    account's identity, no capabilities after a drop, and only the environment it was given."""
    with agent(tmp_path, python=python, procs=[], uid=uid) as (proc, run, out):
        _wait(lambda: "CPN_RUN=1" in out.read_text(), 20, "the job to run")
        text = out.read_text()
        ran = next(line for line in text.splitlines() if line.startswith("ran "))
        assert ran.split()[1] == str(run), text  # the job is the launcher (exec, no fork)
        assert int(ran.split()[2]) == (uid[0] if uid else os.geteuid()), text
        if uid is not None:
            assert "CapEff:\t0000000000000000" in text, text
        env = {line.split("=", 1)[0] for line in text.splitlines() if "=" in line}
        assert env <= {"PATH", "CPN_RUN", "PWD"}, text  # the shell's own PWD, nothing else
        proc.kill()
        proc.wait()
        _wait(lambda: not _alive(run), 10, "the job to die with its agent")
