"""One emulated site agent for bench/agent_emulator.py: its documents and its Txn, cheaply.

A site's JSON documents (SiteStatus, LastSeen, LinkStatus per peer, ServiceEndpoint) are
dumped once through pydantic with sentinel numbers and turned into %-format templates; a
publish fills in figures drawn as integers (in units of the last decimal SimAgent rounds to,
pre-rendered as strings) and assembles Registry.publish's TxnRequest as protobuf bytes by
hand.

What a publish writes is what sites.agent.process.Agent.publish_once writes (sites.agent.drift):
each
interval the site measures; with probability `churn` its allocation changed (new usage
figures, so its free capacity differs), otherwise it keeps the figures it had (its status
differs only in seq and published_at: not written). The status (and last_seen) is written when
sites.agent.drift.status_changed says so against the status last written, each link when
link_changed does against the link last written to that peer (the RTT floor is fixed, the
median moves 0-2 ms above it), the endpoint of a serving site every time, and all of them
every `refresh_s` (each site's first refresh at a random phase, so refreshes spread). A
publish with nothing to write sends no Txn; `seq` counts the statuses written. Both rules are
implemented on the integer figures and checked against sites.agent.drift at setup.

`EmulatedSite.check()` renders a full publish and a partial one (no status, one link, the
endpoint if serving) both ways, the JSON against pydantic's model_dump_json (what
sites.registry.lifecycle._encode writes) and the TxnRequest against aetcd's own message builders in
Registry.publish's shape, and raises EmulatorMismatch unless they are the same bytes.
"""

from __future__ import annotations

import random
import re
import time
import uuid
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import aetcd.transactions
from aetcd import rpc
from benchkit import agent_record, build
from pydantic import BaseModel

from sites.agent.drift import (
    HOST_CPU_PCT,
    HOST_LOAD_PER_CORE,
    HOST_MEM_REL,
    link_changed,
    rtt_tolerance,
    status_changed,
)
from sites.model import keys
from sites.model.capacity import Capacity, normalize, normalize_inventory
from sites.model.catalog import DeviceCatalog
from sites.model.spec import SiteSpec
from sites.model.status import (
    AgentRecord,
    HostUsage,
    LastSeen,
    LinkStatus,
    ServiceEndpoint,
    SiteStatus,
    StorageUsage,
)


class EmulatorMismatch(ValueError):
    """A rendered value or request differs from what pydantic and aetcd produce."""


# -- protobuf, by hand -------------------------------------------------------------------------


def varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def put_op(key_field: bytes, value: bytes, lease_field: bytes) -> bytes:
    """TxnRequest.success entry: RequestOp{request_put: PutRequest{key, value, lease}}.

    key_field is PutRequest field 1 already encoded, lease_field field 3 (b"" for no lease);
    fields go out in number order, as protobuf serializes them."""
    put = key_field + b"\x12" + varint(len(value)) + value + lease_field
    op = b"\x12" + varint(len(put)) + put
    return b"\x12" + varint(len(op)) + op


def key_field(key: str) -> bytes:
    raw = key.encode()
    return b"\x0a" + varint(len(raw)) + raw


def lease_field(lease_id: int) -> bytes:
    return b"\x18" + varint(lease_id) if lease_id else b""


# -- templates ---------------------------------------------------------------------------------

INT_SENTINEL = 900_000_000
FLOAT_SENTINEL = 800_000_000.5


def si(i: int) -> int:
    return INT_SENTINEL + i


def sf(i: int) -> float:
    return FLOAT_SENTINEL + i


class Template:
    """A model's JSON with holes: dumped once with sentinel numbers (si(i), sf(i)), each
    sentinel becoming a %s in the order `holes` names them (which must be the dump's order)."""

    def __init__(self, model: BaseModel, holes: Sequence[int | float]) -> None:
        text = model.model_dump_json().replace("%", "%%")
        at = -1
        for sentinel in holes:
            pattern = re.compile(rf"(?<![\d.]){re.escape(str(sentinel))}(?![\d.])")
            found = list(pattern.finditer(text))
            if len(found) != 1 or found[0].start() < at:
                raise EmulatorMismatch(
                    f"{type(model).__name__}: sentinel {sentinel} found {len(found)} times or "
                    "out of order (did the model change?)"
                )
            at = found[0].start()
            text = pattern.sub("%s", text)
        self.fmt = text

    def render(self, values: tuple[str, ...]) -> bytes:
        return (self.fmt % values).encode()


