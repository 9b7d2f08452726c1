"""Confined runs (docs/security.md): what a tenant's job can reach, tried from inside the job.

The escape battery (tests/sites/escape_battery.py) runs as a real job, in the real sandbox, as
a real tenant account, and asserts from its own output; the settings' bad values name their
field. The fake GPU device nodes below are character devices made with mknod (as /dev/null),
standing in for /dev/nvidia<i>, which this machine cannot have.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from sites.executors.accounts import AccountError, TenantAccounts
from sites.executors.base import ExecutorError, RunHandle, job_dir
from sites.executors.confinement import Confiner, device_nodes
from sites.executors.local import LocalExecutor
from sites.kits.clock import SystemClock
from sites.model.assignments import Assignment, RunState, Serve
from sites.model.catalog import DeviceCatalog
from sites.model.errors import ConfigError
from sites.model.spec import Accounts, Confinement
from sites.registry.client import Registry
from tests.conftest import REPO, Processes, site_doc, wait_for
from tests.sites.escape_battery import checks, escapes
from tests.sites.executors.test_executor import assign, cwd_of, wait_report

BATTERY = REPO / "tests" / "sites" / "escape_battery.py"


@contextlib.contextmanager
def listening() -> Iterator[int]:
    """A port the host listens on (on loopback) for the duration: what a job must not reach."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


ROOT = os.geteuid() == 0
needs_root_and_bwrap = pytest.mark.skipif(
    not ROOT or not Path("/usr/bin/bwrap").exists(),
    reason="the confined identity needs a root agent and bubblewrap (make sandbox)",
)


def assignment(job: str, command: list[str], **fields: Any) -> Assignment:
    base: dict[str, Any] = {"tenant": "acme", "attempt": 1, "fence": 1, "cpu": 1, "mem_gb": 0.5}
    base.update(fields)
    return Assignment(job=job, site="here", command=tuple(command), assigned_at=time.time(),
                      **base)  # fmt: skip


def make_executor(root: Path, **settings: Any) -> LocalExecutor:
    where = root / "sites" / "here"
    confiner = Confiner(Confinement(**settings), site="here", work_dir=where)
    return LocalExecutor(work_dir=where, site="here", catalog=DeviceCatalog.load(),
                         clock=SystemClock(), confiner=confiner)  # fmt: skip


@pytest.fixture
async def confined(tmp_path: Path) -> AsyncIterator[Callable[..., LocalExecutor]]:
    made: list[LocalExecutor] = []

    def make(**settings: Any) -> LocalExecutor:
        ex = make_executor(tmp_path, **settings)
        made.append(ex)
        return ex

    yield make
    for ex in made:
        for ref, proc in list(ex._procs.items()):  # noqa: SLF001 (what a failed test left)
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
            await ex._release(ref)  # noqa: SLF001


async def run_to_end(
    ex: LocalExecutor, a: Assignment, devices: tuple[int, ...] = (), timeout: float = 30
) -> tuple[str, Any]:
    log = job_dir(ex.work_dir, a.job) / f"attempt-{a.attempt}.log"
    handle = await ex.start(a, devices, log)
    ended = await asyncio.wait_for(ex.wait(handle), timeout)
    return log.read_text(), ended


# -- the battery through the executor ----------------------------------------------------------


