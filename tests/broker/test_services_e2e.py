"""Managed inference services end to end (docs/services.md): real etcd, agent and broker
processes, stand-in model servers (routing.standin.server, made to drop what they have in flight
on SIGTERM: tests/broker/abrupt_modelserver.py) as the replicas.

One federation serves the whole lifecycle test (apply -> ready -> traffic -> a recorded
decision scales up -> a lower one drains a replica with streams in flight -> its site's agent
killed -> replaced -> delete), to stay fast on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from broker.model.services import ScalingDecision
from sites.model import keys
from tests.broker.conftest import SITES, Federation
from tests.conftest import AUTH, run_cpn

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

# three sites: two in "east" near client region user-east, one abroad near user-eu
THREE = {name: SITES[name] for name in ("east-a", "east-b", "abroad")}
CLIENTS = {
    "client_regions": [
        {"id": "user-east", "attach": [{"site": "east-a"}, {"site": "east-b"}],
         "cidrs": ["10.1.0.0/16"]},
        {"id": "user-eu", "attach": [{"site": "abroad"}], "cidrs": ["10.2.0.0/16"]},
    ]
}  # fmt: skip
# the stand-in, but dropping what it has in flight on SIGTERM: only a drain saves a stream
ABRUPT = Path(__file__).resolve().parent / "abrupt_modelserver.py"
SERVICE_MS = 1500  # every request takes 1.5 s: a stream is still in flight when its drain begins


def service_doc(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": "chat",
        "tenant": "t1",
        "model": "standin-7b",
        "command": [
            sys.executable, str(ABRUPT), "--listen", "127.0.0.1:{port}",
            "--name", "chat", "--median-ms", str(SERVICE_MS), "--p99-ms", str(SERVICE_MS),
            "--max-concurrency", "8", "--tokens", "15",
        ],
        "cpu": 1,
        "mem_gb": 0.5,
        "slo": {"p95_ms": 10000},
        "scaling": {"target_qps_per_replica": 5, "max_concurrency": 8},
        "min_replicas": 1,
        "max_replicas": 3,
        "clients": ["user-east"],
        "readiness": {"path": "/healthz", "period_s": 0.2},
        "drain_timeout_s": 20,
        "spread": True,  # one replica per site, so a site names a replica (several per site:
                         # test_services_replicas_e2e)
    }  # fmt: skip
    doc.update(overrides)
    return doc


@pytest.fixture
def service_federation(make_federation: Callable[..., Federation], tmp_path: Path) -> Federation:
    cfg = tmp_path / "configs"
    cfg.mkdir()
    (cfg / "clients.yaml").write_text(yaml.safe_dump(CLIENTS))
    return make_federation(THREE)


async def call(
    http: aiohttp.ClientSession, fed: Federation, method: str, path: str, **kw: Any
) -> tuple[int, Any]:
    async with http.request(method, fed.broker_url + path, **kw) as resp:
        return resp.status, await resp.json(content_type=None)


async def describe(http: aiohttp.ClientSession, fed: Federation) -> dict[str, Any]:
    status, view = await call(http, fed, "GET", "/v1/services/chat")
    assert status == 200, view
    return view  # type: ignore[no-any-return]


async def until(what: Callable[[], Any], timeout: float, why: str) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = await what()
        if last:
            return last
        await asyncio.sleep(0.2)
    raise AssertionError(f"{why} within {timeout}s")


def ready(view: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in view["replicas"] if r["state"] == "ready"]


async def decide(fed: Federation, replicas: dict[str, int]) -> None:
    """What the autoscaler does: record a decision for the service."""
    decision = ScalingDecision(
        service="chat", replicas=replicas, reason="test", at=time.time(), by="tests"
    )
    await fed.registry.put_raw(keys.scaling("chat"), decision.model_dump_json().encode())


async def infer(http: aiohttp.ClientSession, fed: Federation) -> tuple[int, str]:
    status, site, _ = await answer(http, fed)
    return status, site


async def answer(http: aiohttp.ClientSession, fed: Federation) -> tuple[int, str, bytes]:
    """A completion's status, the site that served it, and its body."""
    async with http.post(
        fed.broker_url + "/v1/infer/chat/v1/completions",
        json={"prompt": "hi"},
        headers={"X-Cpn-Client-Region": "user-east"},
    ) as resp:
        return resp.status, resp.headers.get("X-Cpn-Site", ""), await resp.read()