def _table(n: int, scale: int) -> list[str]:
    """repr(k / scale) for k in 0..n: how pydantic writes round(x, log10(scale))."""
    return [repr(k / scale) for k in range(n + 1)]


TENTHS = _table(1000, 10)  # cpu_util_pct, mem_used_gb, latency_ms
HUNDREDTHS = _table(800, 100)  # load_1m
THOUSANDTHS = _table(1000, 1000)  # jitter_ms
SMALL_INTS = [str(k) for k in range(9)]  # in_flight


class FreeTables:
    """A capacity's free figures as strings, per amount used: the accelerator part per busy
    device (through the catalog, as SimAgent's normalize and Capacity.minus compute them), the
    CPU part per core used, memory per 0.1 GB and storage per 0.01 TB used."""

    def __init__(self, cap: Capacity, catalog: DeviceCatalog) -> None:
        if len(cap.devices) != 1:
            raise ValueError("the emulator's sites declare exactly one device model")
        ((self.model, total),) = cap.devices.items()
        self.gpu: list[tuple[str, ...]] = []
        for busy in range(total + 1):
            used = normalize(
                devices={self.model: busy}, cpu_cores=0, mem_gb=0, storage_tb=0, catalog=catalog
            )
            free = cap.minus(used)
            self.gpu.append(
                (
                    str(free.devices[self.model]),
                    repr(free.fp64_tflops),
                    repr(free.fp32_tflops),
                    repr(free.fp16_tflops),
                    repr(free.int8_tops),
                    repr(free.accel_mem_gb),
                )
            )
        self.cpu: list[tuple[str, str]] = []
        for cores in range(cap.cpu_cores + 1):
            used = normalize(devices={}, cpu_cores=cores, mem_gb=0, storage_tb=0, catalog=catalog)
            free = cap.minus(used)
            self.cpu.append((str(free.cpu_cores), repr(free.cpu_fp64_tflops)))
        # Capacity.minus: round(max(0, total - used), 6) (sites.model.catalog.round_figure)
        mem_n, sto_n = int(cap.mem_gb * 10), int(cap.storage_tb * 100)
        self.mem = [repr(round(max(0.0, cap.mem_gb - k / 10), 6)) for k in range(mem_n + 1)]
        self.storage = [
            repr(round(max(0.0, cap.storage_tb - k / 100), 6)) for k in range(sto_n + 1)
        ]
        self.storage_used = _table(sto_n, 100)
        # EmulatedSite.status_moved reads "the free capacity differs" as "a usage index differs"
        if not (_distinct(self.gpu) and _distinct(self.cpu) and _distinct(self.mem)):
            raise EmulatorMismatch("two usage figures give the same free capacity")
        if not _distinct(self.storage):
            raise EmulatorMismatch("two storage figures give the same free capacity")

    _cache: dict[str, FreeTables] = {}

    @classmethod
    def of(cls, cap: Capacity, catalog: DeviceCatalog) -> FreeTables:
        key = cap.model_dump_json()
        if key not in cls._cache:
            cls._cache[key] = cls(cap, catalog)
        return cls._cache[key]


def _distinct(items: Sequence[Hashable]) -> bool:
    return len(set(items)) == len(items)


# -- one emulated site -------------------------------------------------------------------------


@dataclass(frozen=True)
class SitePlan:
    """What the bench decides for a site: its spec, the peers it probes, what it serves."""

    spec: SiteSpec
    peers: tuple[str, ...]
    serves: str | None
    seed: int


Usage = tuple[int, int, int, int, int, int, int]
"""A status's usage figures, as integers (units of the last decimal SimAgent rounds to): busy
devices, cores used, memory used (0.1 GB), storage used (0.01 TB), then the host's
cpu_util_pct (0.1), mem_used_gb (0.1) and load_1m (0.01)."""

LinkDraw = tuple[int, int, int]
"""One link's measurement: (peer index, median above the RTT floor in us, jitter in us)."""

