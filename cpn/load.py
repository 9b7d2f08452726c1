"""`cpn load`'s engine: open-loop inference load whose daily curve moves across client regions
(docs/load.md).

Each client region sends Poisson arrivals whose rate follows the day of
simulations.service_demand.DailyDemand, the very curve the autoscaling simulator draws its
demand from: a cosine peaking at `peak_local_hour` of the region's own time zone, `peak_rps` at
the top, `peak_rps / peak_to_trough` at the bottom. The day is compressed: one virtual day takes
`day_s` wall seconds, so `day_s=600` plays 24 h in 10 minutes and the peak walks west with the
sun through the regions. The rate is in wall time (what the gateway really receives); only the
hour of the day it is read at moves faster.

Arrivals come from thinning (Lewis and Shedler): candidates at the highest rate, each kept with
probability rate(t) / highest, which is exactly a Poisson process of rate(t). Open loop: a
request is sent at its time whether or not the earlier ones have been answered (at most
`max_in_flight` at once; beyond that it counts as an error, `client: too many in flight`).

Every request goes through the broker's gateway, POST /v1/infer/<service>/v1/completions with
`X-Cpn-Client-Region`. Its time to first token is the time to the answer's first body byte: with
`stream` the first server-sent event, without it the whole (one-piece) answer. SLO attainment is
the share of the requests sent that were answered (2xx) within the service's SLO for the region
(Slo.for_region: its p95 figure, per request): errors count as misses.

`arrival_times` and `RegionStats` are pure; `run_load` is the shell that sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import math
import random
import ssl
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from simulations.service_demand import DailyDemand

__all__ = [
    "DAY_S",
    "LoadError",
    "LoadReport",
    "LoadSettings",
    "LoadWindow",
    "RegionStats",
    "arrival_times",
    "quantile",
    "run_load",
]

DAY_S = 86_400.0
REGION_HEADER = "X-Cpn-Client-Region"


class LoadError(ValueError):
    """Settings `cpn load` cannot run with (the CLI exits 2 with this one line)."""


@dataclass(frozen=True, kw_only=True)
class LoadSettings:
    """What to send: `peak_rps` per region at its local peak, a virtual day in `day_s` wall
    seconds starting at `start_hour_utc`, for `duration_s` wall seconds. Built with no
    regions it checks the numbers only (the CLI does so before it asks the broker)."""

    service: str
    regions: tuple[str, ...]
    utc_offset_h: Mapping[str, float]  # region -> hours ahead of UTC
    slo_ms: Mapping[str, float]  # region -> the service's TTFT SLO there, ms
    peak_rps: float = 10.0  # requests/s of one region at its local peak (wall time)
    day_s: float = 600.0  # wall seconds one virtual day of 24 h takes
    duration_s: float = 600.0  # wall seconds to send for
    start_hour_utc: float = 0.0  # the virtual UTC hour at the start
    peak_local_hour: float = 20.0
    peak_to_trough: float = 4.0
    stream: bool = False
    max_tokens: int = 8
    prompt: str = "Hello"
    timeout_s: float = 60.0  # one request, to its last byte
    max_in_flight: int = 2_000
    report_s: float = 10.0  # wall seconds between progress lines (windows)
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = (
            (self.peak_rps > 0 and math.isfinite(self.peak_rps), "--peak-rps", "must be > 0"),
            (self.day_s > 0 and math.isfinite(self.day_s), "--day", "must be > 0"),
            (self.duration_s > 0 and math.isfinite(self.duration_s), "--duration", "must be > 0"),
            (0 <= self.start_hour_utc < 24, "--start-hour", "must be in [0, 24)"),
            (0 <= self.peak_local_hour <= 24, "--peak-hour", "must be in [0, 24]"),
            (1 <= self.peak_to_trough <= 1_000, "--peak-to-trough", "must be in [1, 1000]"),
            (self.timeout_s > 0, "--timeout", "must be > 0"),
            (self.max_in_flight >= 1, "--max-in-flight", "must be >= 1"),
            (self.report_s > 0, "--every", "must be > 0"),
            (1 <= self.max_tokens <= 4_096, "--max-tokens", "must be in [1, 4096]"),
        )
        for ok, option, message in checks:
            if not ok:
                raise LoadError(f"{option}: {message}")
        missing = [r for r in self.regions if r not in self.utc_offset_h]
        if missing:
            raise LoadError(
                f"--utc-offset: no UTC offset known for client region {missing[0]!r} "
                f"(not in regions.yaml): give --utc-offset {missing[0]}=HOURS"
            )

    @property
    def demand(self) -> DailyDemand:
        """The daily curve: every region peaking at `peak_rps`."""
        return DailyDemand.from_peak(
            dict.fromkeys(self.regions, self.peak_rps),
            peak_local_hour=self.peak_local_hour,
            peak_to_trough=self.peak_to_trough,
            utc_offset_h=dict(self.utc_offset_h),
        )

    def virtual_s(self, wall_s: float) -> float:
        """Virtual seconds since 00:00 UTC of day 0 at `wall_s` after the start."""
        return self.start_hour_utc * 3600.0 + wall_s * DAY_S / self.day_s

    def rate_per_s(self, region: str, wall_s: float) -> float:
        """Requests/s `region` sends at `wall_s` after the start."""
        return self.demand.rate_per_s(region, self.virtual_s(wall_s), self.utc_offset_h[region])


def arrival_times(settings: LoadSettings, region: str, rng: random.Random) -> Iterator[float]:
    """`region`'s send times, wall seconds after the start, up to `duration_s` (thinning)."""
    demand = settings.demand
    top = demand.peak_rate_per_s(region)
    if top <= 0:
        return
    t = 0.0
    while True:
        t += rng.expovariate(top)
        if t >= settings.duration_s:
            return
        if rng.random() * top <= settings.rate_per_s(region, t):
            yield t


