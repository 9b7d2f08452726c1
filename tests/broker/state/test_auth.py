"""Authorization on a real broker (two replicas on one etcd): every endpoint x every role,
cross-tenant reads and writes, missing, malformed, expired and revoked tokens, the audit log
and the CLI's tokens and config file."""

from __future__ import annotations

import json
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.api.access import ACCESS
from broker.state.auth import GRANTS, Permission, Role
from sites.emulation.etcd_server import EmbeddedEtcd
from tests.broker.apiserver import ApiBroker, Reply, start_api_broker
from tests.conftest import Processes, run_cpn

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)

JOB = {"tenant": "ai-lab", "command": ["true"]}


@pytest.fixture(scope="module")
def fed(etcd: EmbeddedEtcd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fed]:
    root = tmp_path_factory.mktemp("auth")
    procs = Processes(root)
    try:
        a = start_api_broker(etcd.url, procs, root / "a")
        b = start_api_broker(etcd.url, procs, root / "b", leader=False)
        yield Fed(a, b, etcd.url, {})
    finally:
        procs.stop_all()


class Fed:
    def __init__(self, a: ApiBroker, b: ApiBroker, etcd: str, tokens: dict[str, str]) -> None:
        self.a, self.b, self.etcd, self.tokens = a, b, etcd, tokens

    def token(self, who: str) -> str:
        """A token per test principal, made by the admin through the API (once)."""
        if who == "admin":
            return ""  # ApiBroker's default: the tests' admin token
        if who not in self.tokens:
            role, _, tenant = who.partition(":")
            body: dict[str, Any] = {"role": role, "description": f"test {who}"}
            if tenant:
                body["tenant"] = tenant
            reply = self.a.post_json("/v1/tokens", body)
            assert reply.status == 201, reply
            self.tokens[who] = reply.json()["token"]
        return self.tokens[who]

    def as_(self, who: str) -> ApiBroker:
        return self.a if who == "admin" else self.a.as_(f"Bearer {self.token(who)}")

    def job(self, tenant: str = "ai-lab") -> str:
        reply = self.a.post_json("/v1/jobs", {**JOB, "name": "job", "tenant": tenant})
        assert reply.status == 201, reply
        return str(reply.json()["id"])


PRINCIPALS = (
    "admin",
    "operator",
    "tenant-admin:ai-lab",
    "tenant-user:ai-lab",
    "viewer",
    "viewer:ai-lab",
    "tenant-user:vision",
)


def role_of(who: str) -> Role:
    return Role(who.partition(":")[0])


def allowed(who: str, permission: Permission) -> bool:
    return permission is Permission.public or permission in GRANTS[role_of(who)]


def own(who: str) -> bool:
    """Whether `who` may see ai-lab's objects."""
    tenant = who.partition(":")[2]
    return tenant in ("", "ai-lab")


def call(api: ApiBroker, method: str, path: str, body: object = None) -> Reply:
    if body is None:
        return api.call(method, path)
    return api.call(method, path, json.dumps(body).encode(), "application/json")