async def stream(
    http: aiohttp.ClientSession, fed: Federation, session: str, sites: asyncio.Queue[str]
) -> tuple[int, str, bytes]:
    """A streamed completion; its site goes to `sites` as soon as the headers are in."""
    async with http.post(
        fed.broker_url + "/v1/infer/chat/v1/completions",
        json={"prompt": "a long answer", "stream": True},
        headers={"X-Cpn-Client-Region": "user-east", "X-Cpn-Session": session},
    ) as resp:
        site = resp.headers.get("X-Cpn-Site", "")
        sites.put_nowait(site)
        body = await resp.read()
        return resp.status, site, body


async def test_a_service_scales_drains_and_replaces_its_replicas(
    service_federation: Federation, tmp_path: Path
) -> None:
    fed = service_federation
    path = tmp_path / "chat.yaml"
    path.write_text(yaml.safe_dump(service_doc()))
    result = await asyncio.to_thread(run_cpn, "service", "apply", str(path), "--broker",
                                     fed.broker_url)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "service chat applied" in result.stdout
    # and one whose replicas never become ready: each is stopped after its readiness timeout
    stuck = service_doc(
        name="stuck",
        command=["sleep", "60"],
        readiness={"path": "/healthz", "period_s": 0.2, "timeout_s": 1},
    )
    status, _ = fed.request("PUT", "/v1/services/stuck", stuck)  # fmt: skip
    assert status == 201
    async with aiohttp.ClientSession(headers=AUTH) as http:
        # min_replicas: one replica comes up, becomes ready and serves through the gateway
        view = await until(
            lambda: _with(describe(http, fed), lambda v: len(ready(v)) == 1), 30, "one ready"
        )
        first = ready(view)[0]
        assert first["region"] == "user-east" and first["site"] in ("east-a", "east-b")
        assert view["regions"] == [{"region": "user-east", "desired": 1, "actual": 1, "ready": 1}]
        status, site = await until(lambda: _ok(infer(http, fed)), 15, "routed to the replica")
        assert site == first["site"]

        # a recorded decision of 2 for user-east: a second replica, at another site (spread)
        await decide(fed, {"user-east": 2})
        view = await until(
            lambda: _with(describe(http, fed), lambda v: len(ready(v)) == 2), 30, "two ready"
        )
        sites = {r["site"] for r in ready(view)}
        assert len(sites) == 2, view["replicas"]
        second = next(r for r in ready(view) if r["job"] != first["job"])
        assert any(e["type"] == "scaled-up" and e["job"] == second["job"] for e in view["events"])
        await until(
            lambda: _sees(http, fed, second["site"]), 15, "the gateway routes to the second"
        )

        # streams in flight on the replica that goes (the newest), then a decision of 1
        opened: asyncio.Queue[str] = asyncio.Queue()
        streams: list[asyncio.Task[tuple[int, str, bytes]]] = []
        on_target = 0
        for i in range(24):
            streams.append(asyncio.create_task(stream(http, fed, f"s{i}", opened)))
            if await asyncio.wait_for(opened.get(), 10) == second["site"]:
                on_target += 1
            if on_target >= 2:
                break
        assert on_target >= 2, "no stream landed on the replica to remove"
        await decide(fed, {"user-east": 1})
        view = await until(
            lambda: _with(
                describe(http, fed),
                lambda v: any(r["state"] == "draining" for r in v["replicas"]),
            ),
            10,
            "the removed replica draining",
        )
        draining = [r for r in view["replicas"] if r["state"] == "draining"]
        assert [r["site"] for r in draining] == [second["site"]]
        # while it drains, new requests go to the replica that stays
        status, site, body = await answer(http, fed)
        assert (status, site) == (200, first["site"]), body
        done = await asyncio.gather(*streams)
        for status, site, body in done:
            assert status == 200, body
            assert body.rstrip().endswith(b"data: [DONE]"), (site, body[-200:])
        assert sum(site == second["site"] for _, site, _ in done) >= 2
        view = await until(
            lambda: _with(describe(http, fed), lambda v: len(v["replicas"]) == 1),
            15,
            "the drained replica gone",
        )
        assert view["replicas"][0]["job"] == first["job"]
        assert any(e["type"] == "scaled-down" for e in view["events"])

        # the remaining replica's agent killed: the replica is replaced at another site
        fed.kill(fed.agents[first["site"]], signal.SIGKILL)
        view = await until(
            lambda: _with(
                describe(http, fed),
                lambda v: any(r["site"] != first["site"] for r in ready(v)),
            ),
            40,
            "a replica ready at another site",
        )
        assert all(r["site"] != first["site"] for r in ready(view))
        status, site = await until(
            lambda: _ok(infer(http, fed), avoid=first["site"]), 15, "traffic moved"
        )
        assert site != first["site"]

        # a new command: a rolling update, a replica of generation 2 first, then the old drains
        newer = service_doc()
        newer["command"] = [*newer["command"], "--seed", "7"]
        status, applied = fed.request("PUT", "/v1/services/chat", newer)
        assert (status, applied["generation"]) == (200, 2), applied
        view = await until(
            lambda: _with(
                describe(http, fed),
                lambda v: [r["generation"] for r in v["replicas"]] == [2] and len(ready(v)) == 1,
            ),
            30,
            "the replica of generation 2 alone",
        )
        assert any(e["type"] == "updated" for e in view["events"])

        # a graceful stop of the replica's agent drains it first: a stream in flight survives
        serving = next(r["site"] for r in ready(view) if r["site"] != first["site"])
        opened = asyncio.Queue()
        last = asyncio.create_task(stream(http, fed, "last", opened))
        assert await asyncio.wait_for(opened.get(), 10) == serving
        agent = fed.agents[serving]
        agent.send_signal(signal.SIGTERM)
        status, site, body = await last
        assert (status, site) == (200, serving) and body.rstrip().endswith(b"data: [DONE]")
        assert await asyncio.to_thread(agent.wait, 20) == 0

        # the stuck service's replicas never got ready: each stopped at its timeout, failed
        async def stopped_unready() -> bool:
            status, view = await call(http, fed, "GET", "/v1/services/stuck")
            assert status == 200 and all(r["state"] != "ready" for r in view["replicas"])
            jobs = {e["job"] for e in view["events"] if e["job"]}
            for job_id in sorted(jobs):
                _, job = await call(http, fed, "GET", f"/v1/jobs/{job_id}")
                if any("not ready within 1 s" in e["message"] for e in job.get("events", ())):
                    return True
            return False

        await until(stopped_unready, 20, "a stuck replica stopped at its readiness timeout")

        # delete: the replicas drain and stop, then the service is gone
        result = await asyncio.to_thread(run_cpn, "service", "delete", "chat", "--broker",
                                         fed.broker_url)  # fmt: skip
        assert result.returncode == 0, result.stderr
        await until(lambda: _gone(http, fed), 30, "the service gone")
        _, kvs = await fed.registry.list_prefix(keys.service_spec("chat"))
        assert kvs == []
        await until(lambda: _no_endpoints(fed), 15, "its endpoints withdrawn")


