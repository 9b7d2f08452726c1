"""broker.leader.start_backoff: a site where attempts keep failing to start is cordoned for a
back-off that doubles while the failures go on, a run started there forgets them, an attempt
counts once however many passes decide on it; and the registry's automatic cordon never
replaces nor lifts an operator's."""

from __future__ import annotations

from broker.leader.start_backoff import BACKING_OFF, StartBackoff, StartFailure, expired
from broker.placement.settings import SchedulingSettings
from sites.model.status import Cordon
from sites.registry.client import Registry
from tests.routing.helpers import spec

S = SchedulingSettings(
    start_failures=3, start_failure_window_s=600, start_backoff_s=60, start_backoff_max_s=200
)


def fail(job: str, site: str = "a", attempt: int = 1) -> StartFailure:
    return StartFailure(job, attempt, site, "sbatch: error: Batch job submission failed")


def test_three_failures_in_the_window_back_off_doubling_to_the_cap() -> None:
    b = StartBackoff()
    assert b.observe([fail("j1"), fail("j2")], [], 0.0, S) == []
    assert b.observe([fail("j2")], [], 1.0, S) == []  # the same attempt again: still two
    ((site, cordon),) = b.observe([fail("j3"), fail("k1", site="b")], [], 2.0, S)
    assert site == "a" and cordon.until == 62.0 and cordon.reason.startswith(BACKING_OFF)
    assert "3 attempts failed to start" in cordon.reason and "sbatch" in cordon.reason
    assert expired({"a": cordon}, 61.9) == [] and expired({"a": cordon}, 62.0) == [("a", 62.0)]
    # the probe after the back-off fails too, and two more: twice as long, then the cap
    seconds = []
    for n, at in enumerate((100.0, 300.0, 600.0)):
        got = b.observe([fail(f"p{n}-{i}") for i in range(3)], [], at, S)
        seconds.append(got[0][1].until - at if got else None)  # type: ignore[operator]
    assert seconds == [120.0, 200.0, 200.0]
    # a run that starts there forgets it all: the next streak starts from one minute again
    assert b.observe([], ["a"], 700.0, S) == []
    got = b.observe([fail(f"q{i}") for i in range(3)], [], 701.0, S)
    assert got[0][1].until == 761.0


def test_failures_older_than_the_window_do_not_count_and_zero_turns_it_off() -> None:
    b = StartBackoff()
    b.observe([fail("j1"), fail("j2")], [], 0.0, S)
    assert b.observe([fail("j3")], [], 601.0, S) == []  # j1 and j2 fell out of the window
    off = S.model_copy(update={"start_failures": 0})
    assert StartBackoff().observe([fail(f"j{i}") for i in range(9)], [], 0.0, off) == []


async def test_an_automatic_cordon_never_replaces_nor_lifts_an_operators(
    registry: Registry,
) -> None:
    for site in ("bo-a", "bo-b"):
        await registry.join(spec(site, "east", 30, 120), now=0.0)
    auto = Cordon(since=10.0, reason=f"{BACKING_OFF} for 60 s", until=70.0)
    assert await registry.back_off("bo-a", auto)
    assert not await registry.back_off("bo-a", auto.model_copy(update={"until": 99.0}))
    assert not await registry.back_off("nowhere", auto)  # not joined
    snap = await registry.snapshot()
    assert snap.cordons["bo-a"].until == 70.0
    assert not await registry.lift_back_off("bo-a", 99.0)  # not the one put
    assert await registry.lift_back_off("bo-a", 70.0)
    assert "bo-a" not in (await registry.snapshot()).cordons
    # leaving replaces a back-off: the cordon stays until the site is gone
    await registry.back_off("bo-b", auto)
    await registry.cordon("bo-b", reason="leaving", now=20.0)  # an operator's, over it
    assert not await registry.lift_back_off("bo-b", 70.0)
    assert (await registry.snapshot()).cordons["bo-b"].reason == "leaving"