@pytest.mark.e2e
@needs_root_and_bwrap
async def test_escape_battery_from_inside_a_job(
    confined: Callable[..., LocalExecutor], tmp_path: Path
) -> None:
    ex = confined()
    # what a site's host holds: the operator's CLI config, the site's credentials, the CA key,
    # the etcd data dir, and another tenant's running job with its work dir and log
    secrets = tmp_path / "secrets"
    (secrets / "pki").mkdir(parents=True)
    (secrets / "pki" / "ca.key").write_text("CA KEY")
    (secrets / "credentials.yaml").write_text("password: hunter2")
    (secrets / "etcd-data").mkdir()
    (secrets / "etcd-data" / "member").write_text("db")
    cli = Path.home() / ".config" / "cpn" / "config.yaml"
    other = assignment("other", ["sleep", "60"], tenant="rival")
    other_log = job_dir(ex.work_dir, "other") / "attempt-1.log"
    other_handle = await ex.start(other, (), other_log)
    (cwd_of(ex.work_dir, "other")).joinpath("notes").write_text("rival's data")
    spec = {
        "agent_uid": os.getuid(),
        "agent_pids": [os.getpid()],
        "other_pids": [other_handle.pid],
        "secrets": [str(secrets / "pki" / "ca.key"), str(secrets / "credentials.yaml"),
                    str(secrets / "etcd-data" / "member"), str(cli), str(other_log),
                    str(cwd_of(ex.work_dir, "other") / "notes"), "/etc/shadow",
                    str(ex.work_dir.parent / "tenant-ids.json")],
        "dirs": [str(secrets), [str(ex.work_dir / "jobs"), ["bat"]],
                 str(cwd_of(ex.work_dir, "other")),
                 "/root", "/home"],
        "write": ["/etc/cpn-pwned", "/usr/pwned", str(tmp_path / "pwned"),
                  str(job_dir(ex.work_dir, "bat") / "run.json"),
                  str(job_dir(ex.work_dir, "bat") / "pwned")],
        "marker": "MARKER-9f1c",
    }  # fmt: skip
    os.environ["CPN_TEST_MARKER"] = "MARKER-9f1c"  # the agent's environment: none of it leaks
    try:
        out, ended = await run_to_end(
            ex, assignment("bat", ["python3", str(BATTERY), json.dumps(spec)])
        )
    finally:
        del os.environ["CPN_TEST_MARKER"]
    await ex.stop(other_handle, 1.0)
    await ex.wait(other_handle)
    lines = checks(out)
    assert not escapes(out), out
    assert len(lines) >= 25, out
    assert ended.code == 0, out
    # the job's files are its account's, mode 0700, beside the agent's log it cannot touch
    st = cwd_of(ex.work_dir, "bat").stat()
    assert st.st_uid != 0 and st.st_mode & 0o777 == 0o700
    assert (job_dir(ex.work_dir, "bat") / "attempt-1.log").stat().st_uid == 0
    rival = cwd_of(ex.work_dir, "other").stat()
    assert rival.st_uid not in (0, st.st_uid)  # two tenants, two accounts


@pytest.mark.e2e
@needs_root_and_bwrap
async def test_a_run_stopped_as_it_starts_gets_its_sigterm_not_the_kill(
    confined: Callable[..., LocalExecutor],
) -> None:
    """A stop that comes before bubblewrap has forked the payload (the launcher still a shell,
    or the sandbox still being built) reaches the payload once it appears, within the grace,
    instead of waiting the whole grace for a SIGKILL."""
    ex = confined()
    for i in range(5):
        a = assignment(f"early-{i}", ["sleep", "60"])
        handle = await ex.start(a, (), job_dir(ex.work_dir, a.job) / "attempt-1.log")
        await asyncio.sleep(i * 0.01)
        began = time.monotonic()
        await ex.stop(handle, 20.0)
        ended = await asyncio.wait_for(ex.wait(handle), 10)
        assert time.monotonic() - began < 10, i
        assert ended.code == -signal.SIGTERM, (i, ended)


@pytest.mark.e2e
@needs_root_and_bwrap
async def test_a_run_over_its_memory_is_killed_and_reported_out_of_memory(
    confined: Callable[..., LocalExecutor],
) -> None:
    ex = confined()
    if ex.confinement() and ex.confiner.cgroups is None:
        pytest.skip(f"no cgroups here: {ex.confinement()}")
    hog = "b = []\nwhile True: b.append(bytearray(16 << 20))"  # twice its 0.125 GB, and more
    out, ended = await run_to_end(ex, assignment("hog", ["python3", "-c", hog], mem_gb=0.125))
    assert ended.reason == "out_of_memory" and ended.code == -signal.SIGKILL, (ended, out)
    assert "out of memory" in (ended.message or "") and "0.125 GB" in (ended.message or "")
    # and a run within its memory is untouched
    ok = "b = bytearray(32 << 20); print('fine')"
    out, ended = await run_to_end(ex, assignment("fits", ["python3", "-c", ok], mem_gb=0.125))
    assert ended.ok and "fine" in out, (ended, out)


