"""The usage ledger's unit: one `Segment` per run (one attempt of a job at one site). Pure.

The broker closes a segment in the very transaction that ends the run (the job record's
guarded write, broker.state.store / broker.leader.actions), at
/cpn/v1/usage/segments/<day>/<job>/<attempt>
(sites.model.keys.usage_segment). A run ends once per (job, attempt): the transaction that ends it
is guarded on the job record's revision, so a second writer (a retried action, a new leader)
finds the run already over and writes nothing; and the key is the run's own, so even a
repeated put replaces, never adds. docs/metering.md has the long form.

    seconds     end - start, both read on ONE clock (`clock`): the site's, when the site
                reported both (Report.started_at and its finished_at, or its last_seen for a
                lost site: a site's clock that runs ahead or behind bills its run's length all
                the same), else the broker's (its `running` event, the withdrawal); never
                less than 0 nor more than the broker has seen pass since it placed the run
    *_s         billed resource-seconds: the run's request (its share of the site) x seconds;
                for cores and memory the scheduler's measured use when it is larger
                (OpenCost's max(request, usage)); devices are held whole
    *_usd       resource-hours x the site's list price recorded in `prices`
    energy_kwh  `energy_method`: "measured" (Report.usage energy_j: the site's scheduler, e.g.
                Slurm's sacct), "gpu-measured" (NVML: the average power the agent read on the
                job's own devices x its time, the CPUs from the catalog) or "catalog" (catalog
                power_w x utilization, measured or 1.0), x the site's PUE
    co2_kg      energy_kwh x the site's grid intensity (power.grid_kgco2_per_kwh)

A segment of kind "egress" bills data moved between sites and nothing else (`egress_segment`):
the bytes a run pulled for its inputs or checkpoint (its report's `egress`), or a replication
pulled for a dataset (the replica record's), each source's bytes at that source's
usd_per_gb_egress when it is in another region than the site that pulled, free within one.
Its key is its own (the run's with ".egress" after the job, or the replication's), so it is
billed once, beside the run's segment, and summed into the same egress_gb and egress_usd.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sites.model import keys
from sites.model.catalog import DeviceCatalog
from sites.model.spec import Power, SiteSpec
from sites.model.spec import Prices as SitePrices
from sites.model.status import PriceHistory

__all__ = [
    "EndReason",
    "Run",
    "TimeSource",
    "Segment",
    "close",
    "day_of",
    "egress_segment",
    "segment_key",
]

_HOUR = 3600.0
_J_PER_KWH = 3.6e6


class TimeSource(enum.StrEnum):
    """Whose clock a time was read on: a run's length is the difference of two of one source."""

    site = "site"  # the site's agent (a report's started_at, finished_at; its last_seen)
    broker = "broker"  # the broker that wrote it (an event's `at`, the write's now)


class EndReason(enum.StrEnum):
    succeeded = "succeeded"  # the site reported exit 0
    failed = "failed"  # the site reported a non-zero exit
    out_of_memory = "out_of_memory"  # the site's kernel killed it over its memory limit
    stopped = "stopped"  # the site reported the run stopped
    withdrawn = "withdrawn"  # the broker took the assignment back: cancel, suspend, gang, spec
    site_lost = "site_lost"  # the site's lease expired: ended when it was last seen
    preempted = "preempted"  # the broker stopped it to make room for another job


@dataclass(frozen=True, slots=True)
class Run:
    """What the broker knows of a run when it ends (built from the job record and report)."""

    job: str
    tenant: str
    attempt: int
    fence: int
    site: str
    model: str | None
    gpus: int
    cpu: int
    mem_gb: float
    started_at: float | None  # Report.started_at: the site's clock (None: not reported)
    egress_gb: float = 0.0
    egress_usd: float = 0.0  # as priced at placement (Placement.egress_usd)
    measured: dict[str, float] | None = None  # Report.usage: the site scheduler's accounting
    best_effort: bool = False  # ran as best-effort work (on spare, oversubscribed capacity)
    utilization: float | None = None  # device utilization 0..1 over the run, when known
    running_since: float | None = None  # the broker's clock: its "running" event of the run
    placed_at: float | None = None  # the broker's clock: when it placed this attempt
    share: float | None = None  # a share of one device (gpus 1): the part billed and counted

    @property
    def devices(self) -> float:
        """The devices billed: a share's part of one, else `gpus`."""
        return self.share if self.share is not None else float(self.gpus)


