"""routing.gateway.proxy on the OpenAI paths: the body's model resolved to ranked targets, the
name the server serves it by, the usage billed, and the line for room when every site is
saturated (priority first, sheddable refused). Real HTTP on loopback."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from routing.gateway.health import OutlierDetector
from routing.gateway.proxy import InferenceProxy, Upstream


class Picked(list[Upstream]):
    overflow = False


class Upstreams:
    """Model servers that answer after `delay_s`, record what they got, and report usage."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.bodies: list[dict[str, Any]] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        await asyncio.sleep(self.delay_s)
        usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
        return web.json_response({"model": body["model"], "choices": [], "usage": usage})


class Billing:
    def __init__(self) -> None:
        self.settled: list[tuple[Any, ...]] = []

    def admit(self, tenant: str, token_id: str | None) -> None:
        return None

    def settle(self, *args: Any) -> None:
        self.settled.append(args)

    def open(self, *args: Any) -> Any:
        raise AssertionError("whole answers settle in one call")


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[str, Upstreams, InferenceProxy, Billing]]:
    upstreams = Upstreams(delay_s=0.3)
    up_app = web.Application()
    up_app.router.add_post("/v1/chat/completions", upstreams.handle)
    up_runner = web.AppRunner(up_app)
    await up_runner.setup()
    await web.TCPSite(up_runner, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{up_runner.addresses[0][1]}"
    holder: list[InferenceProxy] = []

    async def pick(
        service: str, region: str | None, session: str | None, /, *, prefix_key: str | None = None
    ) -> Sequence[Upstream]:
        picked = Picked([Upstream("site-a", base)])
        # one slot at the one site: saturated while a request is in flight there
        picked.overflow = bool(holder[0].in_flight(service))
        return picked

    targets = {"chat": ((("svc", 1.0),),)}
    billing = Billing()
    proxy = InferenceProxy(
        pick=pick, health=OutlierDetector(), limiter=None, connect_timeout_s=1,
        response_timeout_s=5, max_attempts=1, max_body_bytes=1 << 20, require_region=False,
        resolve_model=lambda model, tenant: targets.get(model),
        served_name=lambda service, model: "served-model",
        accountant=billing,  # type: ignore[arg-type]
        queue_timeout_s=5.0,
    )  # fmt: skip
    holder.append(proxy)
    app = web.Application()
    app.router.add_post("/v1/chat/completions", proxy.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", upstreams, proxy, billing
    await proxy.close()
    await runner.cleanup()
    await up_runner.cleanup()


async def _ask(
    http: aiohttp.ClientSession, url: str, model: str, priority: int | None = None
) -> tuple[int, dict[str, Any]]:
    headers = {} if priority is None else {"X-Cpn-Priority": str(priority)}
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "tag": priority}
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as answer:
        return answer.status, json.loads(await answer.read())


async def test_the_line_serves_higher_priority_first_and_sheds_the_sheddable(
    gateway: tuple[str, Upstreams, InferenceProxy, Billing],
) -> None:
    url, upstreams, _, billing = gateway
    async with aiohttp.ClientSession() as http:
        first = asyncio.create_task(_ask(http, url, "chat", 0))
        await asyncio.sleep(0.1)  # in flight: the site is saturated now
        low = asyncio.create_task(_ask(http, url, "chat", 1))
        await asyncio.sleep(0.05)
        high = asyncio.create_task(_ask(http, url, "chat", 9))
        await asyncio.sleep(0.05)
        status, shed = await _ask(http, url, "chat", -1)
        assert status == 503 and shed["error"]["code"] == "shed", shed
        assert shed["error"]["type"] == "server_error" and shed["error"]["param"]
        results = await asyncio.gather(first, low, high)
    assert [status for status, _ in results] == [200, 200, 200]
    # the one that came later but ranks higher went first
    assert [body["tag"] for body in upstreams.bodies] == [0, 9, 1]
    assert {body["model"] for body in upstreams.bodies} == {"served-model"}
    assert len(billing.settled) == 3
    assert all(args[1] == (5, 2, 0) and args[2] is False for args in billing.settled)


async def test_an_unknown_model_and_a_bad_body_answer_in_openais_shape(
    gateway: tuple[str, Upstreams, InferenceProxy, Billing],
) -> None:
    url, *_ = gateway
    async with aiohttp.ClientSession() as http:
        status, body = await _ask(http, url, "nothing")
        assert status == 404 and body["error"]["code"] == "model_not_found"
        assert body["error"]["param"] == "model"
        async with http.post(url + "/v1/chat/completions", data=b"{") as answer:
            error = json.loads(await answer.read())["error"]
            assert answer.status == 400 and set(error) == {"message", "type", "param", "code"}
        async with http.post(
            url + "/v1/chat/completions", json={"model": "chat"}, headers={"X-Cpn-Priority": "x"}
        ) as answer:
            error = json.loads(await answer.read())["error"]
            assert answer.status == 400 and error["param"] == "X-Cpn-Priority"