@pytest.mark.e2e
@needs_root_and_bwrap
async def test_cpu_and_pids_limits_hold(confined: Callable[..., LocalExecutor]) -> None:
    ex = confined(pids_max=32)
    if ex.confinement() and ex.confiner.cgroups is None:
        pytest.skip(f"no cgroups here: {ex.confinement()}")
    forks = (
        "import subprocess\nps = []\ntry:\n    for i in range(100):\n"
        "        ps.append(subprocess.Popen(['sleep', '5']))\nexcept OSError as e:\n"
        "    print('refused at', len(ps))\nfor p in ps: p.kill()"
    )
    out, ended = await run_to_end(ex, assignment("forks", ["python3", "-c", forks]))
    assert "refused at" in out and int(out.split("refused at")[1].split()[0]) < 32, out
    # 1 cpu of quota: two busy threads' CPU time over wall time stays near 1
    spin = (
        "import os, time, multiprocessing as m\n"
        "def burn():\n    t = time.time()\n    while time.time() - t < 1.5: pass\n"
        "ps = [m.Process(target=burn) for _ in range(2)]\n[p.start() for p in ps]\n"
        "[p.join() for p in ps]\nprint('cpu', sum(os.times()[2:4]))"
    )
    out, ended = await run_to_end(ex, assignment("spin", ["python3", "-c", spin], cpu=1))
    assert ended.ok, out
    assert float(out.split("cpu")[1]) < 2.4, out  # unlimited: ~3.0 on 2 cores


@pytest.mark.e2e
@needs_root_and_bwrap
async def test_network_none_has_only_its_own_loopback(
    confined: Callable[..., LocalExecutor],
) -> None:
    ex = confined(network="none")
    with listening() as port:
        spec = {"agent_uid": 0, "connect": [["127.0.0.1", port]]}
        out, ended = await run_to_end(
            ex, assignment("net", ["python3", str(BATTERY), json.dumps(spec)])
        )
    assert not escapes(out), out
    assert "network none" in ex.confiner.summary


@pytest.mark.e2e
@needs_root_and_bwrap
@pytest.mark.skipif(not Path("/usr/bin/slirp4netns").exists(), reason="needs slirp4netns")
async def test_network_egress_reaches_out_but_not_the_hosts_loopback(
    confined: Callable[..., LocalExecutor],
) -> None:
    ex = confined(network="egress")
    with listening() as port:
        # 10.0.2.2 is the host through slirp4netns: its loopback services stay out of reach
        spec = {"agent_uid": 0, "connect": [["127.0.0.1", port], ["10.0.2.2", port]]}
        script = (
            f"ip -o -4 addr show tap0 || cat /proc/net/dev; python3 {BATTERY} '{json.dumps(spec)}'"
        )
        out, ended = await run_to_end(ex, assignment("egress", ["sh", "-c", script]))
    assert "tap0" in out, out  # its own interface, set up before the job ran
    assert not escapes(out), out


@pytest.mark.e2e
@needs_root_and_bwrap
async def test_only_its_own_accelerators_are_in_its_dev(
    confined: Callable[..., LocalExecutor], tmp_path: Path
) -> None:
    fake_dev = tmp_path / "fake-dev"  # fake GPU nodes: char devices 1:3 (/dev/null's numbers)
    fake_dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm"):
        os.mknod(fake_dev / name, 0o666 | 0o020000, os.makedev(1, 3))
        os.chmod(fake_dev / name, 0o666)  # as the driver makes them (mknod's mode is umasked)
    ex = confined()
    ex.confiner.dev_root = fake_dev
    a = assignment("gpu", ["sh", "-c", "ls /dev; echo hi > /dev/nvidia1 && echo wrote"],
                   model="H100", gpus=1)  # fmt: skip
    out, ended = await run_to_end(ex, a, devices=(1,))
    assert ended.ok, out
    listed = out.split()
    assert "nvidia1" in listed and "nvidiactl" in listed and "wrote" in listed, out
    assert "nvidia0" not in listed and "nvidia2" not in listed, out
    assert device_nodes("nvidia", (0, 2), fake_dev)[0] == (
        str(fake_dev / "nvidia0"),
        "/dev/nvidia0",
    )
    assert device_nodes(None, (0,), fake_dev) == ()


