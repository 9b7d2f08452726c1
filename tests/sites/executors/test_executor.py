"""Jobs at a site: real etcd, real agent processes, real job processes.

There is no broker yet: the tests write assignments into etcd themselves, as the broker will.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from sites.agent.fit import DoesNotFit, SiteResources, allocate
from sites.agent.runs import Run
from sites.executors.base import RunRecord, command_argv, job_dir, job_env
from sites.executors.local import LocalExecutor
from sites.kits.clock import SystemClock
from sites.model import keys
from sites.model.assignments import Assignment, Report, RunState
from sites.model.catalog import DeviceCatalog
from sites.model.status import AgentSecret
from sites.registry.client import Registry
from tests.conftest import Processes, wait_for
from tests.sites.agent.test_agent import join, start_agent

PY = sys.executable


def assignment(site: str, job: str, command: list[str] | str, **fields: Any) -> Assignment:
    argv = (command,) if isinstance(command, str) else tuple(command)
    base: dict[str, Any] = {"tenant": "acme", "attempt": 1, "fence": 1}
    base.update(fields)
    return Assignment(job=job, site=site, command=argv, assigned_at=time.time(), **base)


async def assign(registry: Registry, a: Assignment) -> None:
    await registry.put_raw(keys.assignment(a.site, a.job), a.model_dump_json().encode())


async def get_report(registry: Registry, site: str, job: str) -> Report | None:
    got = await registry.get_raw(keys.report(site, job))
    return None if got is None else Report.model_validate_json(got[0])


async def wait_report(
    registry: Registry, site: str, job: str, state: RunState, timeout: float = 10
) -> Report:
    async def reached() -> Report | None:
        report = await get_report(registry, site, job)
        if report is not None and report.state is not state and report.state.terminal:
            raise AssertionError(f"{job} ended {report.state}: {report.message}")
        return report if report is not None and report.state is state else None

    result: Report = await wait_for(reached, timeout=timeout)
    return result


def alive(pid: int) -> bool:
    """Running (a zombie left to a non-reaping init counts as dead)."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


def kill_if_alive(*pids: int) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


async def agent_url(registry: Registry, site: str) -> str:
    agent = (await registry.snapshot()).view(site).agent
    assert agent is not None
    return agent.url


async def agent_http(registry: Registry, site: str) -> aiohttp.ClientSession:
    """A client of the agent's /jobs endpoints with its bearer, read from etcd as the broker
    does (sites.model.status.AgentSecret)."""
    got = await registry.get_raw(keys.agent_secret(site))
    assert got is not None, f"agent of {site} published no secret"
    bearer = AgentSecret.model_validate_json(got[0]).bearer
    return aiohttp.ClientSession(headers={"Authorization": f"Bearer {bearer}"})


def cwd_of(work: Path, job: str) -> Path:
    return job_dir(work, job) / "work"


# -- through the agent ---------------------------------------------------------------------------


