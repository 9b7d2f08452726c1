"""The chaos soak (docs/chaos.md, issue 46): a federation on a three-member etcd with two broker
replicas, three agents (two with a skewed clock) and stand-in model servers, fed jobs, gangs,
workflows and inference requests while agents, the leader broker and etcd members are
SIGKILLed and restarted at random; then the history is checked (tests/broker/chaos_history.py):
one terminal state per job, one fence per attempt, no overlapping attempts (the jobs' own
stamps and the agents' reports), ledger = runs, no job pending beside free capacity past the
pass bound, every inference request answered within its retries.

The suite runs it for CPN_SOAK_S (20 s of faults); bench/chaos_soak.py runs it for minutes and
prints the figures it writes to CPN_SOAK_FIGURES.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml

from broker.model.jobs import JobSpec
from sites.emulation.etcd_server import EtcdCluster, free_port
from sites.kits.clock import FAULT_CLOCK_SKEW_ENV
from sites.model import keys
from sites.model.errors import RegistryError
from sites.model.status import SiteStatus
from sites.registry.client import DEFAULT_TIMEOUT_S, Registry
from tests.broker import chaos_history as ch
from tests.broker.conftest import BROKER_SETTINGS, federation_site, join_sites, shared_dir
from tests.conftest import AUTH, CONFIGS, Processes, write_admin_token
from tests.routing.standins import StandIns

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)

CHAOS_S = float(os.environ.get("CPN_SOAK_S", "20"))
SEED = int(os.environ.get("CPN_SOAK_SEED", str(int(time.time()))))
# refresh_s 0: a status every interval, so a lost site's last run is billed to its kill. Names
# of their own: an agent that starts stops what is left in its site's cgroups on this host, and
# other tests' federations run sites called east-a or west
SITES: dict[str, dict[str, Any]] = {
    "soak-a": {"region": "east", "coordinates": {"lat": 31.2, "lon": 121.4}, "price": 3.0},
    "soak-b": {"region": "east", "coordinates": {"lat": 31.3, "lon": 120.6}, "price": 2.0},
    "soak-w": {
        "region": "west",
        "coordinates": {"lat": 37.5, "lon": 105.2},
        "price": 1.0,
        "model": "A100-80GB",
    },
}
SKEW_S = {"soak-b": 3.0, "soak-w": -2.0}  # the agents' clocks, off by this (CPN_FAULT_CLOCK_SKEW_S)
SERVED = {"soak-a": "soak-chat", "soak-b": "soak-chat"}  # one model served at two sites
MODEL = "soak-chat"
REGION = {"X-Cpn-Client-Region": "user-east"}
# how long a fitting job may wait PENDING: the batch pass's interval and time limit, a status
# interval for the site's free capacity to be seen, a second of slack; the clock starts
# afresh whenever the leader changed within LEADER_GRACE_S (a new leader rebuilds its view)
PASS_BOUND_S = 2.0 + 1.0 + 0.5 + 1.0
LEADER_GRACE_S = 5.0
# when an etcd member is SIGKILLed and it was the raft leader, the writes in flight are lost
# with it (etcd does not propose them again after the election) and wait out the registry's
# request deadline (sites.registry.client.DEFAULT_TIMEOUT_S) before the pass that sent them
# fails and the next one goes on: a streak that spans such a kill is allowed that much more
ETCD_STALL_S = float(DEFAULT_TIMEOUT_S)
SETTLE_S = 60.0
# the end state is read once it held this long: a kill at the chaos's very end (an agent
# restarted just after it) can still move a job (its run reported lost, retried) seconds later
STABLE_S = 6.0
BILLED_TOLERANCE_S = 1.5
INFERENCE_GRACE_S = 5.0  # after a restart, the first tries that may still fail
# No finding of this soak is left open that its suite version lets pass: the ledger's clock
# (a site ahead under-billed, 1a96222) and the runs never reported running (unbilled,
# 7b13005) were fixed (docs/chaos.md, "Findings"). known_finding stays the one place to name
# one while it is open: its violations are counted and printed, the bench counts them as
# broken, and any other fails here.


def known_finding(history: ch.History, verdict: ch.Verdict, line: str) -> bool:
    return False


def _examples(history: ch.History, verdict: ch.Verdict, n: int = 10) -> list[str]:
    """The first `n` violations, those no known finding explains first."""
    unknown = [b for b in verdict.broken if not known_finding(history, verdict, b)]
    return (unknown + [b for b in verdict.broken if b not in unknown])[:n]


def _gang_of(name: str) -> str | None:
    return re.sub(r"-m\d+$", "", name) if name.startswith("soak-gang-") else None


INFER_TRIES = 8


def stamped(marks: Path, seconds: float, *, flaky: bool = False) -> list[str]:
    """A job that stamps its start and end (the host's real time) per attempt; a TERM stamps
    `term`; a flaky one fails its first attempt."""
    rc = '[ "$CPN_ATTEMPT" -gt 1 ] && rc=0 || rc=3' if flaky else "rc=0"
    head = "$CPN_JOB_ID $CPN_ATTEMPT"
    return ["sh", "-c", (
        f'echo "start {head} $CPN_SITE $(date +%s.%N)" >> {marks}; '
        f'trap \'echo "end {head} term $(date +%s.%N)" >> {marks}; exit 143\' TERM; '
        f"sleep {seconds:.2f} & wait $!; {rc}; "
        f'echo "end {head} $rc $(date +%s.%N)" >> {marks}; exit $rc'
    )]  # fmt: skip


class Soak:
    """The federation and the soak's clients, faults and history."""

    def __init__(self, cluster: EtcdCluster, processes: Processes, cfg: Path, marks: Path):
        self.cluster = cluster
        self.processes = processes
        self.cfg = cfg
        self.marks = marks
        self.rng = random.Random(SEED)
        self.history = ch.History(skew_s=dict(SKEW_S))
        self.lock = threading.Lock()
        self.brokers: dict[str, tuple[Any, str]] = {}  # name -> (process, url)
        self.agents: dict[str, Any] = {}
        self.stop = threading.Event()
        self.started = 0
        self.work: Counter[str] = Counter()
        self.pending_checked = 0

    # -- processes -----------------------------------------------------------------------------

    def _name(self, kind: str) -> str:
        with self.lock:
            self.started += 1
            return f"{kind}-{self.started}"

    def start_agent(self, site: str) -> None:
        env = {"CPN_STATE_DIR": str(self.cfg / "state")}
        if site in SKEW_S:
            env[FAULT_CLOCK_SKEW_ENV] = str(SKEW_S[site])
        self.agents[site] = self.processes.start(
            "agent", "--site", str(self.cfg / "sites" / f"{site}.yaml"),
            "--etcd", self.cluster.url, "--catalog", str(self.cfg / "devices.yaml"),
            "--probe-method", "tcp-connect", name=self._name(f"agent-{site}"), env=env,
        )  # fmt: skip

    def start_broker(self) -> str:
        name = self._name("broker")
        port = free_port()
        proc = self.processes.start(
            "broker", "--etcd", self.cluster.url, "--listen", f"127.0.0.1:{port}",
            "--config-dir", str(self.cfg), "--state-dir", str(self.cfg.parent / f"{name}-state"),
            name=name,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited: {self.processes.log(name)[-3000:]}")
            if self._health(url) is not None:
                with self.lock:
                    self.brokers[name] = (proc, url)
                return name
            time.sleep(0.1)
        raise AssertionError(f"{name} never answered")

    def _health(self, url: str) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2) as resp:
                got: dict[str, Any] = json.loads(resp.read())
                return got
        except (OSError, ValueError):
            return None

    def leader(self) -> str | None:
        with self.lock:
            brokers = list(self.brokers.items())
        for name, (_, url) in brokers:
            health = self._health(url)
            if health and health.get("leader"):
                return name
        return None

    # -- clients -------------------------------------------------------------------------------

    def urls(self) -> list[str]:
        with self.lock:
            urls = [url for _, url in self.brokers.values()]
        self.rng.shuffle(urls)
        return urls

    def call(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        """One request to a random live broker: (status, body); (0, why) when no answer came."""
        urls = self.urls()
        if not urls:
            return 0, "no broker"
        data = None if body is None else json.dumps(body).encode()
        sent = {**AUTH, **(headers or {})}
        if data:
            sent["Content-Type"] = "application/json"
        req = urllib.request.Request(urls[0] + path, data=data, method=method, headers=sent)
        try:
            with urllib.request.urlopen(req, timeout=15) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            try:
                return exc.code, json.loads(exc.read())
            except ValueError:
                return exc.code, None
        except (OSError, ValueError) as exc:
            return 0, repr(exc)

    def submit(self, kind: str, body: dict[str, Any], path: str = "/v1/jobs") -> None:
        """A submit whose answer may be lost: then the job is found (or not) in the history;
        never sent twice (it would be a second job)."""
        status, answer = self.call("POST", path, body)
        if status == 201:
            self.work[f"{kind} accepted"] += 1
        elif status == 0 or status >= 500:
            self.work[f"{kind} answer lost or 5xx"] += 1
        else:
            raise AssertionError(f"submit refused: {status} {answer}")

    def submit_gang(self, name: str, size: int) -> None:
        """Members are sent until the gang is full: a member whose answer was lost is sent
        again, and a 409 on gang.size says the lost one got in."""
        accepted = 0
        for send in range(6 * size):
            if accepted == size:  # a gang half sent would wait for ever: finished even at stop
                break
            body: dict[str, Any] = {
                # a name per send (the placement refused a gang two of whose members shared
                # one until d511d7a: docs/chaos.md, Findings)
                "name": f"{name}-m{send}", "tenant": "t1", "cpu": 1, "mem_gb": 1,
                "gang": {"name": name, "size": size},
                "command": stamped(self.marks, self.rng.uniform(0.5, 2.0)),
            }  # fmt: skip
            status, answer = self.call("POST", "/v1/jobs", body)
            if status == 201:
                accepted += 1
            elif status == 409:
                break
            elif status and status < 500:
                raise AssertionError(f"gang member refused: {status} {answer}")
            else:
                self.work["gang member answer lost or 5xx"] += 1
                time.sleep(0.3)
        self.work["gangs"] += 1

    def workload(self) -> None:
        for k in range(2):  # jobs that outlast the soak: still RUNNING, once, at its end
            long: dict[str, Any] = {
                "name": f"soak-long-{k}", "tenant": "t1", "cpu": 1, "mem_gb": 1,
                "max_retries": 100, "command": stamped(self.marks, CHAOS_S + SETTLE_S + 600),
            }  # fmt: skip
            self.submit("long job", long)
        i = 0
        next_gang = time.monotonic() + 1.0
        next_workflow = time.monotonic()
        while not self.stop.is_set():
            i += 1
            now = time.monotonic()
            if now >= next_workflow:
                next_workflow = now + 15.0
                steps = [
                    {"name": "prep", "cpu": 1, "command": stamped(self.marks, 1.0)},
                    {"name": "train", "after": ["prep"], "cpu": 2,
                     "command": stamped(self.marks, 2.0)},
                    {"name": "eval", "after": ["train"], "cpu": 1,
                     "command": stamped(self.marks, 0.5)},
                ]  # fmt: skip
                flow: dict[str, Any] = {"name": f"soak-wf-{i}", "tenant": "t1", "steps": steps}
                self.submit("workflow", flow, "/v1/workflows")
            elif now >= next_gang:
                next_gang = now + 5.0
                self.submit_gang(f"soak-gang-{i}", 2)
            else:
                gpu = self.rng.random() < 0.2
                body: dict[str, Any] = {
                    "name": f"soak-job-{i}", "tenant": "t1", "cpu": 1, "mem_gb": 1,
                    "max_retries": 3,
                    "command": stamped(
                        self.marks, self.rng.uniform(0.3, 3.0), flaky=self.rng.random() < 0.1
                    ),
                    # 8 of a site's 16: they queue at times, for the pending check to watch
                    **({"gpu": {"model": "H100", "count": 8}} if gpu else {}),
                }  # fmt: skip
                self.submit("gpu job" if gpu else "job", body)
            self.stop.wait(self.rng.uniform(0.2, 0.6))

    def inference(self) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        counts = self.history.inference
        while not self.stop.is_set():
            counts["requests"] += 1
            for attempt in range(INFER_TRIES):
                status, _ = self.call("POST", "/v1/chat/completions", body, REGION)
                if status == 200:
                    counts["answered"] += 1
                    break
                counts["errors"] += 1
                counts[f"error {status or 'no answer'}"] += 1
                if attempt == 0:
                    counts["first_try_errors"] += 1
                    self.history.inference_errors.append(time.time())
                time.sleep(0.25 * (attempt + 1))
            else:
                counts["gave_up"] += 1
            self.stop.wait(0.1)

    # -- faults --------------------------------------------------------------------------------

    def _kill(self, target: str, proc: Any) -> ch.Kill:
        kill = ch.Kill(target=target, at=time.time())
        proc.kill()
        proc.wait(15)
        self.history.kills.append(kill)
        return kill

    def agent_faults(self, first_s: float, every_s: tuple[float, float]) -> None:
        wait = first_s
        while not self.stop.wait(wait):
            site = self.rng.choice(sorted(SITES))
            kill = self._kill(f"agent:{site}", self.agents[site])
            # sometimes back before its lease ends (the runs are reported lost), sometimes after
            # the broker moved its jobs
            time.sleep(self.rng.uniform(0.5, 6.0))
            self.start_agent(site)
            kill.back_at = time.time()
            wait = self.rng.uniform(*every_s)

    def leader_faults(self, first_s: float, every_s: tuple[float, float]) -> None:
        wait = first_s
        while not self.stop.wait(wait):
            wait = self.rng.uniform(*every_s)
            name = self.leader()
            if name is None:
                continue
            with self.lock:
                proc, _ = self.brokers[name]
            # its address stays in the clients' list while it is down: they find out by failing
            kill = self._kill(f"broker:{name}", proc)
            time.sleep(self.rng.uniform(0.5, 3.0))
            with self.lock:
                del self.brokers[name]
            self.start_broker()
            kill.back_at = time.time()

    def etcd_faults(self, first_s: float, every_s: tuple[float, float]) -> None:
        wait = first_s
        while not self.stop.wait(wait):
            wait = self.rng.uniform(*every_s)
            member = self.rng.randrange(len(self.cluster.names))
            kill = ch.Kill(target=f"etcd:{member}", at=time.time())
            self.cluster.kill(member)
            self.history.kills.append(kill)
            time.sleep(self.rng.uniform(0.5, 4.0))
            self.cluster.restart(member)
            kill.back_at = time.time()

    # -- what etcd saw ---------------------------------------------------------------------------

    async def watch_jobs(self, reg: Registry, start: int, done: asyncio.Event) -> None:
        """Every put of a job record, in revision order; the watch resumes after a broken
        stream from the revision after the last it saw."""
        revision = start
        while not done.is_set():
            try:
                async for event in reg.watch(keys.JOBS, start_revision=revision):
                    revision = event.revision + 1
                    if event.value is not None:
                        job = event.key.removeprefix(keys.JOBS)
                        ch.record_job(self.history, job, json.loads(event.value))
                    if done.is_set():
                        return
            except RegistryError as exc:
                if "compacted" in str(exc):
                    self.history.gaps += 1
                    revision = await reg.revision()
                await asyncio.sleep(0.2)

    async def sample_pending(self, reg: Registry, done: asyncio.Event) -> None:
        """Every 0.5 s: each plain job PENDING (not backing off) and each live, uncordoned
        site's free capacity; a job that fits a site's free capacity in PASS_BOUND_S of
        samples in a row, with no leader change meanwhile, waited too long."""
        since: dict[str, float] = {}
        flagged: set[str] = set()
        leader: tuple[bytes, float] | None = None
        while not done.is_set():
            await asyncio.sleep(0.5)
            try:
                now = time.time()
                held = await reg.get_raw(keys.LEADER)
                _, jobs = await reg.list_prefix(keys.JOBS)
                _, site_kvs = await reg.list_prefix(keys.SITES)
            except RegistryError:
                since.clear()  # no sample: no streak spans a gap
                continue
            value = held[0] if held else b""
            if leader is None or leader[0] != value or not value:
                leader = (value, now)
            if not value or now - leader[1] < LEADER_GRACE_S:
                since.clear()
                continue
            free: list[SiteStatus] = []
            cordoned = {k.split("/")[-2] for k, _, _ in site_kvs if k.endswith("/cordon")}
            for key, raw, _ in site_kvs:
                if key.endswith("/status") and key.split("/")[-2] not in cordoned:
                    free.append(SiteStatus.model_validate_json(raw))
            docs = [(key.removeprefix(keys.JOBS), json.loads(raw)) for key, raw, _ in jobs]
            holds = _held(doc for _, doc in docs)
            waiting = set()
            for job, doc in docs:
                if doc["state"] != "PENDING" or not doc["spec"]["name"].startswith("soak-job-"):
                    continue
                if doc.get("not_before", 0) > now:
                    continue
                spec = JobSpec.model_validate(doc["spec"])
                fits = [s.site for s in free if _fits(spec, s, holds.get(s.site, Counter()))]
                if not fits:
                    continue
                waiting.add(job)
                self.pending_checked += 1
                began = since.setdefault(job, now)
                etcd_killed = any(
                    k.target.startswith("etcd:") and began - ETCD_STALL_S <= k.at <= now
                    for k in self.history.kills
                )
                bound = PASS_BOUND_S + (ETCD_STALL_S if etcd_killed else 0.0)
                if now - began > bound and job not in flagged:
                    flagged.add(job)
                    self.history.waited_too_long.append(
                        f"{job}: PENDING {now - since[job]:.1f} s while {', '.join(fits)} had "
                        f"room (unschedulable: {doc.get('unschedulable')})"
                    )
            for job in set(since) - waiting:
                del since[job]


def _named(verdicts: list[ch.Verdict], per_verdict: int = 10) -> list[str]:
    """The jobs the violations name (a line starts with the job's id), the first of each."""
    out: list[str] = []
    for verdict in verdicts:
        if verdict.name.startswith("billed time") or verdict.name.startswith("inference"):
            continue  # the lines say all there is
        for line in verdict.broken[:per_verdict]:
            job = line.split(":")[0].split(" ")[0]
            if job not in out:
                out.append(job)
    return out


def _evidence(soak: Soak, job: str) -> dict[str, Any]:
    """What is known of `job`: its states as the watch saw them, its record's events, its
    stamps, its segments, and for a gang member its gang's other members and their states."""
    history = soak.history
    status, record = soak.call("GET", f"/v1/jobs/{job}")
    events = record.get("events", []) if status == 200 and isinstance(record, dict) else []
    name = history.names.get(job, "")
    gang = _gang_of(name)
    return {
        "name": name,
        "states": history.states.get(job, []),
        "events": [
            f"{e['at']:.2f} {e['type']} attempt {e.get('attempt')} at {e.get('site')}: "
            f"{e['message']}"
            for e in events
        ],
        "stamps": [
            f"attempt {r.attempt} at {r.site}: {r.start:.2f} - {r.end} ({r.outcome})"
            for r in history.runs.values()
            if r.job == job
        ],
        "segments": [
            f"attempt {a}: {seg}" for (j, a), seg in sorted(history.segments.items()) if j == job
        ],
        "gang": {
            other: history.states[other]
            for other, n in history.names.items()
            if gang and other != job and _gang_of(n) == gang
        },
        "kills_near": [
            f"{k.target} {k.at:.2f} - {k.back_at}"
            for k in history.kills
            if any(abs(k.at - r.start) < 10 for r in history.runs.values() if r.job == job)
        ],
        "record": {
            k: v
            for k, v in (record.items() if isinstance(record, dict) else ())
            if k not in ("spec", "events")
        },
    }


def _gist(message: str) -> str:
    """A failure message without what differs per job (ids, numbers), to count alike ones."""
    return re.sub(r"[0-9a-f]{6}\b|\d+(\.\d+)?", "#", message)[:100]


def _held(docs: Iterable[dict[str, Any]]) -> dict[str, Counter[str]]:
    """site -> what the job records placed or running there hold (cpu, mem_gb, a device model's
    count): the broker's own accounting, ahead of what the site's agent last published."""
    out: dict[str, Counter[str]] = {}
    for doc in docs:
        placement = doc.get("placement")
        if doc["state"] not in ("PLACED", "RUNNING") or not placement:
            continue
        held = out.setdefault(placement["site"], Counter())
        held["cpu"] += doc["spec"].get("cpu", 1)
        held["mem_gb"] += doc["spec"].get("mem_gb", 1.0)
        if placement.get("model") and placement.get("gpus"):
            held[placement["model"]] += placement["gpus"]
    return out


def _fits(spec: JobSpec, status: SiteStatus, held: Counter[str]) -> bool:
    """`spec` fits in what the site's agent says is free and in what no job record holds."""
    free, total = status.free, status.capacity
    cpu = min(free.cpu_cores, total.cpu_cores - held["cpu"])
    mem_gb = min(free.mem_gb, total.mem_gb - held["mem_gb"])
    if spec.cpu > cpu or spec.mem_gb > mem_gb:
        return False
    if not spec.gpu.count:
        return True
    models = [spec.gpu.model] if spec.gpu.model else list(spec.gpu.models or ())
    return any(
        min(free.devices.get(m, 0), total.devices.get(m, 0) - held[m]) >= spec.gpu.count
        for m in models
    )


def _configs(tmp: Path, cluster: EtcdCluster, standin_urls: dict[str, str]) -> Path:
    cfg = tmp / "configs"
    (cfg / "sites").mkdir(parents=True)
    shutil.copy(CONFIGS / "devices.yaml", cfg / "devices.yaml")
    shutil.copytree(CONFIGS / "latency", cfg / "latency")
    inference = {"health_interval_s": 0.5,
                 "outlier": {"base_ejection_time_s": 2, "max_ejection_time_s": 4}}  # fmt: skip
    (cfg / "broker.yaml").write_text(yaml.safe_dump({**BROKER_SETTINGS, "inference": inference}))
    regions = {"user_regions": [{"id": "user-east", "lat": 31.23, "lon": 121.47}]}
    (cfg / "regions.yaml").write_text(yaml.safe_dump(regions))
    attach = [{"site": site} for site in SERVED]
    clients = {"client_regions": [{"id": "user-east", "attach": attach, "cidrs": ["127.0.0.0/8"]}]}
    (cfg / "clients.yaml").write_text(yaml.safe_dump(clients))
    (cfg / "tenants.yaml").write_text(yaml.safe_dump({"tenants": {}}))
    shared = shared_dir(tmp)
    for site_id, spec in SITES.items():
        doc = federation_site(site_id, {"shared": shared, "refresh_s": 0, **spec})
        if site_id in standin_urls:
            doc["services"] = [{"name": "chat", "model": SERVED[site_id],
                                "url": standin_urls[site_id], "max_concurrency": 16}]  # fmt: skip
        (cfg / "sites" / f"{site_id}.yaml").write_text(yaml.safe_dump(doc))
    join_sites(cluster.url, sorted((cfg / "sites").glob("*.yaml")), cfg / "devices.yaml")
    return cfg


async def _segments(
    reg: Registry,
) -> dict[tuple[str, int], tuple[str, float, float, float, str]]:
    _, kvs = await reg.list_prefix(keys.USAGE_SEGMENTS)
    out = {}
    for key, raw, _ in kvs:
        job = keys.split(key, keys.USAGE_SEGMENTS)[1]
        if job.endswith(".egress"):
            continue
        seg = json.loads(raw)
        out[(seg["job"], int(seg["attempt"]))] = (
            seg["site"],
            float(seg["start"]),
            float(seg["end"]),
            float(seg["seconds"]),
            seg.get("clock") or "site",  # none: written before segments said (the site's)
        )
    return out


async def _settle(soak: Soak, within_s: float) -> float:
    """Wait until every job the watch saw is terminal, but the long ones, RUNNING, and that has
    held for STABLE_S."""
    started = time.monotonic()
    names = soak.history.names
    held_since: float | None = None
    while time.monotonic() - started < within_s:
        last = {job: states[-1] for job, states in soak.history.states.items()}
        if all(
            state == "RUNNING"
            if names.get(job, "").startswith("soak-long-")
            else state in ch.TERMINAL
            for job, state in last.items()
        ):
            held_since = held_since or time.monotonic()
            if time.monotonic() - held_since >= STABLE_S:
                break
        else:
            held_since = None
        await asyncio.sleep(0.5)
    return time.monotonic() - started


async def _run_threads(
    targets: list[Callable[[], None]], crashed: list[BaseException]
) -> list[threading.Thread]:
    """Each target in a thread of its own; what one raises is put in `crashed` (the soak fails
    on it: a client or a fault loop that died would leave a history that looks quiet)."""

    def guarded(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:  # noqa: BLE001 - the test raises it again
                crashed.append(exc)

        return run

    threads = [threading.Thread(target=guarded(t), daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    return threads


@pytest.fixture
async def cluster(tmp_path: Path) -> Any:
    c = EtcdCluster(3, data_dir=tmp_path / "etcd", unsafe_no_fsync=True)
    c.start()
    try:
        yield c
    finally:
        for i in range(len(c.names)):
            c.kill(i)
        c.stop()


# Not strict: on a quiet run of the whole suite, 7 jobs were RUNNING at the end with no run
# going and unbilled, as an etcd member died ("report ... not written ... retrying", then
# nothing). The likeliest cause, a broker view frozen by a watch that stayed open and silent,
# has a safety net since (a1056c7: docs/chaos.md, "Findings"); it did not recur in 14 runs
# since, but its cause is not proven. The soak reports, and does not stop the suite;
# bench/chaos_soak.py counts every violation as broken.
@pytest.mark.xfail(strict=False, reason="a view frozen across an etcd member's death (a1056c7)")
async def test_the_federation_keeps_its_invariants_under_chaos(
    cluster: EtcdCluster, processes: Processes, standins: StandIns, tmp_path: Path
) -> None:
    urls = {site: await standins.start(f"{site}/chat", "--median-ms", "10", "--p99-ms", "30",
                                       "--max-concurrency", "16") for site in SERVED}  # fmt: skip
    cfg = _configs(tmp_path, cluster, urls)
    marks = tmp_path / "shared" / "runs"
    async with Registry.from_urls(cluster.url) as reg:
        await write_admin_token(reg)
        soak = Soak(cluster, processes, cfg, marks)
        for site in SITES:
            soak.start_agent(site)
        await asyncio.to_thread(soak.start_broker)  # it leads
        await asyncio.to_thread(soak.start_broker)  # it stands by
        deadline = time.monotonic() + 30
        while True:
            status, sites = soak.call("GET", "/v1/sites")
            if status == 200 and all(s["state"] == "up" for s in sites["items"]):
                break
            assert time.monotonic() < deadline, f"sites not up: {sites}"
            await asyncio.sleep(0.2)
        done = asyncio.Event()
        watcher = asyncio.create_task(
            soak.watch_jobs(reg, await reg.revision() + 1, done), name="soak: jobs' history"
        )
        sampler = asyncio.create_task(soak.sample_pending(reg, done), name="soak: pending")
        spread = (CHAOS_S / 4, CHAOS_S / 2.5) if CHAOS_S < 60 else (8.0, 20.0)
        began = time.monotonic()
        crashed: list[BaseException] = []
        threads = await _run_threads([
            soak.workload, soak.inference,
            lambda: soak.agent_faults(2.0, (max(3.0, spread[0] / 2), spread[1] / 2)),
            lambda: soak.etcd_faults(5.0, spread),
            lambda: soak.leader_faults(9.0, spread),
        ], crashed)  # fmt: skip
        try:
            await asyncio.sleep(CHAOS_S)
        finally:
            soak.stop.set()
            for thread in threads:
                await asyncio.to_thread(thread.join, 60)
        chaos_s = time.monotonic() - began
        assert not any(t.is_alive() for t in threads), "a soak thread did not stop"
        settle_s = await _settle(soak, SETTLE_S)
        await asyncio.sleep(1.0)  # the watch's last events, the last segments
        done.set()
        sampler.cancel()
        watcher.cancel()
        tasks_ended = await asyncio.gather(sampler, watcher, return_exceptions=True)
        crashed += [e for e in tasks_ended if isinstance(e, Exception)]

        history = soak.history
        for line in marks.read_text().splitlines() if marks.exists() else []:
            ch.record_marker(history, line)
        for agent_log in processes.log_dir.glob("agent-*.log"):
            ch.record_launches(history, agent_log.read_text(errors="replace"))
        history.segments = await _segments(reg)
        verdicts = [
            ch.terminal_once(history),
            ch.one_placement_per_attempt(history),
            ch.no_overlap_runs(history),
            ch.no_overlap_reports(history),
            ch.ledger_equals_runs(history),
            ch.billed_time(history, BILLED_TOLERANCE_S),
            ch.no_idle_wait(history, soak.pending_checked),
            ch.inference_retried(history, INFERENCE_GRACE_S),
        ]
        for line in verdicts[4].broken:  # ledger = runs: did the broker ever know it ran?
            if line.endswith("ran, not billed"):
                job, _, attempt = line.split(":")[0].split(" ")
                status, record = soak.call("GET", f"/v1/jobs/{job}")
                events = record.get("events", []) if status == 200 else []
                if not any(
                    e["type"] == "running" and e.get("attempt") == int(attempt) for e in events
                ):
                    history.unreported.add((job, int(attempt)))
        # why the jobs that failed did (a flaky job's retries spent, a gang member's fall, ...)
        why_failed: Counter[str] = Counter()
        for job, states in history.states.items():
            if states[-1] == "FAILED":
                status, record = soak.call("GET", f"/v1/jobs/{job}")
                ended = (
                    [e for e in record["events"] if e["type"] == "failed"] if status == 200 else []
                )
                why_failed[_gist(ended[-1]["message"]) if ended else f"no record ({status})"] += 1
        evidence = {job: _evidence(soak, job) for job in _named(verdicts)}
        if evidence:  # the sites as the broker sees them at the end, each broker's health
            evidence["(sites)"] = soak.call("GET", "/v1/sites")[1]
            with soak.lock:
                brokers = list(soak.brokers.items())
            evidence["(brokers)"] = {name: soak._health(url) for name, (_, url) in brokers}
        for job, known in evidence.items():  # what etcd holds of it: its reports, assignments
            for site in SITES if not job.startswith("(") else ():
                for what, key in (("report", keys.report), ("assignment", keys.assignment)):
                    raw = await reg.get_raw(key(site, job))
                    if raw is not None:
                        known[f"{what} at {site}"] = raw[0].decode(errors="replace")[:600]
    final = Counter(states[-1] for states in history.states.values())
    ran_twice = Counter(r.job for r in history.runs.values() if r.outcome == "0")
    figures = {
        "seed": SEED, "chaos_s": chaos_s, "settle_s": settle_s,
        "faults": dict(ch.fault_counts(history)), "work": dict(soak.work),
        "jobs": len(history.states), "final_states": dict(final), "runs": len(history.runs),
        "segments": len(history.segments), "watch_gaps": history.gaps,
        "succeeded_twice": sum(1 for n in ran_twice.values() if n > 1),
        "why_failed": dict(why_failed),
        "evidence": evidence,
        # a client, a fault loop or a watch that died: the history is not whole (the figures
        # are written all the same, for what they show)
        "crashed": [repr(e)[:2000] for e in crashed],
        "inference": dict(history.inference),
        "invariants": [
            {"name": v.name, "checked": v.checked, "violations": v.violations,
             "known_finding": sum(known_finding(history, v, b) for b in v.broken),
             "examples": _examples(history, v)} for v in verdicts
        ],
    }  # fmt: skip
    out = os.environ.get("CPN_SOAK_FIGURES")
    if out:
        Path(out).write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures, indent=1))
    if crashed:
        raise crashed[0]
    assert history.gaps == 0, "the job watch lost events: the history is not whole"
    assert history.kills and history.states, figures
    broken = {
        v.name: [b for b in v.broken if not known_finding(history, v, b)][:10] for v in verdicts
    }
    assert not any(broken.values()), json.dumps(broken, indent=1)
