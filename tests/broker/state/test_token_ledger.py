"""broker.state.token_ledger.TokenLedger against the session's real etcd: sums per (day, tenant,
model, site, region), a replayed or retried flush that adds nothing, what a ledger left in its
file recovered by the next one, a full slot table, bad numbers and names, a day boundary, and
etcd away for a while (a member of its own killed and restarted)."""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from broker.state.token_ledger import FILE_NAME, WRITER_FILE, TokenLedger, TokenLedgerError
from metering.tokens import TokenDay, TokenUse, row_key
from sites.emulation.etcd_server import EtcdCluster
from sites.kits.clock import SystemClock
from sites.model import keys
from sites.model.errors import RegistryUnavailable
from sites.model.spec import TokenPrice
from sites.registry.client import Registry
from tests.conftest import wait_for

PRICE = TokenPrice(input=1.0, output=2.0, cached_input=0.5)
NOON = datetime(2025, 3, 1, 12, tzinfo=UTC).timestamp()


def price(site: str, model: str, at: float) -> TokenPrice | None:
    return None if model == "free" else PRICE


class WallClock(SystemClock):
    """Real sleeps, a wall time the test sets."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


def whole(i: int, *, tenant: str = "acme", model: str = "m1", at: float = NOON, **kw) -> TokenUse:  # type: ignore[no-untyped-def]
    fields = dict(
        request_id=f"req-{i}", tenant=tenant, token_id="tok1", model=model, requested=model,
        service="svc", site="bj", client_region="cn-north", prompt_tokens=10,
        completion_tokens=20, cached_tokens=4, at=at,
    )  # fmt: skip
    fields.update(kw)
    return TokenUse(**fields)  # type: ignore[arg-type]


def stream(ledger: TokenLedger, i: int, *, tenant: str = "acme", prompt: int = 7):  # type: ignore[no-untyped-def]
    return ledger.open(
        request_id=f"s-{i}", tenant=tenant, token_id=None, requested="m1", service="svc",
        model="m1", site="bj", client_region="cn-north", prompt_tokens=prompt,
    )  # fmt: skip


@pytest.fixture
async def ledgers(registry: Registry, tmp_path: Path) -> AsyncIterator[Callable[..., TokenLedger]]:
    made: list[TokenLedger] = []

    def make(state_dir: Path = tmp_path / "state", **kw) -> TokenLedger:  # type: ignore[no-untyped-def]
        kw.setdefault("registry", registry)
        kw.setdefault("price", price)
        ledger = TokenLedger(writer=TokenLedger.writer_id(state_dir), state_dir=state_dir, **kw)
        made.append(ledger)
        return ledger

    yield make
    for ledger in made:
        if ledger.mapped is not None:
            await ledger.close()


async def days(registry: Registry, tenant: str = "acme") -> dict[str, TokenDay]:
    _, rows = await registry.list_prefix(keys.USAGE_TOKENS)
    out = {}
    for _key, value, _ in rows:
        day = TokenDay.model_validate_json(value)
        if day.tenant == tenant:
            out[day.day] = day
    return out


ROW = row_key("m1", "bj", "cn-north")


async def test_settled_uses_are_summed_per_day_tenant_and_row(
    ledgers: Callable[..., TokenLedger], registry: Registry
) -> None:
    ledger = ledgers(clock=WallClock(NOON))
    usd = ledger.settle(whole(1))
    assert usd == pytest.approx((6 * 1.0 + 4 * 0.5 + 20 * 2.0) / 1e6)
    ledger.settle(whole(2, model="free"))
    ledger.settle(whole(3, tenant="globex"))
    ticket = stream(ledger, 1)
    for n in range(1, 6):
        ticket.progress(n)
    use = ticket.settle(7, 5, 0, counted=False)
    assert (use.prompt_tokens, use.completion_tokens, use.at) == (7, 5, NOON)
    assert ticket.settle(1, 1, 1, counted=True) is use  # a second settle is the first
    stream(ledger, 2).abandon()  # nothing reached the client: nothing billed
    assert ledger.pending() == 4
    assert await ledger.flush() == 4
    assert ledger.pending() == 0
    acme = (await days(registry))["2025-03-01"]
    assert acme.seq == 1 and acme.writer == ledger.writer
    row = acme.rows[ROW]
    assert (row.requests, row.prompt_tokens, row.completion_tokens, row.cached_tokens) == (
        2, 17, 25, 4,
    )  # fmt: skip
    assert row.usd == pytest.approx(usd + (7 * 1.0 + 5 * 2.0) / 1e6)
    assert acme.rows[row_key("free", "bj", "cn-north")].usd == 0.0
    assert (await days(registry, "globex"))["2025-03-01"].rows[ROW].requests == 1
    ledger.settle(whole(4))
    assert await ledger.flush() == 1
    again = (await days(registry))["2025-03-01"]
    assert again.seq == 2 and again.rows[ROW].requests == 3
    assert await ledger.flush() == 0  # nothing queued: no write
    assert (await days(registry))["2025-03-01"].seq == 2


async def test_a_flush_starts_from_what_it_wrote_and_reads_a_key_changed_meanwhile(
    ledgers: Callable[..., TokenLedger], registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flush does not read back the TokenDay keys the ledger itself last wrote (it guards on
    their holding exactly that); a key changed by another meanwhile fails the guard, is read,
    and the sums stay right."""
    ledger = ledgers(clock=WallClock(NOON))
    reads: list[list[str]] = []
    get_many = registry.get_many

    async def counting(names, *args, **kw):  # type: ignore[no-untyped-def]
        reads.append(list(names))
        return await get_many(names, *args, **kw)

    monkeypatch.setattr(registry, "get_many", counting)
    ledger.settle(whole(1))
    assert await ledger.flush() == 1
    assert len(reads) == 1  # the first flush reads
    ledger.settle(whole(2))
    assert await ledger.flush() == 1
    assert len(reads) == 1  # the second starts from what the first wrote
    key = keys.usage_tokens("2025-03-01", "acme", ledger.writer)
    changed = (await days(registry))["2025-03-01"]
    changed.rows[ROW].requests += 5  # another writer (a misconfigured twin) wrote meanwhile
    await registry.put_raw(key, changed.model_dump_json().encode())
    ledger.settle(whole(3))
    assert await ledger.flush() == 1
    assert len(reads) == 2  # the guard failed: read again
    assert (await days(registry))["2025-03-01"].rows[ROW].requests == 3 + 5


