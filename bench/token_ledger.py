"""Token ledger: what a proxied request's token accounting costs the broker, and flush throughput.

Prints figures; it is not a timed test.

1. The hot path, no etcd touched: per streamed request `open` + `--chunks` `progress` calls +
   `Ticket.settle`, and per whole answer `TokenLedger.settle`, in microseconds (best of 5
   rounds of --requests each, slots freed between rounds).
2. Flush throughput: --requests settled uses over --tenants tenants, then one `flush` into an
   embedded etcd (on /dev/shm, fsync off): uses per second and transactions.

    .venv/bin/python bench/token_ledger.py
    .venv/bin/python bench/token_ledger.py --requests 50000 --tenants 500
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchkit import embedded_etcd, scratch_dir  # noqa: E402

from broker.state.token_ledger import KEYS_PER_TXN, TokenLedger  # noqa: E402
from metering.tokens import TokenUse  # noqa: E402
from sites.model.spec import TokenPrice  # noqa: E402
from sites.registry.client import Registry  # noqa: E402

PRICE = TokenPrice(input=1.0, output=2.0, cached_input=0.5)


def price(site: str, model: str, at: float) -> TokenPrice | None:  # noqa: ARG001
    return PRICE


def use(i: int, tenants: int) -> TokenUse:
    return TokenUse(
        request_id=f"req-{i:012d}", tenant=f"tenant-{i % tenants}", token_id="tok-1",
        model="meta-llama/Llama-3.1-8B-Instruct", requested="llama", service="llama",
        site="beijing-1", client_region="cn-north", prompt_tokens=512, completion_tokens=128,
        cached_tokens=64, at=time.time(),
    )  # fmt: skip


def hot_path(ledger: TokenLedger, requests: int, chunks: int) -> tuple[float, float]:
    """(µs per streamed request, µs per whole answer), best of 5 rounds."""
    streamed, whole = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(requests):
            ticket = ledger.open(
                request_id=f"req-{i:012d}", tenant="tenant-1", token_id="tok-1",
                requested="llama", service="llama", model="meta-llama/Llama-3.1-8B-Instruct",
                site="beijing-1", client_region="cn-north", prompt_tokens=512,
            )  # fmt: skip
            for n in range(1, chunks + 1):
                ticket.progress(n)
            ticket.settle(512, chunks, 64, counted=False)
        streamed.append((time.perf_counter() - t0) / requests * 1e6)
        free(ledger)
        made = [use(i, 10) for i in range(requests)]
        t0 = time.perf_counter()
        for u in made:
            ledger.settle(u)
        whole.append((time.perf_counter() - t0) / requests * 1e6)
        free(ledger)
    return min(streamed), min(whole)


def free(ledger: TokenLedger) -> None:
    """Drop what is queued (the hot path's rounds are not flushed)."""
    for item in ledger._queue:  # noqa: SLF001 - a bench's reset
        ledger.free_slot(item.slot)
    ledger._queue.clear()  # noqa: SLF001


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--chunks", type=int, default=100, help="progress calls per stream")
    ap.add_argument("--tenants", type=int, default=100)
    args = ap.parse_args()
    where = scratch_dir("cpn-token-ledger-")
    etcd = embedded_etcd(where)
    try:
        etcd.start()
        async with Registry.from_urls(etcd.url) as registry:
            state = where / "state"
            slots = max(args.requests, 1024)
            ledger = TokenLedger(
                registry=registry, writer=TokenLedger.writer_id(state), state_dir=state,
                price=price, slots=slots,
            )  # fmt: skip
            streamed, whole = hot_path(ledger, args.requests, args.chunks)
            per_chunk = (streamed - whole) / args.chunks if args.chunks else 0.0
            print(f"streamed request, open + {args.chunks} progress + settle: {streamed:.1f} µs")
            print(f"  (a progress call, roughly: {max(per_chunk, 0.0) * 1000:.0f} ns)")
            print(f"whole answer, settle: {whole:.1f} µs")
            for i in range(args.requests):
                ledger.settle(use(i, args.tenants))
            t0 = time.perf_counter()
            done = await ledger.flush()
            took = time.perf_counter() - t0
            txns = -(-args.tenants // KEYS_PER_TXN)
            print(
                f"flush: {done} uses over {args.tenants} tenants in {took * 1000:.0f} ms "
                f"({done / took:,.0f} uses/s, {txns} transactions)"
            )
            for i in range(args.requests // 10):
                ledger.settle(use(i, args.tenants))
            t0 = time.perf_counter()
            done = await ledger.flush()
            took = time.perf_counter() - t0
            print(f"flush of {done} more into the same keys: {took * 1000:.0f} ms")
            await ledger.close()
    finally:
        etcd.stop()
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
