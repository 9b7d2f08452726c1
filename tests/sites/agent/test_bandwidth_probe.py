"""The bounded bandwidth probe: the responder's bulk endpoint, the measurement through a shaped
WAN emulation path (a FAKE WAN: sites.emulation.wan), the prober's bounds, and drift.

Emulator scenarios run on the precise-timer loop (`sites.emulation.wan.run`)."""

from __future__ import annotations

import asyncio
import time

import pytest

from sites.agent.collectors import probes
from sites.agent.collectors.probes import (
    Bandwidth,
    BandwidthProber,
    Prober,
    ProbeResponder,
    Target,
    measure_bandwidth,
    summarize,
)
from sites.agent.drift import link_changed
from sites.agent.settings import AgentSettings
from sites.emulation.wan import WanEmulator
from sites.emulation.wan import run as run_precise
from sites.model.spec import MAX_BANDWIDTH_PROBE_BYTES, SiteSpec
from sites.model.status import LinkStatus
from tests.conftest import site_doc

CLIENT_IP = "127.0.1.2"  # node a: the prober
SERVER_IP = "127.0.1.1"  # node b: the peer's responder
FRONT_IP = "127.0.2.1"


async def _responder(host: str = SERVER_IP) -> tuple[asyncio.Server, Target]:
    server = await asyncio.get_running_loop().create_server(ProbeResponder, host, 0)
    h, p = server.sockets[0].getsockname()[:2]
    return server, Target(h, p)


async def _through_wan(
    mbps: float, rtt_ms: float, nbytes: int
) -> tuple[float, float, dict[str, int]]:
    """Mbit/s the probe measures through an emulated path of `mbps` and `rtt_ms`, the seconds
    it took, and the bytes the path carried each way."""
    server, target = await _responder()
    wan = WanEmulator(
        node_of_ip={CLIENT_IP: "a", SERVER_IP: "b"},
        rtt_ms=lambda s, d: 0.0 if s == d else rtt_ms,
        bandwidth_mbps=lambda s, d: None if s == d else mbps,
    )
    try:
        front = await wan.add_route(
            front=(FRONT_IP, 0), backend=(target.host, target.port), node="b"
        )
        start = time.perf_counter()
        measured = await measure_bandwidth(
            Target(*front), nbytes=nbytes, timeout_s=20.0, source=CLIENT_IP
        )
        elapsed = time.perf_counter() - start
        links = {name: s["bytes"] for name, s in wan.stats()["links"].items()}
        return measured, elapsed, links
    finally:
        await wan.close()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(("mbps", "rtt_ms"), [(35.0, 80.0), (100.0, 20.0)])
def test_the_probe_measures_the_shaped_bandwidth_not_the_rtt(mbps: float, rtt_ms: float) -> None:
    nbytes = 2 * 1024 * 1024
    measured, elapsed, carried = run_precise(_through_wan(mbps, rtt_ms, nbytes))
    print(f"{mbps} Mbit/s, {rtt_ms} ms: measured {measured:.1f} Mbit/s in {elapsed:.2f} s")
    # within a reasonable factor of the configured rate; the RTT is not counted (2 MiB at 35
    # Mbit/s is 0.48 s: counting the 80 ms would read 15 % low)
    assert 0.85 * mbps <= measured <= 1.15 * mbps, measured
    assert carried["b->a"] >= nbytes  # the body crossed the shaped path


