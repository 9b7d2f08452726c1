"""The tenancy API on a real broker: /v1/tenants and /v1/tenancy, their bad-input paths and
permissions, and a quota set through the API holding end to end (a real agent runs the jobs)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from sites.emulation.etcd_server import EmbeddedEtcd
from sites.model import keys
from sites.registry.client import Registry
from tests.broker.apiserver import ApiBroker, Reply, start_api_broker
from tests.broker.conftest import SITES, Federation
from tests.conftest import CONFIGS, Processes, write_admin_token

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)


def call(api: ApiBroker, method: str, path: str, body: object = None) -> Reply:
    if body is None:
        return api.call(method, path)
    return api.call(method, path, json.dumps(body).encode(), "application/json")


def items(reply: Reply) -> dict[str, dict[str, Any]]:
    assert reply.status == 200, reply
    return {t["tenant"]: t for t in reply.json()["items"]}


@pytest.fixture(scope="class")
def api(etcd: EmbeddedEtcd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiBroker]:
    """One broker (the repo's configs, no site) per class, on an emptied etcd."""

    async def clean() -> None:
        async with Registry.from_urls(etcd.url) as registry:
            await registry.delete_prefix(keys.ROOT)
            await write_admin_token(registry)

    asyncio.run(clean())  # the tenancy is seeded from configs/tenants.yaml
    root = tmp_path_factory.mktemp("tenants")
    processes = Processes(root)
    try:
        yield start_api_broker(etcd.url, processes, root)
    finally:
        processes.stop_all()


@pytest.fixture(scope="class")
def token(api: ApiBroker) -> Callable[[str], ApiBroker]:
    made: dict[str, ApiBroker] = {}

    def as_(who: str) -> ApiBroker:
        """The broker called with a token of `who` ("role" or "role:tenant")."""
        if who not in made:
            role, _, tenant = who.partition(":")
            body = {"role": role, **({"tenant": tenant} if tenant else {})}
            reply = api.post_json("/v1/tokens", body)
            assert reply.status == 201, reply
            made[who] = api.as_(f"Bearer {reply.json()['token']}")
        return made[who]

    return as_


class TestTenantsApi:
    """The class's broker is stopped before the end-to-end tests below empty etcd: each test
    here uses tenants of its own, or puts back what it changed."""

    def test_the_demo_tenancy_is_seeded_and_listed(self, api: ApiBroker) -> None:
        tenants = items(api.call("GET", "/v1/tenants"))
        assert {"ai-lab", "hpc-center", "startup"} <= set(tenants)
        lab, hpc, startup = tenants["ai-lab"], tenants["hpc-center"], tenants["startup"]
        assert lab["configured"] and lab["cohort"] == "research" and lab["weight"] == 2
        assert lab["quota"] == {"gpus": 4096}
        assert hpc["quota"] == {"gpus": 2048, "gpus/H100": 1024, "gpus@eu-central": 256}
        assert startup["budget"] == {
            "usd_left": 20000.0,
            "usd_total": 20000.0,
            "gpu_hours_left": 5000.0,
            "gpu_hours_total": 5000.0,
        }
        # nothing held: startup may take its quota and what ai-lab may lend, up to its limit
        assert startup["use"] == {"cpu": 0, "gpus": 0, "jobs": 0, "mem_gb": 0}
        assert startup["available"] == {"gpus": 320, "jobs": 100}
        assert startup["borrowed"] == {} and lab["lent"] == {} and startup["share"] == 0
        assert lab["budget"] is None and hpc["cohort"] is None and lab["pending"] == 0
        tenancy = api.call("GET", "/v1/tenancy").json()
        assert set(tenancy["cohorts"]) == {"research"}
        assert tenancy["fair_share"] == {"half_life": 7 * 86400.0}

    def test_put_get_and_delete_a_tenant(self, api: ApiBroker) -> None:
        body = {
            "quota": {"gpus": 8, "gpu_models": {"H100": 4}, "cpu": 64},
            "regions": {"east": {"gpus": 2}},
            "weight": 2,
        }
        created = call(api, "PUT", "/v1/tenants/t-crud", body)
        assert created.status == 201, created
        got = created.json()
        assert got["quota"] == {"gpus": 8, "gpus/H100": 4, "cpu": 64, "gpus@east": 2}
        assert got["policy"]["weight"] == 2 and got["configured"]
        # the next call sees it at once (the handler waited for the mirror): no 409
        replaced = call(api, "PUT", "/v1/tenants/t-crud", {**body, "weight": 3})
        assert replaced.status == 200, replaced
        shown = api.call("GET", "/v1/tenants/t-crud").json()
        assert shown["weight"] == 3 and shown["policy"]["quota"]["gpus"] == 8
        assert "t-crud" in items(api.call("GET", "/v1/tenants"))
        # a YAML body, a budget with a duration, the short form of the quota
        yaml_body = b"gpus: 2\nbudget: {gpu_hours: 10, window: 7d}\n"
        short = api.call("PUT", "/v1/tenants/t-yaml", yaml_body, "application/yaml")
        assert short.status == 201, short
        assert short.json()["quota"] == {"gpus": 2}
        assert short.json()["budget"]["gpu_hours_total"] == 10
        assert short.json()["policy"]["budget"]["window"] == 7 * 86400.0
        removed = api.call("DELETE", "/v1/tenants/t-crud")
        assert removed.status == 200 and removed.json()["weight"] == 3, removed
        assert api.call("GET", "/v1/tenants/t-crud").error() == ("not_found", None)
        assert api.call("DELETE", "/v1/tenants/t-crud").status == 404
        assert api.call("DELETE", "/v1/tenants/t-yaml").status == 200
        assert "t-crud" not in items(api.call("GET", "/v1/tenants"))

    @pytest.mark.parametrize(
        ("body", "field"),
        [
            ({"cohort": "nope"}, "cohort"),  # no such cohort
            ({"borrowing_limit": {"gpus": 2}}, "cohort"),  # a limit with no cohort
            ({"quota": {"gpus": -1}}, "quota.gpus"),
            ({"quota": {"gpus": 1.5}}, "quota.gpus"),
            ({"quota": {"gpus": "4"}}, "quota.gpus"),
            ({"quota": {"gpus": True}}, "quota.gpus"),
            ({"quota": {"tpus": 3}}, "quota.tpus"),
            ({"quota": {"mem_gb": -0.5}}, "quota.mem_gb"),
            ({"regions": {"east": {"cpu": -2}}}, "regions.east.cpu"),
            ({"weight": 0}, "weight"),
            ({"budget": {"usd_per_month": 0}}, "budget.usd_per_month"),
            ({"budget": {"window": "soon"}}, "budget.window"),
            ({"lending_limit": {"jobs": -1}, "cohort": "research"}, "lending_limit.jobs"),
        ],
    )
    def test_a_bad_policy_is_a_400_naming_the_field(
        self, api: ApiBroker, body: dict[str, Any], field: str
    ) -> None:
        reply = call(api, "PUT", "/v1/tenants/t-bad", body)
        assert reply.status == 400, reply
        assert reply.error() == ("invalid", field), reply
        assert api.call("GET", "/v1/tenants/t-bad").status == 404  # nothing was written

    def test_bad_names_and_bodies(self, api: ApiBroker) -> None:
        assert call(api, "PUT", "/v1/tenants/Bad_Name", {}).error() == ("invalid", "tenant")
        assert api.call("GET", "/v1/tenants/Bad_Name").error() == ("invalid", "tenant")
        # a cohort's name is not a tenant's
        assert call(api, "PUT", "/v1/tenants/research", {}).error() == ("invalid", "tenant")
        malformed = api.call("PUT", "/v1/tenants/t-bad", b"{", "application/json")
        assert malformed.status == 400 and malformed.error()[0] == "malformed"
        assert call(api, "PUT", "/v1/tenants/t-bad", [1]).status == 400
        media = api.call("PUT", "/v1/tenants/t-bad", b"gpus=1", "text/plain")
        assert media.status == 415 and media.error() == ("unsupported_media", "Content-Type")

    @pytest.mark.parametrize(
        ("body", "field"),
        [
            ({"tenants": {"a": {"cohort": "x"}}}, "tenants.a.cohort"),
            ({"cohorts": {"c": {"parent": "d"}}}, "cohorts.c.parent"),
            ({"cohorts": {"c": {"parent": "e"}, "e": {"parent": "c"}}}, "cohorts.c.parent"),
            ({"tenants": {"a": {}}, "cohorts": {"a": {}}}, "cohorts.a"),
            ({"tenants": {"a": {"lending_limit": {"gpus": 1}}}}, "tenants.a.cohort"),
            ({"cohorts": {"c": {"borrowing_limit": {"gpus": 1}}}}, "cohorts.c.parent"),
            ({"tenants": {"a": {"quota": {"gpus": -1}}}}, "tenants.a.quota.gpus"),
            ({"priority_classes": {"p": {"value": 2000}}}, "priority_classes.p.value"),
            ({"fair_share": {"half_life": 0}}, "fair_share.half_life"),
            ({"tenant": {}}, "tenant"),
        ],
    )
    def test_a_bad_tenancy_is_a_400_naming_the_field(
        self, api: ApiBroker, body: dict[str, Any], field: str
    ) -> None:
        reply = call(api, "PUT", "/v1/tenancy", body)
        assert reply.status == 400, reply
        assert reply.error() == ("invalid", field), reply

    def test_the_whole_tenancy_is_replaced_at_once_and_audited(self, api: ApiBroker) -> None:
        before = api.call("GET", "/v1/tenancy").json()
        demo = yaml.safe_load((CONFIGS / "tenants.yaml").read_text())
        demo["tenants"] = {"solo": {"quota": {"gpus": 1}, "cohort": "pool"}}
        demo["cohorts"] = {"pool": {"quota": {"gpus": 4}}}
        text = yaml.safe_dump(demo).encode()
        applied = api.call("PUT", "/v1/tenancy", text, "application/yaml")
        assert applied.status == 200, applied
        tenants = items(api.call("GET", "/v1/tenants"))
        assert set(tenants) == {"solo"}, tenants  # ai-lab, hpc-center, startup are gone
        assert tenants["solo"]["available"] == {"gpus": 5}  # its 1 and the cohort's own 4
        put = call(api, "PUT", "/v1/tenants/solo2", {"cohort": "pool"})
        assert put.status == 201, put
        entries = api.call("GET", "/v1/audit?limit=20").json()["items"]
        actions = {(e["action"], e.get("target"), e["status"]) for e in entries}
        assert ("PUT /v1/tenancy", "tenancy", 200) in actions, actions
        assert ("PUT /v1/tenants/{tenant}", "tenant/solo2", 201) in actions, actions
        restored = call(api, "PUT", "/v1/tenancy", before)
        assert restored.status == 200, restored
        assert {"ai-lab", "startup"} <= set(items(api.call("GET", "/v1/tenants")))

    def test_a_tenants_token_sees_its_own_tenant_only(
        self, api: ApiBroker, token: Callable[[str], ApiBroker]
    ) -> None:
        user = token("tenant-user:ai-lab")
        assert set(items(user.call("GET", "/v1/tenants"))) == {"ai-lab"}
        assert user.call("GET", "/v1/tenants/ai-lab").status == 200
        assert user.call("GET", "/v1/tenants/hpc-center").error() == ("not_found", None)
        assert set(user.call("GET", "/v1/tenancy").json()["tenants"]) == {"ai-lab"}
        for method, path in (
            ("PUT", "/v1/tenants/ai-lab"),
            ("DELETE", "/v1/tenants/ai-lab"),
            ("PUT", "/v1/tenancy"),
        ):
            refused = call(user, method, path, {} if method == "PUT" else None)
            assert refused.status == 403, (method, path, refused)
            assert refused.error() == ("forbidden", "Authorization")
        admin_of_its_tenant = token("tenant-admin:ai-lab")
        assert call(admin_of_its_tenant, "PUT", "/v1/tenants/ai-lab", {}).status == 403
        viewer = token("viewer")
        assert {"ai-lab", "hpc-center"} <= set(items(viewer.call("GET", "/v1/tenants")))
        assert call(viewer, "PUT", "/v1/tenants/t-viewer", {}).status == 403
        operator = token("operator")
        assert call(operator, "PUT", "/v1/tenants/t-operator", {"weight": 5}).status == 201
        assert operator.call("DELETE", "/v1/tenants/t-operator").status == 200


# -- end to end: a real agent runs the jobs ----------------------------------------------------


def wait(fed: Federation, job_id: str, check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    record: dict[str, Any] = {}
    while time.monotonic() < deadline:
        record = fed.job(job_id)
        if check(record):
            return record
        time.sleep(0.1)
    raise AssertionError(f"{job_id}: {record.get('state')} {record.get('unschedulable')}")


def statuses(fed: Federation) -> dict[str, dict[str, Any]]:
    status, body = fed.request("GET", "/v1/tenants")
    assert status == 200, body
    return {t["tenant"]: t for t in body["items"]}


def test_a_quota_set_through_the_api_holds_and_the_status_shows_use_and_borrowing(
    make_federation: Callable[..., Federation],
) -> None:
    fed = make_federation({"east-a": SITES["east-a"]})  # 16 H100
    tenancy = {
        "tenants": {
            "lender": {"quota": {"gpus": 8}, "cohort": "lab"},
            "borrower": {"quota": {"gpus": 2}, "cohort": "lab"},
        },
        "cohorts": {"lab": {}},
    }
    status, body = fed.request("PUT", "/v1/tenancy", tenancy)
    assert status == 200, body
    status, body = fed.request("PUT", "/v1/tenants/capped", {"quota": {"gpus": 4}})
    assert status == 201, body
    hold = {"command": ["sleep", "60"], "cpu": 1, "mem_gb": 1.0}
    first = fed.submit(name="first", tenant="capped", gpu={"model": "H100", "count": 4}, **hold)
    wait(fed, first["id"], lambda r: r["state"] in ("PLACED", "RUNNING"))
    beyond = fed.submit(name="beyond", tenant="capped", gpu={"model": "H100", "count": 2}, **hold)
    waiting = wait(fed, beyond["id"], lambda r: "quota" in (r.get("unschedulable") or ""))
    assert waiting["state"] == "PENDING", waiting
    lent = fed.submit(name="lent", tenant="borrower", gpu={"model": "H100", "count": 4}, **hold)
    wait(fed, lent["id"], lambda r: r["state"] in ("PLACED", "RUNNING"))

    tenants = statuses(fed)
    capped, borrower, lender = tenants["capped"], tenants["borrower"], tenants["lender"]
    assert capped["use"]["gpus"] == 4 and capped["use"]["jobs"] == 1, capped
    assert capped["available"]["gpus"] == 0 and capped["pending"] == 1, capped
    assert capped["borrowed"] == {} and capped["share"] > 0, capped
    assert borrower["use"]["gpus"] == 4 and borrower["borrowed"] == {"gpus": 2}, borrower
    # the cohort pools 10, 4 of them held: 6 left to either (lender may reclaim the rest)
    assert borrower["available"]["gpus"] == 6, borrower
    assert lender["use"]["gpus"] == 0 and lender["lent"]["gpus"] > 0, lender
    assert lender["available"]["gpus"] == 6, lender

    # raising the quota through the API lets the waiting job run
    status, body = fed.request("PUT", "/v1/tenants/capped", {"quota": {"gpus": 6}})
    assert status == 200, body
    wait(fed, beyond["id"], lambda r: r["state"] in ("PLACED", "RUNNING"))
    assert statuses(fed)["capped"]["use"]["gpus"] == 6
    for job in (first, beyond, lent):
        fed.request("POST", f"/v1/jobs/{job['id']}/cancel")


def test_tenants_not_configured_are_listed_for_their_work(
    make_federation: Callable[..., Federation],
) -> None:
    fed = make_federation({"east-a": SITES["east-a"]}, agents=False)  # nothing runs
    job = fed.submit(name="waits", tenant="nobody-set", gpu={"model": "H100", "count": 1})
    deadline = time.monotonic() + 10
    while "nobody-set" not in (tenants := statuses(fed)) and time.monotonic() < deadline:
        time.sleep(0.05)  # the replica's view shows the job once its watch has
    free = tenants["nobody-set"]
    assert not free["configured"] and free["available"] is None and free["quota"] == {}
    assert free["pending"] == 1 and free["weight"] == 1, free
    assert tenants["small"]["quota"] == {"gpus": 4}  # the federation's tenants.yaml
    status, body = fed.request("GET", "/v1/tenants/nobody-set")
    assert status == 200 and body["policy"] is None, body
    fed.request("POST", f"/v1/jobs/{job['id']}/cancel")