@pytest.mark.e2e
@needs_root_and_bwrap
async def test_replicas_are_confined_but_keep_a_reachable_port(
    confined: Callable[..., LocalExecutor],
) -> None:
    ex = confined(network="none")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    serve = Serve(service="svc", model="m", port=port)
    server = (
        f"import http.server as h; "
        f"h.HTTPServer(('127.0.0.1', {port}), h.SimpleHTTPRequestHandler).serve_forever()"
    )
    a = assignment("rep", ["python3", "-c", server], serve=serve)
    log = job_dir(ex.work_dir, "rep") / "attempt-1.log"
    handle: RunHandle = await ex.start(a, (), log)
    try:
        assert "network full" in handle.confinement and "bwrap" in handle.confinement

        def answers() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return True
            except OSError:
                return False

        await wait_for(answers, timeout=10)
    finally:
        await ex.stop(handle, 1.0)
        await ex.wait(handle)


@pytest.mark.e2e
async def test_a_site_without_a_sandbox_refuses_or_runs_unsandboxed(
    confined: Callable[..., LocalExecutor], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        "sites.executors.confinement.find_bwrap", lambda: None
    )  # as if not installed
    refusing = confined()
    line = refusing.confinement()
    assert line.startswith("refusing jobs") and "bwrap not found" in line
    with pytest.raises(ExecutorError, match="refuses jobs") as refused:
        await refusing.start(assignment("r", ["/bin/true"]), (), refusing.work_dir / "r.log")
    assert refused.value.site  # the site's fault: counted against it by the leader
    monkeypatch.undo()
    if not ROOT:
        return
    loose = confined(sandbox="none", when_unavailable="unsandboxed")
    assert "NO sandbox" in loose.confinement()
    out, ended = await run_to_end(loose, assignment("u", ["sh", "-c", "id -u; echo $HOME"]))
    uid, home = out.split()[:2]
    assert ended.ok and int(uid) not in (0, os.getuid()) and home.endswith("/work"), out


@pytest.mark.e2e  # the good site's check probes bwrap
async def test_a_work_dir_no_run_can_use_makes_the_site_refuse_jobs(tmp_path: Path) -> None:
    """A broken work dir (here a file where its directory should be; a read-only or full disk
    alike) would fail every run at start: the site says it refuses jobs instead, and placement
    passes it by (sites.model.status.SiteStatus.refusal)."""
    (tmp_path / "sites").write_text("not a directory")
    broken = make_executor(tmp_path)
    line = broken.confinement()
    assert line.startswith("refusing jobs: work dir ") and "not writable" in line, line
    with pytest.raises(ExecutorError, match="refuses jobs"):
        await broken.start(assignment("w", ["/bin/true"]), (), tmp_path / "w.log")
    fine = make_executor(tmp_path / "ok")
    assert not fine.confinement().startswith("refusing"), fine.confinement()


# -- identity ----------------------------------------------------------------------------------


@pytest.mark.skipif(not ROOT, reason="uids are handed out by root agents")
def test_uids_are_stable_distinct_and_kept_across_restarts(tmp_path: Path) -> None:
    ids = tmp_path / "tenant-ids.json"
    first = TenantAccounts(Accounts(uid_range=(500_000, 500_002)), ids_path=ids, field="s:f")
    got = {t: first.for_tenant(t).uid for t in ("a", "b", "c")}
    assert len(set(got.values())) == 3 and all(500_000 <= u <= 500_002 for u in got.values())
    again = TenantAccounts(Accounts(uid_range=(500_000, 500_002)), ids_path=ids, field="s:f")
    assert {t: again.for_tenant(t).uid for t in ("c", "b", "a")} == got
    with pytest.raises(AccountError, match="used up"):
        again.for_tenant("d")
    none = TenantAccounts(Accounts(uid_range=None), ids_path=ids, field="s:f")
    with pytest.raises(AccountError, match="no account"):
        none.for_tenant("a")


@pytest.mark.skipif(not ROOT, reason="named accounts are checked by root agents")
def test_named_accounts_are_checked_at_start(tmp_path: Path) -> None:
    ids = tmp_path / "ids.json"
    root_name = pwd.getpwuid(0).pw_name
    cases = {
        "nosuchuser-cpn": "no account",
        root_name: "root or the agent",
    }
    for user, why in cases.items():
        with pytest.raises(ConfigError, match=why) as info:
            TenantAccounts(Accounts(tenants={"t": user}), ids_path=ids,
                           field="site x:executor.confinement.accounts")  # fmt: skip
        assert info.value.problems[0].field == "executor.confinement.accounts.tenants.t"
    nobody = pwd.getpwnam("nobody").pw_uid  # a host account inside the range
    with pytest.raises(ConfigError, match="range must be free"):
        TenantAccounts(Accounts(uid_range=(nobody, nobody)), ids_path=ids, field="s:f")