@pytest.mark.parametrize("who", PRINCIPALS)
def test_every_endpoint_for_every_role(fed: Fed, who: str) -> None:
    api = fed.as_(who)
    job = fed.job()
    tested: set[tuple[str, str]] = set()

    def check(method: str, spec: str, path: str, body: object = None, cross: bool = False) -> Reply:
        tested.add((method, spec))
        reply = call(api, method, path, body)
        permission = ACCESS[(method, spec)]
        if not allowed(who, permission):
            assert reply.status == 403, (who, method, path, reply)
            assert reply.error() == ("forbidden", "Authorization")
        elif not cross:
            assert reply.status not in (401, 403, 500), (who, method, path, reply)
        return reply

    submit = check("POST", "/v1/jobs", "/v1/jobs", {**JOB, "name": "mine"}, cross=not own(who))
    if allowed(who, Permission.jobs_submit):
        # a tenant's token submits as its own tenant only
        assert submit.status == (201 if own(who) else 403), (who, submit)
        if not own(who):
            assert submit.error() == ("forbidden", "tenant")
    listed = check("GET", "/v1/jobs", "/v1/jobs")
    ids = {j["id"] for j in listed.json()["items"]}
    assert (job in ids) == own(who), who
    got = check("GET", "/v1/jobs/{job}", f"/v1/jobs/{job}")
    assert got.status == (200 if own(who) else 404), (who, got)
    logs = check("GET", "/v1/jobs/{job}/logs", f"/v1/jobs/{job}/logs")
    assert logs.status == (409 if own(who) else 404), (who, logs)  # 409: it has not run
    for action in ("suspend", "resume", "cancel"):
        spec = f"/v1/jobs/{{job}}/{action}"
        reply = check("POST", spec, f"/v1/jobs/{job}/{action}")
        if allowed(who, Permission.jobs_act):
            assert reply.status == (200 if own(who) else 404), (who, action, reply)
    # workflows: the jobs permissions, a tenant's token sees its own tenant's only
    steps = [{"name": "s", "command": ["true"]}, {"name": "t", "command": ["true"], "after": ["s"]}]
    body = {"name": "wf", "tenant": "ai-lab", "steps": steps}
    made = check("POST", "/v1/workflows", "/v1/workflows", body, cross=not own(who))
    if allowed(who, Permission.jobs_submit):
        assert made.status == (201 if own(who) else 403), (who, made)
    wf = fed.a.post_json("/v1/workflows", body)
    wf_id = wf.json()["id"]
    listed_wf = check("GET", "/v1/workflows", "/v1/workflows")
    assert (wf_id in {w["id"] for w in listed_wf.json()["items"]}) == own(who), who
    got_wf = check("GET", "/v1/workflows/{workflow}", f"/v1/workflows/{wf_id}")
    assert got_wf.status == (200 if own(who) else 404), (who, got_wf)
    for action in ("cancel", "retry"):
        reply = check("POST", f"/v1/workflows/{{workflow}}/{action}",
                      f"/v1/workflows/{wf_id}/{action}")  # fmt: skip
        if allowed(who, Permission.jobs_act):
            assert reply.status == (200 if own(who) else 404), (who, action, reply)
    # managed services: the jobs permissions, a tenant's token sees its own tenant's only
    svc = {
        "tenant": "ai-lab",
        "model": "m",
        "command": ["true"],
        "slo": {"p95_ms": 500},
        "scaling": {"target_qps_per_replica": 1},
        "min_replicas": 0,
        "max_replicas": 1,
    }
    mine = "svc-" + who.replace(":", "-")
    put = check("PUT", "/v1/services/{name}", f"/v1/services/{mine}", {**svc, "name": mine},
                cross=not own(who))  # fmt: skip
    if allowed(who, Permission.jobs_submit):
        assert put.status == (201 if own(who) else 403), (who, put)
    made_svc = call(fed.a, "PUT", "/v1/services/shared", {**svc, "name": "shared"})
    assert made_svc.status in (200, 201), made_svc
    listed_svc = check("GET", "/v1/services", "/v1/services")
    if allowed(who, Permission.jobs_read):
        names = {s["name"] for s in listed_svc.json()["items"]}
        assert ("shared" in names) == own(who), (who, names)
    got_svc = check("GET", "/v1/services/{name}", "/v1/services/shared")
    if allowed(who, Permission.jobs_read):
        assert got_svc.status == (200 if own(who) else 404), (who, got_svc)
    gone_svc = check("DELETE", "/v1/services/{name}", f"/v1/services/{mine}")
    if allowed(who, Permission.jobs_act) and allowed(who, Permission.jobs_submit):
        assert gone_svc.status == (200 if own(who) else 404), (who, gone_svc)
    check("GET", "/v1/sites", "/v1/sites")
    route = check(
        "POST", "/v1/route", "/v1/route", {"service": "qwen-72b", "client_region": "shanghai"}
    )
    if allowed(who, Permission.route):
        assert route.status == 404, route  # no site serves it: past auth
    infer = call(api, "POST", "/v1/infer/qwen-72b/v1/completions", {"prompt": "x"})
    tested.add(("*", "/v1/infer/{service}/{path}"))
    assert (infer.status == 403) == (not allowed(who, Permission.route)), (who, infer)
    # the OpenAI surface: inference, as the proxy; its refusals in OpenAI's shape
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        openai = call(api, "POST", path, {"model": "no-such-model", "prompt": "x"})
        tested.add(("POST", path))
        if allowed(who, Permission.route):
            assert openai.status in (400, 404), (who, path, openai)  # past auth
        else:
            assert openai.status == 403, (who, path, openai)
            assert openai.json()["error"]["type"] == "permission_error", openai
    for path, route in (("/v1/models", "/v1/models"), ("/v1/models/x", "/v1/models/{model}")):
        models = call(api, "GET", path)
        tested.add(("GET", route))
        assert (models.status == 403) == (not allowed(who, Permission.route)), (who, models)
    tokens = check("GET", "/v1/tokens", "/v1/tokens")
    if tokens.status == 200:
        listing = json.loads(tokens.body)
        tenants = {t["tenant"] for t in listing}
        assert (None in tenants) if who == "admin" else tenants == {"ai-lab"}, tenants
        assert all("sha256" not in t and "token" not in t for t in listing)
    created = check("POST", "/v1/tokens", "/v1/tokens", {"role": "tenant-user", "tenant": "ai-lab"})
    if created.status == 201:
        tested.add(("DELETE", "/v1/tokens/{token}"))
        gone = call(api, "DELETE", f"/v1/tokens/{created.json()['id']}")
        assert gone.status == 200, gone
    else:
        check("DELETE", "/v1/tokens/{token}", "/v1/tokens/0000000000000000")
    audit = check("GET", "/v1/audit", "/v1/audit")
    if audit.status == 200 and who != "admin":
        entries = audit.json()["items"]
        assert entries and all(
            "ai-lab" in (e.get("tenant"), e.get("actor_tenant")) for e in entries
        )
    usage = check("GET", "/v1/usage", "/v1/usage?tenant=ai-lab", cross=not own(who))
    if allowed(who, Permission.usage):
        # a tenant's token sees its own tenant's usage only
        assert usage.status == (200 if own(who) else 403), (who, usage)
        if not own(who):
            assert usage.error() == ("forbidden", "tenant")
        else:
            assert (usage.json()["idle"] is None) == (who.partition(":")[2] != ""), who
    alerts = check("GET", "/v1/alerts", "/v1/alerts")
    if allowed(who, Permission.alerts):
        assert alerts.status == 200, (who, alerts)
        # a tenant's token lists its own tenant's alerts only
        tenant = who.partition(":")[2]
        assert all(a["labels"].get("tenant") == tenant for a in alerts.json()["items"] if tenant)
    tenants = check("GET", "/v1/tenants", "/v1/tenants")
    if allowed(who, Permission.tenants_read):
        # a tenant's token lists its own tenant only
        names = {t["tenant"] for t in tenants.json()["items"]}
        tenant = who.partition(":")[2]
        if tenant:
            assert names == ({"ai-lab"} if tenant == "ai-lab" else set()), (who, names)
        else:
            assert {"ai-lab", "hpc-center", "startup"} <= names, (who, names)
    theirs = check("GET", "/v1/tenants/{tenant}", "/v1/tenants/hpc-center")
    if allowed(who, Permission.tenants_read):
        assert theirs.status == (404 if who.partition(":")[2] else 200), (who, theirs)
    check("GET", "/v1/tenancy", "/v1/tenancy")
    put = check("PUT", "/v1/tenants/{tenant}", "/v1/tenants/t-auth", {"weight": 2})
    removed = check("DELETE", "/v1/tenants/{tenant}", "/v1/tenants/t-auth")
    if allowed(who, Permission.tenants_write):
        assert (put.status, removed.status) == (201, 200), (who, put, removed)
    tenancy = fed.a.call("GET", "/v1/tenancy").json()
    applied = check("PUT", "/v1/tenancy", "/v1/tenancy", tenancy)
    if allowed(who, Permission.tenants_write):
        assert applied.status == 200, (who, applied)
    check("GET", "/metrics", "/metrics")
    summary = check("GET", "/v1/routes/summary", "/v1/routes/summary")
    if allowed(who, Permission.metrics):
        assert summary.status == 200 and "items" in summary.json(), (who, summary)
    for public in ("/healthz", "/openapi.json", "/v1/whoami"):
        check("GET", public, public)
    # the dashboard's page and files hold no data: public (their API calls carry the token)
    page = check("GET", "/", "/")
    assert page.status == 200 and page.content_type.startswith("text/html"), page
    script = check("GET", "/dashboard/{asset}", "/dashboard/app.js")
    assert script.status == 200 and script.content_type.startswith("text/javascript"), script
    # datasets (broker.api.datasets): no site here stores one, so each answers what is missing
    # (404, 400 no site, 503 no store) once its permission let the call through
    ds = "/v1/datasets/{owner}/{name}"
    base = "/v1/datasets/ai-lab/ds"
    upload = "/uploads/east.0123456789abcdef"
    listed_ds = check("GET", "/v1/datasets", "/v1/datasets")
    if allowed(who, Permission.jobs_read):
        assert listed_ds.status == 200, (who, listed_ds)
    check("GET", ds, base)
    check("DELETE", ds, base)
    check("DELETE", ds + "/versions/{version}", base + "/versions/1")
    check("POST", ds + "/uploads", base + "/uploads", {"manifest": {"files": []}})
    check("PUT", ds + "/uploads/{upload}/files/{path}", base + upload + "/files/a.txt", None)
    check(
        "POST",
        ds + "/uploads/{upload}/commit",
        base + upload + "/commit",
        {"manifest": {"files": []}},
    )
    check("POST", ds + "/replicate", base + "/replicate", {"site": "east"})
    check("PUT", ds + "/shares", base + "/shares", {"add": ["vision"]})
    check("GET", ds + "/versions/{version}/manifest", base + "/versions/1/manifest")
    check("GET", ds + "/versions/{version}/files/{path}", base + "/versions/1/files/a.txt")
    assert set(ACCESS) == tested, set(ACCESS) - tested


