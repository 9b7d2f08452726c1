"""A process that streams through a TokenLedger is SIGKILLed mid-stream: the next ledger on its
state_dir bills exactly what reached the clients (the open streams `counted`), and a third,
started again on the same file, adds nothing."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from broker.state.token_ledger import TokenLedger
from metering.tokens import TokenDay, row_key
from sites.model import keys
from sites.model.spec import TokenPrice
from sites.registry.client import Registry
from tests.conftest import wait_for

CHILD = r"""
import asyncio, sys
from pathlib import Path
from broker.state.token_ledger import TokenLedger
from metering.tokens import TokenUse
from sites.model.spec import TokenPrice
from sites.registry.client import Registry

async def main(url: str, state: Path) -> None:
    registry = Registry.from_urls(url)
    await registry.connect()
    ledger = TokenLedger(
        registry=registry, writer=TokenLedger.writer_id(state), state_dir=state,
        price=lambda site, model, at: TokenPrice(input=1.0, output=2.0), flush_s=0.01,
    )
    runner = asyncio.create_task(ledger.run())
    def ticket(i: int):
        return ledger.open(
            request_id=f"s-{i}", tenant="acme", token_id="tok", requested="m1", service="svc",
            model="m1", site="bj", client_region="cn-north", prompt_tokens=7,
        )
    for i in range(5):  # whole answers
        ledger.settle(TokenUse(
            request_id=f"w-{i}", tenant="acme", token_id=None, model="m1", requested="m1",
            service="svc", site="bj", client_region="cn-north", prompt_tokens=10,
            completion_tokens=20, cached_tokens=0, at=0.0 + __import__("time").time(),
        ))
    done = ticket(100)
    done.progress(3)
    done.settle(7, 3, 0, counted=False)
    streams = [ticket(i) for i in range(4)]
    for n in range(1, 31):
        for t in streams:
            t.progress(n)
        await asyncio.sleep(0)
    print("streaming", flush=True)
    while True:  # the streams stay open, a flush every 10 ms, until the kill
        for t in streams:
            t.progress(30)
        await asyncio.sleep(0.001)

asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
"""


def price(site: str, model: str, at: float) -> TokenPrice | None:
    return TokenPrice(input=1.0, output=2.0)


async def acme_rows(registry: Registry) -> tuple[int, int, int, int, float]:
    _, got = await registry.list_prefix(keys.USAGE_TOKENS)
    total = [0, 0, 0, 0, 0.0]
    for _key, value, _ in got:
        row = TokenDay.model_validate_json(value).rows[row_key("m1", "bj", "cn-north")]
        for i, n in enumerate(
            (row.requests, row.prompt_tokens, row.completion_tokens, row.counted_requests)
        ):
            total[i] += n
        total[4] += row.usd
    return (int(total[0]), int(total[1]), int(total[2]), int(total[3]), total[4])


@pytest.mark.e2e
async def test_a_broker_killed_mid_stream_bills_what_its_clients_received_once(
    registry: Registry, etcd: object, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, PYTHONPATH=str(root))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, registry.url, str(state)],
        stdout=subprocess.PIPE, env=env, cwd=root,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 30)
        assert line.strip() == b"streaming"
        await asyncio.sleep(0.05)  # a few flushes and progress stores under way
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()

    # 5 whole answers (10 + 20), a settled stream (7 + 3), 4 open ones (7 + 30 delivered)
    expected = (10, 5 * 10 + 7 + 4 * 7, 5 * 20 + 3 + 4 * 30, 4)
    for life in range(2):  # recovered, then started again on the same file: nothing added
        ledger = TokenLedger(
            registry=registry, writer=TokenLedger.writer_id(state), state_dir=state,
            price=price, flush_s=0.01,
        )  # fmt: skip
        if life == 0:
            assert ledger.pending() >= 4  # at least the open streams were left in the file
        else:
            assert ledger.pending() == 0
        runner = asyncio.create_task(ledger.run(), name="ledger")
        try:
            await wait_for(lambda: ledger.pending() == 0, 10)  # noqa: B023
            await asyncio.sleep(0.05)  # a few more flush periods: nothing more comes
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
            await ledger.close()
        got = await acme_rows(registry)
        assert got[:4] == expected
        prompt, completion = expected[1], expected[2]
        assert got[4] == pytest.approx((prompt * 1.0 + completion * 2.0) / 1e6)