async def test_a_flush_replayed_after_a_crash_between_commit_and_free_adds_nothing(
    ledgers: Callable[..., TokenLedger], registry: Registry, tmp_path: Path
) -> None:
    ledger = ledgers(clock=WallClock(NOON))
    crashed = tmp_path / "crashed"

    def crash_here() -> None:  # the file as a kill right after the commit leaves it
        crashed.mkdir()
        shutil.copy(tmp_path / "state" / FILE_NAME, crashed / FILE_NAME)
        shutil.copy(tmp_path / "state" / WRITER_FILE, crashed / WRITER_FILE)

    ledger._after_commit = crash_here
    for i in range(3):
        ledger.settle(whole(i))
    ticket = stream(ledger, 9)
    ticket.progress(11)  # open at the crash: recovered as delivered
    assert await ledger.flush() == 3
    before = (await days(registry))["2025-03-01"]
    assert before.rows[ROW].requests == 3
    await ledger.close()

    reborn = ledgers(crashed, clock=WallClock(NOON + 3600))
    assert reborn.writer == ledger.writer
    assert reborn.pending() == 4
    assert reborn.recover() == 4
    assert await reborn.flush() == 4  # 3 found in, the open stream added
    after = (await days(registry))["2025-03-01"]
    row = after.rows[ROW]
    assert (row.requests, row.counted_requests) == (4, 1)
    assert row.completion_tokens == 3 * 20 + 11 and row.prompt_tokens == 3 * 10 + 7
    assert reborn.pending() == 0 and reborn.recover() == 0


