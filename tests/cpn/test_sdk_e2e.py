"""The Python SDK against a real broker: etcd, an agent process and a broker process (the
federation of tests/broker/conftest.py, one site), blocking and async clients both."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

import cpn
from tests.broker.conftest import SITES, Federation, make_federation
from tests.conftest import ADMIN_TOKEN, run_cpn

__all__ = ["make_federation"]  # the fixture, for this module's tests

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)

ONE_SITE = {"east-a": SITES["east-a"]}
SOON = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
STRANGER = "cpn_0000000000000bad_" + "x" * 43  # well formed, never issued


def job(name: str, command: str) -> dict[str, object]:
    return {
        "name": name,
        "tenant": "t1",
        "cpu": 1,
        "duration_hours": 0.1,
        "max_retries": 0,
        "command": ["sh", "-c", command],
    }


def test_the_blocking_client_submits_waits_reads_lists_and_cancels(
    make_federation: Callable[..., Federation],
) -> None:
    fed = make_federation(ONE_SITE)
    with cpn.Client(fed.broker_url) as client:  # the token: $CPN_TOKEN (tests/conftest.py)
        me = client.whoami()
        assert (me.role, me.tenant, me.auth) == ("admin", None, True)

        first = client.jobs.submit(job("sdk-sync", "echo line-one; echo line-two"))
        assert isinstance(first, cpn.JobRecord) and first.spec.name == "sdk-sync"
        done = client.jobs.wait(first.id, timeout=60, poll_s=0.2)
        assert done.state is cpn.JobState.SUCCEEDED and done.exit_code == 0
        assert done.placement is not None and done.placement.site == "east-a"
        assert "line-one\nline-two" in client.jobs.logs(first.id)
        assert "line-two" in "".join(client.jobs.stream_logs(first.id))

        # a long one: running, then cancelled
        long = client.jobs.submit(job("sdk-long", "echo started; sleep 300"))
        running = client.jobs.wait(long.id, states="RUNNING", timeout=60, poll_s=0.2)
        assert running.state is cpn.JobState.RUNNING
        following = client.jobs.stream_logs(long.id, follow=True)
        assert "started" in next(following)
        following.close()  # left early: its HTTP answer is closed, nothing leaks (warnings fail)
        with pytest.raises(cpn.WaitTimeout) as slow:
            client.jobs.wait(long.id, timeout=0.5)
        assert slow.value.record.state is cpn.JobState.RUNNING
        assert client.jobs.cancel(long.id).state is cpn.JobState.CANCELLED
        with pytest.raises(cpn.JobEnded, match="ended CANCELLED, not RUNNING") as ended:
            client.jobs.wait(long.id, states=[cpn.JobState.RUNNING], timeout=30)
        assert ended.value.record.state is cpn.JobState.CANCELLED
        assert client.jobs.cancel(long.id).state is cpn.JobState.CANCELLED  # idempotent
        with pytest.raises(cpn.Conflict) as finished:
            client.jobs.suspend(first.id)
        assert finished.value.status == 409 and finished.value.code == "illegal_transition"

        # lists: newest first, filtered, a page at a time
        assert [r.id for r in client.jobs.list()] == [long.id, first.id]
        assert [r.id for r in client.jobs.list(state="succeeded")] == [first.id]
        assert [r.id for r in client.jobs.list(state=["CANCELLED", "FAILED"])] == [long.id]
        assert [r.id for r in client.jobs.list(limit=1)] == [long.id]
        page = client.jobs.page(limit=1)
        assert [r.id for r in page.items] == [long.id] and page.continue_
        rest = client.jobs.page(limit=1, continue_=page.continue_)
        assert [r.id for r in rest.items] == [first.id] and rest.continue_ is None
        assert {r.id for r in client.jobs.list(since="1h")} == {first.id, long.id}

        # the broker's own model as the spec: only the fields set are sent
        spec = cpn.JobSpec(name="sdk-model", tenant="t1", cpu=1, command="echo from-model")
        modelled = client.jobs.wait(client.jobs.submit(spec).id, timeout=60, poll_s=0.2)
        assert modelled.state is cpn.JobState.SUCCEEDED and modelled.spec == spec
        assert "from-model" in client.jobs.logs(modelled.id)
        assert list(client.services.list()) == []

        # the broker's refusals, each its class, naming its field
        with pytest.raises(cpn.NotFound) as missing:
            client.jobs.get("no-such-job")
        assert (missing.value.status, missing.value.code) == (404, "not_found")
        with pytest.raises(cpn.Invalid) as bad:
            client.jobs.submit({**job("bad", "true"), "gpu": {"count": 2, "model": "H900"}})
        assert (bad.value.status, bad.value.field) == (400, "gpu.model")
        with pytest.raises(cpn.Invalid) as bad_since:
            client.jobs.page(since="yesterday-ish")
        assert (bad_since.value.status, bad_since.value.field) == (400, "since")
        with pytest.raises(cpn.NotFound):
            client.services.get("no-such-service")
        assert client.usage.get(by=("tenant", "day")).by == ["tenant", "day"]
        with pytest.raises(cpn.Invalid) as bad_by:
            client.usage.get(by="colour")
        assert (bad_by.value.status, bad_by.value.field) == (400, "by")
        assert all(isinstance(a, cpn.Alert) for a in client.alerts.list(state="firing"))
        with pytest.raises(cpn.Invalid) as bad_alerts:
            list(client.alerts.list(state="burning"))
        assert (bad_alerts.value.status, bad_alerts.value.field) == (400, "state")

    with cpn.Client(fed.broker_url, token=STRANGER) as stranger:
        with pytest.raises(cpn.Unauthorized) as refused:
            stranger.jobs.get(first.id)
        assert refused.value.status == 401


async def test_the_async_client_follows_logs_suspends_resumes_and_runs_workflows(
    make_federation: Callable[..., Federation], tmp_path: Path
) -> None:
    fed = make_federation(ONE_SITE)
    async with cpn.AsyncClient(fed.broker_url) as client:
        # a job file's YAML text, an unquoted timestamp in it: the broker parses it
        text = (
            "name: sdk-async\ntenant: t1\ncpu: 1\nduration_hours: 0.1\nmax_retries: 0\n"
            f"deadline: {SOON}\ncommand: [sh, -c, 'echo started; sleep 300']\n"
        )
        record = await client.jobs.submit(text)
        assert record.spec.deadline is not None
        await client.jobs.wait(record.id, states="RUNNING", timeout=60, poll_s=0.2)

        async def follow() -> str:
            return "".join([t async for t in client.jobs.stream_logs(record.id, follow=True)])

        following = asyncio.create_task(follow(), name="follow-logs")
        async with asyncio.timeout(30):
            while "started" not in await client.jobs.logs(record.id):
                await asyncio.sleep(0.1)
        assert not following.done()  # it follows the run, which goes on
        assert (await client.jobs.cancel(record.id)).state is cpn.JobState.CANCELLED
        assert "started" in await asyncio.wait_for(following, 60)  # the stream ends with the run

        # suspend and resume
        other = await client.jobs.submit(job("sdk-suspend", "sleep 300"))
        await client.jobs.wait(other.id, states="RUNNING", timeout=60, poll_s=0.2)
        assert (await client.jobs.suspend(other.id)).state is cpn.JobState.SUSPENDED
        resumed = await client.jobs.resume(other.id)
        assert resumed.state in (cpn.JobState.PENDING, cpn.JobState.PLACED)
        await client.jobs.wait(other.id, states="RUNNING", timeout=60, poll_s=0.2)
        await client.jobs.cancel(other.id)
        listed = [r.id async for r in client.jobs.list(state="CANCELLED")]
        assert listed == [other.id, record.id]

        # a workflow of two steps
        steps = [
            {"name": "prep", "command": ["sh", "-c", "echo prep"], "cpu": 1, "max_retries": 0},
            {"name": "train", "after": ["prep"], "cpu": 1, "command": ["sh", "-c", "echo ok"]},
        ]
        flow = await client.workflows.submit({"name": "sdk-flow", "tenant": "t1", "steps": steps})
        assert [s.name for s in flow.steps] == ["prep", "train"]
        assert [w.id for w in await client.workflows.list()] == [flow.id]
        train = flow.steps[1].job
        assert (await client.jobs.wait(train, timeout=90, poll_s=0.2)).state.value == "SUCCEEDED"
        assert (await client.workflows.get(flow.id)).state.value == "SUCCEEDED"

        # refusals
        with pytest.raises(cpn.NotFound):
            await client.jobs.cancel("no-such-job")
        with pytest.raises(cpn.NotFound):
            await client.workflows.get("no-such-flow")
        with pytest.raises(cpn.Invalid) as bad:
            await client.jobs.submit("name: bad\ntenant: t1\ncpu: -1\ncommand: ['true']\n")
        assert (bad.value.status, bad.value.field) == (400, "cpu")
        with pytest.raises(cpn.Conflict) as no_logs:  # a job that never ran has no logs
            pending = await client.jobs.submit({**job("sdk-huge", "true"), "cpu": 100_000})
            await client.jobs.logs(pending.id)
        assert no_logs.value.code == "no_logs"

    # datasets: put by the CLI (its files stream resumably), the rest through the SDK
    (tmp_path / "corpus.txt").write_text("tokens\n" * 100)
    put = await asyncio.to_thread(
        run_cpn, "data", "put", "t1/corpus", str(tmp_path / "corpus.txt"), "--site", "east-a",
        "--broker", fed.broker_url,
    )  # fmt: skip
    assert put.returncode == 0, put.stderr
    async with cpn.AsyncClient(fed.broker_url) as client:
        assert [(d.tenant, d.name, d.latest) async for d in client.datasets.list()] == [
            ("t1", "corpus", 1)
        ]
        info = await client.datasets.get("t1/corpus")
        assert [(v.version, v.bytes, v.home) for v in info.versions] == [(1, 700, "east-a")]
        manifest = await client.datasets.manifest("t1/corpus@1")
        assert [(f.path, f.size) for f in manifest.files] == [("corpus.txt", 700)]
        assert (await client.datasets.share("t1/corpus", add=["t2"])).shared_with == ("t2",)
        with pytest.raises(cpn.NotFound):
            await client.datasets.get("t1/nothing")
        with pytest.raises(cpn.Invalid) as bad:
            await client.datasets.share("t1/corpus", add=["t2"], remove=["t2"])
        assert bad.value.status == 400
        assert (await client.datasets.delete("t1/corpus")).latest == 1
        assert [d async for d in client.datasets.list()] == []


def test_services_are_applied_read_listed_and_deleted(
    make_federation: Callable[..., Federation],
) -> None:
    fed = make_federation(ONE_SITE, agents=False)  # replicas stay pending: no site is up
    doc = {
        "name": "chat",
        "tenant": "t1",
        "model": "standin-7b",
        "command": ["sh", "-c", "sleep 300"],
        "cpu": 1,
        "slo": {"p95_ms": 2000},
        "scaling": {"target_qps_per_replica": 5},
        "min_replicas": 1,
        "max_replicas": 2,
        "clients": ["user-east"],
    }
    with cpn.Client(fed.broker_url) as client:
        applied = client.services.apply(doc)
        assert (applied.name, applied.generation, applied.spec.max_replicas) == ("chat", 1, 2)
        assert client.services.apply(doc).generation == 1  # unchanged: no new generation
        # its file's text; the bounds are not the replicas' template: the same generation
        text = yaml.safe_dump({**doc, "max_replicas": 3})
        bigger = client.services.apply(text)
        assert (bigger.generation, bigger.spec.max_replicas) == (1, 3)
        assert [(s.name, s.tenant, s.max_replicas) for s in client.services.list()] == [
            ("chat", "t1", 3)
        ]
        got = client.services.get("chat")
        assert got.tenant == "t1" and all(r.state == "pending" for r in got.replicas)
        with pytest.raises(cpn.Invalid) as bad:
            client.services.apply({**doc, "min_replicas": 3, "max_replicas": 2})
        assert (bad.value.status, bad.value.field) == (400, "max_replicas")
        with pytest.raises(cpn.Conflict) as taken:
            client.services.apply({**doc, "tenant": "t2"})
        assert (taken.value.status, taken.value.field) == (409, "name")
        assert client.services.delete("chat").deleting
        with pytest.raises(cpn.NotFound):
            client.services.get("nope")
    # the commands that read through the SDK, beside the job, service and usage ones
    who = run_cpn("whoami", "--broker", fed.broker_url)
    assert who.returncode == 0 and who.stdout.strip() == f"token {ADMIN_TOKEN[4:20]}: admin"
    alerts = run_cpn("alerts", "-o", "json", "--broker", fed.broker_url)
    assert alerts.returncode == 0 and isinstance(json.loads(alerts.stdout), list), alerts.stderr
    table = run_cpn("alerts", "--state", "firing", "--broker", fed.broker_url)
    assert table.returncode == 0 and table.stdout.startswith("STATE"), table.stderr