def test_tokens_cannot_be_made_beyond_ones_own(fed: Fed) -> None:
    ta = fed.as_("tenant-admin:ai-lab")
    for body, status, field in (
        ({"role": "tenant-user", "tenant": "vision"}, 403, "Authorization"),
        ({"role": "admin"}, 403, "Authorization"),
        ({"role": "operator"}, 403, "Authorization"),
        ({"role": "viewer", "tenant": "ai-lab", "ttl_s": "1h"}, 201, None),
        ({"role": "tenant-user"}, 400, "tenant"),  # the body names none: checked first
        ({"role": "tenant-user", "tenant": "ai-lab", "ttl_s": "soon"}, 400, "ttl_s"),
        ({"role": "root"}, 400, "role"),
    ):
        reply = call(ta, "POST", "/v1/tokens", body)
        assert reply.status == status, (body, reply)
        if field is not None:
            code = "forbidden" if status == 403 else "invalid"
            assert reply.error() == (code, field), (body, reply)
    # admin input errors name the field
    bad = call(fed.a, "POST", "/v1/tokens", {"role": "tenant-user"})
    assert bad.status == 400 and bad.error() == ("invalid", "tenant"), bad
    bad = call(fed.a, "POST", "/v1/tokens", {"role": "admin", "tenant": "ai-lab"})
    assert bad.status == 400 and bad.error()[1] == "tenant", bad
    # another tenant's token is not there for a tenant-admin
    other = fed.token("tenant-user:vision")
    other_id = other[4:20]
    assert call(ta, "DELETE", f"/v1/tokens/{other_id}").status == 404


