"""The registry's two gRPC transports side by side: sites.registry.h2grpc (the default) and grpc.aio
(CPN_ETCD_TRANSPORT=grpc), as the broker uses them under a live federation.

Prints figures; it is not a timed test. It starts an embedded etcd (fsync off, on /dev/shm) and
N sites' agents publishing every --interval s (bench/live_federation.py's agents process, the
agent emulator), then, for each transport in turn (--rounds times, alternated), a process of
its own that does what the broker's view and its submits do:

- follows one watch of /cpn/v1/ (Registry.watch_batches), applying nothing;
- commits a guarded transaction (Registry.commit: a 2 KiB put under /bench/, as a submit's
  record) --txn-rate times a second, timing each;

and reports that process's CPU (% of one core, and us per watch answer: the commits' share
included), the events it saw
per second, and the transactions' p50/p99 round trip. The process's event loop is busy only
with the watch, as the broker's is with its view (a real broker also applies every event:
bench/live_federation.py measures that).

    .venv/bin/python bench/etcd_transport.py                  # 1000 sites every 1 s, ~2 min
    .venv/bin/python bench/etcd_transport.py --sites 200 --seconds 10 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchkit import embedded_etcd, scratch_dir  # noqa: E402

from sites.registry.client import TRANSPORT_ENV, Guard, Registry  # noqa: E402

TRANSPORTS = ("h2", "grpc")


async def follower(url: str, seconds: float, txn_rate: float) -> dict[str, float]:
    """One transport's process: follow /cpn/v1/ and commit at txn_rate for `seconds`."""
    events = answers = 0
    txn_ms: list[float] = []
    async with Registry.from_urls(url) as registry:
        start = await registry.revision() + 1

        async def follow() -> None:
            nonlocal events, answers
            async for batch in registry.watch_batches("/cpn/v1/", start_revision=start):
                answers += len({e.revision for e in batch})
                events += len(batch)

        async def commit() -> None:
            i = 0
            while True:
                await asyncio.sleep(1 / txn_rate)
                key = f"/bench/transport/{os.getpid()}-{i}"
                i += 1
                started = time.perf_counter()
                await registry.commit(guards=[Guard(key, mod_revision=0)], puts={key: b"x" * 2048})
                txn_ms.append((time.perf_counter() - started) * 1000)

        tasks = [asyncio.create_task(follow()), asyncio.create_task(commit())]
        await asyncio.sleep(1.0)  # connected and caught up
        events = answers = 0
        txn_ms.clear()
        cpu0, wall0 = time.process_time(), time.monotonic()
        await asyncio.sleep(seconds)
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    txn_ms.sort()
    return {
        "cpu_pct": 100 * cpu / wall,
        "events_per_s": events / wall,
        "answers_per_s": answers / wall,
        "us_per_answer": 1e6 * cpu / max(answers, 1),
        "txn_p50_ms": statistics.median(txn_ms) if txn_ms else float("nan"),
        "txn_p99_ms": txn_ms[int(0.99 * (len(txn_ms) - 1))] if txn_ms else float("nan"),
        "txns": len(txn_ms),
    }


def run_transport(transport: str, url: str, args: argparse.Namespace) -> dict[str, float]:
    env = dict(os.environ)
    env.pop(TRANSPORT_ENV, None)
    if transport == "grpc":
        env[TRANSPORT_ENV] = "grpc"
    argv = [sys.executable, __file__, "follow", url, str(args.seconds), str(args.txn_rate)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {transport} follower failed:\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    if sys.argv[1:2] == ["follow"]:
        import uvloop  # as `cpn broker` runs

        url, seconds, rate = sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
        print(json.dumps(uvloop.run(follower(url, seconds, rate))))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sites", type=int, default=1000)
    p.add_argument("--interval", type=float, default=1.0, help="publish interval, s")
    p.add_argument("--seconds", type=float, default=15.0, help="each measurement, s")
    p.add_argument("--rounds", type=int, default=2, help="h2 then grpc, this many times")
    p.add_argument("--txn-rate", type=float, default=20.0, help="commits per s")
    args = p.parse_args()
    tmp = scratch_dir("cpn-transport-")
    etcd = embedded_etcd(tmp)
    agents: subprocess.Popen[bytes] | None = None
    rows: list[tuple[str, dict[str, float]]] = []
    try:
        url = etcd.start()
        ttl = max(3, round(3 * args.interval))
        agents = subprocess.Popen(
            [
                sys.executable, str(ROOT / "bench" / "live_federation.py"), "agents",
                "--etcd", url, "--sites", str(args.sites), "--interval", str(args.interval),
                "--ttl", str(ttl), "--keepalive", str(ttl / 3),
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(tmp / "agents.log", "wb"),  # noqa: SIM115 - closed with the process
            cwd=ROOT,
        )  # fmt: skip
        print(f"etcd {url}; {args.sites} sites publishing every {args.interval:g}s", flush=True)
        time.sleep(5 + args.sites / 500)  # joined and publishing
        for _ in range(args.rounds):
            for transport in TRANSPORTS:
                row = run_transport(transport, url, args)
                rows.append((transport, row))
                print(
                    f"{transport:5} | {row['cpu_pct']:5.1f} % of a core | "
                    f"{row['us_per_answer']:5.0f} us/answer | "
                    f"{row['answers_per_s']:6.0f} answers/s "
                    f"({row['events_per_s']:6.0f} events/s) | Txn p50/p99 "
                    f"{row['txn_p50_ms']:.2f}/{row['txn_p99_ms']:.2f} ms over {row['txns']:.0f}",
                    flush=True,
                )
    finally:
        if agents is not None:
            agents.terminate()
            try:
                agents.wait(30)
            except subprocess.TimeoutExpired:
                agents.kill()
        etcd.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    for transport in TRANSPORTS:
        mine = [r for t, r in rows if t == transport]
        if mine:
            cpu = statistics.median(r["cpu_pct"] for r in mine)
            p50 = statistics.median(r["txn_p50_ms"] for r in mine)
            print(f"{transport}: median {cpu:.1f} % of a core, Txn p50 {p50:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
