"""Priority classes, preemption and the refusals of what can never fit, end to end: real etcd,
a real agent running the jobs as processes, the broker over HTTP on loopback."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.broker.conftest import SITES, Federation

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)

ONE_SITE = {"east-b": {**SITES["east-b"], "count": 8}}
# the first run sleeps (and is preempted); a later run says how it was started, and ends
RESTARTABLE = (
    'echo "restarts=$CPN_RESTARTS resume=${CPN_RESUME:-0} ckpt=$CPN_CHECKPOINT_PATH"; '
    '[ "$CPN_RESTARTS" = 0 ] && exec sleep 120; exit 0'
)


def logs(fed: Federation, job_id: str) -> str:
    status, text = fed.get(f"/v1/jobs/{job_id}/logs")
    assert status == 200, text
    return text


def test_a_production_job_preempts_batch_work_which_restarts_from_its_checkpoint(
    make_federation: Callable[..., Federation],
) -> None:
    fed = make_federation(ONE_SITE)
    low = fed.submit(
        name="train",
        priority_class="batch",
        gpu={"model": "H100", "count": 8},
        checkpoint_path="/ck/train",
        command=["sh", "-c", RESTARTABLE],
    )
    fed.wait_state(low["id"], "RUNNING")
    urgent = fed.submit(
        name="urgent",
        priority_class="production",
        gpu={"model": "H100", "count": 4},
        command=["sh", "-c", "sleep 1"],
    )
    assert urgent["spec"]["priority"] == 500 and not urgent["spec"]["best_effort"]
    done = fed.wait_state(urgent["id"], "SUCCEEDED", "FAILED", timeout=60)
    assert done["state"] == "SUCCEEDED", done["events"]
    # it waited at the site for the victim to stop, rather than failing to fit beside it
    assert done["retries"] == 0 and done["attempt"] == 1, done["events"]
    record = fed.wait_state(low["id"], "SUCCEEDED", "FAILED", timeout=60)
    assert record["state"] == "SUCCEEDED", record["events"]
    types = [e["type"] for e in record["events"]]
    assert "preempted" in types, types
    preempted = next(e for e in record["events"] if e["type"] == "preempted")
    assert f"for {urgent['id']}" in preempted["message"]
    assert "restarts from /ck/train" in preempted["message"]
    assert record["preemptions"] == 1 and record["retries"] == 0  # no retry spent on it
    assert record["attempt"] == 2
    assert "restarts=1 resume=1 ckpt=/ck/train" in logs(fed, low["id"])
    # the preemptor's placement says what it did
    placed = next(e for e in done["events"] if e["type"] == "placed")
    assert placed["site"] == "east-b"
    _, metrics = fed.get("/metrics")
    assert "cpn_broker_preemptions_total 1.0" in metrics


def test_best_effort_runs_on_spare_capacity_and_yields_first(
    make_federation: Callable[..., Federation],
) -> None:
    fed = make_federation(ONE_SITE)
    spare = fed.submit(
        name="spare",
        priority_class="best-effort",
        gpu={"model": "H100", "count": 8},
        command=["sh", "-c", RESTARTABLE],
    )
    assert spare["spec"]["best_effort"] and spare["spec"]["priority"] == 0
    fed.wait_state(spare["id"], "RUNNING")
    # a plain job (priority 0, not best-effort) still takes the site from best-effort work
    plain = fed.submit(name="plain", gpu={"model": "H100", "count": 8}, command=["true"])
    assert fed.wait_state(plain["id"], "SUCCEEDED", "FAILED", timeout=60)["state"] == "SUCCEEDED"
    record = fed.wait_state(spare["id"], "SUCCEEDED", "FAILED", timeout=60)
    assert record["state"] == "SUCCEEDED" and record["preemptions"] == 1


def test_unknown_classes_and_what_can_never_fit_are_refused(
    make_federation: Callable[..., Federation],
) -> None:
    fed = make_federation(ONE_SITE)
    body: dict[str, Any] = {"tenant": "t1", "command": ["true"], "name": "x"}
    status, got = fed.request("POST", "/v1/jobs", {**body, "priority_class": "vip"})
    assert status == 400 and got["error"]["field"] == "priority_class", got
    assert got["error"]["code"] == "invalid", got
    assert "unknown priority class 'vip'" in got["error"]["message"]
    status, got = fed.request(
        "POST", "/v1/jobs", {**body, "priority_class": "production", "priority": 7}
    )
    assert status == 400 and got["error"]["field"] == "priority", got
    assert got["error"]["code"] == "invalid", got
    # tenant "small" has a quota of 4 GPUs (tests/broker/conftest.py): 8 can never fit
    status, got = fed.request(
        "POST", "/v1/jobs", {**body, "tenant": "small", "gpu": {"model": "H100", "count": 8}}
    )
    assert status == 400 and got["error"]["field"] == "gpu.count", got
    assert got["error"]["code"] == "over_quota", got
    assert "can ever hold (4" in got["error"]["message"]
    # 4 fit the quota: accepted; a second 4 waits, saying which quota and how much is held
    hold = ["sleep", "30"]
    first = fed.submit(name="a", tenant="small", gpu={"model": "H100", "count": 4}, command=hold)
    second = fed.submit(name="b", tenant="small", gpu={"model": "H100", "count": 4}, command=hold)
    deadline = time.monotonic() + 20
    record: dict[str, Any] = {}
    while time.monotonic() < deadline:
        record = fed.job(second["id"])
        if record.get("unschedulable"):
            break
        time.sleep(0.1)
    assert fed.job(first["id"])["state"] in ("PLACED", "RUNNING")
    assert "quota: tenant small holds 4 gpus and may take 0 more" in record["unschedulable"]


def test_budgets_refuse_what_can_never_fit_and_hold_back_what_would_overspend(
    make_federation: Callable[..., Federation],
) -> None:
    fed = make_federation(ONE_SITE)
    status, got = fed.request(
        "PUT",
        "/v1/tenants/lab",
        {"budget": {"usd_per_month": 30, "gpu_hours": 20, "window": "7d"}},
    )
    assert status in (200, 201), got
    body: dict[str, Any] = {"tenant": "lab", "command": ["sleep", "30"], "name": "x"}
    gpu = {"model": "H100", "count": 8}
    # 8 GPUs x 3 h = 24 GPU-hours: more than the window ever allows
    status, got = fed.request("POST", "/v1/jobs", {**body, "gpu": gpu, "duration_hours": 3})
    assert status == 400 and got["error"]["code"] == "over_budget", got
    assert got["error"]["field"] == "duration_hours"
    # east-b's H100s cost 2.00 USD/h (a core 0.01, a GB 0.001): 4 x 4 h is 32.04 USD at
    # least, more than 30 a month
    status, got = fed.request(
        "POST", "/v1/jobs", {**body, "gpu": {"model": "H100", "count": 4}, "duration_hours": 4}
    )
    assert status == 400 and got["error"]["code"] == "over_budget", got
    assert "costs at least 32.04 USD" in got["error"]["message"]
    # 4 x 2.00 x 2 h = 16 USD: it runs; a second one would bring the estimate to 32: it waits
    first = fed.submit(name="a", tenant="lab", gpu={"model": "H100", "count": 4}, duration_hours=2,
                       command=["sleep", "30"])  # fmt: skip
    second = fed.submit(name="b", tenant="lab", gpu={"model": "H100", "count": 4},
                        duration_hours=2, command=["true"])  # fmt: skip
    deadline = time.monotonic() + 20
    record: dict[str, Any] = {}
    while time.monotonic() < deadline:
        record = fed.job(second["id"])
        if record.get("unschedulable"):
            break
        time.sleep(0.1)
    assert fed.job(first["id"])["state"] in ("PLACED", "RUNNING")
    why = record["unschedulable"]
    assert "over what tenant lab's budget has left" in why
    assert "budget: tenant lab has" in why and "of 30.00 USD left this month" in why


def test_best_effort_work_runs_above_the_physical_on_an_oversubscribed_site(
    make_federation: Callable[..., Federation],
) -> None:
    fed = make_federation({"east-b": {**ONE_SITE["east-b"], "oversubscription": {"gpus": 1.5}}})
    regular = fed.submit(name="regular", gpu={"model": "H100", "count": 8}, command=["sleep", "30"])
    fed.wait_state(regular["id"], "RUNNING")
    # 8 of 8 devices held: best-effort work still runs, on 4 of the 12 oversubscribed
    spare = fed.submit(
        name="spare",
        priority_class="best-effort",
        gpu={"model": "H100", "count": 4},
        command=["sh", "-c", "echo devices=$CUDA_VISIBLE_DEVICES; sleep 30"],
    )
    fed.wait_state(spare["id"], "RUNNING")
    assert fed.job(regular["id"])["state"] == "RUNNING"
    deadline = time.monotonic() + 10
    while "devices=" not in logs(fed, spare["id"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "devices=0,1,2,3" in logs(fed, spare["id"])
