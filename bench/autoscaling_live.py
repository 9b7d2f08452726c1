"""Autoscaling live, one day compressed in time (issue 15, the first benchmark's live run).

Prints figures; it is not a timed test. A real `cpn up` (etcd, the agents of --sites, the
broker, the WAN emulation) runs one managed service whose replicas are the STAND-IN model
server (routing/standin/server.py) started by the sites' executors; `cpn load`'s engine
(cpn.load.run_load) sends a compressed day whose curve (simulations.service_demand.DailyDemand,
the simulator's) peaks at 20:00 local time in each client region, through the broker's gateway,
streaming, so the time to first token is the first server-sent event as the client sees it.

Two runs on the same seeded arrivals, one after the other on the same federation:

    cpn     the service as written below: the leader broker's autoscaler (broker/leader/scaler.py,
            broker.model.autoscaler.decide) with its delays compressed like the day
    static  the same service with min_replicas = max_replicas: every replica it may have, all
            day (the static fleet of the simulated benchmark)

Figures per client region: requests, errors, TTFT p50/p95/p99 and SLO attainment (the share
answered within the SLO; errors miss); replica-hours, sampled every second from GET
/v1/services/<name> (every replica placed at a site: starting, ready or draining is paid for;
a pending one, which no site can take, is not) and
scaled back to virtual time (x 86,400 / --day); the replicas per region over the day.

What it is not: the demo's replicas are reached over loopback, not through the WAN emulation
(docs/services.md, Limits), so the TTFT here has no RTT in it. Several replicas may run at one
site, so max_replicas (--max-replicas, default 3 per client region) bounds the scaling range
and sizes the static fleet, not the number of sites.
The SkyServe-like baseline runs in the simulated benchmark only (bench/autoscaling.py): the
live broker runs cpn's autoscaler.

    .venv/bin/python bench/autoscaling_live.py                     # ~15 minutes
    .venv/bin/python bench/autoscaling_live.py --day 4m --json /tmp/live.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchkit import log_stamped as log  # noqa: E402
from benchkit import share  # noqa: E402

from broker.model.regions import load_user_regions  # noqa: E402
from cpn.load import LoadReport, LoadSettings, run_load  # noqa: E402
from simulations.service_demand import utc_offset_h_of  # noqa: E402
from sites.emulation.etcd_server import free_port  # noqa: E402
from sites.model.durations import parse_duration_s  # noqa: E402

NAME = "chat-live"
DAY_S = 86_400.0
# the sites run: two in yangtze-delta and in chengdu-chongqing, one in each other region
SITES = ("zhangjiakou", "yrd-demo-zone", "wuhu", "tianfu", "chongqing", "frankfurt", "dallas")
CLIENTS = ("beijing", "shanghai", "frankfurt", "dallas")
PLACED = ("starting", "ready", "draining", "unhealthy")  # running at a site: paid for
REGIONS = ("jing-jin-ji", "yangtze-delta", "chengdu-chongqing", "eu-central", "us-south")


def spec(day_s: float, *, static: bool, count: int) -> dict[str, Any]:
    """The service: 4 slots per replica at a stand-in median of 150 ms (~22 req/s at
    saturation), a target of 9 req/s per replica, the autoscaler's delays compressed like the
    day (60 s up, 600 s down, a decision every 20 s of virtual time; at least 1 s), at most
    `count` replicas (several may run at one site)."""
    k = day_s / DAY_S
    return {
        "name": NAME,
        "tenant": "ai-lab",
        "model": "qwen2.5-7b-instruct",
        "command": (
            f"python -m routing.standin.server --listen {{host}}:{{port}} --name {NAME} "
            "--median-ms 150 --p99-ms 450 --max-concurrency 4"
        ),
        "cpu": 1,
        "mem_gb": 1,
        "slo": {"p95_ms": 600},
        "scaling": {
            "target_qps_per_replica": 9,
            "max_concurrency": 4,
            "interval_s": max(1.0, 20 * k),
            "upscale_delay_s": max(1.0, 60 * k),
            "downscale_delay_s": max(2.0, 600 * k),
        },
        "min_replicas": count if static else 1,
        "max_replicas": count,
        "regions": list(REGIONS),
        "clients": list(CLIENTS),
        "readiness": {"path": "/healthz", "period_s": 0.5, "timeout_s": 60},
        "drain_timeout_s": 5,
    }


class Demo:
    """A `cpn up` this bench started; stopped with SIGINT."""

    def __init__(self, work: Path, interval: float) -> None:
        self.work = work
        self.state = work / "state"
        self.state.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = ""
        self.service_file = work / "service.yaml"
        self.interval = interval
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, service: dict[str, Any]) -> None:
        self.service_file.write_text(yaml.safe_dump(service, sort_keys=False))
        env = {**os.environ, "CPN_STATE_DIR": str(self.state)}
        env["CPN_CONFIG"] = str(self.state / "config.yaml")
        args = [
            sys.executable, "-m", "cpn", "up", "--config-dir", str(REPO / "configs"),
            "--broker-listen", f"127.0.0.1:{self.port}", "--interval", str(self.interval),
            "--sites", ",".join(SITES), "--service", str(self.service_file),
        ]  # fmt: skip
        with open(self.state / "up.log", "ab") as out:
            self.proc = subprocess.Popen(
                args, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        log(f"cpn up started (pid {self.proc.pid}, broker {self.url})")
        deadline = time.monotonic() + 180
        while not self.token:
            self._check(deadline, "wrote no up.json")
            try:
                self.token = json.loads((self.state / "up.json").read_text()).get("token", "")
            except (OSError, ValueError):
                time.sleep(0.5)

    def _check(self, deadline: float, what: str) -> None:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"cpn up exited; see {self.state / 'up.log'}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"cpn up {what} in time; see {self.state / 'up.log'}")

    def call(self, method: str, path: str, body: str | None = None) -> Any:
        headers = {"Authorization": f"Bearer {self.token}"}
        data = None
        if body is not None:
            headers["Content-Type"] = "application/yaml"
            data = body.encode()
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as exc:
            return {"status": exc.code, **json.load(exc)}

    def view(self) -> dict[str, Any] | None:
        try:
            got = self.call("GET", f"/v1/services/{NAME}")
        except (OSError, ValueError):
            return None
        return got if "regions" in got else None

    def wait_ready(self, count: int, timeout: float = 180) -> int:
        """Until `count` replicas are ready, or `timeout` (then as many as are, at least one)."""
        deadline = time.monotonic() + timeout
        ready = 0
        while True:
            if ready >= 1 and time.monotonic() > deadline:
                return ready
            self._check(deadline + 60, f"had no ready replica of {NAME}")
            view = self.view()
            ready = sum(r["ready"] for r in view["regions"]) if view is not None else 0
            if ready >= count:
                return ready
            time.sleep(1.0)

    def apply(self, service: dict[str, Any]) -> None:
        got = self.call("PUT", f"/v1/services/{NAME}", yaml.safe_dump(service, sort_keys=False))
        if got.get("status", 200) >= 400:
            raise RuntimeError(f"the broker refused the service: {got}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


async def sample(demo: Demo, stop: asyncio.Event, out: list[tuple[float, dict[str, int]]]) -> None:
    """Every second: the replicas placed per client region (the reconciler's regions)."""
    started = time.monotonic()
    while not stop.is_set():
        view = await asyncio.to_thread(demo.view)
        if view is not None:
            counts = dict.fromkeys((r["region"] for r in view["regions"]), 0)
            for replica in view["replicas"]:
                if replica["state"] in PLACED:
                    counts[replica["region"]] = counts.get(replica["region"], 0) + 1
            out.append((time.monotonic() - started, counts))
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            pass


async def one_run(
    demo: Demo, label: str, settings: LoadSettings
) -> tuple[LoadReport, list[tuple[float, dict[str, int]]]]:
    log(f"{label}: sending a day in {settings.day_s:.0f} s")
    samples: list[tuple[float, dict[str, int]]] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample(demo, stop, samples))
    try:
        report = await run_load(settings, broker_url=demo.url, token=demo.token)
    finally:
        stop.set()
        await sampler
    return report, samples