def test_bulk_answers_are_capped_and_other_requests_still_ok() -> None:
    async def scenario() -> tuple[bytes, int, bytes]:
        server, target = await _responder("127.0.0.1")
        try:
            reader, writer = await asyncio.open_connection(target.host, target.port)
            # a bulk request over the cap, then a plain probe pipelined behind it
            writer.write(b"GET /probe/bulk?bytes=999999999999 HTTP/1.1\r\nHost: x\r\n\r\n")
            writer.write(b"GET /probe HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            body = await reader.readexactly(length)
            after = await asyncio.wait_for(reader.readexactly(len(probes.PROBE_RESPONSE)), 5)
            writer.close()
            await writer.wait_closed()
            return head, len(body), after
        finally:
            server.close()
            await server.wait_closed()

    head, length, after = asyncio.run(scenario())
    assert head.startswith(b"HTTP/1.1 200")
    assert length == MAX_BANDWIDTH_PROBE_BYTES
    assert after == probes.PROBE_RESPONSE


def test_a_peer_without_the_bulk_endpoint_gives_no_figure() -> None:
    """An older responder answers every request `200 ok`: the probe says so, it does not
    report 2 bytes' worth of throughput."""

    class Old(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.t = transport

        def data_received(self, data: bytes) -> None:
            self.t.write(probes.PROBE_RESPONSE)  # type: ignore[attr-defined]

    async def scenario() -> None:
        server = await asyncio.get_running_loop().create_server(Old, "127.0.0.1", 0)
        try:
            target = Target(*server.sockets[0].getsockname()[:2])
            with pytest.raises(ValueError, match="sent 2 bytes, asked for 65536"):
                await measure_bandwidth(target, nbytes=65536, timeout_s=5, source=None)
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(scenario())


# --- the prober's bounds --------------------------------------------------------------------


def test_peers_are_probed_one_at_a_time_each_at_most_every_interval() -> None:
    async def scenario() -> tuple[BandwidthProber, list[tuple[str, float]], int]:
        server, target = await _responder("127.0.0.1")
        prober = BandwidthProber(interval_s=0.6, nbytes=64 * 1024, timeout_s=0.1, source=None)
        prober.set_targets({"p1": target, "p2": target, "p3": target})
        started: list[tuple[str, float]] = []
        running = 0
        most = 0
        real_probe = prober.probe

        async def counted(site: str) -> Bandwidth | None:
            nonlocal running, most
            started.append((site, time.monotonic()))
            running += 1
            most = max(most, running)
            try:
                return await real_probe(site)
            finally:
                running -= 1

        prober.probe = counted  # type: ignore[method-assign]
        task = asyncio.create_task(prober.run())
        await asyncio.sleep(1.45)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        server.close()
        await server.wait_closed()
        return prober, started, most

    prober, started, most = asyncio.run(scenario())
    assert most == 1
    assert prober.spacing_s() == pytest.approx(0.2)  # 0.6 s over 3 peers
    # every peer once in its first interval, then again only an interval later
    assert [s for s, _ in started[:3]] == ["p1", "p2", "p3"]
    per_site: dict[str, list[float]] = {}
    for site, at in started:
        per_site.setdefault(site, []).append(at)
    for times in per_site.values():
        assert all(b - a >= 0.6 - 0.02 for a, b in zip(times, times[1:], strict=False)), times
    assert len(started) <= 3 * 3
    assert set(prober.results) == {"p1", "p2", "p3"}
    assert all(r.mbps > 0 for r in prober.results.values())


def test_many_peers_are_spread_no_closer_than_the_timeout() -> None:
    prober = BandwidthProber(interval_s=300.0, nbytes=4 << 20, timeout_s=10.0, source=None)
    prober.set_targets({f"s{i}": Target("127.0.0.1", 1000 + i) for i in range(1000)})
    assert prober.spacing_s() == 10.0  # not 0.3 s: a thousand peers do not flood anything
    prober.set_targets({"a": Target("127.0.0.1", 1), "b": Target("127.0.0.1", 2)})
    assert prober.spacing_s() == 150.0  # two peers: spread over the interval
    assert BandwidthProber(interval_s=1, nbytes=1 << 40, timeout_s=1, source=None).nbytes == (
        MAX_BANDWIDTH_PROBE_BYTES
    )


def test_a_failed_probe_keeps_the_last_figure_and_a_moved_peer_drops_it() -> None:
    async def scenario() -> tuple[Bandwidth | None, Bandwidth | None, dict[str, Bandwidth]]:
        server, target = await _responder("127.0.0.1")
        prober = BandwidthProber(interval_s=60, nbytes=64 * 1024, timeout_s=2, source=None)
        prober.set_targets({"p": target})
        first = await prober.probe("p")
        server.close()
        await server.wait_closed()
        second = await prober.probe("p")  # the peer is gone: no figure, the last one stays
        kept = dict(prober.results)
        prober.set_targets({"p": Target("127.0.0.1", target.port + 1)})  # it moved
        assert prober.results == {}
        return first, second, kept

    first, second, kept = asyncio.run(scenario())
    assert first is not None and second is None
    assert kept == {"p": first}


def test_prober_links_carry_the_bandwidth_and_zero_disables_it() -> None:
    async def scenario() -> tuple[list[LinkStatus], Prober]:
        server, target = await _responder("127.0.0.1")
        prober = Prober(
            site="a", method="http", samples=2, interval_s=0.2, timeout_s=1.0, source=None,
            emulated=False, bandwidth_interval_s=60.0, bandwidth_probe_bytes=128 * 1024,
            bandwidth_probe_timeout_s=2.0,
        )  # fmt: skip
        off = Prober(
            site="a", method="http", samples=2, interval_s=0.2, timeout_s=1.0, source=None,
            emulated=False, bandwidth_interval_s=0,
        )  # fmt: skip
        try:
            url = f"http://{target.host}:{target.port}"
            prober.set_peers({"b": url})
            off.set_peers({"b": url})
            for _ in range(200):
                links = prober.links(time.time())
                if links and links[0].bandwidth_mbps is not None:
                    break
                await asyncio.sleep(0.02)
            return links, off
        finally:
            await prober.close()
            await off.close()
            server.close()
            await server.wait_closed()

    links, off = asyncio.run(scenario())
    (link,) = links
    assert link.dst == "b" and link.bandwidth_mbps is not None and link.bandwidth_mbps > 0
    assert link.bandwidth_at is not None
    assert off.bandwidth is None


# --- settings and drift ---------------------------------------------------------------------


def test_the_site_files_agent_section_sets_the_probe_bounds() -> None:
    doc = site_doc("wuhu")
    doc["agent"] = {
        "bandwidth_interval_s": 0, "bandwidth_probe_bytes": 1 << 20,
        "bandwidth_probe_timeout_s": 5,
    }  # fmt: skip
    settings = AgentSettings.from_spec(SiteSpec.model_validate(doc), listen="127.0.0.1:0")
    assert settings.bandwidth_interval_s == 0
    assert settings.bandwidth_probe_bytes == 1 << 20
    assert settings.bandwidth_probe_timeout_s == 5
    doc["agent"] = {"bandwidth_probe_bytes": 1 << 40}
    with pytest.raises(ValueError, match="bandwidth_probe_bytes"):
        SiteSpec.model_validate(doc)


def _link(mbps: float | None, *, rtt: float = 20.0, at: float = 0.0) -> LinkStatus:
    return summarize(
        "a", "b", [rtt], method="http", emulated=True, now=at,
        bandwidth=None if mbps is None else Bandwidth(mbps=mbps, at=at),
    )  # fmt: skip


def test_bandwidth_wobble_is_not_republished_a_real_change_is() -> None:
    old = _link(35.0)
    assert not link_changed(old, _link(33.0, at=60.0))  # a probe's wobble, a newer time
    assert not link_changed(old, _link(41.0))  # under 20 % of 35
    assert link_changed(old, _link(20.0))  # the path got slower
    assert link_changed(_link(None), _link(35.0))  # first measured
    # measured against the value last written: a slow drift is published once it adds up
    assert link_changed(old, _link(27.0)) and not link_changed(_link(31.0), _link(27.0))
