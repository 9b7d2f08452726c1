"""The OpenAI surface's cost in the broker: CPU per proxied request with token accounting and
limits on vs off, streamed and not (issue 42's target: at most +10 %).

    .venv/bin/python bench/openai_gateway.py [--requests 3000] [--concurrency 16]

Each setting gets its own `cpn up` (one site, yrd-demo-zone, its stand-ins answering in about
1 ms) on an embedded etcd; the load is aiohttp clients on loopback sending
POST /v1/chat/completions (the lane serves it) with the model in the body. With metering on,
the tenant has requests-per-minute and tokens-per-minute limits far above the load (admission
runs, nothing is refused) and every answer's usage goes into the token ledger; off is
`inference.metering: false`. Broker CPU = the broker process's user+system seconds over the
load / requests. The two-replica limit figure is tests/routing/test_openai_e2e.py's
(`test_a_tokens_per_minute_limit_holds_across_two_replicas`), whose admitted tokens this
prints when run with -s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.benchkit import (  # noqa: E402
    cpu_seconds,
    embedded_etcd,
    log,
    scratch_dir,
    table,
)
from sites.emulation.etcd_server import free_port  # noqa: E402

REGION = {"X-Cpn-Client-Region": "shanghai", "X-Cpn-Tenant": "bench"}


def _configs(where: Path, metering: bool) -> Path:
    cfg = where / "configs"
    shutil.copytree(ROOT / "configs", cfg)
    (cfg / "standin.yaml").write_text(
        yaml.safe_dump({"default": {"median_ms": 1, "p99_ms": 2}, "models": {}})
    )
    broker = {
        "auth": {"enabled": False},
        "inference": {"metering": metering, "tenant_rate_per_s": 1e6, "tenant_burst": 1000000},
    }
    (cfg / "broker.yaml").write_text(yaml.safe_dump(broker))
    tenants = yaml.safe_load((cfg / "tenants.yaml").read_text()) or {}
    if not os.environ.get("BENCH_NO_LIMITS"):
        tenants.setdefault("tenants", {})["bench"] = {
            "inference": {"requests_per_minute": 10_000_000, "tokens_per_minute": 1_000_000_000}
        }
    (cfg / "tenants.yaml").write_text(yaml.safe_dump(tenants))
    return cfg


def _pin(up: subprocess.Popen[bytes], broker: int, etcd: object) -> None:
    """The broker alone on the first CPU, everything else (this load, the stand-ins, the
    agent, etcd) on the others: its CPU per request then moves less with what runs beside it."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return
    first, rest = {cpus[0]}, set(cpus[1:])
    others = [psutil.Process(up.pid), *psutil.Process(up.pid).children(recursive=True)]
    proc = getattr(etcd, "process", None) or getattr(etcd, "proc", None)
    if proc is not None and getattr(proc, "pid", None):
        others.append(psutil.Process(proc.pid))
    for p in others:
        try:
            p.cpu_affinity(list(first if p.pid == broker else rest))
        except psutil.Error:
            continue
    os.sched_setaffinity(0, rest)


def _broker_pid(up: subprocess.Popen[bytes]) -> int | None:
    for child in psutil.Process(up.pid).children(recursive=True):
        try:
            if "broker" in child.cmdline()[2:4] or " broker " in " ".join(child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    return None


async def _ready(url: str) -> None:
    deadline = time.monotonic() + 90
    async with aiohttp.ClientSession(headers=REGION) as http:
        while time.monotonic() < deadline:
            try:
                async with http.post(
                    url + "/v1/chat/completions",
                    json={"model": "qwen-72b", "messages": [{"role": "user", "content": "hi"}]},
                ) as answer:
                    if answer.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.3)
    raise SystemExit("the federation never served qwen-72b")