@pytest.mark.e2e
async def test_job_runs_with_its_environment_then_succeeds(
    registry: Registry, make_site: Callable[..., Any], work: Path
) -> None:
    await make_site("runner")
    script = "env > env.txt; echo hello; while [ ! -f go ]; do sleep 0.05; done; echo bye"
    a = assignment(
        "runner", "train-1", script, attempt=2, fence=7, model="H100", gpus=2, cpu=4,
        mem_gb=16, env={"FOO": "bar"}, checkpoint_path="/ckpt/train-1", resume=True,
    )  # fmt: skip
    await assign(registry, a)
    running = await wait_report(registry, "runner", "train-1", RunState.running)
    assert (running.attempt, running.fence, running.devices) == (2, 7, (0, 1))
    assert running.started_at is not None and running.exit_code is None
    assert running.log_path == str(job_dir(work, "train-1") / "attempt-2.log")

    cwd = cwd_of(work, "train-1")
    log = Path(running.log_path)
    await wait_for(lambda: log.exists() and b"hello" in log.read_bytes(), 5)  # env.txt is written
    env = dict(
        line.split("=", 1) for line in (cwd / "env.txt").read_text().splitlines() if "=" in line
    )
    assert env["CPN_JOB_ID"] == "train-1" and env["CPN_SITE"] == "runner"
    assert env["CPN_ATTEMPT"] == "2" and env["CPN_TENANT"] == "acme"
    assert env["CPN_DEVICES"] == "H100:0,1" and env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert env["CPN_CHECKPOINT_PATH"] == "/ckpt/train-1" and env["CPN_RESUME"] == "1"
    assert env["FOO"] == "bar"

    url = await agent_url(registry, "runner")
    async with aiohttp.ClientSession() as http:  # without the agent's bearer: 401
        async with http.get(f"{url}/jobs") as resp:
            assert resp.status == 401
            assert (await resp.json())["error"]["code"] == "unauthorized"
        async with http.get(f"{url}/jobs/train-1/log") as resp:
            assert resp.status == 401
        async with http.get(f"{url}/healthz") as resp:
            assert resp.status == 200  # the rest stays open
    async with await agent_http(registry, "runner") as http:
        async with http.get(f"{url}/jobs") as resp:
            jobs = await resp.json()
    assert [(j["job"], j["state"], j["devices"]) for j in jobs] == [("train-1", "running", [0, 1])]
    assert alive(jobs[0]["pid"])

    (cwd / "go").touch()
    done = await wait_report(registry, "runner", "train-1", RunState.succeeded)
    assert (done.exit_code, done.attempt, done.fence) == (0, 2, 7)
    assert done.finished_at is not None and done.started_at == running.started_at
    # its record stays, with its end, until the next agent's start (sites.agent.runs)
    ended = RunRecord.model_validate_json((job_dir(work, "train-1") / "run.json").read_bytes())
    assert ended.ended_at is not None and ended.started_at <= ended.ended_at <= done.finished_at
    async with await agent_http(registry, "runner") as http:
        async with http.get(f"{url}/jobs/train-1/log") as resp:
            assert resp.status == 200 and resp.headers["X-Cpn-Attempt"] == "2"
            assert await resp.text() == "hello\nbye\n"


@pytest.mark.e2e
async def test_failing_and_unstartable_commands_report_failed(
    registry: Registry, make_site: Callable[..., Any]
) -> None:
    await make_site("failer")
    await assign(registry, assignment("failer", "bad", "echo oops >&2; exit 3"))
    await assign(registry, assignment("failer", "missing", ["/nonexistent/program", "x"]))
    bad = await wait_report(registry, "failer", "bad", RunState.failed)
    assert bad.exit_code == 3 and bad.message == "exited with 3"
    missing = await wait_report(registry, "failer", "missing", RunState.failed)
    assert missing.exit_code is None
    assert "cannot start '/nonexistent/program'" in missing.message
    url = await agent_url(registry, "failer")
    async with await agent_http(registry, "failer") as http:
        async with http.get(f"{url}/jobs/bad/log") as resp:
            assert await resp.text() == "oops\n"  # stderr goes to the log too


@pytest.mark.e2e
async def test_withdrawn_assignment_stops_the_job(
    registry: Registry, make_site: Callable[..., Any], work: Path
) -> None:
    await make_site("withdraw")
    await assign(registry, assignment("withdraw", "long", ["sleep", "60"], model="H100", gpus=4))
    await wait_report(registry, "withdraw", "long", RunState.running)
    record = RunRecord.model_validate_json((job_dir(work, "long") / "run.json").read_bytes())
    assert record.pid is not None and alive(record.pid)
    withdrawn_at = time.monotonic()
    await registry.delete_prefix(keys.assignment("withdraw", "long"))
    stopped = await wait_report(registry, "withdraw", "long", RunState.stopped)
    assert time.monotonic() - withdrawn_at < 10  # within the default grace
    assert stopped.exit_code == -signal.SIGTERM and "withdrawn" in stopped.message
    assert stopped.devices == (0, 1, 2, 3)
    assert not alive(record.pid)


