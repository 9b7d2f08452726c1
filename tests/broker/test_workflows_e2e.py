"""Workflows end to end: real etcd, real agent processes, a real broker process, HTTP on
loopback. Four workflows run side by side on one federation, to keep the suite fast."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.broker.conftest import Federation
from tests.conftest import run_cpn

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)

# two regions: moving data between them costs 0.05 USD per GB; south's H100s are cheaper
SITES: dict[str, dict[str, Any]] = {
    "north": {"region": "north", "coordinates": {"lat": 40.0, "lon": 116.4}, "price": 2.0},
    "south": {"region": "south", "coordinates": {"lat": 22.5, "lon": 114.1}, "price": 1.0},
}
H100 = {"model": "H100", "count": 1}


def step(name: str, command: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "command": ["sh", "-c", command], "max_retries": 0, **extra}


def submit(fed: Federation, name: str, *steps: dict[str, Any], **extra: Any) -> dict[str, Any]:
    body = {"name": name, "tenant": "t1", "steps": list(steps), **extra}
    status, view = fed.request("POST", "/v1/workflows", body)
    assert status == 201, view
    return view  # type: ignore[no-any-return]


def workflow(fed: Federation, wf_id: str) -> dict[str, Any]:
    status, view = fed.request("GET", f"/v1/workflows/{wf_id}")
    assert status == 200, view
    return view  # type: ignore[no-any-return]


def wait(fed: Federation, wf_id: str, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    view: dict[str, Any] = {}
    while time.monotonic() < deadline:
        view = workflow(fed, wf_id)
        if done(view):
            return view
        time.sleep(0.1)
    raise AssertionError(f"workflow {wf_id}: {[(s['name'], s['state']) for s in view['steps']]}")


def steps_of(view: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in view["steps"]}


def at(record: dict[str, Any], kind: str) -> float:
    return min(e["at"] for e in record["events"] if e["type"] == kind)


def test_workflows_run_in_order_hold_fail_cancel_and_retry(
    make_federation: Callable[..., Federation], tmp_path: Path
) -> None:
    fed = make_federation(SITES)
    mark = tmp_path / "shared" / "flaky-ran-once"
    pipeline = submit(
        fed, "pipeline",
        # cpu only, in north; leaves 2,000 GB there (100 USD to move south)
        step("preprocess", "echo pre", cpu=1, allowed_regions=["north"],
             outputs=[{"name": "shards", "size_gb": 2000}]),
        step("train", "echo train", gpu=H100, after=["preprocess"],
             outputs=[{"name": "model", "size_gb": 1}]),
        step("evaluate", "echo eval", gpu=H100, after=["train"]),
    )  # fmt: skip
    held = submit(
        fed, "held",
        step("flaky", f"test -f {mark} || {{ touch {mark}; exit 1; }}", cpu=1),
        step("after-flaky", "echo ok", cpu=1, after=["flaky"]),
        on_failure="hold",
    )  # fmt: skip
    failing = submit(
        fed, "failing",
        step("broken", "exit 3", cpu=1),
        step("never", "echo never", cpu=1, after=["broken"]),
        step("nor-this", "echo never", cpu=1, after=["never"]),
    )  # fmt: skip
    slow = submit(
        fed, "slow", step("sleeper", "sleep 60", cpu=1),
        step("next", "echo next", cpu=1, after=["sleeper"]),
    )  # fmt: skip
    assert [s["state"] for s in pipeline["steps"]] == ["PENDING"] * 3
    assert steps_of(pipeline)["train"]["waiting_for"] == ["preprocess"]

    # the hold policy: the child waits, held, for its parent to be retried
    view = wait(fed, held["id"], lambda v: v["state"] == "HELD")
    assert "retry" in steps_of(view)["after-flaky"]["held"]
    status, retried = fed.request("POST", f"/v1/workflows/{held['id']}/retry?step=flaky")
    assert status == 200, retried
    assert steps_of(retried)["flaky"]["previous"] == [steps_of(held)["flaky"]["job"]]
    # the fail policy: the failure runs down the DAG
    view = wait(fed, failing["id"], lambda v: v["state"] == "FAILED" and all(
        s["state"] == "FAILED" for s in v["steps"]))  # fmt: skip
    assert "parent step broken FAILED" in steps_of(view)["never"]["reason"]
    # cancel of the whole workflow, while its first step runs
    wait(fed, slow["id"], lambda v: v["steps"][0]["state"] == "RUNNING")
    status, cancelled = fed.request("POST", f"/v1/workflows/{slow['id']}/cancel")
    assert status == 200 and cancelled["state"] == "CANCELLED", cancelled
    assert {s["state"] for s in cancelled["steps"]} == {"CANCELLED"}
    status, again = fed.request("POST", f"/v1/workflows/{slow['id']}/retry?step=nope")
    assert status == 400 and again["error"]["field"] == "step"

    # the pipeline ran in order, the child next to its parent's data when that was cheapest
    view = wait(fed, pipeline["id"], lambda v: v["state"] == "SUCCEEDED")
    jobs = {name: fed.job(s["job"]) for name, s in steps_of(view).items()}
    assert at(jobs["train"], "placed") >= at(jobs["preprocess"], "succeeded")
    assert at(jobs["evaluate"], "placed") >= at(jobs["train"], "succeeded")
    assert jobs["preprocess"]["placement"]["site"] == "north"
    # 2,000 GB at north: north's 2 USD beat south's 1 USD + 100 USD of egress
    assert jobs["train"]["placement"]["site"] == "north"
    assert jobs["train"]["spec"]["data"] == {"site": "north", "size_gb": 2000.0, "region": None}
    # 1 GB: moving it south (0.05 USD) is cheaper than staying
    assert jobs["evaluate"]["placement"]["site"] == "south"
    view = wait(fed, held["id"], lambda v: v["state"] == "SUCCEEDED")

    # the CLI: describe shows the DAG; a bad file names its field in one line, exit 2
    shown = run_cpn("describe", pipeline["id"], "--broker", fed.broker_url)
    assert shown.returncode == 0, shown.stderr
    assert "State:       SUCCEEDED" in shown.stdout
    assert re.search(r"\n  evaluate +SUCCEEDED +south +train ", shown.stdout), shown.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({
        "name": "bad", "tenant": "t1",
        "steps": [step("a", "true"), step("b", "true", after=["zzz"])],
    }))  # fmt: skip
    out = run_cpn("submit", str(bad), "--broker", fed.broker_url)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "(field: steps[1].after[0])" in out.stderr
    cycle = {"name": "loop", "tenant": "t1", "steps": [
        step("a", "true", after=["b"]), step("b", "true", after=["a"])]}  # fmt: skip
    status, refused = fed.request("POST", "/v1/workflows", cycle)
    assert status == 400 and refused["error"]["field"] == "steps[0].after", refused
    assert "a -> b -> a" in refused["error"]["message"]
    status, listed = fed.request("GET", "/v1/workflows?tenant=t1")
    assert status == 200 and len(listed["items"]) == 4
