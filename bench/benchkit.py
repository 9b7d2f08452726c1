"""What the benchmarks share: statistics, number formats, tables, progress lines, the CPU and
memory of processes, the processes a bench starts, a scratch directory and an embedded etcd,
and what both kinds of simulated agent (registry_fanin.SimAgent, agent_emulator) use.

The scripts run as `python bench/<name>.py`, so bench/ is first on sys.path and they import
this module as `benchkit`. It imports no other bench module: the scripts import each other
only downwards (live_federation -> registry_fanin -> agent_emulator -> emulated_site), and
everything two of them need lives here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

import psutil
from pydantic import BaseModel

from sites.emulation.etcd_server import EmbeddedEtcd
from sites.model.status import AgentRecord
from sites.registry.client import Registry

ROOT = Path(__file__).resolve().parent.parent

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


# -- progress lines (stderr) -------------------------------------------------------------------


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def log_stamped(msg: str) -> None:
    """A progress line with the wall-clock time in front: [HH:MM:SS] msg."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- statistics --------------------------------------------------------------------------------
# Three definitions, each the one its benchmarks have always printed: they differ on small
# samples, so a figure stays comparable with the same bench's earlier ones (bench/JOURNAL.md).


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile, q in 0..100; None for no samples."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100.0 * len(ordered)) - 1))
    return ordered[rank]


def linear_percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between neighbours; nan when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def quantile(values: Sequence[float], q: float) -> float:
    """The sorted values' element at index int(q x n), q in 0..1 (at most the last)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency_stats(ms: Sequence[float]) -> dict[str, float]:
    """p50 and p99 (linear_percentile) and the number of samples."""
    return {"p50": linear_percentile(ms, 50), "p99": linear_percentile(ms, 99), "n": len(ms)}


def rate(before: float | None, after: float | None, seconds: float) -> float | None:
    """(after - before) / seconds; None when either is unknown or the window is empty."""
    if before is None or after is None or seconds <= 0:
        return None
    return (after - before) / seconds


# -- number formats and tables -----------------------------------------------------------------


def num(value: float | None, digits: int = 0) -> str:
    """A figure with thousands separators; '-' for none (None or nan)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def fmt_ms(value: float | None) -> str:
    """Milliseconds to a tenth, no separators; '-' for none."""
    return "-" if value is None else f"{value:.1f}"


def share(x: float | None, digits: int = 2) -> str:
    """A fraction as a percentage ('0.9912' -> '99.12%'); 'none' for none."""
    return "none" if x is None else f"{100 * x:.{digits}f}%"


def table(headers: list[str], rows: list[list[str]], *, label_column: bool = True) -> str:
    """A text table: cells right-aligned, the first column left-aligned when it holds labels."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        cells = enumerate(zip(r, widths, strict=True))
        return " | ".join(
            str(c).ljust(w) if i == 0 and label_column else str(c).rjust(w) for i, (c, w) in cells
        )

    return "\n".join([line(headers), "-+-".join("-" * w for w in widths), *map(line, rows)])


# -- CPU and memory of processes ---------------------------------------------------------------


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of a process so far; None when it cannot be read."""
    if pid is None:
        return None
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return float(times.user + times.system)


def host_busy_seconds() -> float:
    """CPU seconds the whole host spent busy (not idle, not waiting on I/O), all CPUs."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    return float(sum(t) - idle)


def rss_mb(pid: int) -> float | None:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return None


# -- processes a bench starts ------------------------------------------------------------------


def cpn_argv() -> list[str]:
    """The command line that runs `cpn` from this interpreter's venv."""
    script = Path(sys.executable).parent / "cpn"
    return [str(script)] if script.exists() else [sys.executable, "-m", "cpn"]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


STARTED: list[Proc] = []  # stopped, by pid, in reverse order, on every exit path


def start_process(
    name: str,
    argv: list[str],
    log_path: Path,
    *,
    stdout_pipe: bool,
    stdin_pipe: bool = False,
    env: dict[str, str] | None = None,
) -> Proc:
    """argv in the repository root, its stderr (and stdout unless piped) appended to log_path;
    `env` is added to this process's environment."""
    with open(log_path, "ab") as logfile:
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
            stdout=subprocess.PIPE if stdout_pipe else logfile,
            stderr=logfile,
            cwd=ROOT,
            env={**os.environ, **env} if env else None,
        )
    proc = Proc(name, popen, log_path)
    STARTED.append(proc)
    return proc


def stop_process(proc: Proc, timeout_s: float = 20.0) -> None:
    """SIGTERM (the process cleans up), then SIGKILL after timeout_s; by pid, only ours."""
    if proc.alive():
        with contextlib.suppress(ProcessLookupError):
            proc.popen.send_signal(signal.SIGTERM)
        try:
            proc.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log(f"   {proc.name} (pid {proc.pid}) did not stop in {timeout_s:.0f}s: killed")
            proc.popen.kill()
            proc.popen.wait()
    for stream in (proc.popen.stdin, proc.popen.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    if proc in STARTED:
        STARTED.remove(proc)


def stop_all() -> None:
    for proc in reversed(list(STARTED)):
        stop_process(proc)


class LineReader:
    """A child's JSON lines, read by a thread (the event loop never blocks on the pipe)."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.lines: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[bytes]) -> None:
        with contextlib.suppress(ValueError, OSError):
            for raw in stream:
                with contextlib.suppress(ValueError):
                    obj = json.loads(raw)
                    with self._lock:
                        self.lines.append(obj)

    def take(self) -> list[dict[str, Any]]:
        with self._lock:
            out, self.lines = self.lines, []
        return out


# -- a scratch directory and an embedded etcd --------------------------------------------------


def scratch_dir(prefix: str, parent: Path | None = None) -> Path:
    """A new temporary directory under `parent`, else /dev/shm (etcd's data in memory), else
    the system's temporary directory. The caller removes it."""
    shm = Path("/dev/shm")
    where = parent or (shm if shm.is_dir() else None)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=where))


