"""Supervised tasks (sites.kits.tasks): crashes are logged, kept, surfaced, and restarted or
fatal."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from sites.kits.tasks import Backoff, Crash, Supervisor, measure_loop_lag

FAST = Backoff(initial_s=0.01, max_s=0.04, reset_after_s=60.0)


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def until(predicate: object, timeout: float = 2.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():  # type: ignore[operator]
            await asyncio.sleep(0.005)


async def test_a_crash_is_logged_kept_told_and_restarted(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    told: list[Crash] = []
    runs = 0

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            raise RuntimeError("boom")
        await asyncio.Event().wait()

    sup = Supervisor(owner="test", on_crash=told.append, unhealthy_s=30.0, monotonic=clock)
    with caplog.at_level(logging.ERROR):
        sup.spawn("flaky", flaky, restart=FAST)
        await until(lambda: runs == 2)
    assert [c.task for c in told] == ["flaky"]
    assert told[0].error == "RuntimeError: boom" and "Traceback" in told[0].traceback
    assert told[0].restart_in_s == pytest.approx(0.01)
    assert "test flaky crashed; restarting in" in caplog.text
    assert "boom" in caplog.text  # the traceback is logged
    # running again, but unhealthy for unhealthy_s after the crash
    assert not sup.healthy
    status = sup.status()
    assert status["tasks"]["flaky"] == {"state": "running", "crashes": 1}
    assert status["recent_crashes"][0]["task"] == "flaky"
    clock.t += 31
    assert sup.healthy
    await sup.stop()


async def test_backoff_doubles_up_to_the_cap() -> None:
    delays = [FAST.delay_s(n) for n in range(1, 6)]
    assert delays == [0.01, 0.02, 0.04, 0.04, 0.04]
    with pytest.raises(ValueError):
        Backoff(initial_s=5, max_s=1)


async def test_without_restart_the_supervisor_fails() -> None:
    async def broken() -> None:
        raise KeyError("gone")

    sup = Supervisor(owner="test")
    sup.spawn("broken", broken)
    await asyncio.wait_for(sup.failed.wait(), 2)
    assert sup.fatal is not None and sup.fatal.task == "broken" and sup.fatal.restart_in_s is None
    assert not sup.healthy
    assert sup.status()["tasks"]["broken"]["state"] == "failed"
    await sup.stop()


async def test_a_loop_that_returns_counts_as_a_crash() -> None:
    async def quits() -> None:
        return None

    sup = Supervisor(owner="test")
    sup.spawn("quits", quits)
    await asyncio.wait_for(sup.failed.wait(), 2)
    assert sup.fatal is not None and "ended on its own" in sup.fatal.error
    await sup.stop()


async def test_cancellation_is_not_a_crash_and_stop_awaits_every_task() -> None:
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    told: list[Crash] = []
    sup = Supervisor(owner="test", on_crash=told.append)
    sup.spawn("forever", forever, restart=FAST)
    await started.wait()
    await sup.stop()
    assert told == [] and sup.healthy and not sup.failed.is_set()


async def test_a_failing_crash_handler_does_not_hide_the_crash() -> None:
    def handler(_: Crash) -> None:
        raise ValueError("handler bug")

    async def broken() -> None:
        raise RuntimeError("real")

    sup = Supervisor(owner="test", on_crash=handler)
    sup.spawn("broken", broken)
    await asyncio.wait_for(sup.failed.wait(), 2)
    assert sup.fatal is not None and sup.fatal.error == "RuntimeError: real"
    await sup.stop()


async def test_names_are_unique() -> None:
    async def forever() -> None:
        await asyncio.Event().wait()

    sup = Supervisor(owner="test")
    sup.spawn("x", forever)
    with pytest.raises(ValueError, match="already runs"):
        sup.spawn("x", forever)
    await sup.stop()


def _task(name: str) -> asyncio.Task[object]:
    return next(t for t in asyncio.all_tasks() if t.get_name() == name)


async def test_stop_cancels_again_a_task_that_lost_its_cancellation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The CI hang: a mirror's cancellation, lost in 3.11's wait_for inside aetcd, left
    Broker.stop waiting on a watch that never ended. A second cancellation stops it."""
    started = asyncio.Event()

    async def deaf_once() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            pass  # lost, as wait_for loses one that lands together with the result
        await asyncio.Event().wait()  # follows its watch on, as if never asked to stop

    sup = Supervisor(owner="test", stop_grace_s=0.2)
    sup.spawn("mirror /x/", deaf_once, restart=FAST)
    await started.wait()
    task = _task("test mirror /x/")
    with caplog.at_level(logging.WARNING):
        async with asyncio.timeout(2):  # a bound of 2 x stop_grace_s, with room for a slow CI
            await sup.stop()
    assert task.cancelled()
    assert "test mirror /x/: still running 0.2s after it was cancelled; cancelling it again" in (
        caplog.text
    )
    assert "left running" not in caplog.text
    assert sup.status()["tasks"] == {}


async def test_stop_returns_when_a_task_ignores_every_cancellation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    started, release = asyncio.Event(), asyncio.Event()

    async def deaf() -> None:
        started.set()
        while True:
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue
            raise asyncio.CancelledError  # it gives in at last, so that the test leaves nothing

    sup = Supervisor(owner="test", stop_grace_s=0.1)
    sup.spawn("deaf", deaf)
    await started.wait()
    task = _task("test deaf")
    with caplog.at_level(logging.WARNING):
        async with asyncio.timeout(2):
            await sup.stop()
    assert not task.done()  # stop() returned all the same, and said which task it left
    assert "test deaf: still running 0.1s after it was cancelled; cancelling it again" in (
        caplog.text
    )
    assert "test deaf: still running 0.1s after it was cancelled; left running" in caplog.text
    release.set()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled() and not sup.failed.is_set()


async def test_cancel_of_one_task_is_bounded_too(caplog: pytest.LogCaptureFixture) -> None:
    started = asyncio.Event()

    async def deaf_once() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            pass
        await asyncio.Event().wait()

    sup = Supervisor(owner="test", stop_grace_s=0.1)
    sup.spawn("once", deaf_once)
    await started.wait()
    task = _task("test once")
    with caplog.at_level(logging.WARNING):
        async with asyncio.timeout(2):
            await sup.cancel("once")
    assert task.cancelled() and "test once: still running" in caplog.text
    await sup.stop()


async def test_loop_lag_is_how_late_the_loop_woke_a_sleeper() -> None:
    seen: list[float] = []
    task = asyncio.create_task(measure_loop_lag(seen.append, every_s=0.01))
    try:
        while len(seen) < 3:
            await asyncio.sleep(0.01)
        time.sleep(0.08)  # a callback that holds the loop: whoever sleeps wakes that much late
        count = len(seen)
        while len(seen) == count:
            await asyncio.sleep(0.001)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert seen[count] >= 0.06, seen
    assert min(seen[:count]) < 0.06 and min(seen) >= 0
