"""routing.standin.server: the stand-in model server (service times, queue, 429, SSE, stats,
faults).

Real HTTP on loopback: in-process servers on 127.0.0.1:0, and one real subprocess.
"""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from routing.standin.server import (
    ModelServer,
    ModelServerSettings,
    ServiceTime,
    Slots,
)
from tests.conftest import REPO

MakeServer = Callable[..., Awaitable[tuple[str, ModelServer]]]


def test_service_time_has_the_declared_median_and_p99() -> None:
    st = ServiceTime(median_ms=100, p99_ms=400, seed=7)
    draws = sorted(st.draw() for _ in range(40_000))
    assert statistics.median(draws) == pytest.approx(100, rel=0.04)
    assert draws[int(0.99 * len(draws))] == pytest.approx(400, rel=0.08)
    assert statistics.fmean(draws) == pytest.approx(st.mean_ms, rel=0.04)


def test_same_seed_same_draws_and_constant_when_p99_is_median() -> None:
    a = ServiceTime(median_ms=50, p99_ms=300, seed=3)
    b = ServiceTime(median_ms=50, p99_ms=300, seed=3)
    assert [a.draw() for _ in range(10)] == [b.draw() for _ in range(10)]
    flat = ServiceTime(median_ms=50, p99_ms=50, seed=1)
    assert {round(flat.draw(), 9) for _ in range(10)} == {50.0}


def test_settings_reject_p99_below_median() -> None:
    with pytest.raises(ValueError, match="p99_ms"):
        ModelServerSettings(name="x", median_ms=100, p99_ms=50, max_concurrency=1)


@pytest.mark.parametrize(
    ("path", "obj", "key"),
    [
        ("/v1/completions", "text_completion", "text"),
        ("/v1/chat/completions", "chat.completion", "message"),
    ],
)
async def test_completion_is_json_and_marked_standin(
    make_server: MakeServer, http: aiohttp.ClientSession, path: str, obj: str, key: str
) -> None:
    url, _ = await make_server(name="bj-llm")
    async with http.post(url + path, json={"prompt": "hi", "max_tokens": 3}) as resp:
        assert resp.status == 200
        assert resp.headers["X-Cpn-Standin"] == "1"
        body = await resp.json()
    assert body["object"] == obj
    assert body["model"] == "bj-llm"
    assert key in body["choices"][0]
    assert body["usage"]["completion_tokens"] == 3
    assert body["cpn"]["standin"] is True
    async with http.get(url + "/healthz") as resp:
        assert resp.status == 200
        assert resp.headers["X-Cpn-Standin"] == "1"