class Prices(BaseModel):
    """The list prices a segment was billed at (the site spec's, when the run ended)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    usd_per_gpu_hour: float = 0.0
    usd_per_core_hour: float = 0.0
    usd_per_gb_mem_hour: float = 0.0
    usd_per_gb_egress: float = 0.0
    pue: float = 1.0
    grid_kgco2_per_kwh: float = 0.0


class PricePeriod(BaseModel):
    """A part of a run billed at one set of prices (a segment spanning a price change)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    start: float
    end: float
    prices: Prices


class Segment(BaseModel):
    """One run's metered use: /cpn/v1/usage/segments/<day>/<job>/<attempt>."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    job: str
    tenant: str
    attempt: int
    fence: int
    site: str
    model: str | None = Field(default=None, description="accelerator model, None: CPU-only")
    gpus: int
    cpu: int
    mem_gb: float
    start: float = Field(description="unix s: the site reported the run running")
    end: float = Field(description="unix s: finished, withdrawn, or the lost site last seen")
    reason: EndReason
    best_effort: bool = Field(default=False, description="best-effort work: billed as such")
    seconds: float
    gpu_s: float = Field(description="device-seconds billed (gpus x seconds)")
    cpu_core_s: float = Field(description="core-seconds billed: max(request, measured)")
    mem_gb_s: float = Field(description="GB-seconds billed: max(request, measured)")
    measured: dict[str, float] | None = Field(
        default=None, description="what the site's scheduler accounted (Report.usage)"
    )
    prices: Prices
    price_periods: tuple[PricePeriod, ...] | None = Field(
        default=None, description="when prices changed during the run: each part's prices"
    )
    gpu_usd: float
    cpu_usd: float
    mem_usd: float
    egress_gb: float
    egress_usd: float
    total_usd: float
    energy_kwh: float
    energy_method: Literal["measured", "gpu-measured", "catalog"]
    co2_kg: float
    recorded_at: float
    clock: TimeSource | None = Field(
        default=None,
        description="whose clock start and end were read on: the site's (both reported by "
        "it) or the broker's; None: written before segments said (start the site's, end "
        "clamped to the broker's)",
    )
    kind: Literal["run", "egress"] = Field(
        default="run", description="run: a run's use; egress: data moved for it, billed alone"
    )

    @property
    def day(self) -> str:
        return day_of(self.end)

    @property
    def key(self) -> str:
        return segment_key(self.day, self.job, self.attempt)


def day_of(t: float) -> str:
    """The UTC date of unix time `t`, YYYY-MM-DD."""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d")


def segment_key(day: str, job: str, attempt: int) -> str:
    return keys.usage_segment(day, job, attempt)


def _prices(spec: SiteSpec | None, model: str | None) -> Prices:
    if spec is None:  # the site left before its run was closed: nothing to price it at
        return Prices()
    return _billed(spec.prices, spec.power, model)


def _billed(prices: SitePrices, power: Power, model: str | None) -> Prices:
    """A site's list prices and power figures as a segment records them for `model`."""
    return Prices(
        usd_per_gpu_hour=prices.usd_per_gpu_hour.get(model, 0.0) if model else 0.0,
        usd_per_core_hour=prices.usd_per_core_hour,
        usd_per_gb_mem_hour=prices.usd_per_gb_mem_hour,
        usd_per_gb_egress=prices.usd_per_gb_egress,
        pue=power.pue,
        grid_kgco2_per_kwh=power.grid_kgco2_per_kwh,
    )


