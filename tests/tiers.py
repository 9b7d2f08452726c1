"""Test tiers: a test that starts a process is marked ``e2e``, and the suite holds it to that.

``make test`` runs every tier; ``make test-fast`` runs ``-m "not e2e"``: the unit tier, which
starts no agent, broker, ``cpn`` command, Slurm, Prometheus or Chromium (the session's etcd,
started once for every tier, is the one process it shares).

Every process a test starts goes through ``subprocess.Popen`` (asyncio's subprocesses too), so
this plugin wraps it for the session: a test that started one without the ``e2e`` marker fails
at its teardown, naming the program, so the fast tier stays fast as tests are added.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import subprocess
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

E2E = "e2e"
# started once for the whole session by a fixture every tier shares
SHARED = frozenset({"etcd"})

_spawned: list[str] = []
_active = False


def _program(args: Any) -> str:
    if isinstance(args, (str, bytes, os.PathLike)):
        first = os.fsdecode(args).split()[0] if os.fsdecode(args).split() else ""
    else:
        first = os.fsdecode(args[0]) if args else ""
    return os.path.basename(first)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{E2E}: starts processes (agents, brokers, cpn commands, jobs, Slurm, Prometheus, "
        "Chromium) or a federation; `make test-fast` leaves these out",
    )
    original = subprocess.Popen.__init__

    def recording_init(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
        if _active:
            program = _program(args)
            if program not in SHARED:
                _spawned.append(program)
        original(self, args, *rest, **kw)

    subprocess.Popen.__init__ = recording_init  # type: ignore[method-assign]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    global _active
    _spawned.clear()
    _active = True
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    global _active
    yield
    _active = False
    if _spawned and item.get_closest_marker(E2E) is None:
        programs = ", ".join(sorted(set(_spawned)))
        _spawned.clear()
        report = os.environ.get("CPN_TIERS_REPORT")
        if report:  # list them (one JSON line each) instead of failing
            fixtures = sorted(getattr(item, "fixturenames", ()))
            line = {"test": item.nodeid, "programs": programs, "fixtures": fixtures}
            with open(report, "a") as f:
                f.write(json.dumps(line) + "\n")
            return
        pytest.fail(
            f"{item.nodeid} started processes ({programs}) but is not marked "
            f"@pytest.mark.{E2E} (tests/tiers.py)",
            pytrace=False,
        )


# A whole federation (etcd, a broker, four agents, their jobs and stand-ins) is a dozen
# processes whose leases, failovers and drains run on real time. Two of them side by side on
# two cores starve each other's lease keep-alives and connects. So under xdist (`make test`)
# a test that starts one holds a lock all workers of the run share, from the first such test
# of its file to the last (a module-scoped federation lives that long): one federation at a
# time, while the other worker goes on with tests that start none.
FEDERATION_FIXTURES = frozenset({"make_federation", "demo"})
# Every file with a test that starts a federation: those using the fixtures above (a test
# collected in a file not listed fails the run, naming it), `cpn up`'s and the Slurm tests (they
# drive this machine's one Slurm, whose daemons `cpn up --slurm` restarts). The scheduler below
# reads this list: it decides from node ids alone, before any fixture is known.
FEDERATION_FILES = frozenset(
    {
        "tests/broker/api/test_dashboard.py",
        "tests/broker/api/test_tenants_api.py",
        "tests/broker/leader/test_alerts.py",
        "tests/broker/test_agent_tls_e2e.py",
        "tests/broker/test_autoscaling_e2e.py",
        "tests/broker/test_chaos_soak.py",
        "tests/broker/test_data_e2e.py",
        "tests/broker/test_jobs_e2e.py",
        "tests/broker/test_nodes_e2e.py",
        "tests/broker/test_preemption_e2e.py",
        "tests/broker/test_scheduler_e2e.py",
        "tests/broker/test_services_e2e.py",
        "tests/broker/test_services_replicas_e2e.py",
        "tests/broker/test_workflows_e2e.py",
        "tests/cpn/test_load.py",
        "tests/cpn/test_sdk_e2e.py",
        "tests/cpn/test_up.py",
        "tests/metering/test_ledger_e2e.py",
        "tests/metering/test_prometheus.py",
        "tests/routing/test_gateway_e2e.py",
        "tests/routing/test_openai_e2e.py",
        "tests/sites/executors/test_slurm.py",
        "tests/sites/executors/test_slurm_identity.py",
    }
)
FEDERATIONS = "federations"  # the scheduler's one unit for them all
_federation_lock: Any = None
_last_federation: dict[Any, str] = {}  # a test file -> the node id of its last such test


def _file(nodeid: str) -> str:
    return nodeid.split("::")[0]


def _starts_federation(item: pytest.Item) -> bool:
    return _unit(item.nodeid) == FEDERATIONS


@pytest.hookimpl(trylast=True)  # after deselection (-m, -k)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    unlisted = sorted(
        {
            _file(item.nodeid)
            for item in items
            if set(getattr(item, "fixturenames", ())) & FEDERATION_FIXTURES
            and not _starts_federation(item)
        }
    )
    if unlisted:
        raise pytest.UsageError(
            f"{', '.join(unlisted)} start federations: list them in FEDERATION_FILES "
            "(tests/tiers.py)"
        )
    _last_federation.clear()
    for item in items:
        if _starts_federation(item):
            _last_federation[item.path] = item.nodeid
    # longest first (FederationsFirst, below): the federations, then files by
    # their e2e tests (unit tests take milliseconds); a file keeps its own order
    weight: dict[str, float] = {}
    for item in items:
        unit = _unit(item.nodeid)
        cost = 8.0 if item.get_closest_marker(E2E) is not None else 0.05
        weight[unit] = weight.get(unit, 0.0) + cost
    weight[FEDERATIONS] = math.inf
    rank = {unit: i for i, unit in enumerate(sorted(weight, key=lambda u: -weight[u]))}
    items.sort(key=lambda item: rank[_unit(item.nodeid)])


def _unit(nodeid: str) -> str:
    path = _file(nodeid)
    return FEDERATIONS if path in FEDERATION_FILES else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile` (`make test`) as FederationsFirst schedules it."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FederationsFirst(LoadScopeScheduling):
        """Each test file is one work unit, as with `loadfile`, except the files that start
        federations, which are one unit together: one worker runs them in turn while the other
        takes every other file. The units go out in the collection's order, which puts the
        federations first and the other files longest first (pytest_collection_modifyitems),
        so the short ones fill the end. Plain `loadfile` let both workers hold a federation
        file, one waiting on the lock, with its tests' time unused."""

        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    config.option.loadscopereorder = False  # the collection's order, not by count
    return FederationsFirst(config, log)


# tryfirst: the outermost wrapper, so waiting for the lock is not counted by pytest-timeout
@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    global _federation_lock
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # set by xdist for every worker of a run
    if run and _federation_lock is None and _starts_federation(item):
        _federation_lock = open(os.path.join(tempfile.gettempdir(), f"cpn-tests-{run}.lock"), "w")
        fcntl.flock(_federation_lock, fcntl.LOCK_EX)
    yield
    last = _last_federation.get(item.path) == item.nodeid
    if _federation_lock is not None and (last or nextitem is None or nextitem.path != item.path):
        fcntl.flock(_federation_lock, fcntl.LOCK_UN)
        _federation_lock.close()
        _federation_lock = None
