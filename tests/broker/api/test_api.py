"""The API's bad-input paths on a real broker: strict types, YAML bodies, content types.

Every refusal names its code and its field. One broker process serves the whole module.
"""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import Iterator
from typing import Any, cast
from urllib.parse import urlsplit

import pytest

from broker.api import sites as site_list
from broker.api.app import OPERATIONS, make_app, openapi_document
from broker.api.inference import Gateway
from broker.api.keys import HTTP
from broker.api.openapi import spec_path
from broker.api.sites import SiteInfo, SiteRows, site_info, site_row
from broker.model.jobs import NOT_BLANK
from broker.process import Broker
from broker.state.router import Router
from sites.emulation.etcd_server import EmbeddedEtcd
from sites.model import keys
from sites.model.snapshot import Snapshot
from sites.model.status import Cordon, LastSeen
from tests.broker.apiserver import ApiBroker, Reply, start_api_broker
from tests.conftest import AUTH, Processes
from tests.cpn.test_render import PUBLISHED, TOPOLOGY, site_spec, view
from tests.routing.helpers import link

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)

JOB: dict[str, Any] = {"name": "api-job", "tenant": "ai-lab", "command": ["true"]}


@pytest.fixture(scope="module")
def api(etcd: EmbeddedEtcd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiBroker]:
    root = tmp_path_factory.mktemp("api")
    processes = Processes(root)
    try:
        yield start_api_broker(etcd.url, processes, root)
    finally:
        processes.stop_all()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"max_retries": False}, "max_retries"),  # lax mode read this as 0
        ({"cpu": "4"}, "cpu"),
        ({"cpu": 4.0}, "cpu"),
        ({"mem_gb": "4.5"}, "mem_gb"),
        ({"priority": True}, "priority"),
        ({"gpu": {"count": True, "model": "H100"}}, "gpu.count"),
        ({"gpu": {"count": 1, "min_mem_gb": "80"}}, "gpu.min_mem_gb"),
        ({"duration_hours": "2"}, "duration_hours"),
        ({"deadline": 4102444800}, "deadline"),  # a number is not an ISO 8601 date-time
        ({"command": ["echo", 1]}, "command[1]"),
        ({"env": {"A": 1}}, "env.A"),
        ({"denied_regions": "eu-central"}, "denied_regions"),
        ({"name": 7}, "name"),
    ],
)
def test_a_value_of_the_wrong_json_type_is_a_400_naming_the_field(
    api: ApiBroker, change: dict[str, Any], field: str
) -> None:
    reply = api.post_json("/v1/jobs", {**JOB, **change})
    assert reply.status == 400, reply
    assert reply.error() == ("invalid", field)


@pytest.mark.parametrize(
    ("gpu", "field", "words"),
    [
        ({"model": "H100", "share": 1.5}, "gpu.share", "less than or equal to 1"),
        ({"model": "H100", "share": 0.04}, "gpu.share", "greater than or equal to 0.05"),
        ({"model": "H100", "mem_gb": 20}, "gpu.mem_gb", "give share too"),
        ({"model": "H100", "share": 0.25, "count": 2}, "gpu.share", "count must be 1"),
        ({"min_mem_gb": 40, "count": 1, "profile": "3g.40gb"}, "gpu.profile",
         "needs model or models"),
        ({"model": "H100", "count": 12, "per_node": 8}, "gpu.per_node",
         "not a multiple of per_node"),
        ({"model": "H100", "share": 0}, "gpu.share", "greater than or equal to 0.05"),
        ({"model": "H100", "count": 1, "per_node": 0}, "gpu.per_node", "greater than or equal"),
        ({"model": "A100-80GB", "profile": "1g.18gb", "count": 1}, "gpu.profile",
         "A100-80GB has no MIG profile '1g.18gb'"),
    ],
)  # fmt: skip
def test_bad_slices_and_node_shapes_name_their_field(
    api: ApiBroker, gpu: dict[str, Any], field: str, words: str
) -> None:
    reply = api.post_json("/v1/jobs", {**JOB, "gpu": gpu})
    assert reply.status == 400 and reply.error() == ("invalid", field), reply
    assert words in str(reply.json()["error"]["message"]), reply


