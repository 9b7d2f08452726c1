"""The OpenAI surface end to end, with the `openai` client library applications use: `cpn up`
(agents, stand-in model servers, a broker) on a real etcd, one base URL, the model in the
body; a second broker replica for the limits that must hold across replicas."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from sites.emulation.etcd_server import EmbeddedEtcd, free_port
from tests.conftest import ADMIN_TOKEN, CONFIGS, REPO, clear_registry, cpn_cmd

pytestmark = pytest.mark.e2e  # starts processes (tests/tiers.py)

SITES = ("yrd-demo-zone", "wuhu", "shaoguan")
REGION = {"X-Cpn-Client-Region": "shanghai"}
SLOW_MODEL = "qwen2.5-7b-instruct"  # at shaoguan only, made slow and small: the alias spills


def _lower(items: Any) -> dict[str, str]:
    return {name.lower(): value for name, value in items}


class Answer:
    def __init__(self, status_code: int, body: bytes, headers: dict[str, str]) -> None:
        self.status_code = status_code
        self.content = body
        self.headers = headers

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content)


class Http:
    """A few plain HTTP calls (urllib: the answers' raw bytes, streams read whole)."""

    def __init__(self, base_url: str, headers: dict[str, str]) -> None:
        self.base_url = base_url
        self.headers = headers

    def __enter__(self) -> Http:
        return self

    def __exit__(self, *_: object) -> None:
        pass

    def request(
        self,
        method: str,
        path: str,
        *,
        json_body: object = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
    ) -> Answer:
        url = self.base_url + path
        if params:
            url += "?" + "&".join(f"{k}={v}" for k, v in params.items())
        data = content if content is not None else None
        sent = {**self.headers, **(headers or {})}
        if json_body is not None:
            data = json.dumps(json_body).encode()
            sent["Content-Type"] = "application/json"
        elif data is not None:
            sent["Content-Type"] = "application/json"
        request = urllib.request.Request(url, data=data, method=method, headers=sent)
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return Answer(answer.status, answer.read(), _lower(answer.headers.items()))
        except urllib.error.HTTPError as error:
            return Answer(error.code, error.read(), _lower(error.headers.items()))

    def get(self, path: str, **kw: Any) -> Answer:
        return self.request("GET", path, **kw)

    def post(self, path: str, json: object = None, **kw: Any) -> Answer:  # noqa: A002
        return self.request("POST", path, json_body=json, **kw)

    def put(self, path: str, json: object = None, **kw: Any) -> Answer:  # noqa: A002
        return self.request("PUT", path, json_body=json, **kw)


class Demo:
    def __init__(self, url: str, up: subprocess.Popen[bytes], root: Path, cfg: Path) -> None:
        self.url = url
        self.up = up
        self.root = root
        self.cfg = cfg
        self.clients: list[openai.OpenAI] = []  # closed with the module's federation

    def http(self, token: str = ADMIN_TOKEN) -> Http:
        return Http(self.url, {"Authorization": f"Bearer {token}", **REGION})

    def client(self, token: str = ADMIN_TOKEN, url: str | None = None) -> openai.OpenAI:
        client = openai.OpenAI(
            base_url=(url or self.url) + "/v1",
            api_key=token,
            default_headers=REGION,
            max_retries=0,
        )
        self.clients.append(client)
        return client

    def tenant_token(self, tenant: str) -> str:
        with self.http() as http:
            made = http.post("/v1/tokens", json={"role": "tenant-user", "tenant": tenant})
            assert made.status_code == 201, made.text
            return str(made.json()["token"])

    def put_tenant(self, tenant: str, policy: dict[str, Any]) -> None:
        with self.http() as http:
            put = http.put(f"/v1/tenants/{tenant}", json=policy)
            assert put.status_code in (200, 201), put.text


@pytest.fixture(scope="module")
def demo(etcd: EmbeddedEtcd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    root = tmp_path_factory.mktemp("openai")
    cfg = root / "configs"
    shutil.copytree(CONFIGS, cfg)
    # shaoguan's qwen-7b: two slots and slow, so three requests in flight make it saturated
    site_file = cfg / "sites" / "shaoguan.yaml"
    site = yaml.safe_load(site_file.read_text())
    for service in site["services"]:
        if service["name"] == "qwen-7b":
            service["max_concurrency"] = 2
    site.setdefault("prices", {})["usd_per_million_tokens"] = {"*": {"input": 1.0, "output": 2.0}}
    site_file.write_text(yaml.safe_dump(site))
    standin = {
        "default": {"median_ms": 20, "p99_ms": 40},
        "models": {SLOW_MODEL: {"median_ms": 1500, "p99_ms": 1600}},
    }
    (cfg / "standin.yaml").write_text(yaml.safe_dump(standin))
    inference = {
        "health_interval_s": 0.5,
        "aliases": {"chat": [{"qwen-7b": 1}, "deepseek-v3"]},
        "queue": {"timeout_s": 0},
        "routing": {"overflow": "queue"},
    }
    (cfg / "broker.yaml").write_text(yaml.safe_dump({"inference": inference}))
    port = free_port()
    asyncio.run(clear_registry(etcd.url))
    log = open(root / "up.log", "wb")  # noqa: SIM115
    up = subprocess.Popen(
        cpn_cmd("up", "--etcd", etcd.url, "--config-dir", str(cfg), "--sites", ",".join(SITES),
                "--interval", "0.5", "--broker-listen", f"127.0.0.1:{port}"),
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
        env={**os.environ, "CPN_STATE_DIR": str(root / "state")},
    )  # fmt: skip
    log.close()
    demo = Demo(f"http://127.0.0.1:{port}", up, root, cfg)
    try:
        _wait_models(demo)
        yield demo
    finally:
        for client in demo.clients:
            client.close()
        up.send_signal(signal.SIGINT)
        up.wait(30)
        asyncio.run(clear_registry(etcd.url))


def _wait_models(demo: Demo) -> None:
    wanted = {"qwen-72b", "deepseek-v3", "qwen-7b", "chat"}
    deadline = time.monotonic() + 90
    seen: set[str] = set()
    while time.monotonic() < deadline:
        if demo.up.poll() is not None:
            raise AssertionError((demo.root / "up.log").read_text())
        try:
            with demo.http() as http:
                answer = http.get("/v1/models")
                if answer.status_code == 200:
                    seen = {m["id"] for m in answer.json()["data"]}
                    if wanted <= seen:
                        # every stand-in answers before the tests start
                        routed = http.post(
                            "/v1/route", json={"service": "qwen-7b", "client_region": "shanghai"}
                        )
                        if routed.status_code == 200:
                            return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"the models never all showed: {seen}")


def test_chat_completions_and_embeddings_on_one_base_url(demo: Demo) -> None:
    client = demo.client()
    chat = client.chat.completions.with_raw_response.create(
        model="qwen2.5-72b-instruct", messages=[{"role": "user", "content": "hello there"}]
    )
    assert chat.headers["x-cpn-service"] == "qwen-72b"
    parsed = chat.parse()
    assert parsed.choices[0].message.content
    assert parsed.usage is not None and parsed.usage.prompt_tokens > 0
    done = client.completions.create(model="deepseek-v3", prompt="one two three", max_tokens=5)
    assert done.usage is not None and done.usage.completion_tokens > 0
    vectors = client.embeddings.create(model="qwen-72b", input=["a cat", "a dog"])
    assert len(vectors.data) == 2 and len(vectors.data[0].embedding) > 0
    assert vectors.usage.prompt_tokens > 0


def _raw_stream(demo: Demo, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream's events as the client receives them, [DONE] as {}."""
    events = []
    with demo.http() as http:
        answer = http.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        text = answer.text
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append({} if payload == "[DONE]" else json.loads(payload))
    return events


def test_streams_carry_usage_exactly_when_asked(demo: Demo) -> None:
    messages = [{"role": "user", "content": "count to five"}]
    plain = _raw_stream(demo, {"model": "qwen-72b", "messages": messages, "stream": True})
    assert plain[-1] == {} and len(plain) > 2
    assert all("usage" not in event for event in plain), plain
    assert all(event["choices"] for event in plain[:-1])

    asked = _raw_stream(
        demo,
        {
            "model": "qwen-72b",
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert asked[-1] == {}
    last = asked[-2]
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] > 0
    assert all(event["usage"] is None for event in asked[:-2])

    # the openai client sees the same
    chunks = list(
        demo.client().chat.completions.create(
            model="qwen-72b",
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].choices == []


def test_unknown_model_is_openais_404(demo: Demo) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        demo.client().chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    error = caught.value.body
    assert isinstance(error, dict), error
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert error["type"] == "invalid_request_error"
    with demo.http() as http:
        missing = http.get("/v1/models/no-such-model")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
        bad = http.post("/v1/chat/completions", content=b"{not json")
        assert bad.status_code == 400
        assert set(bad.json()["error"]) == {"message", "type", "param", "code"}


def test_model_list_in_openais_shape(demo: Demo) -> None:
    models = demo.client().models.list()
    ids = {m.id for m in models.data}
    assert {"qwen-72b", "qwen2.5-72b-instruct", "deepseek-v3", "chat"} <= ids
    with demo.http() as http:
        card = http.get("/v1/models/qwen2.5-72b-instruct").json()
    assert card["object"] == "model" and card["root"] == "qwen2.5-72b-instruct"
    assert "parent" in card and "max_model_len" in card


def test_alias_spills_when_its_first_target_is_saturated(demo: Demo) -> None:
    client = demo.client()

    def ask(_: int) -> str:
        answer = client.chat.completions.with_raw_response.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        return str(answer.headers["x-cpn-service"])

    with ThreadPoolExecutor(8) as pool:
        served = list(pool.map(ask, range(8)))
    # qwen-7b has two slots (and room for one more in its queue): the rest spill
    assert "qwen-7b" in served and "deepseek-v3" in served, served


def test_sheddable_requests_are_refused_first_when_saturated(demo: Demo) -> None:
    client = demo.client()
    stop = threading.Event()

    def hold(_: int) -> None:
        client.chat.completions.create(
            model="qwen-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )

    with ThreadPoolExecutor(4) as pool:
        held = [pool.submit(hold, i) for i in range(4)]
        time.sleep(0.3)  # the four are in flight at a two-slot site
        with demo.http() as http:
            shed = http.post(
                "/v1/chat/completions",
                json={"model": "qwen-7b", "messages": [{"role": "user", "content": "x"}]},
                headers={"X-Cpn-Priority": "-1"},
            )
        stop.set()
        for future in held:
            future.result()
    assert shed.status_code == 503, shed.text
    assert shed.json()["error"]["code"] == "shed" and shed.headers["retry-after"]


def _usage_rows(demo: Demo, tenant: str) -> dict[str, Any]:
    with demo.http() as http:
        answer = http.get("/v1/usage", params={"tenant": tenant, "by": "tenant,model"})
        assert answer.status_code == 200, answer.text
        return dict(answer.json())


def _token_totals(report: dict[str, Any]) -> tuple[int, int]:
    total = report["total"]
    return int(total.get("prompt_tokens") or 0), int(total.get("completion_tokens") or 0)


def test_tokens_billed_equal_the_usage_the_client_received(demo: Demo) -> None:
    tenant = "openai-billing"
    demo.put_tenant(tenant, {"weight": 1})
    client = demo.client(demo.tenant_token(tenant))
    prompt = completion = 0
    for n in range(4):
        done = client.chat.completions.create(
            model="qwen-72b", messages=[{"role": "user", "content": f"tell me {n} things"}]
        )
        assert done.usage is not None
        prompt += done.usage.prompt_tokens
        completion += done.usage.completion_tokens
    stream = client.chat.completions.create(
        model="deepseek-v3",
        messages=[{"role": "user", "content": "stream please"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    last = list(stream)[-1]
    assert last.usage is not None
    prompt += last.usage.prompt_tokens
    completion += last.usage.completion_tokens
    deadline = time.monotonic() + 20
    totals = (0, 0)
    while time.monotonic() < deadline:
        totals = _token_totals(_usage_rows(demo, tenant))
        if totals == (prompt, completion):
            break
        time.sleep(0.3)
    assert totals == (prompt, completion)


def test_the_429_forms(demo: Demo) -> None:
    tenant = "openai-limited"
    demo.put_tenant(tenant, {"inference": {"requests_per_minute": 2}})
    client = demo.client(demo.tenant_token(tenant))
    message = [{"role": "user", "content": "hi"}]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the broker's tenancy mirror has the new policy
        try:
            for _ in range(3):
                client.chat.completions.create(model="qwen-72b", messages=message, max_tokens=2)
        except openai.RateLimitError as exc:
            assert exc.response.headers["retry-after"]
            assert exc.body["code"] == "rate_limited"  # type: ignore[index]
            break
        time.sleep(0.5)
    else:
        raise AssertionError("no 429 for a tenant over its requests per minute")

    spent = "openai-spent"
    demo.put_tenant(spent, {"inference": {"budget": {"tokens_per_month": 1}}})
    client = demo.client(demo.tenant_token(spent))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            client.chat.completions.create(model="qwen-72b", messages=message, max_tokens=2)
        except openai.RateLimitError as exc:
            assert exc.response.headers["x-should-retry"] == "false"
            assert exc.body["type"] == "insufficient_quota"  # type: ignore[index]
            return
        time.sleep(0.3)
    raise AssertionError("no 429 for a tenant whose budget is spent")


def _second_broker(demo: Demo, etcd_url: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    log = open(demo.root / "broker-2.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        cpn_cmd("broker", "--etcd", etcd_url, "--listen", f"127.0.0.1:{port}",
                "--config-dir", str(demo.cfg), "--state-dir", str(demo.root / "broker-2")),
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
    )  # fmt: skip
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError((demo.root / "broker-2.log").read_text())
        try:
            with Http(url, {"Authorization": f"Bearer {ADMIN_TOKEN}", **REGION}) as http:
                if http.get("/v1/models/qwen-72b").status_code == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the second broker never served the models")


def test_a_tokens_per_minute_limit_holds_across_two_replicas(
    demo: Demo, etcd: EmbeddedEtcd
) -> None:
    limit = 12_000
    tenant = "openai-tpm"
    demo.put_tenant(tenant, {"inference": {"tokens_per_minute": limit}})
    token = demo.tenant_token(tenant)
    proc, second = _second_broker(demo, etcd.url)
    try:
        clients = [demo.client(token), demo.client(token, second)]
        admitted = [0, 0]
        refused = [0, 0]
        message = [{"role": "user", "content": "write a long story about the sea " * 4}]

        def drive(i: int) -> None:
            client = clients[i]
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline and refused[i] < 5:
                try:
                    done = client.chat.completions.create(
                        model="qwen-72b", messages=message, max_tokens=64
                    )
                except openai.RateLimitError:
                    refused[i] += 1
                    time.sleep(0.05)
                    continue
                assert done.usage is not None
                admitted[i] += done.usage.total_tokens

        # the policy reached both replicas: a first request through each
        time.sleep(1.0)
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(drive, range(2)))
        total = sum(admitted)
        assert all(admitted), admitted  # both replicas served the tenant
        assert all(refused), refused  # and both refused it once the limit was reached
        assert limit * 0.95 <= total <= limit * 1.05, (total, admitted)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_a_broker_killed_mid_stream_bills_what_its_client_received(
    demo: Demo, etcd: EmbeddedEtcd
) -> None:
    tenant = "openai-killed"
    demo.put_tenant(tenant, {"weight": 1})
    token = demo.tenant_token(tenant)
    proc, second = _second_broker(demo, etcd.url)
    received = 0
    try:
        body = json.dumps(
            {"model": "qwen-7b", "max_tokens": 16, "stream": True,  # ~90 ms a token
             "messages": [{"role": "user", "content": "a slow story"}]}
        ).encode()  # fmt: skip
        request = urllib.request.Request(
            second + "/v1/chat/completions", data=body, method="POST",
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json",
                     **REGION},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=30) as answer:
            while received < 3:
                line = answer.readline()
                if line.startswith(b"data: {"):
                    received += 1
            proc.kill()  # SIGKILL: no flush, no goodbye
            proc.wait(10)
            try:  # what the broker had written before it died still arrives
                while line := answer.readline():
                    received += line.startswith(b"data: {")
            except (OSError, ValueError, http.client.HTTPException):
                pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert 3 <= received < 16
    # the same replica back on its state directory settles what it had written ahead
    again, _ = _second_broker(demo, etcd.url)
    try:
        deadline = time.monotonic() + 20
        report: dict[str, Any] = {}
        while time.monotonic() < deadline:
            report = _usage_rows(demo, tenant)
            if report["total"].get("inference_requests"):
                break
            time.sleep(0.3)
        total = report["total"]
        assert total["inference_requests"] == 1 and total["counted_requests"] == 1, total
        # billed from the chunks that went out: never fewer than the client received
        assert received <= total["completion_tokens"] <= received + 1, (received, total)
        assert total["prompt_tokens"] > 0
    finally:
        again.send_signal(signal.SIGINT)
        try:
            again.wait(20)
        except subprocess.TimeoutExpired:
            again.kill()