@pytest.mark.e2e
async def test_devices_are_disjoint_and_free_capacity_follows_jobs(
    registry: Registry, make_site: Callable[..., Any]
) -> None:
    await make_site("pool")  # 16 x H100, 224 cores, 4096 GB

    async def free() -> tuple[int, int, float]:
        status = (await registry.snapshot()).statuses["pool"]
        return status.free.devices["H100"], status.free.cpu_cores, status.free.mem_gb

    assert await free() == (16, 224, 4096)
    for job in ("a", "b"):
        await assign(
            registry,
            assignment("pool", job, ["sleep", "60"], model="H100", gpus=8, cpu=100, mem_gb=1000),
        )
    a = await wait_report(registry, "pool", "a", RunState.running)
    b = await wait_report(registry, "pool", "b", RunState.running)
    assert len(a.devices) == len(b.devices) == 8
    assert sorted(a.devices + b.devices) == list(range(16))
    await wait_for(lambda: _eq(free(), (0, 24, 2096)), timeout=5)
    status = (await registry.snapshot()).statuses["pool"]
    assert status.free.fp16_tflops == 0 and status.capacity.devices["H100"] == 16

    # over-commit must not happen (the broker guards it), but the agent refuses it clearly
    misfits: dict[str, tuple[dict[str, Any], str]] = {
        "one-more-gpu": ({"model": "H100", "gpus": 1}, "needs 1 x H100, only 0 of 16 free"),
        "too-many-cores": ({"cpu": 50}, "needs 50 CPU cores, only 24 free"),
        "wrong-model": ({"model": "A100-80GB", "gpus": 1}, "site has no A100-80GB devices"),
        "no-model": ({"gpus": 1}, "names no model"),
    }
    for job, (fields, _) in misfits.items():
        await assign(registry, assignment("pool", job, ["sleep", "60"], **fields))
    for job, (_, message) in misfits.items():
        report = await wait_report(registry, "pool", job, RunState.failed)
        assert "does not fit at site pool" in report.message and message in report.message
        assert report.started_at is None and report.devices == ()

    for job in ("a", "b"):
        await registry.delete_prefix(keys.assignment("pool", job))
    for job in ("a", "b"):
        await wait_report(registry, "pool", job, RunState.stopped)
    await wait_for(lambda: _eq(free(), (16, 224, 4096)), timeout=5)


async def _eq(value: Any, expected: Any) -> bool:
    return bool(await value == expected)


@pytest.mark.e2e
async def test_killed_agent_takes_its_job_along_and_its_successor_does_not_rerun_it(
    registry: Registry,
    processes: Processes,
    make_site: Callable[..., Any],
    work: Path,
    tmp_path: Path,
) -> None:
    agent = await make_site("crashy")
    # the shell dies with the agent (PDEATHSIG); its background child only with the group
    script = "echo run >> starts; sleep 300 & echo $! > grandchild; wait"
    await assign(registry, assignment("crashy", "j", script))
    # and one whose `running` report never landed (as when the agent dies right after the
    # launch): the registry still says `starting` when the next agent comes
    await assign(registry, assignment("crashy", "k", "echo run >> starts; sleep 300"))
    running = await wait_report(registry, "crashy", "j", RunState.running)
    await wait_report(registry, "crashy", "k", RunState.running)
    record = RunRecord.model_validate_json((job_dir(work, "j") / "run.json").read_bytes())
    k_record = RunRecord.model_validate_json((job_dir(work, "k") / "run.json").read_bytes())
    assert record.pid is not None and k_record.pid is not None
    grandchild_file = cwd_of(work, "j") / "grandchild"
    await wait_for(lambda: grandchild_file.exists() and grandchild_file.read_text().strip(), 5)
    # the pid it wrote is its pid in the sandbox's namespace: find it from the host
    grandchild = _host_pid(["sleep", "300"], cwd_of(work, "j"))
    try:
        await asyncio.sleep(1.0)  # both ran a while
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        killed_at = time.time()
        await wait_for(lambda: not alive(record.pid or 0) and not alive(k_record.pid or 0), 5)
        starting = (await get_report(registry, "crashy", "k")).model_copy(  # type: ignore[union-attr]
            update={"state": RunState.starting, "started_at": None}
        )
        await registry.put_raw(keys.report("crashy", "k"), starting.model_dump_json().encode())
        await asyncio.sleep(2.0)  # the next agent comes a while after

        restarted_at = time.time()
        await start_agent(processes, registry, tmp_path / "crashy.yaml", "crashy")
        lost = await wait_report(registry, "crashy", "j", RunState.failed)
        assert "lost" in lost.message and lost.attempt == 1
        # it ended with its agent: billed to the agent's last sign of life (written down every
        # interval), not to the next agent's start
        assert lost.started_at == running.started_at and lost.finished_at is not None
        assert killed_at - 1.5 < lost.finished_at <= killed_at < restarted_at, lost
        # the one never reported running: its start is the executor's record of its launch
        k_lost = await wait_report(registry, "crashy", "k", RunState.failed)
        assert "lost" in k_lost.message and k_lost.started_at == k_record.started_at, k_lost
        assert k_lost.finished_at is not None and killed_at - 1.5 < k_lost.finished_at <= killed_at
        assert not alive(grandchild)  # reaped through the process group
        assert not (job_dir(work, "j") / "run.json").exists()
        assert (cwd_of(work, "j") / "starts").read_text() == "run\n"  # never run twice
        assert (cwd_of(work, "k") / "starts").read_text() == "run\n"
    finally:
        kill_if_alive(grandchild)