async def _load(url: str, requests: int, concurrency: int, stream: bool) -> tuple[float, int]:
    body = json.dumps(
        {
            "model": "qwen2.5-72b-instruct",  # as /v1/models lists it: sent on as it is
            "messages": [{"role": "user", "content": "say something short about the sea"}],
            "max_tokens": 16,
            "stream": stream,
        }
    ).encode()
    headers = {**REGION, "Content-Type": "application/json"}
    left = requests
    failed = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as http:

        async def worker() -> None:
            nonlocal left, failed
            while left > 0:
                left -= 1
                async with http.post(url + "/v1/chat/completions", data=body) as answer:
                    await answer.read()
                    if answer.status != 200:
                        failed += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started, failed


async def _tpm_two_replicas(urls: list[str], limit: int) -> tuple[int, list[int], list[int]]:
    """A tenant with a tokens-per-minute `limit`, its requests alternated over two broker
    replicas until each refused a few: (tokens admitted, per replica, refusals per replica)."""
    tenant = {"X-Cpn-Client-Region": "shanghai", "X-Cpn-Tenant": "bench-tpm"}
    body = {
        "model": "qwen2.5-72b-instruct",
        "messages": [{"role": "user", "content": "write a long story about the sea " * 4}],
        "max_tokens": 64,
    }
    admitted, refused = [0, 0], [0, 0]
    async with aiohttp.ClientSession(headers=tenant) as http:
        put = await http.put(
            urls[0] + "/v1/tenants/bench-tpm", json={"inference": {"tokens_per_minute": limit}}
        )
        put.release()
        await asyncio.sleep(1.5)  # the policy reaches both replicas

        async def drive(i: int) -> None:
            deadline = time.monotonic() + 50
            while time.monotonic() < deadline and refused[i] < 5:
                async with http.post(urls[i] + "/v1/chat/completions", json=body) as answer:
                    got = await answer.json()
                    if answer.status == 429:
                        refused[i] += 1
                        await asyncio.sleep(0.05)
                    elif answer.status == 200:
                        admitted[i] += int(got["usage"]["total_tokens"])

        await asyncio.gather(drive(0), drive(1))
    return sum(admitted), admitted, refused


