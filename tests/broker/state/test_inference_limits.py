"""Inference limits held by broker replicas together (broker.state.inference_limits): two or
three InferenceLimits on the real etcd, each with its own writer id, exchanging their counts
through it; time is simulated (a clock the test moves), the etcd exchange is real (each step
flushes and waits until the other replicas' mirrors hold the flush)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from broker.api.inference import TokenAccountant
from broker.model.tenants import InferencePolicy, TokenLimits
from broker.state.inference_limits import QUIET_S, InferenceLimits, LimitRecord, Refusal
from broker.state.metrics import BrokerMetrics
from broker.state.token_ledger import TokenLedger
from routing.gateway.proxy import Billed
from routing.gateway.tally import Tally
from sites.model import keys
from sites.registry.client import Registry

T0 = datetime(2026, 12, 7, 12, 0, tzinfo=UTC).timestamp()


class SimClock:
    """Simulated wall time (what admit/charge are given); sleeps are real (the loops')."""

    def __init__(self, t: float = T0) -> None:
        self.t = t

    def time(self) -> float:
        return self.t

    def monotonic(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


Make = Callable[..., InferenceLimits]


@pytest.fixture
async def limits(registry: Registry) -> AsyncIterator[Make]:
    """A factory of InferenceLimits with their mirror followed; stopped at the end."""
    tasks: list[asyncio.Task[None]] = []
    books: list[InferenceLimits] = []

    def make(
        writer: str,
        policies: dict[str, InferencePolicy],
        clock: SimClock,
        tokens: dict[str, TokenLimits] | None = None,
    ) -> InferenceLimits:
        book = InferenceLimits(
            registry=registry,
            writer=writer,
            policy=policies.get,
            token_limits=(tokens or {}).get,
            clock=clock,
        )
        tasks.append(asyncio.create_task(book.mirror.run(), name=f"mirror {writer}"))
        books.append(book)
        return book

    yield make
    # A watch cancelled while it connects leaves its socket open (sites.registry.watch opens
    # its channel outside its try): let every mirror's watch come up before stopping them.
    probe = LimitRecord(month="2026-12", writer="probe", seq=1, at=0.0)
    await registry.put_raw(keys.inference_limit("probe", "probe"), probe.model_dump_json().encode())
    await until(lambda: all(book.heard("probe", "probe") == 1 for book in books))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.002)


async def synced(*books: InferenceLimits) -> None:
    for book in books:
        await asyncio.wait_for(book.synced.wait(), 5)


async def exchange(tenant: str, *books: InferenceLimits) -> None:
    """Every book flushes; then waits until every book's mirror (its own too, which tells it
    the key's revision for its next flush) holds that flush."""

    def heard_by_all(book: InferenceLimits) -> Callable[[], bool]:
        return lambda: all(other.heard(tenant, book.writer) >= book.seq for other in books)

    for book in books:
        if await book.flush():
            await until(heard_by_all(book))


def policy(**fields: object) -> InferencePolicy:
    return InferencePolicy.model_validate(fields)


def windows(events: list[tuple[float, int]], start: float, end: float) -> list[int]:
    """Sums of `events` (time, amount) over every 60 s span [t, t + 60) for t in start..end,
    in tenths of a second."""
    out = []
    t = start
    while t <= end:
        out.append(sum(n for at, n in events if t <= at < t + 60))
        t += 0.1
    return out


async def test_two_replicas_hold_tokens_per_minute_within_5_percent(limits: Make) -> None:
    """A client's traffic split over two replicas, twice what the limit allows: what they
    admit in any 60 s stays within 5 % of the limit, and reaches it (not half of it)."""
    clock = SimClock()
    policies = {"ai-lab": policy(tokens_per_minute=12_000)}
    a, b = limits("broker-a", policies, clock), limits("broker-b", policies, clock)
    await synced(a, b)
    per_request, latency_steps = 50, 5  # 0.5 s from admission to the response's usage
    in_flight: list[tuple[int, InferenceLimits]] = []
    charged: list[tuple[float, int]] = []
    step = 0
    while clock.t < T0 + 150:
        book = (a, b)[step % 2]
        if book.admit("ai-lab", None, clock.t) is None:
            in_flight.append((step + latency_steps, book))
        for done in [f for f in in_flight if f[0] <= step]:
            in_flight.remove(done)
            done[1].charge("ai-lab", None, tokens=per_request, usd=0.0, now=clock.t)
            charged.append((clock.t, per_request))
        await exchange("ai-lab", a, b)
        clock.t += 0.1  # 10 requests a second: 30,000 tokens a minute offered
        step += 1
    sums = windows(charged, T0 + 30, T0 + 90)
    print(f"tokens per 60 s, two replicas, limit 12,000: {min(sums):,} .. {max(sums):,}")
    assert max(sums) <= 12_000 * 1.05
    assert min(sums) >= 12_000 * 0.95
    refusal = a.admit("ai-lab", None, clock.t)
    if refusal is not None:  # what a refusal of this kind says
        assert refusal.code == "tokens_per_minute" and refusal.should_retry
        assert refusal.field == "tenants.ai-lab.inference.tokens_per_minute"
        assert refusal.retry_after_s is not None and 0 < refusal.retry_after_s <= 61


async def test_two_replicas_hold_requests_per_minute(limits: Make) -> None:
    clock = SimClock()
    policies = {"ai-lab": policy(requests_per_minute=120)}
    a, b = limits("broker-a", policies, clock), limits("broker-b", policies, clock)
    await synced(a, b)
    admitted: list[tuple[float, int]] = []
    refusals: list[Refusal] = []
    step = 0
    while clock.t < T0 + 130:
        book = (a, b)[step % 2]
        refusal = book.admit("ai-lab", None, clock.t)
        if refusal is None:
            admitted.append((clock.t, 1))
        else:
            refusals.append(refusal)
        await exchange("ai-lab", a, b)
        clock.t += 0.2
        step += 1
    sums = windows(admitted, T0, T0 + 70)
    assert max(sums) <= 120 * 1.05
    assert min(sums[100:]) >= 120 * 0.95  # once the first minute filled the window
    first = refusals[0]
    assert first.status == 429 and first.code == "rate_limited" and first.should_retry
    assert first.field == "tenants.ai-lab.inference.requests_per_minute"
    assert "ai-lab" in first.message and "120" in first.message
    # the window filled in its first 24 s: the first of them leaves it 61 s after it came
    assert first.retry_after_s is not None and 35 < first.retry_after_s <= 61
    assert first.retry_after_header is not None and int(first.retry_after_header) >= 1


async def test_a_spent_budget_is_refused_for_good(limits: Make) -> None:
    clock = SimClock()
    policies = {"ai-lab": policy(budget={"usd_per_month": 1.0, "tokens_per_month": 10_000})}
    a, b = limits("broker-a", policies, clock), limits("broker-b", policies, clock)
    await synced(a, b)
    assert a.admit("ai-lab", None, clock.t) is None
    a.charge("ai-lab", None, tokens=400, usd=0.6, now=clock.t)
    await exchange("ai-lab", a, b)
    assert b.admit("ai-lab", None, clock.t) is None
    b.charge("ai-lab", None, tokens=400, usd=0.5, now=clock.t)
    await exchange("ai-lab", a, b)
    for book in (a, b):
        refusal = book.admit("ai-lab", None, clock.t + 120)
        assert refusal is not None
        assert (refusal.status, refusal.code) == (429, "budget_exhausted")
        assert refusal.should_retry is False and refusal.retry_after_s is None
        assert refusal.field == "tenants.ai-lab.inference.budget.usd_per_month"
        assert "$1.10" in refusal.message and "2026-12" in refusal.message
    standing = b.standing("ai-lab", clock.t)
    assert standing["usd_this_month"] == {"used": 1.1, "limit": 1.0}
    assert standing["tokens_this_month"] == {"used": 800, "limit": 10_000}
    # a new month: the budget is whole again
    january = datetime(2027, 1, 1, 0, 0, 1, tzinfo=UTC).timestamp()
    assert a.admit("ai-lab", None, january) is None


async def test_tokens_budget_names_its_field(limits: Make) -> None:
    clock = SimClock()
    policies = {"ai-lab": policy(budget={"tokens_per_month": 1000})}
    a = limits("broker-a", policies, clock)
    await synced(a)
    a.admit("ai-lab", None, clock.t)
    a.charge("ai-lab", None, tokens=1000, usd=0.0, now=clock.t)
    refusal = a.admit("ai-lab", None, clock.t)
    assert (
        refusal is not None and refusal.field == "tenants.ai-lab.inference.budget.tokens_per_month"
    )
    assert refusal.should_retry is False


async def test_a_tokens_own_limit_applies_beside_its_tenants(limits: Make) -> None:
    clock = SimClock()
    policies = {"ai-lab": policy(requests_per_minute=100)}
    tokens = {"00000000000000b1": TokenLimits(requests_per_minute=3)}
    a = limits("broker-a", policies, clock, tokens)
    b = limits("broker-b", policies, clock, tokens)
    await synced(a, b)
    assert a.admit("ai-lab", "00000000000000b1", clock.t) is None
    assert b.admit("ai-lab", "00000000000000b1", clock.t) is None
    await exchange("ai-lab", a, b)
    assert a.admit("ai-lab", "00000000000000b1", clock.t) is None
    await exchange("ai-lab", a, b)
    refusal = b.admit("ai-lab", "00000000000000b1", clock.t + 1)
    assert refusal is not None and refusal.code == "rate_limited"
    assert refusal.field == "tokens.00000000000000b1.limits.requests_per_minute"
    assert "token 00000000000000b1" in refusal.message
    # the tenant's other tokens (and requests without a limited token) still go
    assert b.admit("ai-lab", "00000000000000c2", clock.t + 1) is None
    assert b.admit("ai-lab", None, clock.t + 1) is None
    standing = b.standing("ai-lab", clock.t + 1)
    assert standing["requests_per_minute"] == {"used": 5, "limit": 100}
    assert standing["tokens"] == {
        "00000000000000b1": {
            "requests_per_minute": {"used": 3, "limit": 3},
            "tokens_per_minute": {"used": 0, "limit": None},
            "tokens_this_month": {"used": 0, "limit": None},
            "usd_this_month": {"used": 0.0, "limit": None},
        }
    }
    # a minute later the token's window is empty again
    assert b.admit("ai-lab", "00000000000000b1", clock.t + 62) is None


async def test_a_restarted_replica_keeps_its_month(limits: Make, registry: Registry) -> None:
    clock = SimClock()
    policies = {"ai-lab": policy(budget={"tokens_per_month": 1000})}
    a = limits("broker-a", policies, clock)
    await synced(a)
    a.admit("ai-lab", None, clock.t)
    a.charge("ai-lab", None, tokens=600, usd=0.25, now=clock.t)
    assert await a.flush()
    await until(lambda: a.heard("ai-lab", "broker-a") == a.seq)
    clock.t += 3600
    again = limits("broker-a", policies, clock)  # the same writer id, a fresh process
    await synced(again)
    assert again.standing("ai-lab", clock.t)["tokens_this_month"] == {"used": 600, "limit": 1000}
    again.admit("ai-lab", None, clock.t)
    again.charge("ai-lab", None, tokens=400, usd=0.25, now=clock.t)
    assert again.admit("ai-lab", None, clock.t) is not None
    assert await again.flush()  # guarded on the revision it read back
    raw = await registry.get_raw(keys.inference_limit("ai-lab", "broker-a"))
    assert raw is not None
    got = LimitRecord.model_validate_json(raw[0])
    assert (got.month, got.tokens, got.usd) == ("2026-12", 1000, 0.5)


async def test_a_dead_replicas_month_still_counts(limits: Make, registry: Registry) -> None:
    clock = SimClock()
    policies = {"ai-lab": policy(tokens_per_minute=5000, budget={"tokens_per_month": 1000})}
    dead = limits("broker-dead", policies, clock)
    await synced(dead)
    dead.admit("ai-lab", None, clock.t)
    dead.charge("ai-lab", None, tokens=900, usd=0.0, now=clock.t)
    assert await dead.flush()  # then it dies: nobody writes its key again
    clock.t += 3 * 86400
    live = limits("broker-live", policies, clock)
    await synced(live)
    standing = live.standing("ai-lab", clock.t)
    assert standing["tokens_per_minute"] == {"used": 0, "limit": 5000}  # its seconds aged out
    assert standing["tokens_this_month"] == {"used": 900, "limit": 1000}  # its month did not
    live.admit("ai-lab", None, clock.t)
    live.charge("ai-lab", None, tokens=100, usd=0.0, now=clock.t)
    refusal = live.admit("ai-lab", None, clock.t)
    assert refusal is not None and refusal.code == "budget_exhausted"
    assert await live.flush()
    await until(lambda: live.heard("ai-lab", "broker-live") == live.seq)
    # in the next month its key is a past month's: any replica deletes it
    assert await live.clean(clock.t) == 0
    january = datetime(2027, 1, 2, tzinfo=UTC).timestamp()
    assert await live.clean(january) == 2  # both replicas' December keys
    assert await registry.get_raw(keys.inference_limit("ai-lab", "broker-dead")) is None


async def test_the_loops_publish_by_themselves(limits: Make, registry: Registry) -> None:
    """run(): the mirror and the flush loop, supervised together; one write per change."""
    clock = SimClock()
    policies = {"ai-lab": policy(requests_per_minute=10)}
    a = InferenceLimits(
        registry=registry, writer="broker-a", policy=policies.get,
        token_limits=lambda _: None, clock=clock, flush_s=0.02,
    )  # fmt: skip
    b = limits("broker-b", policies, clock)
    task = asyncio.create_task(a.run(), name="inference limits a")
    try:
        await synced(a, b)
        for _ in range(4):
            assert a.admit("ai-lab", None, clock.t) is None
        await until(lambda: b.standing("ai-lab", clock.t)["requests_per_minute"] == {
            "used": 4, "limit": 10})  # fmt: skip
        await until(lambda: a.heard("ai-lab", "broker-a") == a.seq)  # its own watch is up
        seq = a.seq
        await asyncio.sleep(0.1)
        assert a.seq == seq  # nothing changed: nothing written
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_loop_publishes_a_tenant_far_from_its_limits_once_a_second(
    limits: Make, registry: Registry
) -> None:
    """The flush loop writes a tenant near a limit every flush_s, one that would reach none
    of them within FAR_S at its rate only every QUIET_S; a direct flush writes both."""
    clock = SimClock()
    policies = {
        "far": policy(requests_per_minute=1_000_000),
        "near": policy(requests_per_minute=40),
    }
    a = InferenceLimits(
        registry=registry, writer="broker-a", policy=policies.get,
        token_limits=lambda _: None, clock=clock, flush_s=0.02,
    )  # fmt: skip
    task = asyncio.create_task(a.run(), name="inference limits a")
    try:
        await synced(a)
        writes = {"far": set(), "near": set()}  # the seqs each tenant's record was written at
        for _ in range(10):
            for tenant in writes:
                assert a.admit(tenant, None, clock.t) is None
            await asyncio.sleep(0.05)
            for tenant, seen in writes.items():
                seen.add(a.heard(tenant, "broker-a"))
        assert len(writes["near"] - {0}) >= 5
        assert len(writes["far"] - {0}) == 1
        clock.t += QUIET_S
        before = a.heard("far", "broker-a")
        await until(lambda: a.heard("far", "broker-a") > before)
        assert a.admit("far", None, clock.t) is None
        assert await a.flush()  # a direct flush does not wait
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_unlimited_tenants_cost_nothing(limits: Make) -> None:
    clock = SimClock()
    policies = {"quiet": policy(priority=5), "busy": policy(requests_per_minute=5)}
    a = limits("broker-a", policies, clock)
    await synced(a)
    for name in ("quiet", "unknown"):
        assert a.admit(name, "00000000000000b1", clock.t) is None
        a.charge(name, None, tokens=10, usd=1.0, now=clock.t)
    assert not await a.flush()
    assert a.standing("quiet", clock.t)["priority"] == 5
    # a limited tenant's request is written: one key, its tenant's
    assert a.admit("busy", None, clock.t) is None
    assert await a.flush()
    await until(lambda: a.heard("busy", "broker-a") == a.seq)
    assert a.heard("quiet", "broker-a") == a.heard("unknown", "broker-a") == 0


def test_a_writer_id_must_be_a_name() -> None:
    with pytest.raises(ValueError, match="writer"):
        InferenceLimits(
            registry=None,  # type: ignore[arg-type]
            writer="a/b", policy=lambda _: None, token_limits=lambda _: None, clock=SimClock(),
        )  # fmt: skip


# -- the gateway's compiled accounting (routing.gateway.tally) over these limits --------------


def accountant(book: InferenceLimits, clock: SimClock, state_dir: Path) -> TokenAccountant:
    """The broker's books over `book`, with a token ledger in `state_dir` (never flushed
    here) and a snapshot with no services (the model is the service's name)."""
    ledger = TokenLedger(
        registry=book.registry,
        writer=book.writer,
        state_dir=state_dir,
        price=lambda site, model, at: None,
        clock=clock,
    )
    snapshot = SimpleNamespace(services={})
    return TokenAccountant(
        ledger=ledger,
        limits=book,
        metrics=BrokerMetrics(),
        snapshot=lambda: snapshot,  # type: ignore[arg-type,return-value]
        clock=clock,
    )


def billed(tenant: str, token_id: str | None = None) -> Billed:
    return Billed("r-1", tenant, token_id, "m1", "svc", "bj", "cn-north")


async def test_the_gateways_headroom_holds_two_replicas_within_5_percent(
    limits: Make, tmp_path: Path
) -> None:
    """The two-replica test with admission and settlement through each replica's Tally:
    several requests between two flushes, most of them admitted on the headroom the limits
    granted without asking them. The limit holds as it does with every request asked."""
    clock = SimClock()
    policies = {"ai-lab": policy(tokens_per_minute=12_000)}
    a, b = limits("broker-a", policies, clock), limits("broker-b", policies, clock)
    await synced(a, b)
    books = [accountant(a, clock, tmp_path / "a"), accountant(b, clock, tmp_path / "b")]
    asked = 0
    for one in books:
        admit = one.admit

        def counting(tenant: str, token_id: str | None, admit: Any = admit) -> Any:
            nonlocal asked
            asked += 1
            return admit(tenant, token_id)

        one.admit = counting  # type: ignore[method-assign]
    # in flight at once at most 2 flushes' requests (12 x 20 tokens: 2 % of the limit)
    per_request, latency_steps = 20, 2
    in_flight: list[tuple[int, Tally]] = []
    charged: list[tuple[float, int]] = []
    step = 0
    start = clock.t
    while clock.t < start + 150:
        for i in range(6):  # 60 requests a second offered, 3 to each replica per flush
            tally = books[i % 2].tally
            clock.t = start + step * 0.1 + i * 0.015
            if tally.admit("ai-lab", None) is None:
                in_flight.append((step + latency_steps, tally))
        for done in [f for f in in_flight if f[0] <= step]:
            in_flight.remove(done)
            done[1].settle(billed("ai-lab"), (per_request // 2, per_request // 2, 0), False)
            charged.append((clock.t, per_request))
        clock.t = start + (step + 1) * 0.1 - 0.001
        await exchange("ai-lab", a, b)
        step += 1
        if step == 50:  # the first 5 s, below the limit: each replica asked once per flush
            assert asked <= 50 * 6 // 2
        clock.t = start + step * 0.1
    for one in books:
        await one.ledger.close()
    sums = windows(charged, start + 30, start + 90)
    assert max(sums) <= 12_000 * 1.05
    assert min(sums) >= 12_000 * 0.90


async def test_the_gateways_counts_reach_the_limits_and_a_budget(
    limits: Make, tmp_path: Path
) -> None:
    """Requests admitted and settled by the Tally alone are published at the next flush, and
    spend a budget: once spent, the books refuse (429, x-should-retry: false)."""
    clock = SimClock()
    policies = {"ai-lab": policy(budget={"tokens_per_month": 1_000})}
    a = limits("broker-a", policies, clock)
    await synced(a)
    books = accountant(a, clock, tmp_path / "a")
    tally = books.tally
    assert tally.admit("ai-lab", None) is None  # asks the books: the headroom is granted
    for _ in range(5):
        assert tally.admit("ai-lab", None) is None
        tally.settle(billed("ai-lab"), (60, 40, 0), False)
    assert await a.flush()
    await until(lambda: a.heard("ai-lab", "broker-a") == a.seq)
    got = await a.registry.get_raw(keys.inference_limit("ai-lab", "broker-a"))
    assert got is not None
    record = LimitRecord.model_validate_json(got[0])
    assert record.tokens == 500
    assert sum(r for _, r, _ in record.buckets) == 6
    refused = None
    for _ in range(10):
        refused = tally.admit("ai-lab", None)
        if refused is not None:
            break
        tally.settle(billed("ai-lab"), (60, 40, 0), False)
    assert refused is not None
    status, code, _, field, headers = refused
    assert (status, code) == (429, "budget_exhausted")
    assert field == "tenants.ai-lab.inference.budget.tokens_per_month"
    assert headers == (("x-should-retry", "false"),)
    standing = a.standing("ai-lab", clock.t)["tokens_this_month"]
    assert isinstance(standing, dict) and standing["used"] == 1_000
    await books.ledger.close()