def _host_pid(cmdline: list[str], cwd: Path) -> int:
    """The host's pid of a run's process (the pid it sees is its sandbox's)."""
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        if proc.info["cmdline"] == cmdline and proc.info["cwd"] == str(cwd):
            return proc.pid
    raise AssertionError(f"no process {cmdline} in {cwd}")


@pytest.mark.e2e
async def test_graceful_stop_stops_jobs_silently_and_a_restart_runs_nothing_twice(
    registry: Registry,
    processes: Processes,
    make_site: Callable[..., Any],
    work: Path,
    tmp_path: Path,
) -> None:
    agent = await make_site("again")
    await assign(registry, assignment("again", "once", "echo run >> starts"))
    await assign(registry, assignment("again", "long", "echo run >> starts; sleep 60"))
    await wait_report(registry, "again", "once", RunState.succeeded)
    await wait_report(registry, "again", "long", RunState.running)
    # running means spawned; on a loaded machine its shell may not have run `echo` yet
    starts = cwd_of(work, "long") / "starts"
    await wait_for(lambda: starts.exists() and starts.read_text() == "run\n", timeout=10)
    record = RunRecord.model_validate_json((job_dir(work, "long") / "run.json").read_bytes())
    assert record.pid is not None
    before = await registry.get_raw(keys.report("again", "once"))
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(10) == 0
    assert not alive(record.pid)  # stopped before the agent let go of the site
    long = await get_report(registry, "again", "long")
    assert long is not None and long.state is RunState.running  # the lease said it all

    await start_agent(processes, registry, tmp_path / "again.yaml", "again")
    # the still-assigned attempt whose process is gone is lost, not run again
    lost = await wait_report(registry, "again", "long", RunState.failed)
    assert lost.message.startswith("lost:")
    # a later job has run, so the restarted agent has seen the finished one too
    await assign(registry, assignment("again", "later", ["true"]))
    await wait_report(registry, "again", "later", RunState.succeeded)
    for job in ("once", "long"):
        assert (cwd_of(work, job) / "starts").read_text() == "run\n"
    assert await registry.get_raw(keys.report("again", "once")) == before


@pytest.mark.e2e
async def test_log_endpoint_serves_and_follows_output(
    registry: Registry, make_site: Callable[..., Any], work: Path
) -> None:
    await make_site("logger")
    script = "echo line 1; while [ ! -f go ]; do sleep 0.05; done; echo line 2"
    await assign(registry, assignment("logger", "talk", script))
    await wait_report(registry, "logger", "talk", RunState.running)
    url = await agent_url(registry, "logger")
    async with await agent_http(registry, "logger") as http:
        async with http.get(f"{url}/jobs/talk/log", params={"follow": "1"}) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
            assert await asyncio.wait_for(resp.content.readline(), 5) == b"line 1\n"
            (cwd_of(work, "talk") / "go").touch()
            assert await asyncio.wait_for(resp.content.readline(), 5) == b"line 2\n"
            # the stream ends by itself once the run has ended
            assert await asyncio.wait_for(resp.content.read(), 5) == b""
        await wait_report(registry, "logger", "talk", RunState.succeeded)
        async with http.get(f"{url}/jobs/talk/log", params={"offset": "7"}) as resp:
            assert await resp.text() == "line 2\n"
        async with http.get(f"{url}/jobs/talk/log", params={"attempt": "1"}) as resp:
            assert await resp.text() == "line 1\nline 2\n"
        async with http.get(f"{url}/jobs/nobody/log") as resp:
            assert resp.status == 404
            error = (await resp.json())["error"]
            assert (error["code"], error["field"]) == ("not_found", "job")
        for name, value in (("offset", "-1"), ("offset", "x"), ("attempt", "0")):
            async with http.get(f"{url}/jobs/talk/log", params={name: value}) as resp:
                assert resp.status == 400
                error = (await resp.json())["error"]
                assert (error["code"], error["field"]) == ("invalid", name)
        async with http.get(f"{url}/jobs/talk/log", params={"attempt": "3"}) as resp:
            assert resp.status == 404


