"""What confining a run costs: submit-to-running with and without the sandbox, and agent CPU.

Two federations of one site each, run one after the other by `cpn up` (embedded etcd, one
agent, one broker, plain loopback), identical but for the site's confinement:

- **sandbox**: the default, a bubblewrap sandbox as the tenant's account with cgroup limits;
- **unsandboxed**: `sandbox: none, when_unavailable: unsandboxed`: the tenant's account and
  the cgroup limits, no sandbox (what a site without bubblewrap may choose).

In each, N jobs (cpu 1, mem_gb 0.25, `sleep 0.2`) are submitted through the broker's API at a
steady pace (`--rate` per second, so the site never queues them), and each job's
submit-to-running time is read from its own events (the broker's `submitted` and `running`
events, as `cpn describe` shows them). The agent's CPU (user + system, its own process) over
the jobs, divided by N, is its CPU per started job; the launcher and bubblewrap run in child
processes and are reported apart (the children's CPU reaped by the agent, the jobs' own
`sleep` included). Then the agent's part alone, in this process: `LocalExecutor.start` to the
job's first instruction (it prints the time), N runs per mode, where the broker's pass and the
watch, which make up most of submit-to-running and move it by +-10 ms, are not in the figure.

    .venv/bin/python bench/confinement.py                 # 200 jobs each: about 2 minutes
    .venv/bin/python bench/confinement.py --jobs 50 --json /tmp/confinement.json

Target (issue 40): the sandbox adds under 50 ms at p50.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import yaml
from benchkit import log, quantile

ROOT = Path(__file__).resolve().parent.parent
SITE = "wuhu"
TARGET_ADDED_P50_MS = 50.0
MODES = {
    "sandbox": {},
    "unsandboxed": {"sandbox": "none", "when_unavailable": "unsandboxed"},
}


def config_dir(tmp: Path, confinement: dict[str, Any]) -> Path:
    """configs/ with the site's executor confined as asked (everything else linked)."""
    out = tmp / "configs"
    out.mkdir()
    for entry in (ROOT / "configs").iterdir():
        if entry.name != "sites":
            (out / entry.name).symlink_to(entry)
    (out / "sites").mkdir()
    for site in (ROOT / "configs" / "sites").iterdir():  # the others are named elsewhere
        (out / "sites" / site.name).symlink_to(site)
    (out / "sites" / f"{SITE}.yaml").unlink()
    doc = yaml.safe_load((ROOT / "configs" / "sites" / f"{SITE}.yaml").read_text())
    executor = dict(doc.get("executor") or {})
    if confinement:
        executor["confinement"] = confinement
    doc["executor"] = executor
    (out / "sites" / f"{SITE}.yaml").write_text(yaml.safe_dump(doc))
    return out


