"""A managed service's replica at this site, as the agent runs it (sites.model.assignments.Serve).

    starting --ready probe passes--> ready --assignment withdrawn--> draining --> stopped
    starting --withdrawn, or not ready within readiness_timeout_s--> stopped

The workload (sites.agent.workload, through sites.agent.serving) gives the run a port
($CPN_PORT, `{port}` in its command), probes `GET http://<host>:<port><readiness_path>` until it
answers 2xx, and from then on the agent publishes it as its own endpoint of the service at this
site (`endpoint`; several replicas of one service may run at a site, each with its own port).
When its assignment is withdrawn (scaled down, the service deleted, the job cancelled) it is
drained before it stops: published as draining (routed as unhealthy, so no broker sends it
more), then, after the brokers had time to see that (`settle_s`: two publish intervals), stopped
once it has nothing in flight or queued (its /metrics or /stats, read as the agent reads any
endpoint's load) or `drain_timeout_s` passed. A server that says nothing of its load gets the
whole drain_timeout_s. SkyServe drains the same way: out of the load balancer first, then
stopped.
"""

from __future__ import annotations

import enum
import socket
from dataclasses import dataclass

import aiohttp

from sites.agent.collectors.services import ServiceLoad, ServiceMonitor
from sites.model.assignments import Assignment, Serve
from sites.model.errors import SitesError
from sites.model.spec import Service
from sites.model.status import ServiceEndpoint

__all__ = [
    "IllegalReplicaTransition",
    "Replica",
    "ReplicaState",
    "free_port",
    "in_flight",
    "probe_ready",
    "with_port",
]

PROBE_TIMEOUT_S = 2.0


class IllegalReplicaTransition(SitesError):
    pass


class ReplicaState(enum.StrEnum):
    starting = "starting"
    ready = "ready"
    draining = "draining"
    stopped = "stopped"


TRANSITIONS: dict[ReplicaState, frozenset[ReplicaState]] = {
    ReplicaState.starting: frozenset(
        {ReplicaState.ready, ReplicaState.draining, ReplicaState.stopped}
    ),
    ReplicaState.ready: frozenset({ReplicaState.draining, ReplicaState.stopped}),
    ReplicaState.draining: frozenset({ReplicaState.stopped}),
    ReplicaState.stopped: frozenset(),
}


@dataclass
class Replica:
    """One run's replica state (the run itself is sites.agent.runs.Run)."""

    job: str
    serve: Serve
    host: str
    port: int
    state: ReplicaState = ReplicaState.starting

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def move(self, new: ReplicaState) -> None:
        if new is self.state:
            return
        if new not in TRANSITIONS[self.state]:
            raise IllegalReplicaTransition(
                f"replica {self.job}: {self.state.value} cannot become {new.value}"
            )
        self.state = new

    def as_service(self) -> Service:
        return Service(
            name=self.serve.service,
            model=self.serve.model,
            url=self.url,
            max_concurrency=self.serve.max_concurrency,
        )

    def endpoint(self, site: str, load: ServiceLoad | None, now: float) -> ServiceEndpoint:
        """The endpoint the agent publishes for it (ready or draining only)."""
        draining = self.state is ReplicaState.draining
        load = load or ServiceLoad(healthy=True)
        return ServiceEndpoint(
            service=self.serve.service,
            site=site,
            model=self.serve.model,
            url=self.url,
            max_concurrency=self.serve.max_concurrency,
            in_flight=load.in_flight,
            queue=load.queue,
            latency_ms=load.latency_ms,
            healthy=load.healthy and not draining,
            updated_at=now,
            job=self.job,
            draining=draining,
            **load.signal_fields(),
        )


def free_port(host: str) -> int:
    """A port free on `host` now (the replica binds it right after; a race loses to a
    readiness timeout and a retry, as any failed start)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def with_port(assignment: Assignment, host: str, port: int) -> Assignment:
    """The assignment as the executor runs it: `{port}` and `{host}` in the command replaced,
    CPN_PORT and CPN_HOST in its environment."""
    command = tuple(
        arg.replace("{port}", str(port)).replace("{host}", host) for arg in assignment.command
    )
    env = {**assignment.env, "CPN_PORT": str(port), "CPN_HOST": host}
    return assignment.model_copy(update={"command": command, "env": env})


async def probe_ready(session: aiohttp.ClientSession, replica: Replica) -> bool:
    """One readiness probe: the path answers 2xx."""
    try:
        async with session.get(
            replica.url + replica.serve.readiness_path,
            timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S),
        ) as resp:
            return 200 <= resp.status < 300
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False


async def in_flight(monitor: ServiceMonitor, replica: Replica) -> int | None:
    """Requests the replica has in flight or queued, by its own signals; None when it does
    not say (no load report, or no answer: an overloaded server may time out, so silence is
    not taken for idle; a server that died ends its run, which ends the drain)."""
    monitor.services = (replica.as_service(),)
    await monitor.poll()
    load = monitor.loads.get(replica.serve.service)
    if load is None or not load.healthy or load.signals is None:
        return None
    return load.in_flight + load.queue
