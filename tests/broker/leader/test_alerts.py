"""Alerts end to end: a real etcd, broker and agent processes, and a real webhook receiver on
loopback. A killed agent fires site_down once, its restart resolves it once; a receiver that
fails twice gets the notification on the third call (same idempotency key); a notification the
leader could not deliver is delivered by the next leader after a failover."""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from sites.emulation.etcd_server import free_port
from tests.broker import conftest as fed_conftest
from tests.broker.conftest import BROKER_SETTINGS, Federation

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)

SITE = {"east-a": fed_conftest.SITES["east-a"]}


@dataclass
class Call:
    hook: str
    status: int  # what the receiver answered
    key: str  # the Idempotency-Key header
    body: dict[str, Any]


@dataclass
class Receiver:
    """An HTTP webhook receiver: every call recorded; `script[hook]` lists the statuses its next
    calls get (then 200, or `default[hook]`)."""

    url: str = ""
    calls: list[Call] = field(default_factory=list)
    script: dict[str, list[int]] = field(default_factory=dict)
    default: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, hook: str) -> int:
        with self.lock:
            queued = self.script.get(hook)
            return queued.pop(0) if queued else self.default.get(hook, 200)

    def delivered(self, hook: str, status: str) -> list[Call]:
        """The calls to `hook` that the receiver accepted (2xx), about alerts in `status`."""
        with self.lock:
            return [
                c
                for c in self.calls
                if c.hook == hook and c.status < 300 and c.body["status"] == status
            ]

    def of(self, hook: str) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if c.hook == hook]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    got = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            hook = self.path.strip("/")
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status = got.answer(hook)
            with got.lock:
                got.calls.append(Call(hook, status, self.headers["Idempotency-Key"], body))
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    got.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield got
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def alert_settings(receiver: Receiver) -> dict[str, Any]:
    off = {"enabled": False}
    return {
        "interval_s": 0.2,
        "webhooks": [
            {"name": "ops", "url": f"{receiver.url}/ops", "headers": {"X-Test": "1"}},
            {"name": "flaky", "url": f"{receiver.url}/flaky"},
        ],
        "delivery": {"interval_s": 0.1, "initial_backoff_s": 0.2, "max_backoff_s": 0.4},
        "site_down": {"for_s": 0.5},
        "link": off,
        "utilization": off,
        "pending": off,
    }