async def run_mode(mode: str, jobs: int, rate: float) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix=f"cpn-bench-conf-{mode}-"))
    env = {**os.environ, "CPN_STATE_DIR": str(tmp), "CPN_CONFIG": str(tmp / "cli.yaml")}
    env.pop("CPN_TOKEN", None)
    env.pop("CPN_ETCD", None)
    up = subprocess.Popen(
        [sys.executable, "-m", "cpn", "up", "--config-dir", str(config_dir(tmp, MODES[mode])),
         "--sites", SITE, "--no-wan-emulation", "--no-service", "--interval", "1",
         "--broker-listen", "127.0.0.1:0"],
        stdout=subprocess.DEVNULL, stderr=open(tmp / "up.log", "wb"), env=env, cwd=ROOT,  # noqa: SIM115
        start_new_session=True,  # its group: killed whole if it does not stop on Ctrl-C
    )  # fmt: skip
    try:
        state = await wait_state(tmp, up)
        agent = next(
            p for p in psutil.Process(up.pid).children(recursive=True)
            if "agent" in p.cmdline()
        )  # fmt: skip
        headers = {"Authorization": f"Bearer {state['token']}"}
        async with aiohttp.ClientSession(state["broker"], headers=headers) as http:
            await wait_site_up(http)
            line = await confinement_line(http)
            log(f"{mode}: {line}")
            before = agent.cpu_times()
            ids = []
            for i in range(jobs):
                started = time.monotonic()
                ids.append(await submit(http, i))
                await asyncio.sleep(max(0.0, 1 / rate - (time.monotonic() - started)))
            latencies = await wait_running(http, ids)
            after = agent.cpu_times()
        own = (after.user + after.system) - (before.user + before.system)
        children = (after.children_user + after.children_system) - (
            before.children_user + before.children_system
        )
        return {
            "mode": mode,
            "confinement": line,
            "jobs": jobs,
            "p50_ms": quantile(latencies, 0.5),
            "p90_ms": quantile(latencies, 0.9),
            "p99_ms": quantile(latencies, 0.99),
            "mean_ms": statistics.fmean(latencies),
            "agent_cpu_ms_per_job": 1000 * own / jobs,
            "children_cpu_ms_per_job": 1000 * children / jobs,
        }
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            log(f"{mode}: cpn up did not stop in 60 s; killing its process group")
        try:  # what it left (an agent, etcd) if it died without stopping them
            os.killpg(up.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        up.wait()
        shutil.rmtree(tmp, ignore_errors=True)


async def wait_state(tmp: Path, up: subprocess.Popen[bytes]) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise SystemExit(f"cpn up exited: {(tmp / 'up.log').read_text()[-2000:]}")
        path = tmp / "up.json"
        if path.exists():
            state: dict[str, Any] = json.loads(path.read_text())
            if state.get("broker") and state.get("token"):
                return state
        await asyncio.sleep(0.2)
    raise SystemExit("cpn up did not start in 120 s")


async def wait_site_up(http: aiohttp.ClientSession) -> None:
    for _ in range(600):
        try:
            async with http.get("/v1/sites") as r:
                if r.status == 200:
                    body = await r.json()
                    items = body.get("items", body) if isinstance(body, dict) else body
                    if any(s.get("id") == SITE and s.get("state") == "up" for s in items):
                        return
        except aiohttp.ClientConnectionError:  # the broker is still starting
            pass
        await asyncio.sleep(0.2)
    raise SystemExit("the site did not come up")


async def confinement_line(http: aiohttp.ClientSession) -> str:
    for _ in range(100):
        async with http.get("/v1/sites") as r:
            body = await r.json()
        items = body.get("items", body) if isinstance(body, dict) else body
        for s in items:
            line = s.get("confinement")
            if s.get("id") == SITE and line:
                return str(line)
        await asyncio.sleep(0.2)
    return "(not published)"


async def submit(http: aiohttp.ClientSession, i: int) -> str:
    spec = {"name": f"conf-{i}", "tenant": "ai-lab", "cpu": 1, "mem_gb": 0.25,
            "command": ["sleep", "0.2"], "max_retries": 0}  # fmt: skip
    async with http.post("/v1/jobs", json=spec) as r:
        body = await r.json()
        if r.status >= 300:
            raise SystemExit(f"submit: {r.status} {body}")
        return str(body["id"])


async def wait_running(http: aiohttp.ClientSession, ids: list[str]) -> list[float]:
    """submit-to-running of each job, from its events (ms)."""
    latencies: dict[str, float] = {}
    deadline = time.monotonic() + 120
    while len(latencies) < len(ids) and time.monotonic() < deadline:
        for job in ids:
            if job in latencies:
                continue
            async with http.get(f"/v1/jobs/{job}") as r:
                record = await r.json()
            events = {e["type"]: e["at"] for e in record.get("events", [])}
            if "running" in events and "submitted" in events:
                latencies[job] = 1000 * (events["running"] - events["submitted"])
            elif record.get("state") in ("FAILED", "CANCELLED"):
                raise SystemExit(f"job {job} {record['state']}: {record.get('events')}")
        await asyncio.sleep(0.5)
    if len(latencies) < len(ids):
        raise SystemExit(f"only {len(latencies)} of {len(ids)} jobs ran")
    return list(latencies.values())


async def direct(mode: str, runs: int) -> dict[str, Any]:
    """The agent's part alone: LocalExecutor.start to the job's first instruction, in process
    (no broker, no etcd), with the same confinement as the federation's site."""
    sys.path.insert(0, str(ROOT))
    from sites.executors.base import job_dir
    from sites.executors.confinement import Confiner
    from sites.executors.local import LocalExecutor
    from sites.kits.clock import SystemClock
    from sites.model.assignments import Assignment
    from sites.model.catalog import DeviceCatalog
    from sites.model.spec import Confinement

    tmp = Path(tempfile.mkdtemp(prefix=f"cpn-bench-direct-{mode}-"))
    work = tmp / "sites" / "bench"
    confiner = Confiner(Confinement(**MODES[mode]), site="bench", work_dir=work)
    ex = LocalExecutor(work_dir=work, site="bench", catalog=DeviceCatalog.load(),
                       clock=SystemClock(), confiner=confiner)  # fmt: skip
    ex.confinement()
    latencies = []
    try:
        for i in range(runs):
            a = Assignment(job=f"d{i}", site="bench", tenant="ai-lab", attempt=1, fence=1,
                           cpu=1, mem_gb=0.25, command=("date", "+%s.%N"),
                           assigned_at=time.time())  # fmt: skip
            log_file = job_dir(work, a.job) / "attempt-1.log"
            before = time.time()
            handle = await ex.start(a, (), log_file)
            await ex.wait(handle)
            latencies.append(1000 * (float(log_file.read_text().split()[0]) - before))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"mode": mode, "p50_ms": quantile(latencies, 0.5),
            "p99_ms": quantile(latencies, 0.99)}  # fmt: skip


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--rate", type=float, default=10.0, help="submits per second")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    rows = []
    for mode in MODES:
        log(f"{mode}: {args.jobs} jobs at {args.rate:g}/s ...")
        rows.append(await run_mode(mode, args.jobs, args.rate))
    print(f"{'mode':<12} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'agent CPU ms/job':>17} "
          f"{'children CPU ms/job':>20}")  # fmt: skip
    for r in rows:
        cpu = f"{r['agent_cpu_ms_per_job']:17.2f} {r['children_cpu_ms_per_job']:20.2f}"
        print(f"{r['mode']:<12} {r['p50_ms']:8.1f} {r['p90_ms']:8.1f} {r['p99_ms']:8.1f} {cpu}")
    added_p50 = rows[0]["p50_ms"] - rows[1]["p50_ms"]
    added_p99 = rows[0]["p99_ms"] - rows[1]["p99_ms"]
    met = "MET" if added_p50 < TARGET_ADDED_P50_MS else "NOT MET"
    print(f"sandbox adds {added_p50:.1f} ms at p50, {added_p99:.1f} ms at p99 "
          f"(target < {TARGET_ADDED_P50_MS:g} ms at p50: {met})")  # fmt: skip
    for r in rows:
        print(f"  {r['mode']}: {r['confinement']}")
    direct_rows = [await direct(mode, args.jobs) for mode in MODES]
    print(f"the agent's part alone (LocalExecutor.start to the job's first instruction, "
          f"{args.jobs} runs each):")  # fmt: skip
    for r in direct_rows:
        print(f"  {r['mode']:<12} p50 {r['p50_ms']:6.1f} ms   p99 {r['p99_ms']:6.1f} ms")
    direct_added = direct_rows[0]["p50_ms"] - direct_rows[1]["p50_ms"]
    print(f"  sandbox adds {direct_added:.1f} ms at p50 here")
    if args.json:
        figures = {"rows": rows, "added_p50_ms": added_p50, "added_p99_ms": added_p99,
                   "direct": direct_rows, "direct_added_p50_ms": direct_added}  # fmt: skip
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