def test_bad_tokens_are_401_with_a_json_body(fed: Fed) -> None:
    good = fed.token("tenant-user:ai-lab")
    for header in (
        "",
        "Bearer",
        "Basic dXNlcjpwYXNz",
        "Bearer nonsense",
        "Bearer " + good[:-1] + ("A" if good[-1] != "A" else "B"),  # right id, wrong secret
        "Bearer cpn_0123456789abcdef_" + "x" * 43,  # unknown id
        "bearer  " + good + "x",
    ):
        reply = fed.a.as_(header).call("GET", "/v1/jobs")
        assert reply.status == 401, (header, reply)
        assert reply.error() == ("unauthorized", "Authorization")
        assert reply.content_type.startswith("application/json")
    # a body error behind a bad token is still a 401 (the token is checked first)
    reply = fed.a.as_("Bearer nope").call("POST", "/v1/jobs", b"{nope", "application/json")
    assert reply.status == 401


def test_an_expired_token_is_refused(fed: Fed) -> None:
    reply = fed.a.post_json("/v1/tokens", {"role": "viewer", "ttl_s": 1})
    assert reply.status == 201
    api = fed.a.as_(f"Bearer {reply.json()['token']}")
    assert api.call("GET", "/v1/jobs").status == 200
    time.sleep(1.2)
    expired = api.call("GET", "/v1/jobs")
    assert expired.status == 401 and "expired" in expired.json()["error"]["message"]