async def test_stream_sends_token_events_then_done(
    make_server: MakeServer, http: aiohttp.ClientSession
) -> None:
    url, _ = await make_server(median_ms=40, p99_ms=40, tokens=4)
    async with http.post(url + "/v1/chat/completions", json={"stream": True}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["X-Cpn-Standin"] == "1"
        text = (await resp.read()).decode()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 4
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == "tok0 tok1 tok2 tok3 "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_queue_is_fifo_and_bounded_then_429(
    make_server: MakeServer, http: aiohttp.ClientSession
) -> None:
    url, server = await make_server(median_ms=300, p99_ms=300, max_concurrency=1, max_queue=1)

    async def call() -> tuple[int, float, str | None]:
        started = time.perf_counter()
        async with http.post(url + "/v1/completions", json={}) as resp:
            await resp.read()
            return resp.status, time.perf_counter() - started, resp.headers.get("Retry-After")

    first = asyncio.create_task(call())
    await asyncio.sleep(0.05)
    second = asyncio.create_task(call())
    await asyncio.sleep(0.05)
    async with http.get(url + "/stats") as resp:
        live = await resp.json()
    assert (live["in_flight"], live["queue"]) == (1, 1)
    status, _, retry_after = await call()
    assert status == 429
    assert retry_after is not None and int(retry_after) >= 1
    (s1, t1, _), (s2, t2, _) = await asyncio.gather(first, second)
    assert (s1, s2) == (200, 200)
    assert 0.25 < t1 < 0.5
    assert t2 > 0.5  # waited for the first, then its own 300 ms
    stats = server.stats()
    assert (stats["served"], stats["rejected"], stats["in_flight"], stats["queue"]) == (2, 1, 0, 0)


async def test_stats_report_recent_percentiles_and_service_rate(
    make_server: MakeServer, http: aiohttp.ClientSession
) -> None:
    url, _ = await make_server(median_ms=50, p99_ms=50, max_concurrency=2)
    async with http.get(url + "/stats") as resp:
        empty = await resp.json()
    assert empty["p50_ms"] is None and empty["served"] == 0
    assert empty["service_rate_per_s"] == pytest.approx(40)  # 2 slots / 50 ms, from the declared
    await asyncio.gather(*(http.post(url + "/v1/completions", json={}) for _ in range(3)))
    async with http.get(url + "/stats") as resp:
        stats = await resp.json()
    assert stats["served"] == 3
    assert stats["p50_ms"] == pytest.approx(50) and stats["p99_ms"] == pytest.approx(50)
    assert stats["service_rate_per_s"] == pytest.approx(40)
    assert stats["max_concurrency"] == 2
    assert {"in_flight", "queue", "errors", "max_queue", "standin"} <= set(stats)


async def test_fault_switch_500_hang_and_ok(
    make_server: MakeServer, http: aiohttp.ClientSession
) -> None:
    url, server = await make_server()
    async with http.post(url + "/admin/fail", json={"mode": "500"}) as resp:
        assert resp.status == 200
    for path, method in (("/v1/completions", "POST"), ("/healthz", "GET")):
        async with http.request(method, url + path, json={}) as resp:
            assert resp.status == 500
            error = (await resp.json())["error"]
            assert (error["code"], error["type"]) == (500, "InternalServerError")
            assert "injected_fault" in error["message"]
    assert server.stats()["errors"] == 2

    await http.post(url + "/admin/fail", json={"mode": "hang"})
    with pytest.raises(asyncio.TimeoutError):
        await http.get(url + "/healthz", timeout=aiohttp.ClientTimeout(total=0.3))
    async with http.get(url + "/stats") as resp:  # stays answerable to see what is going on
        assert (await resp.json())["mode"] == "hang"

    await http.post(url + "/admin/fail", json={"mode": "ok"})
    async with http.get(url + "/healthz") as resp:
        assert resp.status == 200


@pytest.mark.parametrize(
    ("path", "payload", "field"),
    [
        ("/v1/completions", b"{not json", "body"),
        ("/v1/completions", b"[1, 2]", "body"),
        ("/v1/completions", b'{"stream": "yes"}', "stream"),
        ("/v1/chat/completions", b'{"max_tokens": 0}', "max_tokens"),
        ("/admin/fail", b'{"mode": "explode"}', "mode"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field(
    make_server: MakeServer, http: aiohttp.ClientSession, path: str, payload: bytes, field: str
) -> None:
    url, _ = await make_server()
    async with http.post(url + path, data=payload) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["field"] == field
    if path.startswith("/v1/"):  # vLLM's shape there, the field also as `param`
        assert (error["code"], error["type"], error["param"]) == (400, "BadRequestError", field)
    else:
        assert error["code"] in {"invalid", "invalid_json"}


async def test_a_cancelled_waiter_gives_up_its_place() -> None:
    slots = Slots(capacity=1, max_queue=2)
    await slots.acquire()
    first = asyncio.create_task(slots.acquire())
    second = asyncio.create_task(slots.acquire())
    await asyncio.sleep(0)
    assert len(slots.waiters) == 2
    first.cancel()
    await asyncio.sleep(0)
    assert len(slots.waiters) == 1
    slots.release()
    await asyncio.wait_for(second, 1)
    assert (slots.in_flight, len(slots.waiters)) == (1, 0)
    slots.release()
    assert slots.in_flight == 0


@pytest.mark.e2e
async def test_runs_as_a_subprocess(http: aiohttp.ClientSession) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "routing.standin.server", "--listen", "127.0.0.1:0",
        "--name", "sub", "--median-ms", "10", "--p99-ms", "30", "--max-concurrency", "2",
        "--max-queue", "4", "--seed", "1",
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 15)).decode().strip()
        assert line.startswith("listening on http://127.0.0.1:"), line
        url = line.removeprefix("listening on ")
        async with http.post(url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 200
            assert resp.headers["X-Cpn-Standin"] == "1"
            assert (await resp.json())["model"] == "sub"
        async with http.get(url + "/stats") as resp:
            assert (await resp.json())["served"] == 1
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), 15)
    assert rc == 0


@pytest.mark.e2e
async def test_cli_rejects_bad_settings_with_exit_2() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "routing.standin.server", "--listen", "127.0.0.1:0",
        "--name", "x", "--median-ms", "100", "--p99-ms", "50", "--max-concurrency", "1",
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 15)
    assert proc.returncode == 2
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and "p99_ms" in lines[0]