def replica_hours(samples: list[tuple[float, dict[str, int]]], day_s: float) -> float:
    total = 0.0
    for (t0, counts), (t1, _) in zip(samples, samples[1:], strict=False):
        total += sum(counts.values()) * (t1 - t0)
    return total * (DAY_S / day_s) / 3600.0


def summary(report: LoadReport, samples: list[tuple[float, dict[str, int]]]) -> dict[str, Any]:
    s = report.settings
    regions = {}
    for name, r in report.regions.items():
        regions[name] = {
            "sent": r.sent,
            "ok": r.ok,
            "errors": r.errors,
            "error_kinds": r.error_kinds,
            "p50_ms": r.percentile_ms(0.5),
            "p95_ms": r.percentile_ms(0.95),
            "p99_ms": r.percentile_ms(0.99),
            "slo_attainment": r.attainment,
        }
    done = sum(r.ok + r.errors for r in report.regions.values())
    within = sum(r.within_slo for r in report.regions.values())
    rates = {name: v["slo_attainment"] for name, v in regions.items() if v["slo_attainment"]}
    # the replicas per region at each virtual hour (the sample nearest it)
    hourly: dict[str, list[int]] = {}
    for hour in range(24):
        wall = ((hour - s.start_hour_utc) % 24) * s.day_s / 24
        if not samples:
            break
        counts = min(samples, key=lambda p: abs(p[0] - wall))[1]
        for region, n in counts.items():
            hourly.setdefault(region, [0] * 24)[hour] = n
    return {
        "regions": regions,
        "slo_attainment": within / done if done else None,
        "slo_worst": min(rates.values()) if rates else None,
        "replica_hours": replica_hours(samples, s.day_s),
        "peak_replicas": max((sum(c.values()) for _, c in samples), default=0),
        "hourly_replicas": hourly,
    }


