"""`DataPlane`: what the rest of the agent calls of the site's data plane (docs/agent.md).

The agent makes one per site, `await open()`s it before it serves (the store is swept, the
data key read), hands it to its server (`add_routes`) and its workload, runs `loops()` under
its supervisor and `await close()`s it last. The workload calls:

- `stage_inputs(a, progress)` before a run: each input pulled (or found) and held for the job;
- `release(job)` once the run ended;
- `restore_checkpoint(a, dest, progress)` before a run that resumes;
- `sync_checkpoint(a, src, seq)` every `a.checkpoint.interval_s` while it runs (and at its end);
- `save_output(a, spec, src)` for each output of a run that succeeded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from sites.agent.data import peers
from sites.agent.data.errors import BadInput, DataError, NotHeld, PeerError
from sites.agent.data.links import LinkLimits
from sites.agent.data.orders import OrderFollower
from sites.agent.data.records import ReplicaBook
from sites.agent.data.secret import data_key
from sites.agent.data.serve import DataRoutes, add_routes
from sites.agent.data.snapshot import Stat, snapshot
from sites.agent.data.store import DataStore
from sites.agent.data.transfer import Progress, Stager
from sites.executors.base import default_work_dir
from sites.kits.clock import Clock
from sites.kits.tls import PeerTrust
from sites.model.assignments import Assignment
from sites.model.data import (
    CheckpointMark,
    Egress,
    Manifest,
    OutputMade,
    OutputSpec,
    ReplicationOrder,
    StageInput,
)
from sites.model.spec import SiteSpec
from sites.registry.client import Registry

log = logging.getLogger(__name__)

GB = 1_000_000_000
STEP_FILE = "step"  # a checkpoint's own step, an integer the job writes beside it
SWEEP_S = 300.0
Factory = Callable[[], Coroutine[Any, Any, None]]


def store_root(spec: SiteSpec) -> Path:
    """The site's store: `data.store`, else <executor work dir>/data-store."""
    if spec.data.store:
        return Path(spec.data.store).expanduser()
    return default_work_dir(spec) / "data-store"


@dataclass
class _Synced:
    """What the last checkpoint sync of a job saw: each file's stat and hash, and the digest."""

    known: dict[str, Stat] = field(default_factory=dict)
    digest: str | None = None


@dataclass
class _Parts:
    key: str
    store: DataStore
    stager: Stager
    book: ReplicaBook
    routes: DataRoutes
    orders: OrderFollower | None