# -- settings ----------------------------------------------------------------------------------


BAD = {
    "sandbox": ("docker", "executor.confinement.sandbox"),
    "when_unavailable": ("maybe", "executor.confinement.when_unavailable"),
    "network": ("lan", "executor.confinement.network"),
    "accounts": ({"uid_range": [10, 20]}, "executor.confinement.accounts.uid_range"),
    "ro_paths": (["relative/path"], "executor.confinement.ro_paths[0]"),
    "hide": (["no-slash"], "executor.confinement.hide[0]"),
    "rw_paths": (["scratch"], "executor.confinement.rw_paths[0]"),
    "path": ("", "executor.confinement.path"),
    "pids_max": (1, "executor.confinement.pids_max"),
    "min_mem_gb": (0, "executor.confinement.min_mem_gb"),
    "limits": ("sometimes", "executor.confinement.limits"),
    "color": ("red", "executor.confinement.color"),
}


@pytest.mark.e2e
@pytest.mark.parametrize("setting", sorted(BAD))
def test_bad_confinement_settings_name_their_field(setting: str, tmp_path: Path) -> None:
    value, field = BAD[setting]
    doc = site_doc("bad", executor={"confinement": {setting: value}})
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps(doc))
    out = subprocess.run([sys.executable, "-m", "cpn", "site", "validate", str(path)],
                         capture_output=True, text=True, cwd=REPO)  # fmt: skip
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], out.stderr


def test_bad_account_names_name_their_field() -> None:
    with pytest.raises(ValidationError) as info:
        Accounts(tenants={"t": "Bad Name"})
    assert info.value.errors()[0]["loc"] == ("tenants", "t")


# -- through a real agent ----------------------------------------------------------------------