def quantile(ordered: Sequence[float], q: float) -> float | None:
    """The q-quantile of sorted values (nearest rank); None for none."""
    if not ordered:
        return None
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass
class RegionStats:
    """One client region's requests: counts, and the TTFT (ms) of each answered one."""

    region: str
    slo_ms: float
    sent: int = 0
    ok: int = 0
    errors: int = 0
    within_slo: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    error_kinds: dict[str, int] = field(default_factory=dict)

    def answered(self, ttft_ms: float) -> None:
        self.ok += 1
        self.ttft_ms.append(ttft_ms)
        if ttft_ms <= self.slo_ms:
            self.within_slo += 1

    def failed(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1

    def percentile_ms(self, q: float) -> float | None:
        return quantile(sorted(self.ttft_ms), q)

    @property
    def attainment(self) -> float | None:
        """Share of the finished requests answered within the SLO (None: none finished)."""
        done = self.ok + self.errors
        return self.within_slo / done if done else None


ERROR_BODY_BYTES = 4_096  # of an error answer, read for its code and message


def _error_words(body: bytes) -> str:
    """' no_capacity: no site can take ...' from the gateway's JSON error body (its code and the
    message's first words), so that the report tells apart why requests failed; '' if none."""
    try:
        error = json.loads(body)["error"]
        code, message = str(error["code"]), str(error.get("message") or "")
    except (ValueError, KeyError, TypeError):
        return ""
    words = message if len(message) <= 60 else message[:57] + "..."
    return f" {code}: {words}" if words else f" {code}"


@dataclass(frozen=True)
class LoadWindow:
    """One progress period: what each region sent and got in it."""

    start_s: float  # wall seconds after the start
    end_s: float
    virtual_hour_utc: float  # at the window's middle
    sent: dict[str, int]
    ok: dict[str, int]
    errors: dict[str, int]
    target_rps: dict[str, float]  # the curve's rate at the window's middle
    p95_ms: dict[str, float | None]


@dataclass
class LoadReport:
    settings: LoadSettings
    regions: dict[str, RegionStats]
    windows: list[LoadWindow] = field(default_factory=list)
    elapsed_s: float = 0.0


class _Window:
    def __init__(self, regions: Sequence[str], start_s: float) -> None:
        self.start_s = start_s
        self.sent = dict.fromkeys(regions, 0)
        self.ok = dict.fromkeys(regions, 0)
        self.errors = dict.fromkeys(regions, 0)
        self.ttft: dict[str, list[float]] = {r: [] for r in regions}

    def close(self, settings: LoadSettings, end_s: float) -> LoadWindow:
        middle = (self.start_s + end_s) / 2
        return LoadWindow(
            start_s=self.start_s,
            end_s=end_s,
            virtual_hour_utc=(settings.virtual_s(middle) / 3600.0) % 24.0,
            sent=dict(self.sent),
            ok=dict(self.ok),
            errors=dict(self.errors),
            target_rps={r: settings.rate_per_s(r, middle) for r in self.sent},
            p95_ms={r: quantile(sorted(v), 0.95) for r, v in self.ttft.items()},
        )


@dataclass
class _Run:
    settings: LoadSettings
    session: aiohttp.ClientSession
    url: str
    report: LoadReport
    window: _Window
    in_flight: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def one(self, region: str) -> None:
        stats = self.report.regions[region]
        body: dict[str, object] = {
            "prompt": self.settings.prompt,
            "max_tokens": self.settings.max_tokens,
        }
        if self.settings.stream:
            body["stream"] = True
        started = time.perf_counter()
        try:
            async with self.session.post(
                self.url, json=body, headers={REGION_HEADER: region}
            ) as resp:
                first: float | None = None
                head = b""
                async for chunk in resp.content.iter_any():
                    if first is None:
                        first = time.perf_counter()
                    if resp.status >= 300 and len(head) < ERROR_BODY_BYTES:
                        head += chunk
                if resp.status >= 300:
                    kind = f"HTTP {resp.status}{_error_words(head)}"
                elif first is None:
                    kind = "empty answer"
                else:
                    ttft_ms = (first - started) * 1000.0
                    stats.answered(ttft_ms)
                    # counted in the period it finished in, as a periodic line reads it
                    self.window.ok[region] = self.window.ok.get(region, 0) + 1
                    self.window.ttft.setdefault(region, []).append(ttft_ms)
                    return
        except TimeoutError:
            kind = "timeout"
        except aiohttp.ClientError as exc:
            kind = type(exc).__name__
        finally:
            self.in_flight -= 1
        stats.failed(kind)
        self.window.errors[region] = self.window.errors.get(region, 0) + 1

    def send(self, region: str) -> None:
        stats = self.report.regions[region]
        stats.sent += 1
        self.window.sent[region] = self.window.sent.get(region, 0) + 1
        if self.in_flight >= self.settings.max_in_flight:
            stats.failed("client: too many in flight")
            self.window.errors[region] = self.window.errors.get(region, 0) + 1
            return
        self.in_flight += 1
        task = asyncio.create_task(self.one(region), name=f"cpn-load-{region}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


def _schedule(settings: LoadSettings) -> Iterator[tuple[float, str]]:
    """Every region's arrivals, merged in time order, drawn as they are sent (a long run at a
    high rate holds no list of them); seeded when `seed` is given."""
    rng = random.Random(settings.seed)

    def labelled(region: str, own: random.Random) -> Iterator[tuple[float, str]]:
        for t in arrival_times(settings, region, own):
            yield t, region

    return heapq.merge(*(labelled(r, random.Random(rng.getrandbits(64))) for r in settings.regions))


STOP_GRACE_S = 5.0  # after a stop, the requests in flight get this long to finish
_NAP_S = 0.25  # the longest sleep between two looks at the stop event


async def run_load(
    settings: LoadSettings,
    *,
    broker_url: str,
    token: str | None = None,
    ssl_context: ssl.SSLContext | bool = True,
    on_window: Callable[[LoadWindow, LoadReport], None] | None = None,
    stop: asyncio.Event | None = None,
) -> LoadReport:
    """Send `settings`' load through the gateway of the broker at `broker_url`; the report
    once every request has finished (or timed out). `on_window` sees each progress period.
    Once `stop` is set (the CLI's Ctrl-C) nothing more is sent, the requests in flight get
    STOP_GRACE_S, and the report covers what was sent until then."""
    if not settings.regions:
        raise LoadError("--regions: give at least one client region")
    report = LoadReport(
        settings=settings,
        regions={r: RegionStats(r, settings.slo_ms.get(r, math.inf)) for r in settings.regions},
    )
    url = f"{broker_url.rstrip('/')}/v1/infer/{settings.service}/v1/completions"
    headers = {"Authorization": f"Bearer {token}"} if token else None
    schedule = _schedule(settings)
    connector = aiohttp.TCPConnector(ssl=ssl_context, limit=settings.max_in_flight)
    timeout = aiohttp.ClientTimeout(total=settings.timeout_s, sock_connect=5)
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(
        headers=headers, connector=connector, timeout=timeout
    ) as session:
        run = _Run(settings, session, url, report, _Window(settings.regions, 0.0))
        started = loop.time()

        def roll(now_s: float) -> None:
            closed = run.window.close(settings, now_s)
            report.windows.append(closed)
            run.window = _Window(settings.regions, now_s)
            if on_window is not None:
                on_window(closed, report)

        stopped = stop or asyncio.Event()

        async def until(wall_s: float) -> bool:
            """Sleep to `wall_s` after the start; False once stopped."""
            while not stopped.is_set():
                left = started + wall_s - loop.time()
                if left <= 0:
                    return True
                await asyncio.sleep(min(left, _NAP_S))
            return False

        next_report = settings.report_s
        try:
            for at, region in schedule:
                while at >= next_report and await until(next_report):
                    roll(next_report)
                    next_report += settings.report_s
                if not await until(at):
                    break
                run.send(region)
            while next_report < settings.duration_s and await until(next_report):
                roll(next_report)
                next_report += settings.report_s
            if await until(settings.duration_s):
                if run.tasks:
                    await asyncio.gather(*list(run.tasks))
            elif run.tasks:
                await asyncio.wait(list(run.tasks), timeout=STOP_GRACE_S)
            roll(max(next_report - settings.report_s, loop.time() - started))
        finally:
            for task in list(run.tasks):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*list(run.tasks), return_exceptions=True)
        report.elapsed_s = loop.time() - started
    return report