def ms(x: float | None) -> str:
    return "none" if x is None else f"{x:.0f}"


def print_results(res: dict[str, Any], day_s: float) -> None:
    cpn, static = res["cpn"], res["static"]
    print(f"\none day in {day_s:.0f} s of wall time ({DAY_S / day_s:.0f}x), sites {SITES}\n")
    print(f"{'client region':14} {'policy':7} {'sent':>6} {'errors':>6} {'p50':>5} {'p95':>5} "
          f"{'p99':>5} {'SLO met':>8}")  # fmt: skip
    for client in CLIENTS:
        for name, r in (("cpn", cpn), ("static", static)):
            v = r["regions"][client]
            print(
                f"{client:14} {name:7} {v['sent']:6d} {v['errors']:6d} {ms(v['p50_ms']):>5} "
                f"{ms(v['p95_ms']):>5} {ms(v['p99_ms']):>5} {share(v['slo_attainment']):>8}"
            )
    print()
    for name, r in (("cpn", cpn), ("static", static)):
        print(
            f"{name:7} replica-hours {r['replica_hours']:7.1f}  peak {r['peak_replicas']}  "
            f"SLO {share(r['slo_attainment'])}  worst region {share(r['slo_worst'])}"
        )
    print("\ncpn's replicas per client region by virtual UTC hour:")
    for region, counts in sorted(cpn["hourly_replicas"].items()):
        print(f"  {region:10} " + " ".join(str(n) for n in counts))
    # The static run is cpn's scaler at min = max replicas: its count is fixed, but it still
    # moves replicas between client regions as their demand moves (and holds the old ones
    # until the new are ready), which a fleet that never moves would not pay for. The target
    # is checked against the cheaper of the two: max_replicas x 24 h, or what was measured.
    nominal = res["max_replicas"] * 24.0
    fleet = min(static["replica_hours"], nominal)
    print(
        f"static fleet never moving: {res['max_replicas']} x 24 h = {nominal:.1f} replica-hours "
        f"(measured {static['replica_hours']:.1f})"
    )
    ratio = cpn["replica_hours"] / fleet if fleet else None
    ok = (
        ratio is not None
        and cpn["slo_attainment"] is not None
        and static["slo_attainment"] is not None
        and cpn["slo_attainment"] >= static["slo_attainment"]
        and ratio <= 0.6
    )
    print(
        f"\ntarget (SLO at least static's with at most 0.6x its replica-hours): SLO "
        f"{share(cpn['slo_attainment'])} vs {share(static['slo_attainment'])}, replica-hours "
        f"{'none' if ratio is None else f'{ratio:.2f}x'}: {'met' if ok else 'NOT met'}"
    )


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    day_s = parse_duration_s(args.day)
    offsets = {r: utc_offset_h_of(e.lon) for r, e in load_user_regions().items()}
    work = Path(tempfile.mkdtemp(prefix="cpn-autoscaling-live-"))
    demo = Demo(work, args.interval)
    settings = LoadSettings(
        service=NAME,
        regions=CLIENTS,
        utc_offset_h={c: offsets[c] for c in CLIENTS},
        slo_ms=dict.fromkeys(CLIENTS, 600.0),
        peak_rps=args.peak_rps,
        day_s=day_s,
        duration_s=day_s,
        peak_to_trough=args.peak_to_trough,
        stream=True,
        report_s=max(1.0, day_s / 48),
        seed=args.seed,
    )
    results: dict[str, Any] = {
        "day_s": day_s, "sites": SITES, "peak_rps": args.peak_rps,
        "max_replicas": args.max_replicas,
    }  # fmt: skip
    try:
        demo.start(spec(day_s, static=False, count=args.max_replicas))
        demo.wait_ready(1)
        log("warm-up: a quarter of the day, not counted")
        warm = dataclasses.replace(settings, duration_s=day_s / 4, seed=0)
        await run_load(warm, broker_url=demo.url, token=demo.token)
        report, samples = await one_run(demo, "cpn", settings)
        results["cpn"] = summary(report, samples)
        results["cpn"]["events"] = (demo.view() or {}).get("events", [])  # the last 50
        demo.apply(spec(day_s, static=True, count=args.max_replicas))
        got = demo.wait_ready(args.max_replicas, timeout=120)
        log(f"static: {got} replicas ready")
        report, samples = await one_run(demo, "static", settings)
        results["static"] = summary(report, samples)
        results["static"]["events"] = (demo.view() or {}).get("events", [])
    finally:
        demo.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--day", default="6m", help="wall time one virtual day takes (default 6m)")
    p.add_argument("--peak-rps", type=float, default=14.0, help="a region's rate at its peak")
    p.add_argument("--peak-to-trough", type=float, default=6.0)
    p.add_argument("--interval", type=float, default=1.0, help="the agents' publish period")
    p.add_argument(
        "--max-replicas", type=int, default=3 * len(CLIENTS),
        help="the service's max_replicas, the static fleet (default 3 per client region)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args()
    res = asyncio.run(amain(args))
    print_results(res, res["day_s"])
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
