"""`cpn service describe`'s text (cpn.service_cli.describe_service): what an operator reads."""

from __future__ import annotations

from typing import Any

from cpn.service_cli import describe_service


def view(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": "chat", "tenant": "t1", "model": "m", "generation": 2, "deleting": False,
        "spec": {"min_replicas": 1, "max_replicas": 3, "slo": {"p95_ms": 800},
                 "scaling": {"target_qps_per_replica": 5}},
        "regions": [{"region": "beijing", "desired": 2, "actual": 2, "ready": 1},
                    {"region": "*", "desired": 1, "actual": 0, "ready": 0}],
        "replicas": [
            {"job": "chat-a1", "region": "beijing", "generation": 2, "state": "ready",
             "job_state": "RUNNING", "site": "zhangjiakou", "url": "http://x", "reason": "x"},
            {"job": "chat-b2", "region": "beijing", "generation": 2, "state": "pending",
             "job_state": "PENDING", "site": None, "url": None, "reason": "no site within 600 ms"},
        ],
        "decision": {"by": "autoscaler", "at": 0.0, "replicas": {"beijing": 2}, "reason": "slo"},
        "events": [{"at": 10.0, "type": "scaled-up", "message": "replica chat-b2 for beijing"}],
    }  # fmt: skip
    doc.update(overrides)
    return doc


def test_describe_shows_regions_replicas_decision_and_events() -> None:
    text = describe_service(view(), now=30.0)
    lines = text.splitlines()
    assert lines[0] == "service chat  tenant t1  model m  generation 2"
    assert any(line.split() == ["beijing", "2", "/", "2", "/", "1"] for line in lines)
    assert any(line.split()[:1] == ["any"] for line in lines)  # the '*' region
    ready = next(line for line in lines if "chat-a1" in line)
    assert "ready" in ready and "zhangjiakou" in ready and "gen 2" in ready
    pending = next(line for line in lines if "chat-b2" in line)
    assert pending.endswith("no site within 600 ms")  # why a pending replica waits
    assert 'last decision (autoscaler, 30s ago): {"beijing": 2} slo' in lines
    assert lines[-1].split()[:3] == ["20s", "ago", "scaled-up"]


def test_a_deleted_service_says_so_and_an_empty_one_says_none() -> None:
    text = describe_service(view(deleting=True, regions=[], replicas=[], decision=None), now=0.0)
    assert text.splitlines()[0].endswith("DELETING")
    assert text.count("  none") == 2