Endpoint = tuple[int, int]
"""A serving site's endpoint load: (in_flight, latency_ms in 0.1 ms)."""

HOST_CORES, HOST_MEM_GB = 8, 32.0  # SimAgent's host (HostUsage.cpu_cores, mem_gb)


@dataclass(frozen=True, slots=True)
class Publish:
    """What one publish writes, in Registry.publish's order: the status and last_seen (when
    `status` is not None), the links listed, the endpoint (when not None). `refresh`: it writes
    everything, as the agent does every refresh_s; `due`: its loop time."""

    status: Usage | None
    links: tuple[LinkDraw, ...]
    endpoint: Endpoint | None
    refresh: bool
    due: float

    @property
    def puts(self) -> int:
        return 2 * (self.status is not None) + len(self.links) + (self.endpoint is not None)


def status_moved(old: Usage, new: Usage) -> bool:
    """sites.agent.drift.status_changed(old, new) for two statuses of a site that differ only in
    these
    figures (and seq, published_at): capacity, free and storage differ exactly when a usage
    index does (FreeTables checks that each index gives other figures); the host by drift's
    tolerances, on the very floats the documents hold."""
    if old[:4] != new[:4]:
        return True
    if abs(old[4] / 10 - new[4] / 10) > HOST_CPU_PCT:
        return True
    if abs(old[5] / 10 - new[5] / 10) > HOST_MEM_REL * HOST_MEM_GB:
        return True
    return abs(old[6] / 100 - new[6] / 100) > HOST_LOAD_PER_CORE * max(1, HOST_CORES)


def rtt_moved(old_ms: float, tolerance: float, new_ms: float) -> bool:
    """sites.agent.drift's test of a link's median RTT (the floor, loss, method never change
    here)."""
    return abs(new_ms - old_ms) > tolerance