@pytest.mark.e2e
@needs_root_and_bwrap
async def test_a_real_agent_confines_its_jobs_and_says_how(
    registry: Registry,
    processes: Processes,
    make_site: Callable[..., Any],
    work: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CPN_TEST_MARKER", "MARKER-77aa")  # in the agent's environment
    agent = await make_site(
        "jail", executor={"work_dir": str(work), "confinement": {"network": "none"}}
    )
    spec = {"agent_uid": 0, "agent_pids": [agent.pid], "marker": "MARKER-77aa",
            "secrets": [str(work.parent / "jail.yaml")],
            "dirs": [[str(work), ["jobs"]]]}  # fmt: skip
    await assign(
        registry, _through_agent("jail", "bat", ["python3", str(BATTERY), json.dumps(spec)])
    )
    report = await wait_report(registry, "jail", "bat", RunState.succeeded, timeout=20)
    assert report.confinement and "bwrap sandbox as uid" in report.confinement
    out = (job_dir(work, "bat") / "attempt-1.log").read_text()
    assert not escapes(out), out
    status = (await registry.snapshot()).view("jail").status
    assert status is not None and status.confinement.startswith("bwrap sandbox")
    assert "network none" in status.confinement
    # a job over its memory fails with the reason, as the broker's ledger then records it
    hog = "b = []\nwhile True: b.append(bytearray(16 << 20))"
    await assign(registry, _through_agent("jail", "hog", ["python3", "-c", hog], mem_gb=0.125))
    failed = await wait_report(registry, "jail", "hog", RunState.failed, timeout=20)
    assert failed.reason == "out_of_memory" and "out of memory" in failed.message, failed


def _through_agent(site: str, job: str, command: list[str], **fields: Any) -> Assignment:
    base: dict[str, Any] = {"tenant": "acme", "attempt": 1, "fence": 1, "cpu": 1, "mem_gb": 0.5}
    base.update(fields)
    return Assignment(job=job, site=site, command=tuple(command), assigned_at=time.time(), **base)


NOT_ROOT_AGENT = """
import asyncio, json, os, sys, time
from pathlib import Path
from sites.model.assignments import Assignment
from sites.model.catalog import DeviceCatalog
from sites.kits.clock import SystemClock
from sites.executors.local import LocalExecutor, job_dir

root = Path(sys.argv[1])
ex = LocalExecutor(work_dir=root / "sites" / "here", site="here", catalog=DeviceCatalog.load(),
                   clock=SystemClock())
print("LINE", ex.confinement(), flush=True)
a = Assignment(job="bat", site="here", tenant="acme", attempt=1, fence=1, cpu=1, mem_gb=0.5,
               command=("python3", os.environ["BATTERY"], sys.argv[2]), assigned_at=time.time())

async def main():
    log = job_dir(ex.work_dir, "bat") / "attempt-1.log"
    ended = await ex.wait(await ex.start(a, (), log))
    print(log.read_text(), flush=True)
    print("EXIT", ended.code, flush=True)

asyncio.run(main())
"""


@pytest.mark.e2e
@needs_root_and_bwrap
def test_an_agent_that_is_not_root_still_sandboxes_its_jobs(tmp_path: Path) -> None:
    """An agent running as nobody: its jobs keep its uid, but nothing of its files is there."""
    import shutil
    import tempfile

    nobody = pwd.getpwnam("nobody")
    root = Path(tempfile.mkdtemp(prefix="cpn-nonroot-"))  # not under root's 0700 pytest dir
    try:
        (root / "state").mkdir()
        (root / "state" / "credentials.yaml").write_text("password: agent's own")
        (root / "sites").mkdir()
        (root / "sites" / "agent-secret").write_text("agent's bearer")
        for path in (root, *root.rglob("*")):
            os.chown(path, nobody.pw_uid, nobody.pw_gid)
        spec = {"agent_uid": nobody.pw_uid,
                "secrets": [str(root / "state" / "credentials.yaml"),
                            str(root / "sites" / "agent-secret")],
                "dirs": [[str(root), ["sites"]]], "write": [str(root / "pwned")]}  # fmt: skip
        env = {"PATH": os.environ["PATH"], "HOME": str(root), "CPN_STATE_DIR": str(root / "state"),
               "PYTHONPATH": str(REPO), "BATTERY": str(BATTERY)}  # fmt: skip
        out = subprocess.run(
            # (the battery's path in the environment: files on an agent's command line are hidden)
            ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
             sys.executable, "-c", NOT_ROOT_AGENT, str(root), json.dumps(spec)],
            capture_output=True, text=True, env=env, cwd=root, timeout=60,
        )  # fmt: skip
        assert "LINE bwrap sandbox, the agent's uid, sandboxed" in out.stdout, out
        assert "NO limits" in out.stdout  # nobody may not make cgroups here: it says so
        lines = checks(out.stdout)
        # what it wrote above its work dir went to the sandbox's own directories, not the host's
        assert not (root / "pwned").exists()
        escaped = [ln for ln in lines if ln.startswith("ESCAPED") and "write" not in ln]
        assert not escaped, out.stdout
        assert "EXIT 0" in out.stdout, out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_cgroup_v2_files_written_for_a_run(tmp_path: Path) -> None:
    """On a cgroup v2 host (a fake tree of plain files here: this machine is v1/hybrid): the
    site's group gets its controllers, a run's group its limits, and the OOM counter is read
    from memory.events."""
    from sites.executors.cgroups import Cgroups, Limits

    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    agent = tmp_path / "system.slice" / "agent.service"
    agent.mkdir(parents=True)
    (agent / "cgroup.procs").write_text("")
    (agent / "cgroup.subtree_control").write_text("")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/system.slice/agent.service\n")
    cgroups = Cgroups.detect("east", root=tmp_path, proc_cgroup=proc)
    assert cgroups.version == 2 and cgroups.parents == {"": agent}
    cgroups.check()
    assert (agent / "cgroup.subtree_control").read_text() == "+memory +cpu +pids"
    group = cgroups.create("job-1.2", Limits(cpu=2, mem_bytes=1 << 30, pids_max=64))
    d = agent / "cpn-east" / "job-1.2"
    assert group.dirs == {"": d}
    assert (d / "memory.max").read_text() == str(1 << 30)
    assert (d / "memory.swap.max").read_text() == "0"
    assert (d / "cpu.max").read_text() == "200000 100000"
    assert (d / "pids.max").read_text() == "64"
    assert group.procs_files == [str(d / "cgroup.procs")]
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert group.oom_kills() == 1
    assert [g.dirs for g in cgroups.leftovers()] == [{"": d}]
    # another agent of a site of the same name on this host (another work dir: another
    # scope) neither sees this one's runs as its leftovers nor has its own seen as ours
    other = Cgroups.detect("east", root=tmp_path, proc_cgroup=proc, scope="0ther000")
    other.check()
    theirs = other.create("job-1.2", Limits(cpu=1, mem_bytes=1 << 30, pids_max=64))
    assert theirs.dirs == {"": agent / "cpn-east-0ther000" / "job-1.2"}
    assert [g.dirs for g in other.leftovers()] == [theirs.dirs]
    assert [g.dirs for g in cgroups.leftovers()] == [{"": d}]
    (tmp_path / "cgroup.controllers").write_text("cpu io\n")
    with pytest.raises(Exception, match="memory, pids"):
        Cgroups.detect("east", root=tmp_path, proc_cgroup=proc)