async def _with(view: Any, check: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
    got = await view
    return got if check(got) else None


async def _ok(got: Any, avoid: str | None = None) -> tuple[int, str] | None:
    status, site = await got
    return (status, site) if status == 200 and site != avoid else None


async def _sees(http: aiohttp.ClientSession, fed: Federation, site: str) -> bool:
    # requests of different sessions spread over the routed sites (rendezvous hashing)
    for i in range(16):
        async with http.post(
            fed.broker_url + "/v1/route",
            json={"service": "chat", "client_region": "user-east", "session_key": f"p{i}"},
        ) as resp:
            body = await resp.json()
            if resp.status == 200 and body["site"] == site:
                return True
    return False


async def _gone(http: aiohttp.ClientSession, fed: Federation) -> bool:
    status, _ = await call(http, fed, "GET", "/v1/services/chat")
    return status == 404


async def _no_endpoints(fed: Federation) -> bool:
    """No endpoint of chat: neither a site's own nor a managed replica's (replicas/<site>/chat/)."""
    _, own = await fed.registry.list_prefix(keys.SERVICES + "chat/")
    _, replicas = await fed.registry.list_prefix(keys.REPLICAS)
    return not own and not [k for k, _, _ in replicas if keys.split(k, keys.REPLICAS)[1] == "chat"]


def test_bad_service_files_name_their_field(
    make_federation: Callable[..., Federation], tmp_path: Path
) -> None:
    cfg = tmp_path / "configs"
    cfg.mkdir()
    sovereign = {
        "client_regions": [
            {"id": "user-east", "attach": [{"site": "east-a"}], "cidrs": ["10.1.0.0/16"]},
            {"id": "user-eu", "attach": [{"site": "abroad"}], "cidrs": ["10.2.0.0/16"],
             "allowed_regions": ["eu"]},
        ]
    }  # fmt: skip
    (cfg / "clients.yaml").write_text(yaml.safe_dump(sovereign))
    fed = make_federation({n: SITES[n] for n in ("east-a", "abroad")}, agents=False)
    cases = {
        "slo": {k: v for k, v in service_doc().items() if k != "slo"},
        "max_replicas": service_doc(min_replicas=3, max_replicas=2),
        "clients[0]": service_doc(clients=["atlantis"]),
        "gpu.model": service_doc(gpu={"count": 1, "model": "H9000"}),
        "port": service_doc(port=70000),
        "readiness.path": service_doc(readiness={"path": "healthz"}),
        "regions[0]": service_doc(regions=["mars"]),
        "env": service_doc(env={"CPN_PORT": "1"}),
        # user-eu may be served from region eu only (clients.yaml), the service runs in east
        "clients[1]": service_doc(clients=["user-east", "user-eu"], regions=["east"]),
    }
    for field, doc in cases.items():
        status, body = fed.request("PUT", "/v1/services/chat", doc)
        assert status == 400, (field, body)
        assert body["error"]["field"] == field, (field, body)
    status, body = fed.request("PUT", "/v1/services/other", service_doc())
    assert (status, body["error"]["field"]) == (400, "name")
    # the CLI: exit 2 with one line that names the field
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(service_doc(min_replicas=3, max_replicas=2)))
    result = run_cpn("service", "apply", str(path), "--broker", fed.broker_url)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "max_replicas" in result.stderr
    path.write_text("- not\n- a mapping\n")
    result = run_cpn("service", "apply", str(path), "--broker", fed.broker_url)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    # a good one is listed, described, and a tenant of another name cannot take the name
    status, body = fed.request("PUT", "/v1/services/chat", service_doc())
    assert status == 201, body
    status, body = fed.request("PUT", "/v1/services/chat", service_doc())
    assert status == 200 and body["generation"] == 1  # unchanged: no new generation
    status, body = fed.request("PUT", "/v1/services/chat", service_doc(tenant="t2"))
    assert (status, body["error"]["field"]) == (409, "name")
    status, listed = fed.request("GET", "/v1/services?limit=1")
    assert [s["name"] for s in listed["items"]] == ["chat"] and listed["continue"] is None
    status, _ = fed.request("PUT", "/v1/services/chat-b", service_doc(name="chat-b"))
    assert status == 201
    status, listed = fed.request("GET", "/v1/services?limit=1")
    assert [s["name"] for s in listed["items"]] == ["chat"] and listed["continue"] == "chat"
    status, listed = fed.request("GET", "/v1/services?limit=1&continue=chat&tenant=t1")
    assert [s["name"] for s in listed["items"]] == ["chat-b"] and listed["continue"] is None
    result = run_cpn("services", "--broker", fed.broker_url)
    assert result.returncode == 0 and "chat" in result.stdout, result.stderr
    result = run_cpn("service", "describe", "chat", "--broker", fed.broker_url)
    assert result.returncode == 0 and "user-east" in result.stdout, result.stderr
    status, body = fed.request("GET", "/v1/services/nope")
    assert status == 404
    assert json.dumps(body)  # a JSON error body
