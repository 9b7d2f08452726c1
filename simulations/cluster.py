"""Scenarios on a Dask cluster: a planner's sweep that outgrows one machine (`--cluster ADDRESS`).

    dask scheduler --port 8786                       # on one machine
    dask worker tcp://SCHEDULER:8786 --nthreads 1    # on each machine, cpn installed
    cpn simulate sweep.yaml --sweep policy.kind=fast-path,batch --cluster tcp://SCHEDULER:8786

Each part of a scenario (simulations.parts) is one task, run by simulations.pool.run_task in a
worker process exactly as a local worker runs it: `cpn simulate` and `cpn plan-capacity` hand
their tasks to a simulations.pool.SimPool connected here (`connect`). The scenario goes to the
worker as its validated model (the federation it names is loaded there, so the files must be
at the same path on every worker, or shared). Results come back in input order. A task that
raises stops the run with its error and the others are cancelled, as locally.

Why Dask and not Ray: a simulation is a pure function of its scenario, one CPU-bound task with
no shared state and no actors; Dask's distributed scheduler runs that from two small
pure-Python wheels, on any machine where `pip install cpn[cluster]` works, with no object store
or cluster daemon to size. Ray's strengths (actors, a shared object store, GPUs) are not used.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["ClusterError", "connect"]

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


def connect(address: str) -> Any:
    """A Dask Client of the scheduler at `address`; ClusterError when Dask is not installed or
    no scheduler answers within the connect timeout."""
    try:
        import distributed
    except ImportError:
        raise ClusterError("--cluster needs Dask: pip install 'cpn[cluster]'") from None
    dask: Any = distributed  # partly typed: its Client's methods are not
    timeout = _connect_timeout()
    try:
        client = dask.Client(address, timeout=timeout)
    except (OSError, TimeoutError) as exc:
        raise ClusterError(f"no Dask scheduler answers at {address}: {exc}") from None
    return client