async def test_a_commit_whose_answer_was_lost_is_not_counted_again(
    ledgers: Callable[..., TokenLedger], registry: Registry
) -> None:
    ledger = ledgers()

    def lose_answer() -> None:
        ledger._after_commit = None
        raise RegistryUnavailable("the answer was lost after etcd applied it")

    ledger._after_commit = lose_answer
    ledger.settle(whole(1))
    with pytest.raises(RegistryUnavailable):
        await ledger.flush()
    assert ledger.pending() == 1  # kept, not known to be in
    ledger.settle(whole(2))
    assert await ledger.flush() == 2
    day = (await days(registry))["2025-03-01"]
    assert day.rows[ROW].requests == 2 and day.seq == 2


async def test_many_concurrent_streams_and_a_full_slot_table(
    ledgers: Callable[..., TokenLedger], registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = ledgers(slots=16, flush_s=0.01, clock=WallClock(NOON))
    runner = asyncio.create_task(ledger.run(), name="ledger")

    async def one(i: int) -> int:
        ticket = stream(ledger, i, tenant=f"t{i % 3}")
        for n in range(1, 6):
            ticket.progress(n)
            await asyncio.sleep(0)
        if i % 10 == 0:
            ticket.abandon()
            return 0
        ticket.settle(7, 5, 1, counted=False)
        return 1

    try:
        with caplog.at_level(logging.WARNING):
            settled = sum(await asyncio.gather(*(one(i) for i in range(200))))
        assert sum("slots are taken" in r.message for r in caplog.records) == 1
        await wait_for(lambda: ledger.pending() == 0, 10)
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
    rows = [(await days(registry, f"t{t}"))["2025-03-01"].rows[ROW] for t in range(3)]
    assert sum(r.requests for r in rows) == settled == 180
    assert sum(r.completion_tokens for r in rows) == 5 * settled
    assert sum(r.cached_tokens for r in rows) == settled
    assert len(ledger._free) == 16  # every slot back


async def test_bad_numbers_are_clamped_and_long_names_kept_in_memory(
    ledgers: Callable[..., TokenLedger], registry: Registry
) -> None:
    ledger = ledgers(clock=WallClock(NOON))
    ledger.settle(whole(1, prompt_tokens=-5, completion_tokens=10**30, cached_tokens=99))
    ledger.settle(whole(2, at=float("nan"), cached_tokens=None))
    long_model = "m" * 200
    ledger.settle(whole(3, model=long_model, request_id="r" * 500))
    ticket = stream(ledger, 4)
    ticket.progress(-3)
    ticket.settle("x", 2.9, -1, counted=True)  # not ints: clamped
    # one slot for the row of uses 1, 2 and 4 (the ticket's own was freed when it settled);
    # the long model's row has none
    assert len(ledger._free) == ledger.slots - 1
    assert await ledger.flush() == 4
    day = (await days(registry))["2025-03-01"]
    row = day.rows[ROW]
    assert row.prompt_tokens == 0 + 10 + 0
    assert row.completion_tokens == (1 << 40) + 20 + 2
    assert row.cached_tokens == 0  # clamped to the prompt, and None is none
    assert day.rows[row_key(long_model, "bj", "cn-north")].requests == 1


async def test_a_day_boundary_writes_two_days(
    ledgers: Callable[..., TokenLedger], registry: Registry
) -> None:
    midnight = datetime(2025, 3, 2, tzinfo=UTC).timestamp()
    clock = WallClock(midnight - 1)
    ledger = ledgers(clock=clock)
    ticket = stream(ledger, 1)  # opened before midnight, ends after: billed when it ended
    ledger.settle(whole(1, at=midnight - 1))
    clock.now = midnight + 1
    ticket.settle(7, 3, 0, counted=False)
    ledger.settle(whole(2, at=midnight + 1))
    assert await ledger.flush() == 3
    got = await days(registry)
    assert sorted(got) == ["2025-03-01", "2025-03-02"]
    assert got["2025-03-01"].rows[ROW].requests == 1
    assert got["2025-03-02"].rows[ROW].requests == 2


async def test_the_file_is_one_writers_and_one_processes(
    ledgers: Callable[..., TokenLedger], registry: Registry, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    writer = TokenLedger.writer_id(state)
    assert TokenLedger.writer_id(state) == writer  # made once, kept
    ledger = ledgers(state)
    with pytest.raises(TokenLedgerError, match="held by another process"):
        ledgers(state)
    await ledger.close()
    with pytest.raises(TokenLedgerError, match="holds writer"):
        TokenLedger(registry=registry, writer="other", state_dir=state, price=price)
    with pytest.raises(TokenLedgerError, match="not a key segment"):
        TokenLedger(registry=registry, writer="a/b", state_dir=state, price=price)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / FILE_NAME).write_bytes(b"x" * 300)
    with pytest.raises(TokenLedgerError, match="not a version"):
        TokenLedger(registry=registry, writer=writer, state_dir=tmp_path / "junk", price=price)


async def test_etcd_away_for_a_while_loses_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = EtcdCluster(1, data_dir=tmp_path / "etcd", unsafe_no_fsync=True)
    url = cluster.start()
    registry = Registry.from_urls(url, timeout_s=2)
    await registry.connect()
    state = tmp_path / "state"
    ledger = TokenLedger(
        registry=registry, writer=TokenLedger.writer_id(state), state_dir=state, price=price,
        flush_s=0.02,
    )  # fmt: skip
    runner = asyncio.create_task(ledger.run(), name="ledger")
    try:
        with caplog.at_level(logging.WARNING, logger="broker.state.token_ledger"):
            for i in range(10):
                ledger.settle(whole(i))
            await wait_for(lambda: ledger.pending() == 0, 10)
            cluster.kill(0)
            for i in range(10, 30):
                ledger.settle(whole(i))
            await wait_for(lambda: any("flush failed" in r.message for r in caplog.records), 15)
            await asyncio.sleep(0.5)  # a few more tries against no etcd
            assert ledger.pending() == 20
            cluster.restart(0)
            await wait_for(lambda: ledger.pending() == 0, 20)
        assert sum("flush failed" in r.message for r in caplog.records) == 1  # once per outage
        day = (await days(registry))["2025-03-01"]
        assert day.rows[ROW].requests == 30 and day.rows[ROW].completion_tokens == 600
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        await ledger.close()
        await registry.close()
        cluster.stop()


async def test_rows_settled_but_never_flushed_are_billed_after_a_kill(
    ledgers: Callable[..., TokenLedger], registry: Registry, tmp_path: Path
) -> None:
    """Whole answers share their row's slot; a kill before the flush leaves the row's sums in
    the file, and the next process bills them."""
    ledger = ledgers(clock=WallClock(NOON))
    for i in range(5):
        ledger.settle(whole(i))
    killed = tmp_path / "killed"
    killed.mkdir()
    shutil.copy(tmp_path / "state" / FILE_NAME, killed / FILE_NAME)
    shutil.copy(tmp_path / "state" / WRITER_FILE, killed / WRITER_FILE)
    ledger._queue.clear()  # this process "died": nothing of it reaches etcd
    ledger._rows.clear()
    await ledger.close()
    reborn = ledgers(killed, clock=WallClock(NOON + 60))
    assert reborn.recover() == 5
    assert await reborn.flush() == 5
    row = (await days(registry))["2025-03-01"].rows[ROW]
    assert (row.requests, row.prompt_tokens, row.completion_tokens) == (5, 50, 100)
