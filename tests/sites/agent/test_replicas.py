"""A replica at its site (sites.agent.replicas): the port it is given, its states, its endpoint, and
its readiness and in-flight reads against a real stand-in model server on loopback."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from routing.standin.server import ModelServerSettings, make_app
from sites.agent.collectors.services import ServiceLoad, ServiceMonitor
from sites.agent.replicas import (
    IllegalReplicaTransition,
    Replica,
    ReplicaState,
    free_port,
    in_flight,
    probe_ready,
    with_port,
)
from sites.model.assignments import Assignment, Serve

SERVE = Serve(service="chat", model="m", readiness_path="/healthz")


def test_the_port_reaches_the_command_and_the_environment() -> None:
    a = Assignment(
        job="chat-1", site="s", tenant="t", attempt=1, fence=1,
        command=("serve", "--listen", "{host}:{port}", "--x"), env={"A": "1"},
        assigned_at=0.0, serve=SERVE,
    )  # fmt: skip
    run = with_port(a, "127.0.0.1", 8123)
    assert run.command == ("serve", "--listen", "127.0.0.1:8123", "--x")
    assert run.env == {"A": "1", "CPN_PORT": "8123", "CPN_HOST": "127.0.0.1"}
    assert a.command[2] == "{host}:{port}"  # the input is not changed


def test_a_free_port_can_be_bound() -> None:
    port = free_port("127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_states_follow_the_transition_table() -> None:
    replica = Replica(job="chat-1", serve=SERVE, host="127.0.0.1", port=1)
    replica.move(ReplicaState.ready)
    replica.move(ReplicaState.draining)
    with pytest.raises(IllegalReplicaTransition):
        replica.move(ReplicaState.ready)  # a draining replica never takes traffic again
    replica.move(ReplicaState.stopped)


def test_a_draining_endpoint_is_unhealthy_and_says_so() -> None:
    replica = Replica(job="chat-1", serve=SERVE, host="127.0.0.1", port=9, state=ReplicaState.ready)
    ep = replica.endpoint("s", ServiceLoad(healthy=True, in_flight=2), 5.0)
    assert (ep.healthy, ep.draining, ep.job, ep.url) == (
        True,
        False,
        "chat-1",
        "http://127.0.0.1:9",
    )
    replica.move(ReplicaState.draining)
    ep = replica.endpoint("s", ServiceLoad(healthy=True, in_flight=2), 6.0)
    assert (ep.healthy, ep.draining, ep.in_flight) == (False, True, 2)


@pytest.fixture
async def standin() -> AsyncIterator[Replica]:
    settings = ModelServerSettings(name="chat", median_ms=600, p99_ms=600, max_concurrency=4)
    runner = web.AppRunner(make_app(settings))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield Replica(job="chat-1", serve=SERVE, host="127.0.0.1", port=port)
    await runner.cleanup()


async def test_ready_and_in_flight_come_from_the_server_itself(standin: Replica) -> None:
    monitor = ServiceMonitor(())
    async with aiohttp.ClientSession() as http:
        assert await probe_ready(http, standin)
        assert await in_flight(monitor, standin) == 0
        request = asyncio.create_task(
            http.post(standin.url + "/v1/completions", json={"prompt": "x"})
        )
        await asyncio.sleep(0.2)
        assert await in_flight(monitor, standin) == 1
        async with await request as resp:
            assert resp.status == 200
        assert await in_flight(monitor, standin) == 0
    await monitor.close()
    gone = Replica(job="x", serve=SERVE, host="127.0.0.1", port=free_port("127.0.0.1"))
    async with aiohttp.ClientSession() as http:
        assert not await probe_ready(http, gone)
