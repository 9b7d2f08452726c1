"""Jobs end to end: real etcd, real agent processes, a real broker process, HTTP on loopback."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sites.model import keys
from sites.model.assignments import Assignment
from sites.registry.client import Registry
from tests.broker.conftest import SITES, Federation, assignments_of
from tests.conftest import AUTH, run_cpn

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)

CPU_ONLY: dict[str, Any] = {"cpu": 2, "mem_gb": 4}
SOON = (datetime.now(UTC) + timedelta(hours=1)).isoformat()


@pytest.mark.parametrize(
    ("spec", "site", "model"),
    [
        # cheapest H100 site wins on price alone (abroad 1.5 < east-b 2.0 < east-a 3.0)
        ({"name": "cheap", "gpu": {"model": "H100", "count": 4}}, "abroad", "H100"),
        # only mainland sites (denied eu): the cheaper of the two east sites
        (
            {"name": "domestic", "gpu": {"model": "H100", "count": 4}, "denied_regions": ["eu"]},
            "east-b",
            "H100",
        ),
        # any of two models: the A100 site is cheaper still
        (
            {"name": "either", "gpu": {"models": ["H100", "A100-80GB"], "count": 4}},
            "west",
            "A100-80GB",
        ),
        # sovereignty: only the eu region is allowed
        (
            {"name": "sovereign", "gpu": {"model": "H100", "count": 4}, "allowed_regions": ["eu"]},
            "abroad",
            "H100",
        ),
        # data gravity: 10 TB in east makes egress dominate
        (
            {
                "name": "gravity",
                "gpu": {"models": ["H100", "A100-80GB"], "count": 1},
                "data": {"region": "east", "size_gb": 10000},
            },
            "east-b",
            "H100",
        ),
        # latency: users in the east within 10 ms rule out west and abroad
        (
            {
                "name": "near",
                "gpu": {"models": ["H100", "A100-80GB"], "count": 1},
                "user": {"region": "user-east", "max_latency_ms": 10},
            },
            "east-b",
            "H100",
        ),
        # memory floor: 80 GB devices, cheapest is the A100 site
        ({"name": "floor", "gpu": {"min_mem_gb": 80, "count": 2}}, "west", "A100-80GB"),
        # more GPUs than the eu site has: 12 > 8, so east-b
        (
            {"name": "big", "gpu": {"model": "H100", "count": 12}, "denied_regions": ["west"]},
            "east-b",
            "H100",
        ),
    ],
    ids=lambda v: v["name"] if isinstance(v, dict) else str(v),
)
def test_job_runs_on_the_preferred_site(
    make_federation: Callable[..., Federation], spec: dict[str, Any], site: str, model: str
) -> None:
    fed = make_federation()
    record = fed.submit(**spec)
    done = fed.wait_state(record["id"], "SUCCEEDED", "FAILED")
    assert done["state"] == "SUCCEEDED", done["events"]
    assert done["placement"]["site"] == site and done["placement"]["model"] == model
    types = [e["type"] for e in done["events"]]
    assert types[:2] == ["submitted", "placed"] and types[-1] == "succeeded"
    assert done["exit_code"] == 0


async def test_unschedulable_job_says_why_per_site(
    make_federation: Callable[..., Federation],
) -> None:
    fed = make_federation()
    record = fed.submit(name="toobig", gpu={"model": "H100", "count": 64})
    for _ in range(100):
        record = fed.job(record["id"])
        if record.get("unschedulable"):
            break
        await asyncio.sleep(0.1)
    assert record["state"] == "PENDING"
    assert record["unschedulable"].startswith("0/4 sites:")
    assert (
        "lack H100" in record["unschedulable"]
        and "not enough free GPUs" in record["unschedulable"]
        or "GPU" in record["unschedulable"]
    )
    described = run_cpn("describe", record["id"], "--broker", fed.broker_url)
    assert "Waiting:     0/4 sites:" in described.stdout


async def test_concurrent_submits_never_overcommit(
    make_federation: Callable[..., Federation], registry: Registry
) -> None:
    fed = make_federation()
    capacity = {"east-a": 16, "east-b": 16, "west": 16, "abroad": 8}
    results: list[int] = []

    def submit(i: int) -> None:
        status, _ = fed.request(
            "POST",
            "/v1/jobs",
            {"name": f"burst-{i}", "tenant": "t1", "command": ["sleep", "30"],
             "gpu": {"models": ["H100", "A100-80GB"], "count": 2}},
        )  # fmt: skip
        results.append(status)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(201) == 200

    fits = sum(capacity.values()) // 2  # jobs of 2 GPUs

    def placed() -> int:
        status, page = fed.request("GET", "/v1/jobs?state=PLACED,running&limit=1000")
        return len(page["items"]) if status == 200 else -1

    deadline = time.monotonic() + 30  # the leader places what fits
    while placed() < fits and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    for _ in range(20):
        held: dict[str, int] = {}
        _, kvs = await registry.list_prefix(keys.ASSIGNMENTS)
        for _, raw, _ in kvs:
            a = Assignment.model_validate_json(raw)
            held[a.site] = held.get(a.site, 0) + a.gpus
        assert all(held.get(s, 0) <= cap for s, cap in capacity.items()), held
        await asyncio.sleep(0.1)
    assert sum(held.values()) == sum(capacity.values())  # everything that fits is placed
    status, page = fed.request("GET", "/v1/jobs?state=PLACED,running&limit=1000")
    assert status == 200 and page["continue"] is None
    assert len(page["items"]) == sum(capacity.values()) // 2


async def test_killed_site_job_moves_and_finishes_once(
    make_federation: Callable[..., Federation], tmp_path: Any, registry: Registry
) -> None:
    fed = make_federation()
    marker = tmp_path / "shared" / "runs.log"
    # the job appends one line when it starts and one when it completes
    command = (
        f"echo start $CPN_SITE $CPN_ATTEMPT >> {marker}; sleep 4; echo done $CPN_SITE >> {marker}"
    )
    record = fed.submit(
        name="survivor",
        gpu={"model": "H100", "count": 4},
        command=["sh", "-c", command],
        checkpoint_path="/ckpt/survivor",
    )
    running = fed.wait_state(record["id"], "RUNNING")
    first = running["placement"]["site"]
    assert first == "abroad"
    await asyncio.sleep(0.5)
    fed.kill(fed.agents[first])  # SIGKILL: its lease expires, the job must move
    done = fed.wait_state(record["id"], "SUCCEEDED", "FAILED", timeout=60)
    assert done["state"] == "SUCCEEDED", done["events"]
    assert done["placement"]["site"] != first
    types = [e["type"] for e in done["events"]]
    assert "migrated" in types
    lines = marker.read_text().splitlines()
    assert sum(1 for line in lines if line.startswith("done")) == 1, lines
    assert f"done {done['placement']['site']}" in lines
    assert not any(line == f"done {first}" for line in lines)
    # the dead site comes back: it must not run the job again
    fed.start_agent(first)
    await asyncio.sleep(3)
    assert sum(1 for line in marker.read_text().splitlines() if line.startswith("done")) == 1
    assert first not in await assignments_of(registry)


async def test_broker_restart_loses_nothing(make_federation: Callable[..., Federation]) -> None:
    fed = make_federation()
    long = fed.submit(name="long", gpu={"model": "H100", "count": 2}, command=["sleep", "6"])
    waiting = fed.submit(name="waiting", gpu={"model": "H100", "count": 64})
    suspended = fed.submit(name="paused", **CPU_ONLY, command=["sleep", "30"])
    fed.wait_state(long["id"], "RUNNING")
    fed.wait_state(suspended["id"], "RUNNING")
    assert fed.request("POST", f"/v1/jobs/{suspended['id']}/suspend")[0] == 200
    before = {j: fed.job(j)["state"] for j in (long["id"], waiting["id"], suspended["id"])}
    assert before == {long["id"]: "RUNNING", waiting["id"]: "PENDING", suspended["id"]: "SUSPENDED"}
    assert fed.broker is not None
    fed.kill(fed.broker)  # SIGKILL mid-flight
    fed.start_broker()  # waits for it to lead (after the old leader lease expired)
    after = {j: fed.job(j)["state"] for j in before}
    assert after == before
    done = fed.wait_state(long["id"], "SUCCEEDED", timeout=30)
    assert [e["type"] for e in done["events"]].count("placed") == 1
    assert fed.job(suspended["id"])["state"] == "SUSPENDED"
    # resume and cancel still work through the new broker
    assert fed.request("POST", f"/v1/jobs/{suspended['id']}/resume")[1]["state"] == "PENDING"
    fed.wait_state(suspended["id"], "RUNNING")
    assert fed.request("POST", f"/v1/jobs/{suspended['id']}/cancel")[1]["state"] == "CANCELLED"


async def test_cancel_stops_the_process(
    make_federation: Callable[..., Federation], registry: Registry
) -> None:
    fed = make_federation()
    record = fed.submit(name="stopme", **CPU_ONLY, command=["sleep", "60"])
    running = fed.wait_state(record["id"], "RUNNING")
    site = running["placement"]["site"]
    status, body = fed.request("POST", f"/v1/jobs/{record['id']}/cancel")
    assert status == 200 and body["state"] == "CANCELLED"
    for _ in range(100):
        if site not in await assignments_of(registry):
            break
        await asyncio.sleep(0.1)
    assert site not in await assignments_of(registry)
    status, body = fed.request("POST", f"/v1/jobs/{record['id']}/resume")
    assert status == 409 and body["error"]["code"] == "illegal_transition"


def test_failing_job_retries_then_fails(make_federation: Callable[..., Federation]) -> None:
    fed = make_federation()
    record = fed.submit(name="flaky", **CPU_ONLY, command=["sh", "-c", "exit 3"], max_retries=2)
    done = fed.wait_state(record["id"], "FAILED", timeout=40)
    assert done["retries"] == 2 and done["exit_code"] == 3
    assert [e["type"] for e in done["events"]].count("retried") == 2


BAD_SPECS = [
    ({"tenant": "t1", "command": ["true"]}, "name"),
    ({"name": "x", "tenant": "t1"}, "command"),
    ({"name": "Bad Name", "tenant": "t1", "command": ["true"]}, "name"),
    (
        {"name": "x", "tenant": "t1", "command": ["true"], "gpu": {"count": -1, "model": "H100"}},
        "gpu.count",
    ),
    (
        {"name": "x", "tenant": "t1", "command": ["true"], "gpu": {"count": 2, "model": "H900"}},
        "gpu.model",
    ),
    (
        {
            "name": "x",
            "tenant": "t1",
            "command": ["true"],
            "gpu": {"count": 2, "model": "H100", "models": ["H200"]},
        },
        "gpu",
    ),
    (
        {"name": "x", "tenant": "t1", "command": ["true"], "gpu": {"count": 2, "min_mem_gb": 4096}},
        "gpu.min_mem_gb",
    ),
    (
        {
            "name": "x",
            "tenant": "t1",
            "command": ["true"],
            "allowed_regions": ["east"],
            "denied_regions": ["east"],
        },
        None,
    ),
    (
        {"name": "x", "tenant": "t1", "command": ["true"], "allowed_regions": ["mars"]},
        "allowed_regions[0]",
    ),
    (
        {"name": "x", "tenant": "t1", "command": ["true"], "deadline": "2001-01-01T00:00:00Z"},
        "deadline",
    ),
    (
        {
            "name": "x",
            "tenant": "t1",
            "command": ["true"],
            "duration_hours": 5,
            "deadline": SOON,
        },
        None,
    ),
    (
        {"name": "x", "tenant": "t1", "command": ["true"], "user": {"region": "atlantis"}},
        "user.region",
    ),
    ({"name": "x", "tenant": "t1", "command": ["true"], "env": {"CPN_SITE": "x"}}, "env"),
    (
        {
            "name": "x",
            "tenant": "t1",
            "command": ["true"],
            "data": {"region": "east", "site": "west"},
        },
        "data",
    ),
    ({"name": "x", "tenant": "t1", "command": ["true"], "cpu": 0}, None),
    ({"name": "x", "tenant": "t1", "command": ["true"], "surprise": 1}, "surprise"),
]


def test_bad_specs_get_400_naming_the_field_and_store_nothing(
    make_federation: Callable[..., Federation],
) -> None:
    fed = make_federation(agents=False)
    for body, field in BAD_SPECS:
        status, reply = fed.request("POST", "/v1/jobs", body)
        assert status == 400, (body, reply)
        assert reply["error"]["code"] in ("invalid", "malformed")
        if field is not None:
            assert reply["error"]["field"] == field, (body, reply)
        assert reply["error"]["message"]
    assert fed.request("GET", "/v1/jobs")[1] == {"items": [], "continue": None}
    # not JSON at all, and not an object
    import urllib.request

    req = urllib.request.Request(
        fed.broker_url + "/v1/jobs",
        data=b"{nope",
        method="POST",
        headers={"Content-Type": "application/json", **AUTH},
    )
    try:
        urllib.request.urlopen(req, timeout=10)
    except urllib.error.HTTPError as exc:
        assert exc.code == 400 and json.loads(exc.read())["error"]["code"] == "malformed"
    assert fed.request("POST", "/v1/jobs", [1, 2])[0] == 400
    assert fed.request("GET", "/v1/jobs/nope")[0] == 404
    assert fed.request("GET", "/v1/nothing")[0] == 404
    assert fed.request("GET", "/v1/jobs?state=SLEEPING")[0] == 400
    status, big = fed.request("POST", "/v1/jobs", {"name": "x" * 2_000_000})
    assert status == 413 and big["error"]["code"] == "too_large"


def test_openapi_document(make_federation: Callable[..., Federation]) -> None:
    fed = make_federation(agents=False)
    status, text = fed.get("/openapi.json")
    doc = json.loads(text)
    assert doc["openapi"].startswith("3.")
    assert {"/v1/jobs", "/v1/jobs/{job}", "/v1/jobs/{job}/cancel", "/v1/jobs/{job}/logs"} <= set(
        doc["paths"]
    )
    assert "JobSpec" in doc["components"]["schemas"]


def test_cli_submit_jobs_describe_logs(
    make_federation: Callable[..., Federation], tmp_path: Any
) -> None:
    fed = make_federation()
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        "name: cli-job\ntenant: t1\ncpu: 1\ncommand: [sh, -c, 'echo line-one; echo line-two']\n"
        # an unquoted YAML timestamp: the file goes to the broker as YAML, which parses it
        f"duration_hours: 0.1\ndeadline: {SOON}\n"
    )
    out = run_cpn("submit", str(job_file), "--broker", fed.broker_url)
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.split()[1]
    fed.wait_state(job_id, "SUCCEEDED")
    listing = run_cpn("jobs", "--broker", fed.broker_url)
    assert job_id in listing.stdout and "SUCCEEDED" in listing.stdout
    as_json = json.loads(run_cpn("jobs", "-o", "json", "--broker", fed.broker_url).stdout)
    assert as_json[0]["id"] == job_id
    described = run_cpn("describe", job_id, "--broker", fed.broker_url).stdout
    assert "State:       SUCCEEDED" in described and "Events:" in described
    logs = run_cpn("logs", job_id, "--broker", fed.broker_url)
    assert "line-one\nline-two" in logs.stdout, logs.stderr
    bad = run_cpn("describe", "nope", "--broker", fed.broker_url)
    assert bad.returncode == 2 and bad.stderr.startswith("cpn: error: no job")
    bad_file = tmp_path / "bad.yaml"
    bad_file.write_text('name: x\ntenant: t1\ncommand: ["true"]\ngpu: {count: 2, model: H900}\n')
    bad = run_cpn("submit", str(bad_file), "--broker", fed.broker_url)
    assert bad.returncode == 2 and "(field: gpu.model)" in bad.stderr
    assert signal.SIGTERM  # keep the import used


def test_sites_come_a_page_at_a_time(make_federation: Callable[..., Federation]) -> None:
    fed = make_federation(agents=False)
    status, first = fed.request("GET", "/v1/sites?limit=3")
    assert status == 200 and len(first["items"]) == 3 and first["continue"]
    status, rest = fed.request("GET", f"/v1/sites?limit=3&continue={first['continue']}")
    assert status == 200 and rest["continue"] is None
    ids = [s["id"] for s in first["items"] + rest["items"]]
    assert ids == sorted(SITES) and all(s["state"] == "down" for s in rest["items"])
    assert fed.request("GET", "/v1/sites")[1]["continue"] is None
    status, bad = fed.request("GET", "/v1/sites?limit=0")
    assert status == 400 and bad["error"]["field"] == "limit"