def test_a_revocation_reaches_every_replica_within_a_second(fed: Fed) -> None:
    reply = fed.a.post_json("/v1/tokens", {"role": "tenant-user", "tenant": "ai-lab"})
    token = reply.json()["token"]
    on_b = fed.b.as_(f"Bearer {token}")
    deadline = time.monotonic() + 5
    while on_b.call("GET", "/v1/jobs").status != 200:  # b sees the new token
        assert time.monotonic() < deadline
        time.sleep(0.02)
    revoked = fed.a.call("DELETE", f"/v1/tokens/{reply.json()['id']}")
    assert revoked.status == 200
    t0 = time.monotonic()
    while on_b.call("GET", "/v1/jobs").status != 401:
        assert time.monotonic() - t0 < 1.0, "replica b still takes a revoked token"
        time.sleep(0.01)
    assert fed.a.as_(f"Bearer {token}").call("GET", "/v1/jobs").status == 401


def test_every_change_is_audited_with_who_what_and_outcome(fed: Fed) -> None:
    user = fed.as_("tenant-user:ai-lab")
    headers_id = f"audit-{time.monotonic_ns()}"
    import urllib.request

    req = urllib.request.Request(
        fed.a.url + "/v1/jobs",
        data=json.dumps({**JOB, "name": "audited"}).encode(),
        method="POST",
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {fed.token('tenant-user:ai-lab')}",
            "X-Request-Id": headers_id,
        },
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.headers["X-Request-Id"] == headers_id
        job = json.loads(resp.read())["id"]
    refused = call(user, "POST", "/v1/jobs", {**JOB, "name": "theirs", "tenant": "vision"})
    assert refused.status == 403
    bad = call(user, "POST", "/v1/jobs", {**JOB, "name": "Bad Name"})
    assert bad.status == 400
    entries = fed.a.call("GET", "/v1/audit?limit=50").json()["items"]
    mine = next(e for e in entries if e["request_id"] == headers_id)
    assert mine["action"] == "POST /v1/jobs" and mine["target"] == job
    assert mine["tenant"] == "ai-lab" and mine["outcome"] == "ok" and mine["status"] == 201
    assert mine["actor"] == fed.token("tenant-user:ai-lab")[4:20] and mine["role"] == "tenant-user"
    outcomes = [(e["status"], e["outcome"]) for e in entries[:5]]
    assert (403, "forbidden") in outcomes and (400, "invalid") in outcomes, outcomes
    # reads are not audited; entries come newest first and page with continue
    assert all(e["action"].split()[0] in ("POST", "PUT", "PATCH", "DELETE") for e in entries)
    assert [e["at"] for e in entries] == sorted((e["at"] for e in entries), reverse=True)
    assert fed.a.call("GET", "/v1/audit?limit=0").error() == ("invalid", "limit")
    assert fed.a.call("GET", "/v1/audit?continue=xyz").error() == ("invalid", "continue")
    page = fed.a.call("GET", "/v1/audit?limit=2").json()
    assert len(page["items"]) == 2 and page["continue"]
    more = fed.a.call("GET", f"/v1/audit?limit=2&continue={page['continue']}").json()
    assert not {json.dumps(e) for e in more["items"]} & {json.dumps(e) for e in page["items"]}
    # they survive the broker: the other replica reads the same log from etcd
    again = fed.b.call("GET", "/v1/audit?limit=50").json()["items"]
    assert any(e["request_id"] == headers_id for e in again)