def test_a_site_entry_gives_free_devices_per_node() -> None:
    # pure: the entry GET /v1/sites builds from the registry's view (docs/topology.md)
    entry = site_info(view(site_spec(TOPOLOGY), PUBLISHED), 101.0)
    assert entry.nodes is not None and entry.nodes["g-0"] == {"H100": 3}
    assert entry.nodes["c"] == {} and list(entry.nodes) == ["g-0", "g-1", "g-2", "g-3", "c"]
    assert site_info(view(site_spec(None), ()), 101.0).nodes is None
    assert site_info(view(site_spec(TOPOLOGY), None), 101.0).nodes is None


def test_a_site_row_is_its_views_entry() -> None:
    """GET /v1/sites builds its rows from the snapshot without a view per site (site_row): the
    same JSON as site_info of the view, and what a validated SiteInfo gives."""
    up = view(site_spec(TOPOLOGY), PUBLISHED)
    other = site_spec(None).model_copy(update={"id": "plain"})
    gone = site_spec(None).model_copy(update={"id": "zz-cordoned"})
    assert up.status is not None
    snapshot = Snapshot(
        revision=1,
        specs={up.id: up.spec, other.id: other, gone.id: gone},
        statuses={up.id: up.status},
        links={
            (up.id, other.id): link(up.id, other.id, 12.5),
            (up.id, gone.id): link(up.id, gone.id, 3.0),
            (other.id, up.id): link(other.id, up.id, None),  # every probe lost
        },
        cordons={gone.id: Cordon(since=50.0, reason="maintenance")},
        last_seen={other.id: LastSeen(at=90.0, instance="i0")},
    )
    by_src, _ = snapshot.grouped()
    for site in snapshot.site_ids():
        row = site_row(snapshot, site, by_src, 101.0)
        assert row == site_info(snapshot.view(site), 101.0).model_dump_json().encode()
        assert row is not None
        assert SiteInfo.model_validate_json(row).model_dump_json().encode() == row
    assert json.loads(site_row(snapshot, up.id, by_src, 101.0) or b"")["rtt_ms"] == {
        "zz-cordoned": 3.0,
        "plain": 12.5,
    }
    assert site_row(snapshot, "left", by_src, 101.0) is None


