"""Scenarios on a Dask cluster: a planner's sweep that outgrows one machine (`--cluster ADDRESS`).

    dask scheduler --port 8786                       # on one machine
    dask worker tcp://SCHEDULER:8786 --nthreads 1    # on each machine, cpn installed
    cpn simulate sweep.yaml --sweep policy.kind=fast-path,batch --cluster tcp://SCHEDULER:8786

Each scenario is one task, run by `Simulation(scenario).run()` in a worker process, exactly as
a local process runs it; the scenario goes to the worker as its validated model (the federation
it names is loaded there, so the files must be at the same path on every worker, or shared).
Results come back in input order. A scenario that raises stops the run with its error and the
others are cancelled, as locally.

Why Dask and not Ray: a simulation is a pure function of its scenario, one CPU-bound task with
no shared state and no actors; Dask's distributed scheduler runs that from two small
pure-Python wheels, on any machine where `pip install cpn[cluster]` works, with no object store
or cluster daemon to size. Ray's strengths (actors, a shared object store, GPUs) are not used.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from simulations.engine import Simulation
from simulations.scenario import Scenario

__all__ = ["ClusterError", "run_on_cluster"]

CONNECT_TIMEOUT_S = 10.0
TIMEOUT_ENV = "CPN_CLUSTER_CONNECT_TIMEOUT_S"  # overrides CONNECT_TIMEOUT_S


class ClusterError(Exception):
    """The cluster cannot be used: not reachable, or Dask is not installed."""


def _connect_timeout() -> float:
    """Seconds to wait for the scheduler: $CPN_CLUSTER_CONNECT_TIMEOUT_S, else 10."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return CONNECT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ClusterError(f"{TIMEOUT_ENV} must be a number of seconds > 0, got {text!r}")
    return value


def _run(scenario: Scenario, file: str | None) -> dict[str, Any]:
    results = Simulation(scenario).run(None)
    results["scenario"]["file"] = file
    return results


def connect(address: str) -> tuple[Any, Any]:
    """(the distributed module, a Client of the scheduler at `address`); ClusterError when
    Dask is not installed or no scheduler answers within the connect timeout."""
    try:
        import distributed
    except ImportError:
        raise ClusterError("--cluster needs Dask: pip install 'cpn[cluster]'") from None
    dask: Any = distributed  # partly typed: its Client's methods are not
    timeout = _connect_timeout()
    try:
        client = dask.Client(address, timeout=timeout)  # as_completed needs it default
    except (OSError, TimeoutError) as exc:
        raise ClusterError(f"no Dask scheduler answers at {address}: {exc}") from None
    return dask, client


def run_on_cluster(
    scenarios: Sequence[Scenario],
    files: Sequence[str | None],
    address: str,
    update: Callable[[int, float], None],
) -> list[dict[str, Any]]:
    """Run each scenario as one task on the Dask cluster at `address`; results in input order.
    `update(i, 1.0)` as each one finishes."""
    dask, client = connect(address)
    run = secrets.token_hex(4)
    try:
        futures = [
            client.submit(_run, scenario, file, key=f"cpn-simulate-{run}-{i}", pure=False)
            for i, (scenario, file) in enumerate(zip(scenarios, files, strict=True))
        ]
        index = {future.key: i for i, future in enumerate(futures)}
        for future in dask.as_completed(futures):
            if future.status == "error":
                for other in futures:
                    other.cancel()
                raise future.exception()
            update(index[future.key], 1.0)
        results: list[dict[str, Any]] = client.gather(futures)
        return results
    finally:
        client.close()
