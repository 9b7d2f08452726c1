"""The managed services' replicas among this site's runs (sites.agent.replicas has one replica's
states): each is given its port when it starts, probed until ready, drained before it stops,
and published with its own model server's load while ready or draining.

The workload (sites.agent.workload) runs the replicas' processes like any run's; `Serving` does
what only a replica needs, on the workload's clock and executor.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import aiohttp

from sites.agent.collectors.services import ServiceMonitor
from sites.agent.replicas import Replica, ReplicaState, free_port, in_flight, probe_ready, with_port
from sites.agent.runs import Run
from sites.executors.base import Executor, RunHandle
from sites.kits.clock import Clock
from sites.model.assignments import Assignment, Serve
from sites.model.status import ServiceEndpoint

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.2  # how often a draining replica's in-flight count is read
REPLICA_POLL_S = 0.5  # how often the published replicas' load is read


class Serving:
    """The replicas of the runs `runs` gives (see the module docstring)."""

    def __init__(
        self,
        *,
        site: str,
        runs: Callable[[], Iterable[Run]],
        executor: Executor,
        clock: Clock,
        closing: asyncio.Event,
        host: str,
        settle_s: float,
        stop_grace_s: float,
    ) -> None:
        self.site = site
        self._runs = runs
        self.executor = executor
        self.clock = clock
        self._closing = closing  # the agent is stopping: no replica is waited for any more
        # where replicas listen, how long a draining one waits for the brokers to see it
        # draining, and the published ones' load
        self.host = host
        self.settle_s = settle_s
        self.stop_grace_s = stop_grace_s
        self._loads = ServiceMonitor((), by_url=True)

    def replica(self, a: Assignment, serve: Serve) -> tuple[Assignment, Replica]:
        """The replica `a` runs (`serve`: a.serve) on its port: the assignment as the executor
        is given it ($CPN_PORT, `{port}` in its command), and the replica to follow."""
        port = serve.port or free_port(self.host)
        replica = Replica(job=a.job, serve=serve, host=self.host, port=port)
        return with_port(a, self.host, port), replica

    async def await_ready(self, run: Run, handle: RunHandle) -> None:
        """Probe until the replica is ready; stop it when it is not within its timeout."""
        replica = run.replica
        if replica is None:
            return
        serve = replica.serve
        await self.clock.sleep(serve.readiness_initial_delay_s)
        deadline = self.clock.monotonic() + serve.readiness_timeout_s
        async with aiohttp.ClientSession() as session:
            while run.live and replica.state is ReplicaState.starting:
                if run.withdrawn.is_set() or self._closing.is_set():
                    return
                if await probe_ready(session, replica):
                    replica.move(ReplicaState.ready)
                    log.info("job %s: replica of %s ready at %s", run.job, serve.service,
                             replica.url)  # fmt: skip
                    return
                if self.clock.monotonic() >= deadline:
                    run.unready = (
                        f"not ready within {serve.readiness_timeout_s:g} s: "
                        f"{serve.readiness_path} never answered 2xx"
                    )
                    log.warning("job %s: %s; stopping it", run.job, run.unready)
                    await self.executor.stop(handle, self.stop_grace_s)
                    return
                await self.clock.sleep(serve.readiness_period_s)

    async def drain(self, run: Run, replica: Replica) -> None:
        """Out of routing first, then wait for what it has in flight (module docstring of
        sites.agent.replicas); a replica not ready yet serves nothing and stops at once."""
        if replica.state is not ReplicaState.ready:
            return
        replica.move(ReplicaState.draining)
        started = self.clock.monotonic()
        deadline = started + max(replica.serve.drain_timeout_s, self.settle_s)
        log.info("job %s: replica of %s draining", run.job, replica.serve.service)
        await self.clock.sleep(self.settle_s)  # the brokers see it draining: nothing new comes
        monitor = ServiceMonitor(())
        try:
            while run.live and self.clock.monotonic() < deadline:
                left = await in_flight(monitor, replica)
                if left == 0:
                    break
                await self.clock.sleep(DRAIN_POLL_S)
        finally:
            await monitor.close()
        log.info("job %s: replica drained after %.1f s", run.job, self.clock.monotonic() - started)

    async def drain_ready(self) -> None:
        """Drain every ready replica at once (the agent is stopping; it still publishes)."""
        serving = [
            (run, run.replica) for run in self._runs()
            if run.live and run.replica is not None and run.replica.state is ReplicaState.ready
        ]  # fmt: skip
        await asyncio.gather(*(self.drain(run, replica) for run, replica in serving))

    def published(self) -> list[Replica]:
        """The replicas published here, ready or draining, by job: each has an endpoint of its
        own (several replicas of one service may run at a site)."""
        out = [
            run.replica
            for run in self._runs()
            if run.live
            and run.replica is not None
            and run.replica.state in (ReplicaState.ready, ReplicaState.draining)
        ]
        return sorted(out, key=lambda r: (r.serve.service, r.job))

    def endpoints(self, now: float) -> list[ServiceEndpoint]:
        """The endpoints of the replicas ready or draining here, for the agent to publish: each
        with its own address and its own model server's load (read by URL)."""
        loads = self._loads.loads
        return [r.endpoint(self.site, loads.get(r.url), now) for r in self.published()]

    async def follow_loads(self) -> None:
        """Read the published replicas' load, every REPLICA_POLL_S, until cancelled."""
        while True:
            published = self.published()
            self._loads.services = tuple(r.as_service() for r in published)
            await self._loads.poll()
            await self.clock.sleep(REPLICA_POLL_S)

    async def close(self) -> None:
        await self._loads.close()