def price_periods(
    start: float,
    end: float,
    spec: SiteSpec | None,
    history: PriceHistory | None,
    model: str | None,
) -> list[PricePeriod]:
    """[start, end] cut where the site's prices changed, each part with the prices in force
    in it (oldest first). Before the history's first change, and without a history, the
    spec's prices hold (a site joined before price histories were kept)."""
    prices = _prices(spec, model)
    cuts: list[tuple[float, Prices]] = []
    for change in history.changes if history is not None else ():
        if change.since <= start:
            prices = _billed(change.prices, change.power, model)
        elif change.since < end:
            cuts.append((change.since, _billed(change.prices, change.power, model)))
    out = []
    at = start
    for since, following in cuts:
        out.append(PricePeriod(start=at, end=since, prices=prices))
        at, prices = since, following
    out.append(PricePeriod(start=at, end=end, prices=prices))
    return out


def _watts(catalog: DeviceCatalog, model: str | None) -> float:
    if model is None or model not in catalog:
        return 0.0
    return float(catalog.get(model).power_w or 0.0)


def span(
    run: Run, *, end: float, ended_by: TimeSource, now: float
) -> tuple[float, float, TimeSource] | None:
    """(start, end, clock) of `run` ended at `end` (read on `ended_by`'s clock), both times on
    one clock; None when it never started. The site's clock when the site gave both times (a
    skewed clock bills the length it measured); else the broker's: from its `running` event
    to `end`, or to `now` when `end` is the site's (the broker's end of a run it only learned
    of). Clamped: at least 0 s, at most what the broker saw pass since it placed the run, and
    a broker end never after `now`."""
    if run.started_at is not None and ended_by is TimeSource.site:
        start, stop, clock = run.started_at, end, TimeSource.site
    elif run.running_since is not None:
        start, clock = run.running_since, TimeSource.broker
        stop = min(end, now) if ended_by is TimeSource.broker else now
    elif run.started_at is not None:
        # reported running but the broker had not yet seen it, then ended by the broker (a
        # cancel between the two): the site's start, no earlier than the placement
        start, clock = run.started_at, TimeSource.broker
        if run.placed_at is not None:
            start = max(start, run.placed_at)
        stop = min(end, now)
        start = min(start, stop)
    else:
        return None
    seconds = max(0.0, stop - start)
    if run.placed_at is not None:  # no run is longer than the broker saw pass since placing it
        seconds = min(seconds, max(0.0, now - run.placed_at))
    return start, start + seconds, clock