@pytest.mark.e2e
async def test_slurm_site_without_sbatch_fails_its_jobs(
    registry: Registry,
    processes: Processes,
    site_file: Callable[..., Path],
    tmp_path: Path,
) -> None:
    file = site_file("hpc", executor={"kind": "slurm", "work_dir": str(tmp_path / "w")})
    await join(registry, file)
    empty = tmp_path / "bin"
    empty.mkdir()
    proc = processes.start(
        "agent", "--site", str(file), "--etcd", registry.url, "--interval", "1",
        "--probe-method", "http", name="agent-hpc", env={"PATH": str(empty)},
    )  # fmt: skip
    await wait_for(lambda: _agent_up(registry, "hpc", proc.pid), timeout=20)
    await assign(registry, assignment("hpc", "sim", ["true"]))
    report = await wait_report(registry, "hpc", "sim", RunState.failed)
    assert report.message.startswith("slurm executor: sbatch, squeue")
    assert report.message.endswith(" not found")
    assert "slurm executor: sbatch" in processes.log("agent-hpc")


@pytest.mark.e2e
async def test_slurm_site_whose_controller_does_not_answer_runs_without_it(
    registry: Registry,
    processes: Processes,
    site_file: Callable[..., Path],
    tmp_path: Path,
) -> None:
    """The client commands installed (`make test` installs them), but no cluster: the agent
    runs as if Slurm were absent (the demo's Slurm site after `make test`), it does not exit,
    and its status says it refuses jobs, so that no broker places one there."""
    import shutil

    if shutil.which("sinfo") is None:
        pytest.skip("the Slurm client commands are not installed (make slurm)")
    from sites.emulation.etcd_server import free_port

    conf = tmp_path / "slurm.conf"  # a cluster whose slurmctld is not running
    conf.write_text(
        f"ClusterName=nocluster\nSlurmctldHost=localhost(127.0.0.1)\n"
        f"SlurmctldPort={free_port()}\nNodeName=localhost CPUs=1\nPartitionName=gpu Nodes=ALL\n"
    )
    for site, path, reason in (
        ("lonely", conf, "slurm executor: no Slurm controller answers"),
        ("confless", tmp_path / "absent.conf", "slurm executor: no Slurm configuration at"),
    ):
        executor = {"kind": "slurm", "partition": "gpu", "work_dir": str(tmp_path / site),
                    "slurm": {"conf": str(path), "default_account": {"account": "x"}}}  # fmt: skip
        file = site_file(site, executor=executor)
        await join(registry, file)
        proc = processes.start(
            "agent", "--site", str(file), "--etcd", registry.url, "--interval", "1",
            "--probe-method", "http", name=f"agent-{site}",
        )  # fmt: skip
        await wait_for(lambda s=site, p=proc: _agent_up(registry, s, p.pid), timeout=40)

        # its status says so: placement passes it by (broker.state.view), `cpn sites` shows it
        async def refusal(s: str = site) -> str | None:
            status = (await registry.snapshot()).statuses.get(s)
            return None if status is None else status.refusal

        assert reason in await wait_for(refusal, timeout=10)
        await assign(registry, assignment(site, "sim", ["true"]))
        report = await wait_report(registry, site, "sim", RunState.failed)
        assert report.message.startswith(reason), report.message
        assert proc.poll() is None, processes.log(f"agent-{site}")


async def _agent_up(registry: Registry, site: str, pid: int) -> bool:
    agent = (await registry.snapshot()).view(site).agent
    return agent is not None and agent.pid == pid


# -- the executor and allocation in-process ------------------------------------------------------


@pytest.fixture
async def executor(work: Path) -> AsyncIterator[LocalExecutor]:
    ex = LocalExecutor(
        work_dir=work, site="here", catalog=DeviceCatalog.load(), clock=SystemClock()
    )
    yield ex
    for proc in list(ex._procs.values()):  # anything a failed test left running
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        await proc.wait()