def embedded_etcd(where: Path, *, fsync: bool = False) -> EmbeddedEtcd:
    """An embedded etcd, not started: its data in where/etcd, its log in where/etcd.log, fsync
    off (--unsafe-no-fsync) unless `fsync`."""
    return EmbeddedEtcd(
        data_dir=where / "etcd", log_path=where / "etcd.log", unsafe_no_fsync=not fsync
    )


# -- async helpers -----------------------------------------------------------------------------


async def bounded(jobs: Sequence[Callable[[], Awaitable[Any]]], limit: int) -> None:
    """Every job, at most `limit` at a time."""
    sem = asyncio.Semaphore(limit)

    async def one(job: Callable[[], Awaitable[Any]]) -> None:
        async with sem:
            await job()

    await asyncio.gather(*(one(job) for job in jobs))


async def step(aw: Awaitable[T], what: str, timeout_s: float = 30.0) -> T | None:
    """One teardown step, bounded in time so a stuck call cannot keep the bench from exiting."""
    try:
        return await asyncio.wait_for(aw, timeout_s)
    except TimeoutError:
        log(f"   warning: {what} did not finish within {timeout_s:.0f}s; going on")
        return None


# -- what both kinds of simulated agent share --------------------------------------------------


@dataclass
class AgentStats:
    """What the simulated agents did; window counters count only while `measuring`."""

    measuring: bool = False
    publish_ms: list[float] = field(default_factory=list)
    lag_ms: list[float] = field(default_factory=list)
    publishes: int = 0
    puts: int = 0
    keepalives: int = 0
    status_bytes: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    # since the last progress tick (all phases)
    tick_publishes: int = 0
    tick_keepalives: int = 0
    tick_errors: int = 0
    tick_publish_ms: list[float] = field(default_factory=list)

    def published(self, call_ms: float, lag_ms: float, puts: int, size: int) -> None:
        self.tick_publishes += 1
        self.tick_publish_ms.append(call_ms)
        if self.measuring:
            self.publish_ms.append(call_ms)
            self.lag_ms.append(lag_ms)
            self.publishes += 1
            self.puts += puts
        self.status_bytes = max(self.status_bytes, size)

    def kept_alive(self) -> None:
        self.tick_keepalives += 1
        if self.measuring:
            self.keepalives += 1

    def error(self, what: str) -> None:
        self.tick_errors += 1
        if self.measuring:
            self.errors[what] += 1


def build(model: type[M], **fields: Any) -> M:
    """model(**fields) minus the fields the model does not (or no longer) declare.

    The status models evolve; the bench keeps running when a field is renamed or dropped and
    still fails loudly (ValidationError) when a new required field appears.
    """
    return model(**{k: v for k, v in fields.items() if k in model.model_fields})


def agent_record(site: str, instance: str, rng: random.Random, lease_id: int) -> AgentRecord:
    """The agent lock's record of a simulated site's agent (a made-up URL: never called)."""
    return AgentRecord(
        site=site,
        instance=instance,
        pid=os.getpid(),
        host=socket.gethostname(),
        started_at=time.time(),
        url=f"http://127.0.0.1:{20000 + rng.randrange(20000)}",
        lease_id=lease_id,
    )


def make_registry(url: str, *, local_subchannels: bool) -> Registry:
    reg = Registry.from_urls(url)
    if local_subchannels:
        # gRPC shares one TCP connection between channels to the same target by default; a
        # private subchannel pool gives each client its own connection, as separate agent
        # processes would have.
        reg._conn.client._options = {"grpc.use_local_subchannel_pool": 1}
    return reg


def agents_summary(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """What the agents' process (`live_federation.py agents`) reported in its JSON lines, one a
    second: rates per second, the publish calls' p50/p99, the schedule lag's p99, errors."""
    publish_ms = [x for line in lines for x in line.get("publish_ms", ())]
    lag_ms = [x for line in lines for x in line.get("lag_ms", ())]
    errors: Counter[str] = Counter()
    for line in lines:
        errors.update(line.get("errors", {}))
        errors.update(line.get("crashed", {}))
    seconds = len(lines) or 1
    return {
        "publishes_per_s": sum(line.get("publishes", 0) for line in lines) / seconds,
        "skipped_per_s": sum(line.get("skipped", 0) for line in lines) / seconds,
        "keepalives_per_s": sum(line.get("keepalives", 0) for line in lines) / seconds,
        "publish_call_ms": {"p50": percentile(publish_ms, 50), "p99": percentile(publish_ms, 99)},
        "schedule_lag_p99_ms": percentile(lag_ms, 99),
        "errors": dict(errors),
    }
