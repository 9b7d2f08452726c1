"""The metrics on a real federation (etcd, two agent processes, a broker process): every
/metrics endpoint passes `promtool check metrics`, and a real Prometheus scrapes them all and
answers PromQL for per-site capacity and per-tenant cost (docs/metrics.md), and every panel
of the Grafana dashboards (metering/grafana.py, docs/dashboards.md) returns series.

Prometheus and promtool come from the Debian package `prometheus` (`make prometheus`,
.ci/install-prometheus); without them these tests skip, saying so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from metering import grafana
from sites.emulation.etcd_server import free_port
from sites.model import keys
from tests.broker.conftest import Federation
from tests.conftest import ADMIN_TOKEN, AUTH
from tests.routing.standins import StandIns

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)

SITES: dict[str, dict[str, Any]] = {
    "east-a": {"region": "east", "coordinates": {"lat": 31.2, "lon": 121.4}, "price": 3.0},
    "west": {
        "region": "west",
        "coordinates": {"lat": 37.5, "lon": 105.2},
        "price": 1.0,
        "model": "A100-80GB",
        "count": 8,
    },
}
# what the federation has: accelerators per site (tests/broker/conftest.py's inventory)
ACCELERATORS = {"east-a": 16.0, "west": 8.0}

needs_prometheus = pytest.mark.skipif(
    shutil.which("promtool") is None or shutil.which("prometheus") is None,
    reason="no prometheus/promtool on PATH: `make prometheus` (.ci/install-prometheus)",
)


def scrape(url: str, *, auth: bool) -> str:
    req = urllib.request.Request(url + "/metrics", headers=AUTH if auth else {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        body: bytes = resp.read()
    return body.decode()


async def agent_urls(fed: Federation) -> dict[str, str]:
    """site -> the base URL its agent advertises in its record (/cpn/v1/agents/<site>)."""
    _, kvs = await fed.registry.list_prefix(keys.AGENTS)
    return {
        keys.split(key, keys.AGENTS)[0]: json.loads(value)["url"].rstrip("/")
        for key, value, _ in kvs
    }


def promtool_check(text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )


def run_jobs(fed: Federation) -> list[dict[str, Any]]:
    """One GPU job finished on each site (the cheapest one for its model): usage to bill."""
    jobs = [
        fed.submit(name="on-h100", gpu={"model": "H100", "count": 2}, command=["sleep", "1"]),
        fed.submit(name="on-a100", gpu={"model": "A100-80GB", "count": 1}, command=["sleep", "1"]),
    ]
    return [fed.wait_state(job["id"], "SUCCEEDED", "FAILED", timeout=30) for job in jobs]


@needs_prometheus
async def test_every_metrics_endpoint_passes_promtool(
    make_federation: Callable[..., Federation],
) -> None:
    fed = make_federation(SITES)
    done = run_jobs(fed)
    assert [job["state"] for job in done] == ["SUCCEEDED", "SUCCEEDED"], done
    endpoints = {"broker": scrape(fed.broker_url, auth=True)}
    endpoints.update(
        {site: scrape(url, auth=False) for site, url in (await agent_urls(fed)).items()}
    )
    assert set(endpoints) == {"broker", *SITES}
    for name, text in endpoints.items():
        checked = promtool_check(text)
        assert checked.returncode == 0, f"{name}: {checked.stdout}{checked.stderr}"
        assert checked.stdout.strip() == "" and checked.stderr.strip() == "", (name, checked)
        assert "_total_total" not in text, name

    broker = endpoints["broker"]
    assert 'cpn_broker_jobs_finished_total{state="SUCCEEDED",tenant="t1"} 2.0' in broker
    assert "cpn_broker_placement_latency_seconds_count" in broker
    assert 'cpn_broker_watch_lag_seconds_count{kind="site_status"}' in broker
    assert 'cpn_broker_site_up{region="east",site="east-a"} 1.0' in broker
    assert 'cpn_usage_cost_usd_total{site="east-a",tenant="t1"}' in broker
    assert 'cpn_usage_energy_joules_total{site="west",tenant="t1"}' in broker
    east = endpoints["east-a"]
    assert 'cpn_site_capacity_accelerators{model="H100",site="east-a"} 16.0' in east
    assert 'cpn_site_capacity_memory_bytes{site="east-a"} 4.096e+12' in east
    assert 'cpn_link_rtt_seconds{peer="west",site="east-a"}' in east
    # no GPU on a declared-inventory site (nor on this machine): the NVML series are absent
    assert "cpn_gpu_utilization_ratio{" not in east and "cpn_gpu_power_watts{" not in east


class Prometheus:
    """A real Prometheus on a loopback port, with its own config and storage; stopped by pid."""

    def __init__(self, root: Path, targets: dict[str, list[str]], token: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {
                    "job_name": "cpn-broker",
                    "authorization": {"type": "Bearer", "credentials": token},
                    "static_configs": [{"targets": targets["broker"]}],
                },
                {"job_name": "cpn-agents", "static_configs": [{"targets": targets["agents"]}]},
            ],
        }
        (root / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = root / "prometheus.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    "prometheus",
                    f"--config.file={root / 'prometheus.yml'}",
                    f"--storage.tsdb.path={root / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]["result"]  # type: ignore[no-any-return]

    def by(self, promql: str, label: str) -> dict[str, float]:
        return {r["metric"][label]: float(r["value"][1]) for r in self.query(promql)}

    def wait(self, promql: str, label: str, want: Callable[[dict[str, float]], bool]) -> Any:
        deadline = time.monotonic() + 30
        got: dict[str, float] = {}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError("prometheus exited: " + self.log.read_text())
            try:
                got = self.by(promql, label)
            except OSError:
                got = {}
            if want(got):
                return got
            time.sleep(0.25)
        raise AssertionError(f"{promql}: {got}; prometheus log: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[dict[str, list[str]]], Prometheus]]:
    started: list[Prometheus] = []

    def start(targets: dict[str, list[str]]) -> Prometheus:
        root = tmp_path / "prometheus"
        root.mkdir()
        server = Prometheus(root, targets, ADMIN_TOKEN)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def hostport(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc


@needs_prometheus
async def test_prometheus_scrapes_the_federation_and_answers_promql(
    make_federation: Callable[..., Federation],
    prometheus: Callable[[dict[str, list[str]]], Prometheus],
) -> None:
    fed = make_federation(SITES)
    done = run_jobs(fed)
    agents = await agent_urls(fed)
    prom = prometheus(
        {"broker": [hostport(fed.broker_url)], "agents": [hostport(u) for u in agents.values()]}
    )
    up = prom.wait(
        "count by (job) (up == 1)", "job", lambda got: got == {"cpn-broker": 1, "cpn-agents": 2}
    )
    assert up == {"cpn-broker": 1.0, "cpn-agents": 2.0}

    capacity = prom.wait(
        "sum by (site) (cpn_site_capacity_accelerators)", "site", lambda got: len(got) == 2
    )
    assert capacity == ACCELERATORS

    # per-tenant cost: what the ledger billed, as GET /v1/usage reports it
    status, usage = fed.request("GET", "/v1/usage?by=tenant")
    assert status == 200, usage
    billed = {row["tenant"]: row["total_usd"] for row in usage["items"]}
    assert set(billed) == {"t1"} and billed["t1"] > 0, usage
    cost = prom.wait(
        "sum by (tenant) (max without (instance, job) (cpn_usage_cost_usd_total))",
        "tenant",
        lambda got: got.get("t1", 0) > 0,
    )
    assert cost["t1"] == pytest.approx(billed["t1"], rel=1e-6)
    finished = prom.wait(
        "max by (tenant) (cpn_broker_jobs_finished_total)", "tenant", lambda got: "t1" in got
    )
    assert finished == {"t1": float(len(done))}


# -- the Grafana dashboards (metering/grafana.py): every panel's query answers ----------------

MODEL = "chat-model"
CLIENTS = {"client_regions": [{"id": "user-east", "attach": [{"site": "east-a"}]}]}
# what a dashboard's variables and Grafana's own macros stand for here
MACROS = {
    "$__rate_interval": "15s",  # four scrape intervals and more, as Grafana's is
    "$__range": "5m",
    '=~"$site"': '=~"east-a"',
    '=~"$tenant"': '=~"t1"',
    '=~"$client_region"': '=~"user-east"',
    '=~"$model"': f'=~"{MODEL}"',
}


def expand(expr: str) -> str:
    for macro, value in MACROS.items():
        expr = expr.replace(macro, value)
    if "$" in expr:
        raise AssertionError(f"a variable this test does not give a value: {expr}")
    return expr


def chat(fed: Federation, token: str) -> dict[str, Any]:
    """One chat completion through the broker's gateway, from client region user-east."""
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    ).encode()
    req = urllib.request.Request(
        fed.broker_url + "/v1/chat/completions",
        data=body,
        method="POST",
        headers={
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/json",
            "X-Cpn-Client-Region": "user-east",
        },
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
    return answer


@needs_prometheus
async def test_every_dashboard_panel_returns_series(
    make_federation: Callable[..., Federation],
    prometheus: Callable[[dict[str, list[str]]], Prometheus],
    standins: StandIns,
    tmp_path: Path,
) -> None:
    model_server = await standins.start(MODEL, "--median-ms", "5", "--p99-ms", "10")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "clients.yaml").write_text(yaml.safe_dump(CLIENTS))
    service = {"name": "chat", "model": MODEL, "url": model_server, "max_concurrency": 4}
    fed = make_federation({**SITES, "east-a": {**SITES["east-a"], "services": [service]}})
    # the activity the panels read: finished jobs (the ledger, the scheduler's latency), a
    # running one and one that waits for it (unfinished jobs, the batch solver), inference
    # requests of tenant t1 from a client region (routing, the gateway, tokens)
    run_jobs(fed)
    running = fed.submit(
        name="holds-east", gpu={"model": "H100", "count": 16}, command=["sleep", "120"]
    )
    fed.wait_state(running["id"], "RUNNING", timeout=30)
    waiting = fed.submit(name="waits", gpu={"model": "H100", "count": 16}, command=["true"])
    status, made = fed.request("POST", "/v1/tokens", {"role": "tenant-user", "tenant": "t1"})
    assert status == 201, made
    for _ in range(3):
        answer = chat(fed, made["token"])
        assert answer["model"] == MODEL and answer["usage"]["completion_tokens"] > 0, answer
    assert fed.job(waiting["id"])["state"] == "PENDING"

    agents = await agent_urls(fed)
    prom = prometheus(
        {"broker": [hostport(fed.broker_url)], "agents": [hostport(u) for u in agents.values()]}
    )
    boards = grafana.dashboards()
    assert set(boards) == {
        "cpn-federation", "cpn-site", "cpn-tenant", "cpn-inference", "cpn-scheduler"
    }  # fmt: skip
    pending = {
        (uid, title, expand(expr)) for uid, board in boards.items()
        for title, expr in grafana.queries(board)
    }  # fmt: skip
    assert len(pending) > 50
    # the variables' lists: each has the value the panels are asked with
    wanted = {"site": "east-a", "tenant": "t1", "client_region": "user-east", "model": MODEL}
    variables = {
        (uid, name, f"count by ({label}) ({metric})", label)
        for uid, board in boards.items()
        for name, metric, label in grafana.variable_queries(board)
    }
    assert {name for _, name, _, _ in variables} == set(wanted)

    def has_value(promql: str, label: str, value: str) -> bool:
        return value in {r["metric"].get(label) for r in prom.query(promql)}

    deadline = time.monotonic() + 60
    while (pending or variables) and time.monotonic() < deadline:
        if prom.proc.poll() is not None:
            raise AssertionError("prometheus exited: " + prom.log.read_text())
        try:
            pending = {q for q in pending if not prom.query(q[2])}
            variables = {v for v in variables if not has_value(v[2], v[3], wanted[v[1]])}
        except OSError:
            pass
        if pending or variables:
            time.sleep(1)
    assert not pending, "panels without series:\n" + "\n".join(map(str, sorted(pending)))
    assert not variables, variables