def close(
    run: Run,
    *,
    end: float,
    reason: EndReason,
    spec: SiteSpec | None,
    catalog: DeviceCatalog,
    now: float,
    history: PriceHistory | None = None,
    ended_by: TimeSource = TimeSource.site,
) -> Segment | None:
    """The segment of `run` ended at `end` (read on `ended_by`'s clock: `span`); None when it
    never started (nothing was held). With the site's price `history`, each part of the run
    is billed at the prices then in force (`price_periods`); without, at the spec's."""
    timed = span(run, end=end, ended_by=ended_by, now=now)
    if timed is None:
        return None
    start, end, clock = timed
    seconds = end - start
    measured = dict(run.measured) if run.measured else None
    gpu_s = run.devices * seconds
    cpu_core_s = max(run.cpu * seconds, (measured or {}).get("cpu_core_s", 0.0))
    mem_gb_s = max(run.mem_gb * seconds, (measured or {}).get("mem_gb_s", 0.0))
    periods = price_periods(start, end, spec, history, run.model)
    prices = periods[-1].prices  # in force at the end: egress, PUE and grid intensity
    gpu_usd = cpu_usd = mem_usd = 0.0
    for period in periods:  # each part of the run at the prices then in force
        part = (period.end - period.start) / seconds if seconds > 0 else 1.0
        gpu_usd += gpu_s * part / _HOUR * period.prices.usd_per_gpu_hour
        cpu_usd += cpu_core_s * part / _HOUR * period.prices.usd_per_core_hour
        mem_usd += mem_gb_s * part / _HOUR * period.prices.usd_per_gb_mem_hour
    cpu_joules = run.cpu * _watts(catalog, catalog.cpu_reference) * seconds
    if measured is not None and "energy_j" in measured:  # the site's scheduler, whole job
        method: Literal["measured", "gpu-measured", "catalog"] = "measured"
        it_joules = measured["energy_j"]
    elif measured is not None and "gpu_energy_j" in measured and measured.get("gpu_metered_s"):
        # NVML's power of the job's own devices, averaged over the part of the run it was
        # read for (one reading each publish interval) and held for the whole run; the CPUs
        # from the catalog
        method = "gpu-measured"
        watts = measured["gpu_energy_j"] / measured["gpu_metered_s"]
        it_joules = watts * seconds + cpu_joules
    else:
        method = "catalog"
        utilization = run.utilization
        if utilization is None:
            utilization = (measured or {}).get("gpu_util_ratio", 1.0)
        it_joules = run.devices * _watts(catalog, run.model) * utilization * seconds + cpu_joules
    energy_kwh = it_joules * prices.pue / _J_PER_KWH
    return Segment(
        job=run.job,
        tenant=run.tenant,
        attempt=run.attempt,
        fence=run.fence,
        site=run.site,
        model=run.model,
        gpus=run.gpus,
        cpu=run.cpu,
        mem_gb=run.mem_gb,
        start=start,
        end=end,
        reason=reason,
        best_effort=run.best_effort,
        seconds=seconds,
        gpu_s=gpu_s,
        cpu_core_s=cpu_core_s,
        mem_gb_s=mem_gb_s,
        measured=measured,
        prices=prices,
        price_periods=tuple(periods) if len(periods) > 1 else None,
        gpu_usd=gpu_usd,
        cpu_usd=cpu_usd,
        mem_usd=mem_usd,
        egress_gb=run.egress_gb,
        egress_usd=run.egress_usd,
        total_usd=gpu_usd + cpu_usd + mem_usd + run.egress_usd,
        energy_kwh=energy_kwh,
        energy_method=method,
        co2_kg=energy_kwh * prices.grid_kgco2_per_kwh,
        recorded_at=now,
        clock=clock,
    )


_GB = 1e9


@dataclass(frozen=True, slots=True)
class Moved:
    """Bytes pulled from `source` (in `source_region`) into a site in another or the same region,
    at the source's `usd_per_gb` (sites.model.data.Egress with its site's terms)."""

    source: str
    bytes: int
    same_region: bool
    usd_per_gb: float


def egress_segment(
    *,
    job: str,
    attempt: int,
    tenant: str,
    site: str,
    moved: list[Moved],
    at: float,
    now: float,
) -> Segment | None:
    """The egress segment of what `site` pulled for `tenant` (None when nothing moved): data
    from another region at its source's rate, free within one."""
    if not moved or not any(m.bytes for m in moved):
        return None
    gb = sum(m.bytes for m in moved if not m.same_region) / _GB
    usd = sum(m.bytes / _GB * m.usd_per_gb for m in moved if not m.same_region)
    rates = {m.usd_per_gb for m in moved if not m.same_region}
    return Segment(
        job=job,
        tenant=tenant,
        attempt=attempt,
        fence=0,
        site=site,
        model=None,
        gpus=0,
        cpu=0,
        mem_gb=0.0,
        start=at,
        end=at,
        reason=EndReason.succeeded,
        seconds=0.0,
        gpu_s=0.0,
        cpu_core_s=0.0,
        mem_gb_s=0.0,
        measured={f"bytes_from:{m.source}": float(m.bytes) for m in moved},
        prices=Prices(usd_per_gb_egress=rates.pop() if len(rates) == 1 else 0.0),
        gpu_usd=0.0,
        cpu_usd=0.0,
        mem_usd=0.0,
        egress_gb=gb,
        egress_usd=usd,
        total_usd=usd,
        energy_kwh=0.0,
        energy_method="catalog",
        co2_kg=0.0,
        recorded_at=now,
        kind="egress",
    )


def puts(segment: Segment | None) -> dict[str, bytes]:
    """What the run-ending transaction writes for `segment` (nothing for None)."""
    if segment is None:
        return {}
    return {segment.key: segment.model_dump_json(exclude_none=True).encode()}
