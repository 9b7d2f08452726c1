"""One emulated site agent for bench/agent_emulator.py: its documents and its Txn, cheaply.

A site's JSON documents (SiteStatus, LastSeen, LinkStatus per peer, ServiceEndpoint) are
dumped once through pydantic with sentinel numbers and turned into %-format templates; a
publish fills in figures drawn as integers (in units of the last decimal SimAgent rounds to,
pre-rendered as strings) and assembles Registry.publish's TxnRequest as protobuf bytes by
hand. `EmulatedSite.check()` renders one publish both ways, the JSON against pydantic's
model_dump_json (what sites.registry._encode writes) and the TxnRequest against aetcd's own
message builders, and raises EmulatorMismatch unless they are the same bytes.
"""

from __future__ import annotations

import random
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aetcd.transactions
import registry_fanin as fanin
from aetcd import rpc
from pydantic import BaseModel

from sites import keys
from sites.catalog import Capacity, DeviceCatalog, normalize, normalize_inventory
from sites.spec import SiteSpec
from sites.status import (
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
        # Capacity.minus: round(max(0, total - used), 6) (sites.catalog._round)
        mem_n, sto_n = int(cap.mem_gb * 10), int(cap.storage_tb * 100)
        self.mem = [repr(round(max(0.0, cap.mem_gb - k / 10), 6)) for k in range(mem_n + 1)]
        self.storage = [
            repr(round(max(0.0, cap.storage_tb - k / 100), 6)) for k in range(sto_n + 1)
        ]
        self.storage_used = _table(sto_n, 100)

    _cache: dict[str, FreeTables] = {}

    @classmethod
    def of(cls, cap: Capacity, catalog: DeviceCatalog) -> FreeTables:
        key = cap.model_dump_json()
        if key not in cls._cache:
            cls._cache[key] = cls(cap, catalog)
        return cls._cache[key]


# -- one emulated site -------------------------------------------------------------------------


@dataclass(frozen=True)
class SitePlan:
    """What the bench decides for a site: its spec, the peers it probes, what it serves."""

    spec: SiteSpec
    peers: tuple[str, ...]
    serves: str | None
    seed: int


Draw = tuple[int, ...]
"""One publish's random figures, as integers (units of the last decimal SimAgent rounds to)."""


class EmulatedSite:
    """A site's agent state and its pre-rendered documents; no I/O of its own."""

    def __init__(self, plan: SitePlan, interval_s: float, catalog: DeviceCatalog) -> None:
        spec = plan.spec
        self.id = spec.id
        self.plan = plan
        self.interval_s = interval_s
        self.catalog = catalog
        self.rng = random.Random(plan.seed)
        self.instance = uuid.uuid4().hex[:12]
        self.capacity = normalize_inventory(spec.inventory, catalog)
        self.tables = FreeTables.of(self.capacity, catalog)
        # a link's RTT floor in us (SimAgent: uniform 2-60 ms, rounded to 3 decimals)
        self.links = [(peer, round(self.rng.uniform(2.0, 60.0) * 1000)) for peer in plan.peers]
        self.record: AgentRecord | None = None
        self.seq = 0
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
        return fanin.agent_record(self.id, self.instance, self.rng, lease_id)

    def set_record(self, record: AgentRecord | None) -> None:
        self.record = record
        if record is None:
            return
        value = record.model_dump_json().encode()  # sites.registry._encode
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

    # -- one publish --------------------------------------------------------------------------

    def draw(self) -> Draw:
        r = self.rng.random
        t = self.tables
        out = [
            int(r() * len(t.gpu)),  # busy devices
            int(r() * len(t.cpu)),  # cores used
            int(r() * len(t.mem)),  # memory used, 0.1 GB
            int(r() * len(t.storage)),  # storage used, 0.01 TB
            20 + int(r() * 931),  # host cpu_util_pct 2-95, 0.1
            40 + int(r() * 261),  # host mem_used_gb 4-30, 0.1
            int(r() * 801),  # load_1m 0-8, 0.01
        ]
        for _ in self.links:
            out.append(int(r() * 2001))  # median above the floor, us (0-2 ms)
            out.append(int(r() * 1001))  # jitter, us (0-1 ms)
        if self.plan.serves:
            out.append(int(r() * 9))  # in_flight 0-8
            out.append(200 + int(r() * 401))  # latency_ms 20-60, 0.1
        return tuple(out)

    def values(self, d: Draw, now: float) -> list[bytes]:
        """The documents of one publish: status, last_seen, links..., endpoint."""
        t = self.tables
        at = repr(now)
        out = [
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
            ),
            self._seen_t.render((at,)),
        ]
        i = 7
        for (_, base), template in zip(self.links, self._link_t, strict=True):
            out.append(template.render((repr((base + d[i]) / 1000), THOUSANDTHS[d[i + 1]], at)))
            i += 2
        if self._endpoint_t is not None:
            out.append(self._endpoint_t.render((SMALL_INTS[d[i]], TENTHS[d[i + 1]], at)))
        return out

    def request(self, values: list[bytes]) -> bytes:
        """The TxnRequest of Registry.publish for these documents."""
        lease = self._lease
        parts = [
            self._compare,
            put_op(self._status_key, values[0], lease),
            put_op(self._seen_key, values[1], b""),
        ]
        for key, value in zip(self._link_keys, values[2 : 2 + len(self.links)], strict=True):
            parts.append(put_op(key, value, lease))
        if self._endpoint_t is not None:
            parts.append(put_op(self._endpoint_key, values[-1], lease))
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
        return fanin.build(
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
            host=fanin.build(
                HostUsage,
                cpu_cores=8,
                cpu_util_pct=util,
                mem_gb=32.0,
                mem_used_gb=mem_used,
                load_1m=load,
            ),
        )

    def _link_model(
        self, peer: str, base_us: int, median_ms: float, jitter_ms: float, now: float
    ) -> LinkStatus:
        """SimAgent.links' document."""
        floor = base_us / 1000
        return fanin.build(
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

    def models(self, d: Draw, now: float) -> list[BaseModel]:
        """values() through pydantic, as SimAgent builds them: the reference for the check."""
        used = normalize(
            devices={self.tables.model: d[0]},
            cpu_cores=d[1],
            mem_gb=d[2] / 10,
            storage_tb=d[3] / 100,
            catalog=self.catalog,
        )
        out: list[BaseModel] = [
            self._status_model(
                self.seq,
                now,
                self.capacity.minus(used),
                used.storage_tb,
                d[4] / 10,
                d[5] / 10,
                d[6] / 100,
            ),
            LastSeen(at=now, instance=self.instance),
        ]
        i = 7
        for peer, base in self.links:
            out.append(self._link_model(peer, base, (base + d[i]) / 1000, d[i + 1] / 1000, now))
            i += 2
        if self.plan.serves:
            out.append(self._endpoint_model(d[i], d[i + 1] / 10, now))
        return out

    def check(self) -> None:
        """One publish rendered both ways must match byte for byte (raises EmulatorMismatch)."""
        if self.record is None:
            raise EmulatorMismatch(f"{self.id}: no agent record to check against")
        d, now = self.draw(), time.time()
        values, models = self.values(d, now), self.models(d, now)
        for value, model in zip(values, models, strict=True):
            expected = model.model_dump_json().encode()  # sites.registry._encode
            if value != expected:
                raise EmulatorMismatch(
                    f"{self.id}: {type(model).__name__} differs from pydantic's:\n"
                    f"  emulator: {value!r}\n  pydantic: {expected!r}"
                )
            type(model).model_validate_json(value)  # what the broker does with it
        if self.request(values) != reference_txn(self.record, models, self.plan.serves):
            raise EmulatorMismatch(f"{self.id}: the TxnRequest differs from aetcd's")


def range_holes(n: int) -> list[int | float]:
    """The SiteStatus template's sentinels in dump order (see _sentinel_status)."""
    ints = {0, 2, 8}
    return [si(i) if i in ints else sf(i) for i in range(n)]


def reference_txn(record: AgentRecord, models: Sequence[BaseModel], serves: str | None) -> bytes:
    """Registry.publish's TxnRequest, built with aetcd's own classes as aetcd's client does."""
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
    status, seen, *rest = models
    ops = [put(keys.site_status(site), status, True), put(keys.site_last_seen(site), seen, False)]
    for model in rest:
        if isinstance(model, LinkStatus):
            ops.append(put(keys.link(site, model.dst), model, True))
        elif isinstance(model, ServiceEndpoint) and serves:
            ops.append(put(keys.service_endpoint(model.service, site, model.job), model, True))
    request = rpc.TxnRequest(
        compare=[value_cmp.build_message(), version_cmp.build_message()], success=ops, failure=[]
    )
    return bytes(request.SerializeToString())
