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
# cpn up starts federations; the Slurm tests drive this machine's one Slurm, whose daemons
# `cpn up --slurm` (in test_up.py) restarts: they take turns under the same lock
FEDERATION_FILES = frozenset(
    {
        "tests/cpn/test_up.py",
        "tests/cpn/test_load.py",
        "tests/sites/executors/test_slurm.py",
        "tests/sites/executors/test_slurm_identity.py",
    }
)
_federation_lock: Any = None
_last_federation: dict[Any, str] = {}  # a test file -> the node id of its last such test


def _starts_federation(item: pytest.Item) -> bool:
    fixtures = set(getattr(item, "fixturenames", ()))
    return bool(fixtures & FEDERATION_FIXTURES) or item.nodeid.split("::")[0] in FEDERATION_FILES


@pytest.hookimpl(trylast=True)  # after deselection (-m, -k)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    _last_federation.clear()
    for item in items:
        if _starts_federation(item):
            _last_federation[item.path] = item.nodeid


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