class EmulatedSite:
    """A site's agent state and its pre-rendered documents; no I/O of its own."""

    def __init__(
        self,
        plan: SitePlan,
        interval_s: float,
        catalog: DeviceCatalog,
        *,
        churn: float = 0.1,
        refresh_s: float = 30.0,
    ) -> None:
        if not 0.0 <= churn <= 1.0:
            raise ValueError(f"churn {churn}: expected a fraction in [0, 1]")
        if refresh_s < 0:
            raise ValueError(f"refresh_s {refresh_s}: expected >= 0")
        spec = plan.spec
        self.id = spec.id
        self.plan = plan
        self.interval_s = interval_s
        self.catalog = catalog
        self.churn = churn
        self.refresh_s = refresh_s
        self.rng = random.Random(plan.seed)
        self.instance = uuid.uuid4().hex[:12]
        self.capacity = normalize_inventory(spec.inventory, catalog)
        self.tables = FreeTables.of(self.capacity, catalog)
        # a link's RTT floor in us (SimAgent: uniform 2-60 ms, rounded to 3 decimals)
        self.links = [(peer, round(self.rng.uniform(2.0, 60.0) * 1000)) for peer in plan.peers]
        self.record: AgentRecord | None = None
        self.seq = 0  # statuses written under this instance (sites.agent.process)
        # what the agent measures and what the registry holds of it (Agent._written_*)
        self.usage: Usage | None = None
        self.written_status: Usage | None = None
        self.written_median: list[float | None] = [None] * len(self.links)  # ms
        self.written_tolerance: list[float] = [0.0] * len(self.links)
        self.refreshed_at: float | None = None  # loop time
        self._phased = False  # the first refresh's phase is drawn
        self.txn_busy = False
        self.owed: float | None = None  # a publish fell due while the previous was in flight
        self.ka_sent: float | None = None  # loop time of the keepalive in flight
        self.reacquiring = False
        self.publish_slot = 0
        self.keepalive_slot = 0
        self.stream = 0
        self._compare = b""
        self._lease = b""
        self.keepalive_request = b""
        self._status_key = key_field(keys.site_status(self.id))
        self._seen_key = key_field(keys.site_last_seen(self.id))
        self._link_keys = [key_field(keys.link(self.id, peer)) for peer, _ in self.links]
        self._endpoint_key = (
            key_field(keys.service_endpoint(plan.serves, self.id, None)) if plan.serves else b""
        )
        self._status_t = Template(self._status_model(*self._sentinel_status()), range_holes(16))
        self._seen_t = Template(LastSeen(at=sf(0), instance=self.instance), (sf(0),))
        self._link_t = [
            Template(self._link_model(peer, base, sf(0), sf(1), sf(2)), (sf(0), sf(1), sf(2)))
            for peer, base in self.links
        ]
        self._endpoint_t = (
            Template(self._endpoint_model(si(0), sf(1), sf(2)), (si(0), sf(1), sf(2)))
            if plan.serves
            else None
        )

    # -- the record ---------------------------------------------------------------------------

    def new_record(self, lease_id: int) -> AgentRecord:
        """As SimAgent.acquire writes it."""
        return agent_record(self.id, self.instance, self.rng, lease_id)

    def set_record(self, record: AgentRecord | None) -> None:
        self.record = record
        self.forget()  # a new lease holds none of our keys (Agent._reacquire)
        if record is None:
            return
        value = record.model_dump_json().encode()  # sites.registry.lifecycle._encode
        compares = (
            rpc.Compare(
                result=rpc.Compare.EQUAL,
                target=rpc.Compare.VALUE,
                key=keys.agent(self.id).encode(),
                value=value,
            ),
            rpc.Compare(
                result=rpc.Compare.GREATER,
                target=rpc.Compare.VERSION,
                key=keys.site_spec(self.id).encode(),
                version=0,
            ),
        )
        self._compare = b"".join(
            b"\x0a" + varint(len(raw)) + raw for raw in (c.SerializeToString() for c in compares)
        )
        self._lease = lease_field(record.lease_id)
        self.keepalive_request = b"\x08" + varint(record.lease_id)  # LeaseKeepAliveRequest{ID}

    # -- what a publish writes (Agent.publish_once) --------------------------------------------

    def forget(self) -> None:
        """The registry holds nothing of ours: the next publish writes it all."""
        self.written_status = None
        self.written_median = [None] * len(self.links)
        self.refreshed_at = None

    def next_publish(self, due: float) -> Publish | None:
        """Measure (draw) and decide what to write, as Agent.publish_once; None: nothing, no Txn.

        With probability `churn` the allocation changed (new usage figures), else the figures
        are those of the last interval; every link is measured again (a median 0-2 ms above its
        floor); the endpoint's load is drawn each time."""
        r = self.rng.random
        usage = self.usage
        if usage is None or r() < self.churn:
            usage = self.usage = self.draw_usage()
        refresh = self.refreshed_at is None or due - self.refreshed_at >= self.refresh_s
        written = self.written_status
        put_status = refresh or written is None or status_moved(written, usage)
        links: list[LinkDraw] = []
        medians, tolerances = self.written_median, self.written_tolerance
        for i, (_, base) in enumerate(self.links):
            median, jitter = int(r() * 2001), int(r() * 1001)
            old = medians[i]
            if refresh or old is None or rtt_moved(old, tolerances[i], (base + median) / 1000):
                links.append((i, median, jitter))
        endpoint = self.draw_endpoint()
        if not (put_status or links or endpoint is not None):
            return None
        return Publish(usage if put_status else None, tuple(links), endpoint, refresh, due)

    def written(self, pub: Publish) -> None:
        """The Txn of `pub` succeeded: the registry now holds what it wrote."""
        if pub.status is not None:
            self.written_status = pub.status
            self.seq += 1
        for i, median, _ in pub.links:
            old = (self.links[i][1] + median) / 1000
            self.written_median[i] = old
            self.written_tolerance[i] = rtt_tolerance(old)
        if pub.refresh:
            if self._phased:
                self.refreshed_at = pub.due
            else:  # as if the agent had started at a random time: refreshes spread over refresh_s
                self._phased = True
                self.refreshed_at = pub.due - self.rng.uniform(0.0, self.refresh_s)

    def draw_usage(self) -> Usage:
        r = self.rng.random
        t = self.tables
        return (
            int(r() * len(t.gpu)),  # busy devices
            int(r() * len(t.cpu)),  # cores used
            int(r() * len(t.mem)),  # memory used, 0.1 GB
            int(r() * len(t.storage)),  # storage used, 0.01 TB
            20 + int(r() * 931),  # host cpu_util_pct 2-95, 0.1
            40 + int(r() * 261),  # host mem_used_gb 4-30, 0.1
            int(r() * 801),  # load_1m 0-8, 0.01
        )

    def draw_links(self) -> tuple[LinkDraw, ...]:
        r = self.rng.random
        # median above the floor 0-2 ms, jitter 0-1 ms, in us
        return tuple((i, int(r() * 2001), int(r() * 1001)) for i in range(len(self.links)))

    def draw_endpoint(self) -> Endpoint | None:
        if not self.plan.serves:
            return None
        r = self.rng.random
        return int(r() * 9), 200 + int(r() * 401)  # in_flight 0-8, latency_ms 20-60 in 0.1

    def values(self, pub: Publish, now: float) -> list[bytes]:
        """The documents of one publish, in its order: status, last_seen, links..., endpoint."""
        at = repr(now)
        out = []
        if (d := pub.status) is not None:
            t = self.tables
            out.append(
                self._status_t.render(
                    (
                        str(self.seq),
                        at,
                        *t.gpu[d[0]],
                        *t.cpu[d[1]],
                        t.mem[d[2]],
                        t.storage[d[3]],
                        t.storage_used[d[3]],
                        TENTHS[d[4]],
                        TENTHS[d[5]],
                        HUNDREDTHS[d[6]],
                    )
                )
            )
            out.append(self._seen_t.render((at,)))
        for i, median, jitter in pub.links:
            base = self.links[i][1]
            out.append(
                self._link_t[i].render((repr((base + median) / 1000), THOUSANDTHS[jitter], at))
            )
        if (e := pub.endpoint) is not None and self._endpoint_t is not None:
            out.append(self._endpoint_t.render((SMALL_INTS[e[0]], TENTHS[e[1]], at)))
        return out

    def request(self, pub: Publish, values: list[bytes]) -> bytes:
        """The TxnRequest of Registry.publish for these documents (values(pub, ...))."""
        lease = self._lease
        parts = [self._compare]
        k = 0
        if pub.status is not None:
            parts.append(put_op(self._status_key, values[0], lease))
            parts.append(put_op(self._seen_key, values[1], b""))
            k = 2
        for i, _, _ in pub.links:
            parts.append(put_op(self._link_keys[i], values[k], lease))
            k += 1
        if pub.endpoint is not None:
            parts.append(put_op(self._endpoint_key, values[k], lease))
        return b"".join(parts)

    # -- the same documents through pydantic (templates and the self check) -------------------

    def _sentinel_status(self) -> tuple[int, float, Capacity, float, float, float, float]:
        free = Capacity(
            devices={self.tables.model: si(2)},
            fp64_tflops=sf(3),
            fp32_tflops=sf(4),
            fp16_tflops=sf(5),
            int8_tops=sf(6),
            accel_mem_gb=sf(7),
            cpu_cores=si(8),
            cpu_fp64_tflops=sf(9),
            mem_gb=sf(10),
            storage_tb=sf(11),
        )
        return si(0), sf(1), free, sf(12), sf(13), sf(14), sf(15)

    def _status_model(
        self,
        seq: int,
        now: float,
        free: Capacity,
        used_tb: float,
        util: float,
        mem_used: float,
        load: float,
    ) -> SiteStatus:
        """SimAgent.measure's document for these figures."""
        return build(
            SiteStatus,
            site=self.id,
            instance=self.instance,
            seq=seq,
            published_at=now,
            interval_s=self.interval_s,
            mode="declared",
            capacity=self.capacity,
            free=free,
            storage=(StorageUsage(path="/data", total_tb=50.0, used_tb=used_tb),),
            host=build(
                HostUsage,
                cpu_cores=HOST_CORES,
                cpu_util_pct=util,
                mem_gb=HOST_MEM_GB,
                mem_used_gb=mem_used,
                load_1m=load,
            ),
        )

    def _link_model(
        self, peer: str, base_us: int, median_ms: float, jitter_ms: float, now: float
    ) -> LinkStatus:
        """SimAgent.links' document."""
        floor = base_us / 1000
        return build(
            LinkStatus,
            src=self.id,
            dst=peer,
            rtt_ms=floor,
            rtt_min_ms=floor,
            rtt_median_ms=median_ms,
            jitter_ms=jitter_ms,
            loss_pct=0.0,
            samples=5,
            method="http",
            emulated=True,
            measured_at=now,
        )

    def _endpoint_model(self, in_flight: int, latency_ms: float, now: float) -> ServiceEndpoint:
        """SimAgent.endpoints' document."""
        serves = self.plan.serves or ""
        return ServiceEndpoint(
            service=serves,
            site=self.id,
            model=serves,
            url=f"http://127.0.0.1:9/{self.id}",  # never called: routes only
            max_concurrency=32,
            in_flight=in_flight,
            queue=0,
            latency_ms=latency_ms,
            healthy=True,
            updated_at=now,
        )

    def status_model(self, d: Usage, now: float) -> SiteStatus:
        """The status values() renders for `d`, through pydantic as SimAgent builds it."""
        used = normalize(
            devices={self.tables.model: d[0]},
            cpu_cores=d[1],
            mem_gb=d[2] / 10,
            storage_tb=d[3] / 100,
            catalog=self.catalog,
        )
        return self._status_model(
            self.seq,
            now,
            self.capacity.minus(used),
            used.storage_tb,
            d[4] / 10,
            d[5] / 10,
            d[6] / 100,
        )

    def link_model(self, link: LinkDraw, now: float) -> LinkStatus:
        i, median, jitter = link
        peer, base = self.links[i]
        return self._link_model(peer, base, (base + median) / 1000, jitter / 1000, now)

    def endpoint_model(self, e: Endpoint, now: float) -> ServiceEndpoint:
        return self._endpoint_model(e[0], e[1] / 10, now)

    def check(self) -> None:
        """A full publish and a partial one (no status, one link, the endpoint if serving),
        rendered both ways, must match byte for byte, and the rules deciding what a publish
        writes must agree with sites.agent.drift (raises EmulatorMismatch)."""
        if self.record is None:
            raise EmulatorMismatch(f"{self.id}: no agent record to check against")
        now = time.time()
        full = Publish(self.draw_usage(), self.draw_links(), self.draw_endpoint(), True, 0.0)
        self._check_publish(full, now, "a full publish")
        partial = Publish(None, full.links[:1], full.endpoint, False, 0.0)
        if partial.puts:
            self._check_publish(partial, now, "a partial publish")
        self._check_drift(now)

    def _check_publish(self, pub: Publish, now: float, what: str) -> None:
        record = self.record
        if record is None:
            raise EmulatorMismatch(f"{self.id}: no agent record to check against")
        status = None if pub.status is None else self.status_model(pub.status, now)
        links = [self.link_model(link, now) for link in pub.links]
        services = [] if pub.endpoint is None else [self.endpoint_model(pub.endpoint, now)]
        models: list[BaseModel] = []
        if status is not None:
            models += [status, LastSeen(at=now, instance=self.instance)]
        models += [*links, *services]
        values = self.values(pub, now)
        if len(values) != len(models) or len(values) != pub.puts:
            raise EmulatorMismatch(f"{self.id}: {what} renders {len(values)} documents")
        for value, model in zip(values, models, strict=True):
            expected = model.model_dump_json().encode()  # sites.registry.lifecycle._encode
            if value != expected:
                raise EmulatorMismatch(
                    f"{self.id}: {what}: {type(model).__name__} differs from pydantic's:\n"
                    f"  emulator: {value!r}\n  pydantic: {expected!r}"
                )
            type(model).model_validate_json(value)  # what the broker does with it
        reference = reference_txn(record, status=status, links=links, services=services)
        if self.request(pub, values) != reference:
            raise EmulatorMismatch(f"{self.id}: {what}: the TxnRequest differs from aetcd's")

    def _check_drift(self, now: float) -> None:
        """status_moved and rtt_moved against sites.agent.drift on the documents themselves: random
        pairs and pairs at drift's tolerances (a step of exactly the tolerance, and one more).
        The status rule depends on the site's capacity alone: checked once per capacity."""
        if self.tables not in EmulatedSite._drift_checked:
            self._check_status_drift(now)
            EmulatedSite._drift_checked.append(self.tables)
        self._check_link_drift(now)

    _drift_checked: list[FreeTables] = []

    def _check_status_drift(self, now: float) -> None:
        old = self.draw_usage()
        news = [old, self.draw_usage()]
        if len(self.tables.gpu) > 1:
            news.append(_replace(old, 0, 0 if old[0] else 1))
        # (index, tolerance in the figure's units, its range)
        for k, tolerance, lo, hi in (
            (4, round(HOST_CPU_PCT * 10), 20, 950),
            (5, round(HOST_MEM_REL * HOST_MEM_GB * 10), 40, 300),
            (6, round(HOST_LOAD_PER_CORE * max(1, HOST_CORES) * 100), 0, 800),
        ):
            for step in (tolerance, tolerance + 1):
                moved = old[k] + step if old[k] + step <= hi else old[k] - step
                if lo <= moved <= hi:
                    news.append(_replace(old, k, moved))
        old_model = self.status_model(old, now)
        for new in news:
            expected = status_changed(old_model, self.status_model(new, now))
            if status_moved(old, new) != expected:
                raise EmulatorMismatch(
                    f"{self.id}: status {old} -> {new}: the emulator says changed="
                    f"{not expected}, sites.agent.drift.status_changed {expected}"
                )

    def _check_link_drift(self, now: float) -> None:
        r = self.rng.random
        for i, (_, base) in enumerate(self.links):
            w = int(r() * 2001)
            tolerance_us = round(rtt_tolerance((base + w) / 1000) * 1000)
            steps = (0, tolerance_us, tolerance_us + 1, int(r() * 2001) - w)
            medians = {w + s for s in steps} | {w - s for s in steps}
            old_ms = (base + w) / 1000
            old_model = self.link_model((i, w, 0), now)
            for m in sorted(x for x in medians if 0 <= x <= 2000):
                expected = link_changed(old_model, self.link_model((i, m, 0), now))
                got = rtt_moved(old_ms, rtt_tolerance(old_ms), (base + m) / 1000)
                if got != expected:
                    raise EmulatorMismatch(
                        f"{self.id}: link {i} median {w} -> {m} us: the emulator says changed="
                        f"{got}, sites.agent.drift.link_changed {expected}"
                    )