class DataPlane:
    """The site's data store, its routes, transfers, records and orders (module docstring)."""

    def __init__(
        self,
        *,
        spec: SiteSpec,
        registry: Registry | None,
        clock: Clock,
        root: Path | None = None,
        retry_window_s: float | None = None,
        local_host: str | None = None,
        peer_trust: PeerTrust | None = None,
    ) -> None:
        self.spec = spec
        self.site = spec.id
        self.settings = spec.data
        self.registry = registry
        self.clock = clock
        self.root = root or store_root(spec)
        self._retry_window_s = retry_window_s
        self._local_host = local_host  # where its transfers leave from (the agent's address)
        # the live agents' advertised URLs (the agent's mirror of /cpn/v1/agents/): a source
        # whose agent restarted at another address is reached there (its grant still holds)
        self.peer_urls: dict[str, str] = {}
        self._peer_trust = peer_trust  # what peers' https:// endpoints are verified against
        self._parts: _Parts | None = None
        self._key: str | None = None
        self._synced: dict[str, _Synced] = {}

    # -- lifecycle --------------------------------------------------------------------------

    async def read_key(self) -> str:
        """The data key (made once, kept in the store's root): for the agent's AgentSecret,
        read before the agent takes its site; the store itself opens only after (`open`)."""
        if self._key is None:
            self._key = await asyncio.to_thread(data_key, self.root)
        return self._key

    async def open(self) -> None:
        """Sweep and load the store, read (or make) the data key. Only the agent that holds
        the site may: the sweep deletes what an open store has in progress."""
        if self._parts is not None:
            return
        key = await self.read_key()
        store = await asyncio.to_thread(DataStore, self.root, int(self.settings.cache_gb * GB))
        limits = LinkLimits(
            default_mbps=self.settings.link_mbps,
            per_site_mbps=self.settings.link_limits_mbps,
            clock=self.clock,
        )
        extra = {} if self._retry_window_s is None else {"retry_window_s": self._retry_window_s}
        stager = Stager(
            store=store, clock=self.clock, limits=limits,
            parallel_files=self.settings.parallel_files, local_host=self._local_host,
            trust=self._peer_trust, resolve=lambda site: self.peer_urls.get(site),
            **extra,
        )  # fmt: skip
        book = ReplicaBook(registry=self.registry, site=self.site, store=store)
        routes = DataRoutes(
            store=store, site=self.site, key=key, clock=self.clock, committed=self._committed
        )
        orders = None
        if self.registry is not None:
            orders = OrderFollower(registry=self.registry, site=self.site, carry=self.carry_order)
        self._parts = _Parts(key, store, stager, book, routes, orders)
        log.info(
            "site %s: data store %s holds %d objects, %d bytes", self.site, self.root,
            len(store.digests()), store.bytes_held(),
        )  # fmt: skip

    async def close(self) -> None:
        if self._parts is not None:
            await self._parts.stager.close()
            await asyncio.to_thread(self._parts.store.flush)

    @property
    def parts(self) -> _Parts:
        if self._parts is None:
            raise RuntimeError("the data plane is not open")
        return self._parts

    @property
    def key(self) -> str | None:
        """The data key, for the agent's AgentSecret (None until read)."""
        return self._key

    @property
    def store(self) -> DataStore:
        return self.parts.store

    @property
    def stager(self) -> Stager:
        return self.parts.stager

    def add_routes(self, router: web.UrlDispatcher) -> None:
        """The /data/ routes on the agent's server (503 until the store is open)."""
        add_routes(router, lambda: self._parts.routes if self._parts is not None else None)

    def loops(self) -> list[tuple[str, Factory]]:
        """The long-lived tasks the agent runs under its supervisor (restarted on a crash)."""
        parts = self.parts
        out: list[tuple[str, Factory]] = [
            ("data-records", parts.book.run),
            ("data-sweep", self._sweep_loop),
        ]
        if parts.orders is not None:
            out.append(("data-orders", parts.orders.run))
        return out

    async def _sweep_loop(self) -> None:
        while True:
            await self.clock.sleep(SWEEP_S)
            await self.tidy()

    async def tidy(self) -> None:
        """Stale uploads swept, the cache kept under its limit, the index written."""
        store = self.store
        await asyncio.to_thread(store.sweep_incoming, max_age_s=3600.0)
        retention = self.settings.checkpoint_retention_days * 86400
        expired = await asyncio.to_thread(store.expire_checkpoints, max_age_s=retention)
        if expired:
            log.info("site %s: checkpoints of %d finished jobs expired", self.site, len(expired))
            self.parts.book.changed()
        await self._evict()
        await asyncio.to_thread(store.flush)

    async def _evict(self) -> None:
        evicted = await asyncio.to_thread(self.store.evict_to)
        if evicted:
            log.info("site %s: data store evicted %d objects", self.site, len(evicted))
            self.parts.book.changed()

    async def _committed(self, _: str) -> None:
        """An object became complete here: its record written, the cache kept in its limit."""
        await self._evict()
        await self.parts.book.sync()

    # -- inputs -------------------------------------------------------------------------------

    async def stage_inputs(
        self, a: Assignment, progress: Progress
    ) -> tuple[tuple[StageInput, ...], list[Egress]]:
        """Each input of `a` complete here and held for the job (until `release(a.job)`), with
        `local` set to its read-only tree; the bytes pulled per source site. StagingError
        (what the job is told) when an input cannot be staged; nothing stays held then."""
        staged: list[StageInput] = []
        egress: dict[str, int] = {}
        try:
            for inp in a.inputs:
                tree = await self._stage_held(inp, a.job, progress, egress)
                staged.append(inp.model_copy(update={"local": str(tree)}))
        except BaseException:
            self.release(a.job)
            raise
        if egress:
            await self._committed("")
        return tuple(staged), [Egress(source=s, bytes=n) for s, n in sorted(egress.items())]

    async def _stage_held(
        self, inp: StageInput, job: str, progress: Progress, egress: dict[str, int]
    ) -> Path:
        for _ in range(2):  # evicted between its commit and our hold: staged again once
            sources = tuple(s for s in inp.sources if s.site != self.site)
            _, pulled = await self.stager.stage(inp.digest, sources, progress, what=inp.dataset)
            for e in pulled:
                egress[e.source] = egress.get(e.source, 0) + e.bytes
            with contextlib.suppress(NotHeld):
                return self.store.acquire(inp.digest, _holder(job))
        raise NotHeld(f"{inp.dataset} was evicted as soon as it was staged", "inputs")

    def release(self, job: str) -> None:
        """What `stage_inputs` held for `job` may be evicted again."""
        if self._parts is not None and self._parts.store.release(_holder(job)):
            self._parts.book.changed()  # a dropped object went with its last user

    # -- checkpoints --------------------------------------------------------------------------

    async def restore_checkpoint(
        self, a: Assignment, dest: Path, progress: Progress
    ) -> tuple[CheckpointMark | None, list[Egress]]:
        """The last complete checkpoint of `a.job` at its store, copied into `dest` (files of
        the agent's own, writable); (None, []) when the store holds none. StagingError or
        PeerError when it cannot be read."""
        plan = a.checkpoint
        if plan is None:
            return None, []
        store = self.store
        egress: list[Egress] = []
        if plan.store is None or plan.store.site == self.site:
            mark = store.latest(a.tenant, a.job)
            if mark is None:
                return None, []
            manifest = store.manifest(mark.digest)
        else:
            found = await peers.latest_checkpoint(
                self.stager.session(), plan.store, a.tenant, a.job
            )
            if found is None:
                return None, []
            mark, manifest = found
            if manifest.digest != mark.digest:
                raise PeerError(f"site {plan.store.site} answered a checkpoint whose manifest "
                                f"is not its mark's")  # fmt: skip
            _, egress = await self.stager.stage(
                mark.digest, (plan.store,), progress, what=f"checkpoint {mark.seq} of {a.job}",
                kind="ckpt",
            )  # fmt: skip
        holder = f"restore:{a.job}"
        tree = store.acquire(mark.digest, holder)
        try:
            await asyncio.to_thread(_copy_tree, tree, manifest, dest)
        finally:
            store.release(holder)
        # the files as restored: the first sync hashes nothing it need not
        known = await asyncio.to_thread(_stats_of, dest, manifest)
        self._synced[a.job] = _Synced(known=known, digest=mark.digest)
        log.info("site %s: restored checkpoint %d of %s (step %s) into %s", self.site, mark.seq,
                 a.job, mark.step, dest)  # fmt: skip
        return mark, egress

    async def sync_checkpoint(self, a: Assignment, src: Path, seq: int) -> CheckpointMark | None:
        """Snapshot `src` (only files whose size or mtime changed are read) and push it to the
        checkpoint store as checkpoint `seq` (greater than the store's latest); None when `src`
        is empty, unchanged since the last sync, or a file changed while it was read (the next
        sync takes it). PeerError when the store cannot be reached or refuses it."""
        plan = a.checkpoint
        if plan is None:
            return None
        synced = self._synced.setdefault(a.job, _Synced())
        local = plan.store is None or plan.store.site == self.site
        store = self.store
        if local:
            snap = await asyncio.to_thread(store.snap, src, synced.known)
        else:
            snap = await asyncio.to_thread(snapshot, src, known=synced.known)
        if snap.unstable:
            synced.known = {**synced.known, **snap.stats}
            log.info("site %s: checkpoint of %s not taken: %s changed while read", self.site,
                     a.job, snap.unstable[0])  # fmt: skip
            return None
        if not snap.files:
            return None
        manifest = snap.manifest()
        if manifest.digest == synced.digest:
            synced.known = snap.stats
            return None
        step = await asyncio.to_thread(_read_step, src)
        at = self.clock.time()
        if local:
            mark = await asyncio.to_thread(
                store.put_checkpoint, a.tenant, a.job, seq, manifest, at=at, step=step,
                site=self.site,
            )  # fmt: skip
            await self._evict()
        else:
            target = plan.store
            if target is None:  # pragma: no cover - `local` covers it
                return None
            mark, sent = await peers.push_checkpoint(
                self.stager.session(), target, tenant=a.tenant, job=a.job, seq=seq,
                manifest=manifest, at=at, step=step, file_of=lambda p: src / p,
                bucket=self.stager.limits.bucket(target.site),
            )  # fmt: skip
            log.info("site %s: checkpoint %d of %s at %s: %d files, %d bytes sent",
                     self.site, seq, a.job, target.site, len(manifest.files), sent)  # fmt: skip
        synced.known = snap.stats
        synced.digest = manifest.digest
        return mark

    def forget(self, job: str) -> None:
        """The job left this site: what its checkpoint syncs remembered is dropped."""
        self._synced.pop(job, None)

    # -- outputs ------------------------------------------------------------------------------

    async def save_output(self, a: Assignment, spec: OutputSpec, src: Path) -> OutputMade:
        """`src` (a directory or one file) kept here as a complete object, recorded, and pushed
        to `spec.store` when set; `sites` says where it is complete (a failed push is logged
        and leaves that site out). BadInput when `src` is missing, a link, or changes."""
        if not os.path.lexists(src):
            raise BadInput(f"output {spec.path!r} does not exist in the run's work dir", "outputs")
        try:
            manifest = await asyncio.to_thread(self.store.ingest, src)
        except DataError as exc:
            raise BadInput(f"output {spec.path!r}: {exc}", "outputs") from exc
        await self._committed(manifest.digest)
        sites = [self.site]
        target = spec.store
        if target is not None and target.site != self.site:
            tree = self.store.acquire(manifest.digest, f"push:{a.job}")
            try:
                await peers.upload(
                    self.stager.session(), target, manifest, file_of=lambda p: tree / p,
                    bucket=self.stager.limits.bucket(target.site),
                )  # fmt: skip
                sites.append(target.site)
            except PeerError as exc:
                log.warning("site %s: output %s of %s not pushed: %s", self.site,
                            spec.dataset, a.job, exc)  # fmt: skip
            finally:
                self.store.release(f"push:{a.job}")
        return OutputMade(
            dataset=spec.dataset, digest=manifest.digest, bytes=manifest.bytes,
            files=len(manifest.files), sites=tuple(sites),
        )  # fmt: skip

    # -- replication orders ----------------------------------------------------------------

    async def carry_order(self, order: ReplicationOrder) -> None:
        """Carry out one replication order (sites.agent.data.orders)."""
        store = self.store
        if order.action == "drop":
            await asyncio.to_thread(store.unpin, order.digest)
            await asyncio.to_thread(store.drop, order.digest)
        else:
            sources = tuple(s for s in order.sources if s.site != self.site)
            _, egress = await self.stager.stage(
                order.digest, sources, lambda _: None, what=order.dataset
            )
            if order.pin:
                await asyncio.to_thread(
                    store.pin, order.digest, egress=tuple(egress) if egress else None
                )
        self.parts.book.changed()
        await self.parts.book.sync()


def _holder(job: str) -> str:
    return f"job:{job}"


def _copy_tree(tree: Path, manifest: Manifest, dest: Path) -> None:
    """Copy the object's files into `dest` as ordinary files of ours (the job writes there)."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in manifest.files:
        target = dest / f.path
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.is_dir():
            raise BadInput(f"{target} is in the way of the checkpoint's {f.path!r}", "checkpoint")
        tmp = target.with_name(f".{target.name}.restore")
        shutil.copyfile(tree / f.path, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)


def _stats_of(dest: Path, manifest: Manifest) -> dict[str, Stat]:
    out: dict[str, Stat] = {}
    for f in manifest.files:
        st = os.lstat(dest / f.path)
        out[f.path] = (st.st_size, st.st_mtime_ns, f.sha256)
    return out


def _read_step(src: Path) -> int | None:
    """The job's `step` file: an integer, or None when there is none or it is not one."""
    try:
        fd = os.open(src / STEP_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(64)
    try:
        return int(raw.strip())
    except ValueError:
        return None