@pytest.mark.e2e
async def test_stop_escalates_to_sigkill_for_the_whole_group(
    executor: LocalExecutor, work: Path
) -> None:
    # ignores SIGTERM, and so does the child it leaves in its process group
    script = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)']); "
        "open('child', 'w').write(str(child.pid)); print('ready', flush=True); time.sleep(60)"
    )
    a = assignment("here", "stubborn", [PY, "-c", script])
    log = work / "stubborn.log"
    handle = await executor.start(a, (), log)
    await wait_for(lambda: log.exists() and b"ready" in log.read_bytes(), 10)
    child_argv = [PY, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "time.sleep(60)"]  # fmt: skip
    child = _host_pid(child_argv, cwd_of(work, "stubborn"))
    started = time.monotonic()
    await executor.stop(handle, grace_s=0.5)
    assert 0.5 <= time.monotonic() - started < 3
    assert (await asyncio.wait_for(executor.wait(handle), 5)).code == -signal.SIGKILL
    assert not alive(child) and handle.pid is not None and not alive(handle.pid)
    ended = RunRecord.model_validate_json((job_dir(work, "stubborn") / "run.json").read_bytes())
    assert ended.ended_at is not None  # kept with its end, for the next agent's start


@pytest.mark.e2e
async def test_reap_stops_recorded_runs_but_never_a_reused_pid(
    executor: LocalExecutor, work: Path
) -> None:
    a = assignment("here", "orphan", ["sleep", "60"], attempt=3, fence=9)
    handle = await executor.start(a, (), work / "orphan.log")
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        # a record of another site, and one whose pid now belongs to someone else
        other = RunRecord(
            site="elsewhere", job="x", attempt=1, fence=1, ref=str(stranger.pid),
            pid=stranger.pid, created_at=None, started_at=0, log_path="x", agent_pid=1,
        )  # fmt: skip
        reused = other.model_copy(update={"site": "here", "job": "y", "created_at": 1.0})
        for record in (other, reused):
            path = job_dir(work, record.job) / "run.json"
            path.parent.mkdir(parents=True)
            path.write_text(record.model_dump_json())

        successor = LocalExecutor(
            work_dir=work, site="here", catalog=DeviceCatalog.load(), clock=SystemClock()
        )
        reaped = await successor.reap(grace_s=2)
        assert [(r.job, r.attempt, r.fence) for r in reaped] == [("orphan", 3, 9)]
        assert (await asyncio.wait_for(executor.wait(handle), 5)).code == -signal.SIGTERM
        assert stranger.poll() is None  # not ours: left alone
        assert not (job_dir(work, "y") / "run.json").exists()
        assert (job_dir(work, "x") / "run.json").exists()  # another site's record is not ours
    finally:
        stranger.kill()
        stranger.wait()


def test_job_env_and_command_line() -> None:
    a = assignment("s", "j", ["run"], model="MI300X", gpus=2, env={"CUDA_VISIBLE_DEVICES": "9"})
    env = job_env(a, (2, 3), site="s", vendor="amd", base={"CPN_RESUME": "1", "HOME": "/h"})
    assert env["ROCR_VISIBLE_DEVICES"] == "2,3" and env["CPN_DEVICES"] == "MI300X:2,3"
    assert "CPN_RESUME" not in env and env["HOME"] == "/h"
    cpu_only = job_env(assignment("s", "j", ["run"]), (), site="s", vendor=None, base={})
    assert cpu_only["CUDA_VISIBLE_DEVICES"] == "" and cpu_only["CPN_DEVICES"] == ""
    assert command_argv(["echo hi; exit 1"]) == ["/bin/sh", "-c", "echo hi; exit 1"]
    assert command_argv(["python", "train.py"]) == ["python", "train.py"]
    assert command_argv(["true"]) == ["true"]


def test_allocate_takes_lowest_free_indices_and_counts_cores_and_memory() -> None:
    resources = SiteResources(
        devices={"H100": (0, 1, 2, 3), "L40S": (4, 5)}, cpu_cores=8, mem_gb=64
    )
    first = Run(assignment=assignment("s", "a", ["x"], model="H100", gpus=2, cpu=4, mem_gb=32))
    first.devices = allocate(first.assignment, resources, [])
    assert first.devices == (0, 1)
    second = assignment("s", "b", ["x"], model="H100", gpus=2, cpu=4, mem_gb=32)
    assert allocate(second, resources, [first]) == (2, 3)
    assert allocate(assignment("s", "c", ["x"], model="L40S", gpus=1), resources, [first]) == (4,)
    with pytest.raises(DoesNotFit, match=r"needs 3 x H100, only 2 of 4 free"):
        allocate(assignment("s", "d", ["x"], model="H100", gpus=3), resources, [first])
    with pytest.raises(DoesNotFit, match=r"needs 40 GB of memory, only 32 free"):
        allocate(assignment("s", "e", ["x"], mem_gb=40), resources, [first])
    first.state = RunState.succeeded  # a finished run holds nothing
    assert allocate(assignment("s", "f", ["x"], model="H100", gpus=4), resources, [first]) == (
        0, 1, 2, 3,
    )  # fmt: skip