async def test_a_changes_audit_entry_is_written_in_the_changes_own_transaction(fed: Fed) -> None:
    """Atomic: a broker killed after the change cannot have dropped its entry. The token's key
    and the entry share one etcd revision; so do a new job's record and its entry."""
    from sites.model import keys
    from sites.registry.client import Registry

    request_id = f"atomic-{time.monotonic_ns()}"
    created = fed.a.post_json("/v1/tokens", {"role": "viewer", "description": request_id})
    assert created.status == 201, created
    token_id = created.json()["id"]
    submitted = fed.a.post_json("/v1/jobs", {**JOB, "name": "atomic"})
    job_id = submitted.json()["id"]
    async with Registry.from_urls(fed.etcd) as registry:
        _, entries = await registry.list_prefix(keys.AUDIT)
        revision_of = {}
        for _, raw, revision in entries:
            entry = json.loads(raw)
            revision_of[entry.get("target")] = (revision, entry)
        token_revision = (await registry.get_raw(keys.token(token_id)))[1]  # type: ignore[index]
        assert revision_of[token_id][0] == token_revision
        assert revision_of[token_id][1]["status"] == 201
        assert revision_of[token_id][1]["outcome"] == "ok"
        # the job's first revision: its index entry as submitted is at the same revision
        job_revision, entry = revision_of[job_id]
        assert entry["action"] == "POST /v1/jobs" and entry["status"] == 201
        reply = await registry.get_many([keys.job(job_id)], revision=job_revision)
        assert reply, "the job did not exist at its audit entry's revision"
        before = await registry.get_many([keys.job(job_id)], revision=job_revision - 1)
        assert not before, "the job existed before its audit entry"