def run_one(metering: bool, args: argparse.Namespace) -> dict[str, float]:
    where = scratch_dir("cpn-bench-openai-")
    etcd = embedded_etcd(where)
    etcd.start()
    cfg = _configs(where, metering)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logfile = open(where / "up.log", "wb")  # noqa: SIM115
    up = subprocess.Popen(
        [sys.executable, "-m", "cpn", "up", "--etcd", etcd.url, "--config-dir", str(cfg),
         "--sites", "yrd-demo-zone", "--interval", "1", "--broker-listen", f"127.0.0.1:{port}"],
        stdout=logfile, stderr=subprocess.STDOUT, cwd=ROOT,
        env={**os.environ, "CPN_STATE_DIR": str(where / "state")},
    )  # fmt: skip
    logfile.close()
    out: dict[str, float] = {}
    try:
        asyncio.run(_ready(url))
        pid = _broker_pid(up)
        if args.pin and pid is not None:
            _pin(up, pid, etcd)
        for stream in (False, True):
            asyncio.run(_load(url, min(500, args.requests), args.concurrency, stream))  # warm
            spy = None
            if args.perf and pid is not None:
                spy = subprocess.Popen(
                    ["perf", "record", "-g", "-F", "1999", "-p", str(pid), "-o",
                     f"{args.perf}-{'on' if metering else 'off'}-{int(stream)}.data"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                time.sleep(1.0)
            if args.profile and pid is not None:
                spy_file = f"{args.profile}-{'on' if metering else 'off'}-{int(stream)}.txt"
                spy = subprocess.Popen(
                    [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid),
                     "--format", "raw", "--output", spy_file, "--rate", "1000", "--nonblocking"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                time.sleep(1.0)
            before = cpu_seconds(pid) or 0.0
            seconds, failed = asyncio.run(_load(url, args.requests, args.concurrency, stream))
            after = cpu_seconds(pid) or 0.0
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(30)
            kind = "stream" if stream else "whole"
            out[f"{kind}_us"] = (after - before) / args.requests * 1e6
            out[f"{kind}_rps"] = args.requests / seconds
            out[f"{kind}_failed"] = failed
        if metering and args.tpm_limit:
            port2 = free_port()
            with open(where / "broker-2.log", "wb") as log2:
                second = subprocess.Popen(
                    [sys.executable, "-m", "cpn", "broker", "--etcd", etcd.url,
                     "--listen", f"127.0.0.1:{port2}", "--config-dir", str(cfg),
                     "--state-dir", str(where / "broker-2")],
                    stdout=log2, stderr=subprocess.STDOUT, cwd=ROOT,
                )  # fmt: skip
            try:
                asyncio.run(_ready(f"http://127.0.0.1:{port2}"))
                total, each, refused = asyncio.run(
                    _tpm_two_replicas([url, f"http://127.0.0.1:{port2}"], args.tpm_limit)
                )
                out["tpm_admitted"] = total
                log(f"   two replicas, tokens_per_minute {args.tpm_limit}: admitted {total} "
                    f"({each[0]} + {each[1]}), {total / args.tpm_limit * 100 - 100:+.1f} % of "
                    f"the limit; refusals {refused}")  # fmt: skip
            finally:
                second.send_signal(signal.SIGINT)
                try:
                    second.wait(20)
                except subprocess.TimeoutExpired:
                    second.kill()
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()
        etcd.stop()
        if not os.environ.get("BENCH_KEEP"):
            shutil.rmtree(where, ignore_errors=True)
        else:
            log(f"kept {where}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="off/on pairs, alternated")
    parser.add_argument(
        "--pin", action="store_true",
        help="the broker alone on one CPU, the rest on the others (steadier figures)",
    )  # fmt: skip
    parser.add_argument(
        "--tpm-limit", type=int, default=12_000,
        help="the two-replica tokens-per-minute check's limit (0: skip it)",
    )  # fmt: skip
    parser.add_argument(
        "--profile", metavar="PREFIX", help="py-spy the broker under load into PREFIX-*.txt"
    )
    parser.add_argument("--only", choices=("on", "off"), help="run one setting")
    parser.add_argument("--perf", metavar="PREFIX", help="perf record the broker under load")
    args = parser.parse_args()
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for n in range(args.rounds):
        for metering in (False, True):
            if args.only and args.only != ("on" if metering else "off"):
                continue
            log(f"round {n + 1}: metering {'on' if metering else 'off'}: {args.requests} "
                "requests x 2 (whole, stream)")  # fmt: skip
            runs[metering].append(run_one(metering, args))
    if not runs[False] or not runs[True]:
        print(json.dumps(runs, indent=1))
        return
    rows = []
    for kind in ("whole", "stream"):
        off = statistics.median(r[f"{kind}_us"] for r in runs[False])
        on = statistics.median(r[f"{kind}_us"] for r in runs[True])
        each = " ".join(
            f"{a[f'{kind}_us']:.0f}/{b[f'{kind}_us']:.0f}"
            for a, b in zip(runs[False], runs[True], strict=False)
        )
        rows.append(
            [
                kind,
                f"{off:.0f}",
                f"{on:.0f}",
                f"{(on / off - 1) * 100:+.1f} %",
                each,
                f"{sum(r[f'{kind}_failed'] for r in runs[False] + runs[True]):.0f}",
            ]
        )
    print(
        table(
            ["answer", "CPU us/req off", "on", "change (medians)", "each round off/on", "failed"],
            rows,
        )
    )
    print("target: at most +10 % broker CPU per request with accounting and limits on")
    admitted = [r["tpm_admitted"] for r in runs[True] if "tpm_admitted" in r]
    if admitted:
        print(
            f"two replicas, tokens_per_minute {args.tpm_limit}: admitted "
            + ", ".join(f"{a:.0f} ({a / args.tpm_limit * 100 - 100:+.1f} %)" for a in admitted)
            + " (target: within 5 %)"
        )


if __name__ == "__main__":
    main()