async def test_site_rows_follow_the_journals_and_render_only_what_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GET /v1/sites' rows (broker.api.sites.SiteRows) against a snapshot kept current as the
    view keeps it: after each change, every page equals the rows rendered from scratch, and
    only the sites the change touched were rendered again."""
    monkeypatch.setattr(site_list, "SITES_REFRESH_S", 0.0)
    monkeypatch.setattr(site_list, "JOURNAL_CHUNK", 1)  # the journals read in slices
    up = view(site_spec(TOPOLOGY), PUBLISHED)
    assert up.status is not None
    specs = [site_spec(None).model_copy(update={"id": f"s{i:02d}"}) for i in range(30)]
    sites = Snapshot(revision=0, link_journal=[], site_journal=[])
    for spec in [up.spec, *specs]:
        sites.apply(keys.site_spec(spec.id), spec.model_dump_json().encode())
    sites.apply(keys.site_status(up.id), up.status.model_dump_json().encode())
    for spec in specs[:3]:
        ln = link(spec.id, up.id, 10.0)
        sites.apply(keys.link(spec.id, up.id), ln.model_dump_json().encode())
    rendered: list[str] = []
    real = site_list._render

    def counted(snapshot: Snapshot, site: str, rtt: dict[str, float]) -> Any:
        rendered.append(site)
        return real(snapshot, site, rtt)

    monkeypatch.setattr(site_list, "_render", counted)
    rows = SiteRows()

    async def check(expect_rendered: set[str]) -> None:
        rendered.clear()
        await rows.refresh(sites)
        assert set(rendered) == expect_rendered
        by_src, _ = sites.grouped()
        want = [site_row(sites, site, by_src, 200.0) for site in sites.site_ids()]
        got, after = [], ""
        while True:  # pages of 7, as a client follows `continue`
            page, after_ = rows.page(after, 7, 200.0)
            got += page
            if after_ is None:
                break
            after = after_
        assert got == want

    await check({up.id, *(s.id for s in specs)})  # the first list renders every site
    await check(set())  # nothing changed: nothing rendered
    status = up.status.model_copy(update={"published_at": 150.0})
    sites.apply(keys.site_status(up.id), status.model_dump_json().encode())
    await check({up.id})
    sites.apply(
        keys.link(specs[1].id, up.id), link(specs[1].id, up.id, 3.5).model_dump_json().encode()
    )
    sites.apply(keys.link(specs[2].id, up.id), None)
    await check({specs[1].id, specs[2].id})
    assert json.loads(rows.page("", 100, 200.0)[0][2])["rtt_ms"] == {up.id: 3.5}
    sites.apply(
        keys.site_cordon(specs[5].id), Cordon(since=1.0, reason="r").model_dump_json().encode()
    )
    await check({specs[5].id})
    # a site joins: the whole list again (the set of sites changed)
    joined = site_spec(None).model_copy(update={"id": "s99"})
    sites.apply(keys.site_spec(joined.id), joined.model_dump_json().encode())
    await check({up.id, joined.id, *(s.id for s in specs)})
    # a journal that dropped what the rows had not read yet: the whole list again
    sites.apply(keys.site_status(up.id), up.status.model_dump_json().encode())
    sites.site_journal_base += len(sites.site_journal or []) + 1
    sites.site_journal = []
    await check({up.id, joined.id, *(s.id for s in specs)})
    # a page answered while the whole list is rendered again (between its chunks) reads the
    # rows from before, all of them, never a list half rendered
    monkeypatch.setattr(site_list, "SITES_CHUNK", 1)
    before = rows.page("", 100, 200.0)[0]
    sites.apply(
        keys.site_spec("s98"), joined.model_copy(update={"id": "s98"}).model_dump_json().encode()
    )
    rebuilding = asyncio.create_task(rows.refresh(sites))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not rebuilding.done() and rows.page("", 100, 200.0)[0] == before
    await rebuilding
    assert len(rows.page("", 100, 200.0)[0]) == len(before) + 1


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b'"mem_gb": NaN', "mem_gb"),
        (b'"latency_weight": Infinity, "user": {"region": "shanghai"}', "latency_weight"),
        (b'"budget_usd": -Infinity', "budget_usd"),
    ],
)
def test_json_non_finite_numbers_are_refused(api: ApiBroker, raw: bytes, field: str) -> None:
    body = b'{"name": "x", "tenant": "ai-lab", "command": ["true"], ' + raw + b"}"
    reply = api.call("POST", "/v1/jobs", body, "application/json")
    assert reply.status == 400 and reply.error() == ("invalid", field), reply


def test_strict_json_keeps_the_conversions_json_needs(api: ApiBroker) -> None:
    body = {
        **JOB,
        "name": "conversions",
        "deadline": "2099-01-01T00:00:00Z",  # ISO 8601 string -> datetime
        "command": "sh -c 'echo hi'",  # a shell string is split
        "denied_regions": ["eu-central"],  # an array -> a tuple
        "mem_gb": 4,  # an integer is a fine number
        "group": {"name": "g", "kind": "spread"},  # a string -> a literal
    }
    reply = api.post_json("/v1/jobs", body)
    assert reply.status == 201, reply
    spec = reply.json()["spec"]
    assert isinstance(spec, dict)
    assert spec["deadline"] == "2099-01-01T00:00:00Z"
    assert spec["command"] == ["sh", "-c", "echo hi"]
    assert spec["denied_regions"] == ["eu-central"] and spec["mem_gb"] == 4.0


def test_answers_carry_the_brokers_own_time(api: ApiBroker) -> None:
    def dur_ms(reply: Reply) -> float:
        assert reply.server_timing is not None and reply.server_timing.startswith("app;dur="), reply
        return float(reply.server_timing.removeprefix("app;dur="))

    def counted() -> float:
        metrics = api.call("GET", "/metrics").body.decode()
        prefix = 'cpn_broker_http_request_duration_seconds_count{method="POST",route="/v1/jobs"}'
        lines = [line for line in metrics.splitlines() if line.startswith(prefix)]
        return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0

    before = counted()
    created = api.post_json("/v1/jobs", {**JOB, "name": "timed"})
    refused = api.post_json("/v1/jobs", {**JOB, "cpu": "4"})
    assert created.status == 201 and refused.status == 400
    assert 0 < dur_ms(created) < 30_000 and 0 < dur_ms(refused) < 30_000
    assert counted() == before + 2  # the histogram counts both, refusals included
    # and how late the broker's loop runs, sampled every 50 ms since it started
    metrics = api.call("GET", "/metrics").body.decode()
    (samples,) = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("cpn_broker_event_loop_lag_seconds_count ")
    ]
    assert samples > 0


@pytest.mark.parametrize("content_type", ["application/yaml", "text/yaml"])
def test_a_yaml_body_is_parsed_as_yaml(api: ApiBroker, content_type: str) -> None:
    name = "yaml-" + content_type.split("/")[0]
    text = (
        f"name: {name}\ntenant: ai-lab\ncpu: 2\nmem_gb: 8\n"
        "deadline: 2099-01-01 12:00:00+00:00\n"  # a YAML timestamp
        "command: echo from yaml\nenv: {MODE: fast}\n"
    )
    reply = api.call("POST", "/v1/jobs", text.encode(), f"{content_type}; charset=utf-8")
    assert reply.status == 201, reply
    record = reply.json()
    spec = record["spec"]
    assert isinstance(spec, dict)
    assert (spec["name"], spec["cpu"], spec["command"]) == (name, 2, ["echo", "from", "yaml"])
    assert spec["deadline"] == "2099-01-01T12:00:00Z" and spec["env"] == {"MODE": "fast"}


@pytest.mark.parametrize(
    ("text", "code", "field"),
    [
        ("name: y\ntenant: ai-lab\ncommand: [x]\nmax_retries: false\n", "invalid", "max_retries"),
        ("name: y\ntenant: ai-lab\ncommand: [x]\ncpu: '4'\n", "invalid", "cpu"),
        ("name: y\ntenant: ai-lab\ncommand: [x]\nmem_gb: .nan\n", "invalid", "mem_gb"),
        ("name: y\ntenant: ai-lab\ncommand: [x]\nenv: {1: a}\n", "invalid", "env"),
        ("name: y\ntenant: ai-lab\ncommand: [x]\nsurprise: 1\n", "invalid", "surprise"),
        ("name: y\ntenant: [unclosed\n", "malformed", None),
        ("- name: y\n", "invalid", None),
    ],
)
def test_a_bad_yaml_body_is_a_400(api: ApiBroker, text: str, code: str, field: str | None) -> None:
    reply = api.call("POST", "/v1/jobs", text.encode(), "application/yaml")
    assert reply.status == 400, reply
    assert reply.error() == (code, field)


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/route"])
@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "application/xml"]
)
def test_another_content_type_is_a_415(api: ApiBroker, path: str, content_type: str) -> None:
    reply = api.call("POST", path, json.dumps(JOB).encode(), content_type)
    assert reply.status == 415, reply
    assert reply.error() == ("unsupported_media", "Content-Type")
    assert reply.content_type.startswith("application/json")


def test_a_body_without_content_type_is_read_as_json(api: ApiBroker) -> None:
    url = urlsplit(api.url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=10)
    try:
        conn.request("POST", "/v1/jobs", body=json.dumps({**JOB, "max_retries": "3"}), headers=AUTH)
        resp = conn.getresponse()
        error = json.loads(resp.read())["error"]
    finally:
        conn.close()
    assert resp.status == 400 and (error["code"], error["field"]) == ("invalid", "max_retries")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"service": 5, "client_region": "shanghai"}, "service"),
        ({"service": "", "client_region": "shanghai"}, "service"),
        ({"service": "qwen-72b", "client_region": False}, "client_region"),
        ({"service": "qwen-72b", "client_region": "shanghai", "extra": 1}, "extra"),
        ({"service": "qwen-72b", "client_region": "atlantis"}, "client_region"),
        ({"service": "qwen-72b"}, "client_region"),
        ({"service": "qwen-72b", "client_region": "shanghai", "prefix_key": ""}, "prefix_key"),
        ({"service": "qwen-72b", "client_region": "shanghai", "prefix_key": 7}, "prefix_key"),
        (
            {"service": "qwen-72b", "client_region": "shanghai", "prefix_key": "k" * 257},
            "prefix_key",
        ),
    ],
)
def test_route_bodies_are_strict(api: ApiBroker, body: dict[str, Any], field: str) -> None:
    reply = api.post_json("/v1/route", body)
    assert reply.status == 400 and reply.error() == ("invalid", field), reply


def test_route_to_a_service_nobody_serves_is_a_404(api: ApiBroker) -> None:
    reply = api.post_json("/v1/route", {"service": "nope", "client_region": "shanghai"})
    assert reply.status == 404 and reply.error() == ("not_found", None)


def test_query_parameters_are_checked(api: ApiBroker) -> None:
    reply = api.call("GET", "/v1/jobs?state=SLEEPING")
    assert reply.status == 400 and reply.error() == ("invalid", "state")
    assert api.call("GET", "/v1/jobs?state=pending").status == 200
    reply = api.call("GET", "/v1/jobs/some-job/logs?follow=maybe")
    assert reply.status == 400 and reply.error() == ("invalid", "follow")


def _stand_in() -> Broker:
    """Enough of a Broker for make_app to wire its routes (no etcd behind it)."""
    from types import SimpleNamespace

    from broker.placement.settings import BrokerSettings
    from sites.kits.clock import SystemClock

    return cast(
        Broker,
        SimpleNamespace(
            tokens=None,
            audit=None,
            settings=BrokerSettings(),
            clock=SystemClock(),
            agent_trust=None,
            operations=SimpleNamespace(user_regions=frozenset()),  # the document lists them
        ),
    )


def _app_as_served() -> Any:
    """The app as broker.server wires it, on stand-ins: only the routes matter here."""
    from types import SimpleNamespace

    # the document lists the router's client regions (none here)
    router = cast(Router, SimpleNamespace(clients=SimpleNamespace(regions={})))
    broker = _stand_in()
    app = make_app(broker, router)
    Gateway(broker=broker, router=router).install(app)
    return app


def test_the_document_lists_exactly_the_routes_served() -> None:
    app = _app_as_served()
    served = set()
    for route in app.router.routes():
        methods = [m.lower() for m in route.method.split()]
        path = spec_path(route.resource.canonical)
        if route.method == "*":
            methods = ["get", "put", "post", "delete", "options", "head", "patch"]
        served |= {(m, path) for m in methods}
    doc = openapi_document(app)
    documented = {(m, p) for p, item in doc["paths"].items() for m in item}
    assert served == documented
    assert {"/v1/route", "/v1/infer/{service}/{path}"} <= set(doc["paths"])
    assert len(app[OPERATIONS]) == len(app.router.routes())


def test_the_document_describes_bodies_errors_and_parameters() -> None:
    doc = openapi_document(_app_as_served())
    schemas = doc["components"]["schemas"]
    submit = doc["paths"]["/v1/jobs"]["post"]
    assert set(submit["requestBody"]["content"]) == {
        "application/json",
        "application/yaml",
        "text/yaml",
    }
    assert submit["requestBody"]["content"]["text/yaml"]["schema"] == {
        "$ref": "#/components/schemas/JobSpec"
    }
    for status in ("400", "409", "413", "415"):
        schema = submit["responses"][status]["content"]["application/json"]["schema"]
        assert schema == {"$ref": "#/components/schemas/Error"}
    assert schemas["Error"]["properties"]["error"]["required"] == ["code", "message", "field"]
    # every $ref points at a component, and no $defs is left inside one
    text = json.dumps(doc)
    assert '"$defs"' not in text
    for ref in {part.split('"')[0] for part in text.split('"$ref": "')[1:]}:
        assert ref.removeprefix("#/components/schemas/") in schemas, ref
    spec = schemas["JobSpec"]["properties"]
    assert spec["max_retries"]["type"] == "integer"
    assert {"type": "string", "pattern": NOT_BLANK} in spec["command"]["anyOf"]  # a shell string
    infer = doc["paths"]["/v1/infer/{service}/{path}"]["post"]
    where = {(p["name"], p["in"]) for p in infer["parameters"]}
    assert {("service", "path"), ("path", "path"), ("X-Cpn-Client-Region", "header")} <= where
    assert {"400", "404", "429", "503"} <= set(infer["responses"])
    route = doc["paths"]["/v1/route"]["post"]
    assert route["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/RouteAnswer"
    }
    logs = doc["paths"]["/v1/jobs/{job}/logs"]["get"]
    assert {p["name"]: p["in"] for p in logs["parameters"]} == {"job": "path", "follow": "query"}
    assert "text/plain" in logs["responses"]["200"]["content"]


async def test_one_client_session_lives_as_long_as_the_app() -> None:
    from aiohttp import web

    app = make_app(_stand_in())
    runner = web.AppRunner(app)
    await runner.setup()
    session = app[HTTP]
    assert not session.closed
    await runner.cleanup()
    assert session.closed