def test_the_cli_bootstraps_a_token_from_etcd_and_uses_its_config(
    fed: Fed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CPN_TOKEN")
    monkeypatch.setenv("CPN_CONFIG", str(tmp_path / "config.yaml"))
    out = run_cpn("jobs", "--broker", fed.a.url)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "no token" in out.stderr
    made = run_cpn("token", "create", "--role", "admin", "--etcd", fed.etcd, "-o", "json")
    assert made.returncode == 0, made.stderr
    token = json.loads(made.stdout)["token"]
    from cpn.config import save_context

    path = save_context("test", fed.a.url, token)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    who = run_cpn("whoami")  # the broker and the token from the config file
    assert who.returncode == 0 and "admin" in who.stdout, who.stderr
    user = run_cpn("token", "create", "--role", "tenant-user", "--tenant", "ai-lab", "-o", "json")
    assert user.returncode == 0, user.stderr
    listed = run_cpn("token", "list")
    assert listed.returncode == 0 and json.loads(user.stdout)["id"] in listed.stdout
    assert "LAST USED" in listed.stdout
    stale = run_cpn("token", "ls", "--stale", "1d", "-o", "json")  # not the new ones
    assert stale.returncode == 0, stale.stderr
    stale_ids = {t["id"] for t in json.loads(stale.stdout)}
    assert not stale_ids & {json.loads(user.stdout)["id"], json.loads(made.stdout)["id"]}
    bad_stale = run_cpn("token", "list", "--stale", "soon")
    assert bad_stale.returncode == 2 and bad_stale.stderr.startswith("cpn: error: --stale:")
    revoked = run_cpn("token", "revoke", json.loads(user.stdout)["id"])
    assert revoked.returncode == 0, revoked.stderr
    audit = run_cpn("audit", "--limit", "5")
    assert audit.returncode == 0 and "DELETE /v1/tokens/{token}" in audit.stdout, audit.stdout
    bad = run_cpn("token", "create", "--role", "tenant-user")
    assert bad.returncode == 2 and "tenant" in bad.stderr, bad.stderr
    path.chmod(0o644)
    leaky = run_cpn("whoami")
    assert leaky.returncode == 2 and "readable by others" in leaky.stderr, leaky.stderr


def test_an_inference_token_is_rate_limited_as_its_tenant(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    procs = Processes(tmp_path)
    try:
        api = start_api_broker(
            etcd.url, procs, tmp_path / "limited",
            {"inference": {"tenant_rate_per_s": 0.1, "tenant_burst": 2}}, leader=False,
        )  # fmt: skip
        made = api.post_json("/v1/tokens", {"role": "tenant-user", "tenant": "ai-lab"})
        import urllib.error
        import urllib.request

        statuses, fields = [], []
        for i in range(3):  # a different X-Cpn-Tenant each time: the token's tenant counts
            req = urllib.request.Request(
                api.url + "/v1/infer/qwen-72b/v1/completions",
                data=b"{}",
                method="POST",
                headers={
                    "Authorization": f"Bearer {made.json()['token']}",
                    "X-Cpn-Client-Region": "shanghai",
                    "X-Cpn-Tenant": f"someone-else-{i}",
                    "Content-Type": "application/json",
                },
            )
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    statuses.append(resp.status)
            except urllib.error.HTTPError as exc:
                statuses.append(exc.code)
                fields.append(json.loads(exc.read())["error"]["field"])
        assert statuses == [404, 404, 429], statuses  # no site serves it; then over the limit
        assert fields[-1] == "X-Cpn-Tenant"
        # the inference lane refuses as the API's middlewares do: 401 JSON, the challenge, the
        # request's id; and counts its requests with the API's
        bare = urllib.request.Request(
            api.url + "/v1/infer/qwen-72b/v1/completions",
            data=b"{}",
            method="POST",
            headers={"X-Cpn-Client-Region": "shanghai", "X-Request-Id": "trace-7"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(bare, timeout=10)
        assert refused.value.code == 401
        assert refused.value.headers["WWW-Authenticate"] == 'Bearer realm="cpn"'
        assert refused.value.headers["X-Request-Id"] == "trace-7"
        assert json.loads(refused.value.read())["error"]["field"] == "Authorization"
        metrics = api.call("GET", "/metrics").body.decode()
        route = 'route="/v1/infer/{service}/{path}"'
        counted = {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("cpn_broker_http_requests_total{") and route in line
        }
        assert sum(v for k, v in counted.items() if 'status="404"' in k) == 2, counted
        assert sum(v for k, v in counted.items() if 'status="401"' in k) == 1, counted
    finally:
        procs.stop_all()