def test_an_api_key_named_but_unset_is_exit_2(monkeypatch: pytest.MonkeyPatch) -> None:
    from routing.standin import server as modelserver

    monkeypatch.delenv("CPN_TEST_NO_KEY", raising=False)
    argv = ["--listen", "127.0.0.1:0", "--name", "x", "--median-ms", "1", "--p99-ms", "2"]
    argv += ["--max-concurrency", "1", "--api-key-env", "CPN_TEST_NO_KEY"]
    assert modelserver.main(argv) == 2


async def test_an_api_key_guards_v1_only(
    make_server: MakeServer, http: aiohttp.ClientSession
) -> None:
    """As vLLM's --api-key: /v1/ needs the bearer key; /healthz, /metrics, /stats stay open
    (the agents and the broker's health checks read them without it)."""
    url, _ = await make_server(api_key="sk-1")
    body = {"prompt": "hi"}
    for auth, want in ((None, 401), ("Bearer sk-2", 401), ("Bearer sk-1", 200)):
        hdrs = {"Authorization": auth} if auth else {}
        async with http.post(f"{url}/v1/completions", json=body, headers=hdrs) as resp:
            assert resp.status == want
    for path in ("/healthz", "/metrics", "/stats"):
        async with http.get(url + path) as resp:
            assert resp.status == 200, path


def test_prefix_cache_flags_default_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """`cpn up` passes the stand-ins only timing and size; a bench sets the prefix-cache model
    through CPN_STANDIN_PREFILL_MS and CPN_STANDIN_PREFIX_CACHE_ENTRIES."""
    from routing.standin import server as modelserver

    need = ["--listen", "127.0.0.1:0", "--name", "x", "--median-ms", "1", "--p99-ms", "2"]
    need += ["--max-concurrency", "1"]
    monkeypatch.delenv("CPN_STANDIN_PREFILL_MS", raising=False)
    monkeypatch.delenv("CPN_STANDIN_PREFIX_CACHE_ENTRIES", raising=False)
    args = modelserver._parser().parse_args(need)
    assert (args.prefill_ms, args.prefix_cache_entries) == (0.0, 1024)
    monkeypatch.setenv("CPN_STANDIN_PREFILL_MS", "300")
    monkeypatch.setenv("CPN_STANDIN_PREFIX_CACHE_ENTRIES", "32")
    args = modelserver._parser().parse_args(need)
    assert (args.prefill_ms, args.prefix_cache_entries) == (300.0, 32)
    args = modelserver._parser().parse_args([*need, "--prefill-ms", "5"])
    assert args.prefill_ms == 5.0