def _replace(u: Usage, k: int, value: int) -> Usage:
    f = list(u)
    f[k] = value
    return f[0], f[1], f[2], f[3], f[4], f[5], f[6]


def range_holes(n: int) -> list[int | float]:
    """The SiteStatus template's sentinels in dump order (see _sentinel_status)."""
    ints = {0, 2, 8}
    return [si(i) if i in ints else sf(i) for i in range(n)]


def reference_txn(
    record: AgentRecord,
    *,
    status: SiteStatus | None,
    links: Sequence[LinkStatus],
    services: Sequence[ServiceEndpoint],
) -> bytes:
    """Registry.publish's TxnRequest (no deletes), built with aetcd's own classes as aetcd's
    client does: the status and last_seen when `status` is given, the links, the endpoints."""
    tx = aetcd.transactions
    site, lease = record.site, record.lease_id

    def put(key: str, model: BaseModel, with_lease: bool) -> Any:
        return rpc.RequestOp(
            request_put=rpc.PutRequest(
                key=key.encode(),
                value=model.model_dump_json().encode(),
                lease=lease if with_lease else 0,
                prev_kv=False,
            )
        )

    # aetcd's comparison DSL: `==` and `>` return the comparison, as Registry.publish uses it
    value_cmp = tx.Value(keys.agent(site).encode()) == record.model_dump_json().encode()
    version_cmp = tx.Version(keys.site_spec(site).encode()) > 0
    ops = []
    if status is not None:
        seen = LastSeen(at=status.published_at, instance=record.instance)
        ops += [
            put(keys.site_status(site), status, True),
            put(keys.site_last_seen(site), seen, False),
        ]
    ops += [put(keys.link(site, ln.dst), ln, True) for ln in links]
    ops += [put(keys.service_endpoint(ep.service, site, ep.job), ep, True) for ep in services]
    request = rpc.TxnRequest(
        compare=[value_cmp.build_message(), version_cmp.build_message()], success=ops, failure=[]
    )
    return bytes(request.SerializeToString())
