"""The site's content-addressed data store (docs/agent.md, "The data store").

Layout under `root`:

    .data-key                  this agent's data key (sites.agent.data.secret), 0600
    blobs/<sha256>             each file's bytes once, 0444
    objects/<digest>/          a manifest's tree of hardlinks to its blobs: dirs 0555, files 0444
    manifests/<digest>.json    the manifest, written LAST: without it the object is incomplete
                               and is never served nor used
    partial/<sha256>.part      a download in progress (resumed from its length)
    partial/*.tmp              a blob being written (an upload, a push, an ingest): swept on open
    incoming/<id>/files/...    an upload's files until its commit; swept after an hour
    checkpoints/<tenant>/<job>/<seq>.json   a complete checkpoint (its mark), written LAST
    index.json                 what the LRU and the replica records need: last use, pinned,
                               kind (data | ckpt), the egress a replication cost; atomic rename

Crash safety: every file that says something is complete (a blob under its name, a manifest,
a checkpoint entry, the index) appears by an atomic rename after its content was fsynced, so a
process killed at any moment leaves either the old state or the new one, plus debris that
`DataStore(...)` sweeps on open: trees without a manifest, temporary files, stale uploads.

Why one module of ~800 lines: blobs, objects, uploads, checkpoints and the LRU are one state
on disk under one lock (a checkpoint's entry protects its object from eviction, an upload's
commit adopts blobs and commits an object); split apart, each part would reach into the others'.

Thread safety: the event loop calls the quick methods; hashing, copying and materializing run
in threads (asyncio.to_thread) and take the lock only to publish what they made, so the loop is
never held behind a long operation.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Literal

from pydantic import ValidationError

from sites.agent.data.errors import BadInput, Conflict, NotHeld
from sites.agent.data.snapshot import Sink, Snapshot, Stat, snapshot
from sites.model.data import SHA256_RE, CheckpointMark, Egress, Manifest, ReplicaRecord

log = logging.getLogger(__name__)

Kind = Literal["data", "ckpt"]
FILE_MODE = 0o444
DIR_MODE = 0o555
INCOMING_TTL_S = 3600.0  # an upload not committed within this is swept
FRESH_BLOB_S = 3600.0  # an unreferenced blob younger than this is kept (a push on its way)
CHECKPOINTS_KEPT = 3  # per job, the newest
CHUNK = 1 << 20
NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


def check_name(value: str, what: str) -> str:
    """A tenant, job or upload id used as one path segment; BadInput naming `what`."""
    if not re.fullmatch(NAME_RE, value):
        raise BadInput(f"{what} {value!r} must be 1-128 of A-Z a-z 0-9 . _ -", what)
    return value


def check_sha(value: str, what: str = "sha256") -> str:
    if not SHA256_RE.match(value):
        raise BadInput(f"{what} {value!r} must be 64 lowercase hex digits", what)
    return value


@dataclass
class Entry:
    """What the index keeps of one complete object."""

    bytes: int
    files: int
    at: float  # when it became complete
    used_at: float
    kind: Kind = "data"
    pinned: bool = False
    egress: tuple[Egress, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {
            "bytes": self.bytes,
            "files": self.files,
            "at": self.at,
            "used_at": self.used_at,
            "kind": self.kind,
            "pinned": self.pinned,
            "egress": [e.model_dump() for e in self.egress],
        }

    @classmethod
    def from_json(cls, raw: dict[str, object], manifest: Manifest) -> Entry:
        kind = raw.get("kind")
        egress = raw.get("egress")
        return cls(
            bytes=manifest.bytes,
            files=len(manifest.files),
            at=float(raw.get("at", 0.0)),  # type: ignore[arg-type]
            used_at=float(raw.get("used_at", 0.0)),  # type: ignore[arg-type]
            kind="ckpt" if kind == "ckpt" else "data",
            pinned=bool(raw.get("pinned", False)),
            egress=tuple(Egress.model_validate(e) for e in egress)
            if isinstance(egress, list)
            else (),
        )


@dataclass
class _Held:
    """In-memory only: who uses what now (a running job, a request being served)."""

    users: dict[str, set[str]] = field(default_factory=dict)  # digest -> holders
    doomed: set[str] = field(default_factory=set)  # dropped: deleted once unused
    blobs: dict[str, int] = field(default_factory=dict)  # sha -> holds (a staging relies on it)


class DataStore:
    """See the module docstring. `limit_bytes`: what the LRU keeps the blobs under."""

    def __init__(self, root: Path, limit_bytes: int, *, clock: Callable[[], float] = time.time):
        self.root = root
        self.limit_bytes = limit_bytes
        self.clock = clock
        self.blobs = root / "blobs"
        self.objects = root / "objects"
        self.manifests = root / "manifests"
        self.partial = root / "partial"
        self.incoming = root / "incoming"
        self.checkpoints = root / "checkpoints"
        self._lock = threading.RLock()
        self._entries: dict[str, Entry] = {}
        self._manifests: dict[str, Manifest] = {}
        self._ckpt_refs: collections.Counter[str] = collections.Counter()
        self._refs: dict[str, int] = {}  # blob sha -> complete objects using it
        self._blob_bytes: dict[str, int] = {}  # every blob on disk -> its size
        self._held = _Held()
        self._dirty = False
        self._open()

    # -- opening --------------------------------------------------------------------------

    def _open(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)  # the trees are bind-mounted into jobs of any uid
        for d in (self.blobs, self.objects, self.manifests, self.partial, self.incoming):
            d.mkdir(exist_ok=True)
        self.checkpoints.mkdir(mode=0o700, exist_ok=True)
        for p in self.manifests.iterdir():
            if not p.name.endswith(".json"):
                p.unlink(missing_ok=True)  # a manifest being written when we died
        for p in self.partial.iterdir():
            name = p.name
            if not (name.endswith(".part") and SHA256_RE.match(name[:-5])):
                _remove(p)
        for p in self.blobs.iterdir():
            if SHA256_RE.match(p.name) and p.is_file():
                self._blob_bytes[p.name] = p.stat().st_size
            else:
                _remove(p)
        index = self._read_index()
        for p in self.objects.iterdir():
            digest = p.name
            manifest = self._load_manifest(digest)
            if manifest is None:
                log.info("data store %s: sweeping incomplete object %s", self.root, digest[:12])
                _remove(p)
                continue
            raw = index.get(digest, {})
            entry = Entry.from_json(raw if isinstance(raw, dict) else {}, manifest)
            if not entry.at:
                entry.at = entry.used_at = (self.manifests / f"{digest}.json").stat().st_mtime
            self._add(digest, manifest, entry)
        for p in self.manifests.iterdir():
            if p.name[:-5] not in self._manifests:
                p.unlink(missing_ok=True)  # its tree is gone
        self.sweep_incoming(max_age_s=INCOMING_TTL_S)
        self._sweep_checkpoints()
        # digest -> how many checkpoint entries name it: what the cache keeps and a dropped
        # checkpoint may delete, without reading every job's entries on each sync
        self._ckpt_refs = collections.Counter(
            m.digest for p in self.checkpoints.glob("*/*/*.json") if (m := _read_mark(p))
        )
        self._dirty = True
        self.flush()

    def _load_manifest(self, digest: str) -> Manifest | None:
        path = self.manifests / f"{digest}.json"
        try:
            manifest = Manifest.model_validate_json(path.read_bytes())
        except (OSError, ValidationError):
            return None
        if manifest.digest != digest:
            return None
        return manifest

    def _read_index(self) -> dict[str, object]:
        try:
            raw = json.loads((self.root / "index.json").read_bytes())
        except (OSError, ValueError):
            return {}
        objects = raw.get("objects") if isinstance(raw, dict) else None
        return objects if isinstance(objects, dict) else {}

    def _sweep_checkpoints(self) -> None:
        for job_dir in self.checkpoints.glob("*/*"):
            for p in job_dir.iterdir():
                if not p.name.endswith(".json"):
                    p.unlink(missing_ok=True)
                    continue
                mark = _read_mark(p)
                if mark is None or mark.digest not in self._manifests:
                    p.unlink(missing_ok=True)  # never complete: its object is not here

    # -- index ----------------------------------------------------------------------------

    def flush(self) -> None:
        """Write the index if it changed (atomic rename)."""
        with self._lock:
            if not self._dirty:
                return
            body = {"objects": {d: e.to_json() for d, e in self._entries.items()}}
            self._dirty = False
            _write_atomic(self.root / "index.json", json.dumps(body).encode())

    def _add(self, digest: str, manifest: Manifest, entry: Entry) -> None:
        self._manifests[digest] = manifest
        self._entries[digest] = entry
        for sha in {f.sha256 for f in manifest.files}:
            self._refs[sha] = self._refs.get(sha, 0) + 1

    # -- reading --------------------------------------------------------------------------

    def has(self, digest: str) -> bool:
        return digest in self._manifests

    def manifest(self, digest: str) -> Manifest:
        manifest = self._manifests.get(digest)
        if manifest is None:
            raise NotHeld(f"object {digest[:12]} is not complete here", "digest")
        return manifest

    def entry(self, digest: str) -> Entry:
        self.manifest(digest)
        return self._entries[digest]

    def digests(self) -> list[str]:
        return list(self._manifests)

    def tree(self, digest: str) -> Path:
        """The object's read-only tree; counts as a use (LRU)."""
        self.manifest(digest)
        with self._lock:
            self._entries[digest].used_at = self.clock()
            self._dirty = True
        return self.objects / digest

    def file(self, digest: str, path: str) -> tuple[Path, int, str]:
        """(the file in the object's tree, its size, its sha256); NotHeld naming `path`."""
        manifest = self.manifest(digest)
        for f in manifest.files:
            if f.path == path:
                return self.objects / digest / path, f.size, f.sha256
        raise NotHeld(f"object {digest[:12]} has no file {path!r}", "path")

    def has_blob(self, sha: str) -> bool:
        return sha in self._blob_bytes

    def missing_blobs(self, shas: Iterable[str]) -> list[str]:
        return sorted({s for s in shas if s not in self._blob_bytes})

    def bytes_held(self) -> int:
        return sum(self._blob_bytes.values())

    def records(self) -> dict[str, ReplicaRecord]:
        """The replica record of each complete dataset object (not checkpoints)."""
        with self._lock:
            return {
                d: ReplicaRecord(
                    digest=d,
                    bytes=e.bytes,
                    files=e.files,
                    at=e.at,
                    pinned=e.pinned,
                    egress=e.egress,
                )  # fmt: skip
                for d, e in self._entries.items()
                if e.kind == "data"
            }

    # -- blobs ------------------------------------------------------------------------------

    def part(self, sha: str) -> Path:
        """Where a download of blob `sha` goes until it is complete and checked."""
        return self.partial / f"{check_sha(sha)}.part"

    def temp(self) -> Path:
        return self.partial / f"{secrets.token_hex(8)}.tmp"

    def adopt(self, sha: str, path: Path) -> None:
        """Keep `path` (whose content the caller checked is `sha`) as blob `sha`; `path` is
        gone afterwards. A blob already held stays as it is."""
        check_sha(sha)
        target = self.blobs / sha
        with self._lock:
            if sha in self._blob_bytes:
                path.unlink(missing_ok=True)
                os.utime(target)  # fresh again: a push's manifest may be on its way
                return
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(path, FILE_MODE)
        size = path.stat().st_size
        with self._lock:
            os.replace(path, target)
            self._blob_bytes[sha] = size
        _fsync_dir(self.blobs)

    def sink(self) -> Sink:
        """A snapshot's copy target: a temporary file kept as the blob of what was read."""

        def open_one() -> tuple[BinaryIO, Callable[[str], None], Callable[[], None]]:
            tmp = self.temp()
            f = open(tmp, "wb")  # noqa: SIM115 - closed by keep or discard

            def keep(sha: str) -> None:
                f.close()
                self.adopt(sha, tmp)

            def discard() -> None:
                f.close()
                tmp.unlink(missing_ok=True)

            return f, keep, discard

        return open_one

    @contextlib.contextmanager
    def holding(self, shas: Iterable[str]) -> Iterator[None]:
        """Blobs a staging relies on until it commits: eviction leaves them."""
        held = list(set(shas))
        with self._lock:
            for s in held:
                self._held.blobs[s] = self._held.blobs.get(s, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                for s in held:
                    n = self._held.blobs.get(s, 0) - 1
                    if n > 0:
                        self._held.blobs[s] = n
                    else:
                        self._held.blobs.pop(s, None)

    # -- making objects -----------------------------------------------------------------------

    def ingest(self, src: Path, *, kind: Kind = "data") -> Manifest:
        """Copy what is under `src` (a directory, or one file) into blobs and commit it as an
        object; Conflict when a file changed while it was read (it is still being written)."""
        snap = self.snap(src)
        if snap.unstable:
            raise Conflict(f"{snap.unstable[0]!r} changed while it was read", snap.unstable[0])
        manifest = snap.manifest()
        self.commit(manifest, kind=kind)
        return manifest

    def snap(self, src: Path, known: dict[str, Stat] | None = None) -> Snapshot:
        """A snapshot of `src` whose files' bytes are all in blobs (sites.agent.data.snapshot)."""
        return snapshot(src, known=known, copy=self.sink(), has_blob=self.has_blob)

    def commit(
        self,
        manifest: Manifest,
        *,
        kind: Kind = "data",
        pinned: bool = False,
        egress: tuple[Egress, ...] = (),
    ) -> Path:
        """Make `manifest` a complete object from blobs held here: its tree, then its manifest
        file last. Conflict naming the first file whose blob is missing or of another size."""
        digest = manifest.digest
        with self._lock:
            entry = self._entries.get(digest)
            if entry is not None:
                entry.used_at = self.clock()
                entry.pinned = entry.pinned or pinned
                if kind == "data":
                    entry.kind = "data"  # a dataset's is recorded, even if a checkpoint's too
                if egress and not entry.egress:
                    entry.egress = egress
                self._dirty = True
                return self.objects / digest
        with self.holding(f.sha256 for f in manifest.files):
            for f in manifest.files:
                size = self._blob_bytes.get(f.sha256)
                if size is None:
                    raise Conflict(f"file {f.path!r}: no blob {f.sha256[:12]} here", f.path)
                if size != f.size:
                    raise Conflict(
                        f"file {f.path!r}: the blob of its sha256 has {size} bytes, the "
                        f"manifest says {f.size}",
                        f.path,
                    )
            tmp = self.objects / f".{digest}.{secrets.token_hex(4)}.tmp"
            tmp.mkdir()
            try:
                self._materialize(manifest, tmp)
            except BaseException:
                _remove(tmp)
                raise
            target = self.objects / digest
            now = self.clock()
            with self._lock:
                if target.exists():
                    _remove(target)  # torn: a tree without its manifest
                os.replace(tmp, target)
                _fsync_dir(self.objects)
                _write_atomic(
                    self.manifests / f"{digest}.json", manifest.model_dump_json().encode()
                )
                entry = Entry(
                    bytes=manifest.bytes, files=len(manifest.files), at=now, used_at=now,
                    kind=kind, pinned=pinned, egress=egress,
                )  # fmt: skip
                self._add(digest, manifest, entry)
                self._dirty = True
        self.flush()
        return target

    def _materialize(self, manifest: Manifest, into: Path) -> None:
        dirs: set[Path] = {into}
        for f in manifest.files:
            dest = into / f.path
            parent = dest.parent
            if parent not in dirs:
                parent.mkdir(parents=True, exist_ok=True)
                p = parent
                while p not in dirs:
                    dirs.add(p)
                    p = p.parent
            blob = self.blobs / f.sha256
            try:
                os.link(blob, dest)
            except OSError as exc:
                if exc.errno not in (errno.EMLINK, errno.EXDEV, errno.EPERM):
                    raise
                shutil.copyfile(blob, dest)  # too many links, or no links here
                os.chmod(dest, FILE_MODE)
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            os.chmod(d, DIR_MODE)
            _fsync_dir(d)

    # -- uploads -------------------------------------------------------------------------------

    def upload_file(self, upload_id: str, path: str) -> Path:
        """Where an upload's file goes (its parents made); BadInput for a bad id."""
        check_name(upload_id, "upload")
        base = self.incoming / upload_id
        dest = base / "files" / path
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
        except (NotADirectoryError, FileExistsError) as exc:
            raise Conflict(f"{path!r}: a part of it is a file of this upload", path) from exc
        os.utime(base)  # alive: the sweep counts an hour from the last file
        return dest

    def commit_upload(self, upload_id: str, manifest: Manifest) -> Manifest:
        """Check every file of `manifest` against what the upload holds (size, then sha256),
        keep them as blobs, commit the object; Conflict naming the first bad or missing file.
        Blocking (hashes): call it in a thread."""
        check_name(upload_id, "upload")
        base = self.incoming / upload_id / "files"
        if not base.exists() and self.has(manifest.digest):
            return manifest  # committed already: a retry after a lost answer
        for f in manifest.files:
            p = base / f.path
            try:
                st = os.lstat(p)
            except (FileNotFoundError, NotADirectoryError):
                raise Conflict(f"file {f.path!r} was not uploaded", f.path) from None
            if not stat.S_ISREG(st.st_mode):
                raise Conflict(f"file {f.path!r} is not a regular file", f.path)
            if st.st_size != f.size:
                raise Conflict(
                    f"file {f.path!r} has {st.st_size} bytes, the manifest says {f.size}", f.path
                )
            sha = _hash_file(p)
            if sha != f.sha256:
                raise Conflict(
                    f"file {f.path!r} has sha256 {sha}, the manifest says {f.sha256}", f.path
                )
        with self.holding(f.sha256 for f in manifest.files):
            for f in manifest.files:
                p = base / f.path
                if p.exists():
                    self.adopt(f.sha256, p)
            self.commit(manifest)
        _remove(self.incoming / upload_id)
        return manifest

    def sweep_incoming(self, *, max_age_s: float) -> list[str]:
        """Remove uploads untouched for `max_age_s`; their ids."""
        now = time.time()
        gone = []
        for p in self.incoming.iterdir():
            try:
                age = now - p.stat().st_mtime
            except FileNotFoundError:
                continue
            if age >= max_age_s:
                _remove(p)
                gone.append(p.name)
        return gone

    # -- checkpoints -----------------------------------------------------------------------

    def _job_dir(self, tenant: str, job: str) -> Path:
        return self.checkpoints / check_name(tenant, "tenant") / check_name(job, "job")

    def marks(self, tenant: str, job: str) -> list[CheckpointMark]:
        """The job's complete checkpoints here, oldest first."""
        d = self._job_dir(tenant, job)
        if not d.is_dir():
            return []
        marks = [_read_mark(p) for p in sorted(d.glob("*.json"))]
        return [m for m in marks if m is not None and m.digest in self._manifests]

    def latest(self, tenant: str, job: str) -> CheckpointMark | None:
        marks = self.marks(tenant, job)
        return marks[-1] if marks else None

    def put_checkpoint(
        self,
        tenant: str,
        job: str,
        seq: int,
        manifest: Manifest,
        *,
        at: float,
        step: int | None,
        site: str,
    ) -> CheckpointMark:
        """Commit a checkpoint from blobs held here, then its entry (written last); keep the
        newest CHECKPOINTS_KEPT. Conflict: a missing blob (naming the file), or a `seq` not
        after the latest (the same seq with the same digest is answered as before)."""
        if seq < 1:
            raise BadInput(f"seq must be 1 or more, got {seq}", "seq")
        marks = self.marks(tenant, job)
        for m in marks:
            if m.seq == seq:
                if m.digest == manifest.digest:
                    return m
                raise Conflict(f"checkpoint {seq} of {tenant}/{job} is another one", "seq")
        if marks and seq < marks[-1].seq:
            raise Conflict(f"seq {seq} is not after the latest checkpoint {marks[-1].seq}", "seq")
        holder = f"checkpoint:{tenant}/{job}/{seq}"
        self.commit(manifest, kind="ckpt")
        self.acquire(manifest.digest, holder)
        try:
            mark = CheckpointMark(
                seq=seq, at=at, step=step, site=site, digest=manifest.digest,
                bytes=manifest.bytes,
            )  # fmt: skip
            d = self._job_dir(tenant, job)
            d.mkdir(parents=True, exist_ok=True)
            _write_atomic(d / f"{seq:010d}.json", mark.model_dump_json().encode())
            self._ckpt_refs[mark.digest] += 1
        finally:
            self.release(holder)
        kept = [*marks, mark][-CHECKPOINTS_KEPT:]
        keep = {m.digest for m in kept}
        for old in [*marks, mark][:-CHECKPOINTS_KEPT]:
            (d / f"{old.seq:010d}.json").unlink(missing_ok=True)
            self._ckpt_refs[old.digest] -= 1
            if old.digest not in keep and not self._in_checkpoints(old.digest):
                entry = self._entries.get(old.digest)
                if entry is not None and entry.kind == "ckpt" and not entry.pinned:
                    self.drop(old.digest)
        return mark

    def expire_checkpoints(self, *, max_age_s: float) -> list[str]:
        """Delete the checkpoints of every job none was added for in `max_age_s` (a finished
        job's, by its last one's time): entries first, then their objects unless pinned or
        named by another job's checkpoint. The jobs ('tenant/job') whose checkpoints went."""
        now = self.clock()
        gone: list[str] = []
        dropped: set[str] = set()
        for d in sorted(p for p in self.checkpoints.glob("*/*") if p.is_dir()):
            entries = sorted(d.glob("*.json"))
            if entries and now - max(_mtime(e) for e in entries) < max_age_s:
                continue
            marks = [m for m in (_read_mark(e) for e in entries) if m is not None]
            for e in entries:
                e.unlink(missing_ok=True)
            for m in marks:
                self._ckpt_refs[m.digest] -= 1
            _remove(d)
            dropped.update(m.digest for m in marks)
            gone.append(f"{d.parent.name}/{d.name}")
        for digest in sorted(dropped):
            entry = self._entries.get(digest)
            if entry is not None and entry.kind == "ckpt" and not entry.pinned:
                if not self._in_checkpoints(digest):
                    self.drop(digest)
        return gone

    def checkpoint_digests(self, tenant: str, job: str) -> set[str]:
        return {m.digest for m in self.marks(tenant, job)}

    def _in_checkpoints(self, digest: str) -> bool:
        return self._ckpt_refs[digest] > 0

    # -- use, pins, eviction ---------------------------------------------------------------

    def acquire(self, digest: str, holder: str) -> Path:
        """`holder` (a job, a request) uses the object: it is not evicted until released."""
        with self._lock:
            path = self.tree(digest)
            self._held.users.setdefault(digest, set()).add(holder)
            return path

    def release(self, holder: str) -> list[str]:
        """Everything `holder` acquired is released; the digests deleted now (dropped ones)."""
        gone = []
        with self._lock:
            for digest, holders in list(self._held.users.items()):
                holders.discard(holder)
                if not holders:
                    del self._held.users[digest]
                    if digest in self._held.doomed:
                        gone.append(digest)
        for digest in gone:
            self.drop(digest)
        return gone

    def in_use(self, digest: str) -> bool:
        return bool(self._held.users.get(digest))

    def pin(self, digest: str, *, egress: tuple[Egress, ...] | None = None) -> None:
        with self._lock:
            entry = self.entry(digest)
            entry.pinned = True
            self._held.doomed.discard(digest)
            if egress is not None:
                entry.egress = egress
            self._dirty = True
        self.flush()

    def unpin(self, digest: str) -> None:
        with self._lock:
            entry = self._entries.get(digest)
            if entry is not None:
                entry.pinned = False
                self._dirty = True
        self.flush()

    def drop(self, digest: str) -> bool:
        """Delete the object now, or once its last user releases it; True if deleted now."""
        with self._lock:
            if digest not in self._manifests:
                return False
            if self.in_use(digest):
                self._held.doomed.add(digest)
                return False
            self._held.doomed.discard(digest)
            trash, shas = self._unlink_object(digest)
            freed = self._free_blobs(self._orphans(shas))
        _remove(trash)
        self._delete_blobs(freed)
        self.flush()
        return True

    def evict_to(self, limit_bytes: int | None = None) -> list[str]:
        """Delete least recently used objects (not pinned, in use, or a kept checkpoint) and
        the blobs no object references, until the blobs take at most `limit_bytes` (the
        store's limit by default); the digests deleted."""
        limit = self.limit_bytes if limit_bytes is None else limit_bytes
        evicted: list[str] = []
        trash: list[Path] = []
        now = time.time()
        with self._lock:
            # garbage first: blobs no object uses, not held, and old enough not to be a push
            freed = self._free_blobs(
                s
                for s in self._orphans(self._blob_bytes)
                if now - _mtime(self.blobs / s) >= FRESH_BLOB_S
            )
            total = sum(self._blob_bytes.values())
            if total > limit:
                protected = self._protected()
                order = sorted(
                    (e.used_at, d)
                    for d, e in self._entries.items()
                    if d not in protected
                )  # fmt: skip
                for _, digest in order:
                    if total <= limit:
                        break
                    gone, shas = self._unlink_object(digest)
                    trash.append(gone)
                    evicted.append(digest)
                    more = self._free_blobs(self._orphans(shas))
                    total -= sum(size for _, size in more)
                    freed += more
            if total > limit:
                log.warning(
                    "data store %s holds %d bytes over its limit of %d: the rest is pinned, in "
                    "use or a kept checkpoint", self.root, total - limit, limit,
                )  # fmt: skip
        for p in trash:
            _remove(p)
        self._delete_blobs(freed)
        if evicted:
            self.flush()
        return evicted

    def _protected(self) -> set[str]:
        kept = {d for d, n in self._ckpt_refs.items() if n > 0}
        pinned = {d for d, e in self._entries.items() if e.pinned}
        return kept | pinned | {d for d, users in self._held.users.items() if users}

    def _orphans(self, shas: Iterable[str]) -> list[str]:
        """Of `shas`, the blobs held here that no complete object uses and no staging holds."""
        return [
            s
            for s in list(shas)
            if s in self._blob_bytes and not self._refs.get(s) and not self._held.blobs.get(s)
        ]

    def _unlink_object(self, digest: str) -> tuple[Path, set[str]]:
        """Under the lock: the manifest goes first (the object is incomplete from then on),
        the tree is renamed aside for the caller to delete outside the lock."""
        (self.manifests / f"{digest}.json").unlink(missing_ok=True)
        manifest = self._manifests.pop(digest)
        self._entries.pop(digest, None)
        self._dirty = True
        shas = {f.sha256 for f in manifest.files}
        for sha in shas:
            n = self._refs.get(sha, 0) - 1
            if n > 0:
                self._refs[sha] = n
            else:
                self._refs.pop(sha, None)
        trash = self.objects / f".{digest}.{secrets.token_hex(4)}.gone"
        with contextlib.suppress(FileNotFoundError):
            os.replace(self.objects / digest, trash)
        return trash, shas

    def _free_blobs(self, shas: Iterable[str]) -> list[tuple[str, int]]:
        """Under the lock: forget these blobs; (sha, size) for the caller to delete."""
        out = []
        for s in list(shas):
            size = self._blob_bytes.pop(s, None)
            if size is not None:
                out.append((s, size))
        return out

    def _delete_blobs(self, freed: list[tuple[str, int]]) -> None:
        for sha, _ in freed:
            (self.blobs / sha).unlink(missing_ok=True)


def _read_mark(path: Path) -> CheckpointMark | None:
    try:
        return CheckpointMark.model_validate_json(path.read_bytes())
    except (OSError, ValidationError):
        return None


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Delete a file or a tree, read-only directories included."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        path.unlink(missing_ok=True)
        return
    for d, _, _ in os.walk(path):
        with contextlib.suppress(OSError):
            os.chmod(d, 0o700)
    shutil.rmtree(path, ignore_errors=True)