def test_best_effort_runs_share_devices_on_an_oversubscribed_site() -> None:
    from sites.model.spec import Oversubscription

    resources = SiteResources(
        devices={"H100": (0, 1, 2, 3)},
        cpu_cores=8,
        mem_gb=64,
        oversubscription=Oversubscription(gpus=1.5, cpu=2.0),
    )
    regular = Run(assignment=assignment("s", "r", ["x"], model="H100", gpus=4, cpu=8))
    regular.devices = allocate(regular.assignment, resources, [])
    assert regular.devices == (0, 1, 2, 3)
    # best-effort work shares the devices, 2 runs a device (ceil 1.5), the cores up to 16
    spare = Run(
        assignment=assignment("s", "b", ["x"], model="H100", gpus=2, cpu=4, best_effort=True)
    )
    spare.devices = allocate(spare.assignment, resources, [regular])
    assert spare.devices == (0, 1)
    more = assignment("s", "c", ["x"], model="H100", gpus=2, cpu=4, best_effort=True)
    assert allocate(more, resources, [regular, spare]) == (2, 3)
    with pytest.raises(DoesNotFit, match=r"only 2 of 4 may take another best-effort run"):
        allocate(
            assignment("s", "d", ["x"], model="H100", gpus=3, best_effort=True),
            resources,
            [regular, spare],
        )
    with pytest.raises(DoesNotFit, match=r"needs 5 CPU cores, only 4 free"):
        allocate(assignment("s", "e", ["x"], cpu=5, best_effort=True), resources, [regular, spare])
    # a regular run counts only regular holdings against the physical capacity
    assert allocate(
        assignment("s", "f", ["x"], model="H100", gpus=2, cpu=4), resources, [spare]
    ) == (0, 1)
    with pytest.raises(DoesNotFit, match=r"needs 1 x H100, only 0 of 4 free"):
        allocate(assignment("s", "g", ["x"], model="H100", gpus=1), resources, [regular, spare])
    # without oversubscription, best-effort runs hold devices like any other
    plain = SiteResources(devices={"H100": (0, 1, 2, 3)}, cpu_cores=8, mem_gb=64)
    with pytest.raises(DoesNotFit, match=r"only 0 of 4 free"):
        allocate(spare.assignment, plain, [regular])


def test_a_run_meters_the_power_of_its_own_devices_while_it_runs() -> None:
    """Run.meter: NVML readings of the job's devices, power x time and utilization x time
    (the fake readings stand in for a GPU this machine does not have)."""
    from sites.agent.runs import Run
    from sites.model.status import GpuDevice

    def gpu(index: int, watts: float | None, util: float, model: str = "H100") -> GpuDevice:
        return GpuDevice(index=index, model=model, name="fake", mem_gb=80, mem_used_gb=1,
                         util_pct=util, power_w=watts, busy=True)  # fmt: skip

    run = Run(assignment=assignment("s", "j", ["true"], model="H100", gpus=2), devices=(1, 2))
    readings = [gpu(0, 500, 90), gpu(1, 300, 50), gpu(2, 200, 100), gpu(3, 700, 0, "A100-80GB")]
    run.meter(readings, 100.0)  # still starting: nothing counts, the clock starts
    run.state = RunState.running
    run.meter(readings, 110.0)
    run.meter(readings, 130.0)
    assert run.gpu_energy_j == pytest.approx((300 + 200) * 30)  # its two devices only
    assert run.metered() == {
        "gpu_energy_j": pytest.approx(15000.0),
        "gpu_util_ratio": pytest.approx(0.75),
        "gpu_metered_s": pytest.approx(30.0),
    }
    run.meter([gpu(1, None, 50), gpu(2, 200, 100)], 140.0)  # a device without power: skipped
    assert run.metered_s == pytest.approx(30.0)
    assert Run(assignment=run.assignment).metered() == {}