@pytest.mark.e2e
@needs_root_and_bwrap
async def test_the_python_launcher_where_setpriv_is_missing(
    confined: Callable[..., LocalExecutor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher is sh + setpriv; without setpriv a few lines of Python do the same (the
    cgroup, the parent-death signal, and the account when there is no sandbox)."""
    monkeypatch.setattr("sites.executors.launcher.SETPRIV", None)
    ex = confined(sandbox="none", when_unavailable="unsandboxed")
    ex.confinement()
    script = "id -u; cat /proc/self/cgroup | grep memory; grep CapEff /proc/self/status"
    out, ended = await run_to_end(ex, assignment("py", ["sh", "-c", script]))
    assert ended.ok, out
    uid = int(out.split()[0])
    assert uid not in (0, os.getuid()) and re.search(r"cpn-here-[0-9a-f]{8}/py.1", out), out
    assert "CapEff:\t0000000000000000" in out, out


@pytest.mark.e2e
@needs_root_and_bwrap
async def test_the_agents_files_stay_hidden_inside_a_path_runs_may_read(
    confined: Callable[..., LocalExecutor], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator opens a directory to runs (ro_paths) that holds the agent's credentials, its
    state and the site's `hide`: those are still covered, the rest is readable."""
    opened = tmp_path / "opt-site"
    (opened / "state").mkdir(parents=True)
    (opened / "state" / "db").write_text("agent state")
    (opened / "creds.yaml").write_text("key: agent's")
    (opened / "private").mkdir()
    (opened / "private" / "x").write_text("operator's")
    (opened / "tool.txt").write_text("shared tool")
    for path in (tmp_path, opened, *opened.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    monkeypatch.setattr("sys.argv", ["cpn", "agent", f"--etcd-credentials={opened / 'creds.yaml'}"])
    monkeypatch.setenv("CPN_STATE_DIR", str(opened / "state"))
    ex = confined(ro_paths=[str(opened)], hide=[str(opened / "private")])
    spec = {"agent_uid": 0, "secrets": [str(opened / "creds.yaml"), str(opened / "state" / "db"),
                                       str(opened / "private" / "x")]}  # fmt: skip
    script = f"cat {opened / 'tool.txt'}; echo; python3 {BATTERY} '{json.dumps(spec)}'"
    out, ended = await run_to_end(ex, assignment("hid", ["sh", "-c", script]))
    assert "shared tool" in out, out
    assert not escapes(out), out


@pytest.mark.e2e
@needs_root_and_bwrap
async def test_a_job_the_kernel_cannot_start_fails_and_leaves_no_cgroup(
    confined: Callable[..., LocalExecutor],
) -> None:
    """A tenant's env with a NUL byte cannot be passed to exec: the run fails with a clear
    message (never an agent error) and its cgroup, made before the start, is gone."""
    ex = confined()
    a = assignment("nul", ["true"], env={"BAD": "a\x00b"})
    with pytest.raises(ExecutorError, match="cannot start 'true'.*null byte") as failed:
        await ex.start(a, (), job_dir(ex.work_dir, "nul") / "attempt-1.log")
    assert not failed.value.site  # the job's own: never counted against the site
    with pytest.raises(ExecutorError, match="no such executable") as missing:
        await ex.start(assignment("nx", ["no-such-program-here"]), (), ex.work_dir / "nx.log")
    assert not missing.value.site
    # a tenant with no account here is that tenant's matter: never counted against the site
    closed = confined(accounts={"uid_range": None})
    with pytest.raises(ExecutorError, match="no account") as unknown:
        await closed.start(assignment("na", ["true"]), (), closed.work_dir / "na.log")
    assert not unknown.value.site
    cgroups = ex.confiner.cgroups
    assert cgroups is None or not cgroups.group("nul.1").dirs