@pytest.fixture
def federation(
    make_federation: Callable[..., Federation], receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> Federation:
    monkeypatch.setattr(
        fed_conftest, "BROKER_SETTINGS", {**BROKER_SETTINGS, "alerts": alert_settings(receiver)}
    )
    return make_federation(SITE)


def wait(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout}s: {what}")


def alerts(fed: Federation, **query: str) -> list[dict[str, Any]]:
    path = "/v1/alerts" + ("?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else "")
    status, page = fed.request("GET", path)
    assert status == 200, page
    return list(page["items"])


def test_site_down_fires_and_resolves_with_one_webhook_call_each_and_retries(
    federation: Federation, receiver: Receiver
) -> None:
    fed = federation
    receiver.script["flaky"] = [500, 500]  # the first notification's first two calls fail
    time.sleep(1.0)
    assert alerts(fed) == [] and receiver.calls == []
    bad = ("state=bogus", "state=", "rule=nope", "rule=", "limit=0")
    for query, name in ((q, q.split("=")[0]) for q in bad):
        status, body = fed.request("GET", f"/v1/alerts?{query}")
        assert status == 400 and body["error"]["field"] == name, body

    fed.kill(fed.agents["east-a"])  # SIGKILL: its lease expires in ~2 s
    wait(lambda: receiver.delivered("ops", "firing"), 15, "a firing call to ops")
    wait(lambda: receiver.delivered("flaky", "firing"), 10, "flaky delivered after two 500s")
    [firing] = alerts(fed, state="firing")
    assert firing["rule"] == "site_down" and firing["labels"]["site"] == "east-a"
    assert firing["alertname"] == "CpnSiteDown" and firing["ends_at"] is None

    fed.start_agent("east-a")
    wait(lambda: receiver.delivered("ops", "resolved"), 15, "a resolved call to ops")
    wait(lambda: receiver.delivered("flaky", "resolved"), 10, "a resolved call to flaky")
    time.sleep(1.0)  # nothing more comes

    [ops_fire], [ops_resolve] = receiver.of("ops")[:1], receiver.of("ops")[1:]
    assert len(receiver.of("ops")) == 2, receiver.of("ops")
    assert ops_fire.status == ops_resolve.status == 200
    body = ops_fire.body
    assert body["version"] == "4" and body["status"] == "firing"
    [alert] = body["alerts"]
    assert alert["labels"]["alertname"] == "CpnSiteDown" and alert["labels"]["site"] == "east-a"
    assert alert["endsAt"] == "0001-01-01T00:00:00Z" and alert["startsAt"].endswith("Z")
    assert body["notificationId"] == ops_fire.key
    assert ops_resolve.body["alerts"][0]["endsAt"] != "0001-01-01T00:00:00Z"
    assert ops_resolve.key != ops_fire.key

    flaky = receiver.of("flaky")
    assert [c.status for c in flaky] == [500, 500, 200, 200], flaky
    assert {c.key for c in flaky[:3]} == {ops_fire.key}  # retries carry the same key
    assert flaky[3].key == ops_resolve.key

    [resolved] = alerts(fed, state="resolved")
    assert resolved["ends_at"] is not None and alerts(fed, state="firing") == []
    # the outbox is empty again
    _, metrics = fed.get("/metrics")
    assert "cpn_alerts_outbox_notifications 0.0" in metrics
    assert 'cpn_alerts_notifications_total{result="failed",webhook="flaky"} 2.0' in metrics


def test_a_new_leader_delivers_what_the_old_one_could_not(
    federation: Federation, receiver: Receiver
) -> None:
    fed = federation
    receiver.default["flaky"] = 503  # down until the failover
    port = free_port()
    second = fed.processes.start(
        "broker", "--etcd", fed.registry.url, "--listen", f"127.0.0.1:{port}",
        "--config-dir", str(fed.config_dir), name="broker-second",
    )  # fmt: skip
    first_url, fed.broker_url = fed.broker_url, f"http://127.0.0.1:{port}"
    wait(lambda: _healthy(fed), 30, "the second broker serves")
    fed.broker_url = first_url

    fed.kill(fed.agents["east-a"])
    wait(lambda: receiver.delivered("ops", "firing"), 15, "a firing call to ops")
    wait(lambda: len(receiver.of("flaky")) >= 2, 10, "flaky refused it twice")
    assert fed.broker is not None
    fed.kill(fed.broker, signal.SIGKILL)  # the leader dies with the notification undelivered
    receiver.default["flaky"] = 200
    fed.broker_url = f"http://127.0.0.1:{port}"
    wait(lambda: receiver.delivered("flaky", "firing"), 20, "the new leader delivers it")
    time.sleep(1.0)

    [ops] = receiver.of("ops")  # no second firing: the new leader read the state from etcd
    flaky = receiver.of("flaky")
    assert {c.key for c in flaky} == {ops.key}, flaky
    assert [c.status for c in flaky if c.status < 300] == [200]
    [firing] = alerts(fed, state="firing")
    assert firing["labels"]["site"] == "east-a"
    assert second.poll() is None


def _healthy(fed: Federation) -> bool:
    try:
        status, _ = fed.get("/healthz")
    except OSError:
        return False
    return status == 200


def test_a_site_where_starts_keep_failing_is_backed_off_alerted_and_tried_again(
    make_federation: Callable[..., Federation], receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A site whose executor breaks after its agent started (here its jobs directory turned
    into a file: every run fails before it starts) gets start_failures attempts, each retried
    elsewhere; then the leader cordons it for a back-off (`backing off`, its reason and end),
    site_backing_off fires, new work goes elsewhere at once; once the back-off is over the
    cordon is lifted, the alert resolves, and the next job runs there again."""
    scheduling = {**BROKER_SETTINGS["scheduling"], "start_failures": 2, "start_backoff_s": 8.0}
    settings = {**BROKER_SETTINGS, "scheduling": scheduling, "alerts": alert_settings(receiver)}
    monkeypatch.setattr(fed_conftest, "BROKER_SETTINGS", settings)
    fed = make_federation({s: fed_conftest.SITES[s] for s in ("east-a", "east-b")})
    jobs = fed.config_dir / "state" / "sites" / "east-b" / "jobs"  # b is the cheaper
    shutil.rmtree(jobs, ignore_errors=True)
    jobs.parent.mkdir(parents=True, exist_ok=True)
    jobs.write_text("not a directory")

    gpu = {"model": "H100", "count": 1}  # at b's price, cheaper: placed there first
    first = [fed.submit(name=f"b{i}", gpu=gpu, command=["true"]) for i in range(2)]

    def cordon() -> dict[str, Any] | None:
        status, page = fed.request("GET", "/v1/sites")
        assert status == 200, page
        (site,) = (s for s in page["items"] if s["id"] == "east-b")
        return site.get("cordon")  # type: ignore[no-any-return]

    backing = wait(cordon, 15, "east-b cordoned")
    assert backing["until"] is not None and backing["reason"].startswith("backing off for 8 s")
    assert "2 attempts failed to start" in backing["reason"], backing
    for job in first:
        done = fed.wait_state(job["id"], "SUCCEEDED", "FAILED", timeout=30)
        assert done["state"] == "SUCCEEDED" and done["placement"]["site"] == "east-a", done
        assert any(e.get("site") == "east-b" and "cannot confine" in e["message"]
                   for e in done["events"]), done["events"]  # fmt: skip
    wait(lambda: alerts(fed, state="firing", rule="site_backing_off"), 10, "the alert fires")
    moved = fed.submit(name="meanwhile", gpu=gpu, command=["true"])
    done = fed.wait_state(moved["id"], "SUCCEEDED", "FAILED", timeout=30)
    assert done["placement"]["site"] == "east-a" and done["attempt"] == 1, done

    jobs.unlink()  # repaired; the back-off ends by itself
    wait(lambda: cordon() is None, 20, "the back-off lifted")
    wait(lambda: receiver.delivered("ops", "resolved"), 15, "site_backing_off resolved")
    again = fed.submit(name="again", gpu=gpu, command=["true"])
    done = fed.wait_state(again["id"], "SUCCEEDED", "FAILED", timeout=30)
    assert done["placement"]["site"] == "east-b" and done["attempt"] == 1, done
