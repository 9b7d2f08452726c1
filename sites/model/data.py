"""Data that follows the work: the values the broker, the agents and their data stores share.

A dataset version is a Manifest: files with their sizes and sha256. Its digest (the sha256 of
its canonical JSON) names it everywhere below the broker: an agent's data store keeps each file
once by its sha256 (a blob) and each manifest it holds complete by its digest, so two versions
or two tenants holding the same bytes share them, and an unchanged checkpoint file is never sent
twice. Who may read what is decided by the broker alone, which hands out Grants: short-lived
tokens signed with the serving agent's own data key (sites.model.status.AgentSecret.data_key),
which that agent checks without asking anyone (docs/data.md).

What travels with a job (sites.model.assignments):
- `StageInput`: a dataset version the job reads at `path`, and the replicas it may be pulled
  from (each with a read grant);
- `OutputSpec`: a directory of the work dir saved as a new version when the job succeeds;
- `CheckpointPlan`: where checkpoints are synced to (a durable replica at another site) and
  whether this run resumes from the last complete one.
What comes back in the job's reports: `StagingProgress`, `CheckpointMark`, `OutputMade`,
`Egress` (bytes pulled per source site, billed by the broker).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import posixpath
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_FILES = 10_000  # files in one version; a larger tree is packed (tar) first
MAX_PATH = 512
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
DATASET_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
CHECKPOINT_DIR = "checkpoint"  # CPN_CHECKPOINT_PATH's default, inside the run's work dir


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def clean_path(path: str, what: str = "path") -> str:
    """A relative POSIX path with no '..', no empty or '.' part; ValueError naming `what`."""
    if not path or len(path) > MAX_PATH:
        raise ValueError(f"{what} must be 1 to {MAX_PATH} characters")
    if path.startswith("/") or "\\" in path or "\x00" in path:
        raise ValueError(f"{what} {path!r} must be relative, with '/' between parts")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{what} {path!r} may not contain empty, '.' or '..' parts")
    return path


# clean_path's rule as a JSON Schema pattern: parts of any character but '/', '\\' and NUL,
# none of them '.' or '..' (no lookahead: every generator reads this)
PATH_PART = r"(?:[^/\\\x00.][^/\\\x00]*|\.[^/\\\x00.][^/\\\x00]*|\.\.[^/\\\x00]+)"
PATH_PATTERN = f"^{PATH_PART}(?:/{PATH_PART})*$"


class FileEntry(Frozen):
    path: str = Field(
        description="relative to the dataset's root, '/' between parts",
        json_schema_extra={"minLength": 1, "maxLength": MAX_PATH, "pattern": PATH_PATTERN},
    )
    size: int = Field(ge=0, description="bytes")
    sha256: str = Field(json_schema_extra={"pattern": SHA256_RE.pattern})

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        return clean_path(value)

    @field_validator("sha256")
    @classmethod
    def _sha(cls, value: str) -> str:
        if not SHA256_RE.match(value):
            raise ValueError("must be 64 lowercase hex digits")
        return value


class Manifest(Frozen):
    """A dataset version or a checkpoint: its files, sorted by path, each path once."""

    files: tuple[FileEntry, ...] = Field(
        max_length=MAX_FILES,
        description="each path once, and no path both a file and another's directory (not "
        "expressible in JSON Schema: a 400 names files otherwise)",
    )

    @field_validator("files")
    @classmethod
    def _sorted_unique(cls, files: tuple[FileEntry, ...]) -> tuple[FileEntry, ...]:
        ordered = tuple(sorted(files, key=lambda f: f.path))
        seen: set[str] = set()
        for f in ordered:
            if f.path in seen:
                raise ValueError(f"path {f.path!r} is listed twice")
            # a file and a directory of the same name cannot both exist
            parent = posixpath.dirname(f.path)
            while parent:
                if parent in seen:
                    raise ValueError(f"{parent!r} is both a file and a directory")
                parent = posixpath.dirname(parent)
            seen.add(f.path)
        return ordered

    def canonical(self) -> bytes:
        return json.dumps(
            [[f.path, f.size, f.sha256] for f in self.files], separators=(",", ":")
        ).encode()

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.canonical()).hexdigest()

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)


class Source(Frozen):
    """One place a manifest (or a job's checkpoints) can be read from or written to."""

    site: str
    url: str = Field(description="the agent's advertised base URL (the WAN front when emulated)")
    grant: str = Field(description="a Grant token signed with that agent's data key")


class StageInput(Frozen):
    """A dataset version the job reads, mounted read-only at `path`."""

    dataset: str = Field(description="tenant/name@version, for messages")
    digest: str = Field(description="the version's manifest digest")
    bytes: int = Field(ge=0)
    path: str = Field(description="where the job sees it: absolute in the sandbox, or relative "
                      "to its work dir")  # fmt: skip
    local: str | None = Field(
        default=None, description="set by the agent once staged: the read-only tree to mount"
    )
    sources: tuple[Source, ...] = Field(
        default=(), description="replicas to pull from, best first (none: held here)"
    )


class OutputSpec(Frozen):
    """A directory (or file) of the work dir saved as a new version of `dataset` on success."""

    path: str
    dataset: str = Field(description="tenant/name")
    store: Source | None = Field(
        default=None, description="where a copy is pushed besides this site (none: here only)"
    )


class CheckpointPlan(Frozen):
    """The run's checkpoints: `path` inside the work dir (CPN_CHECKPOINT_PATH), synced every
    `interval_s` to `store`; `restore`: stage the last complete one first (CPN_RESUME=1)."""

    path: str = CHECKPOINT_DIR
    interval_s: float = Field(default=300.0, gt=0)
    store: Source | None = Field(default=None, description="the durable replica's agent")
    restore: bool = False


class StagingProgress(Frozen):
    bytes_done: int = Field(ge=0)
    bytes_total: int = Field(ge=0)
    rate_bps: float = Field(default=0.0, ge=0, description="bytes per second, recent")
    eta_s: float | None = Field(default=None, ge=0)
    source: str | None = Field(default=None, description="the site pulled from now")
    what: str = Field(default="", description="the input or checkpoint being staged")


class CheckpointMark(Frozen):
    """A complete checkpoint at the durable replica (its manifest written last)."""

    seq: int = Field(ge=1)
    at: float = Field(description="unix seconds it was taken")
    step: int | None = Field(default=None, description="the job's own step, from a `step` file")
    site: str = Field(description="the site holding it")
    digest: str
    bytes: int = Field(ge=0)


class OutputMade(Frozen):
    dataset: str = Field(description="tenant/name")
    digest: str
    bytes: int = Field(ge=0)
    files: int = Field(ge=0)
    sites: tuple[str, ...] = Field(description="sites holding it complete")


class Egress(Frozen):
    """Bytes this run pulled from another site (for inputs or a checkpoint): billed."""

    source: str
    bytes: int = Field(ge=0)


class ReplicaRecord(Frozen):
    """At /cpn/v1/data-replicas/<site>/<digest>, written by that site's agent once every file
    of the manifest is in its store and checked; deleted when it evicts it."""

    digest: str
    bytes: int = Field(ge=0)
    files: int = Field(ge=0)
    at: float = Field(description="unix seconds it became complete")
    pinned: bool = Field(default=False, description="kept: never evicted by the cache")
    egress: tuple[Egress, ...] = Field(
        default=(), description="what pulling it cost other sites (a replication's, billed)"
    )


class ReplicationOrder(Frozen):
    """At /cpn/v1/data-orders/<site>/<digest>, written by the broker (`cpn data replicate`):
    the site's agent pulls the manifest from `sources` and pins it; the broker deletes the
    order once the site's replica record is there."""

    digest: str
    dataset: str = Field(description="tenant/name@version, for messages")
    bytes: int = Field(ge=0)
    action: Literal["pull", "drop"] = Field(
        default="pull", description="pull: hold it pinned; drop: unpin and delete it"
    )
    sources: tuple[Source, ...] = ()
    pin: bool = True
    ordered_at: float


# -- grants ----------------------------------------------------------------------------------

Op = Literal["read", "write"]


class GrantError(Exception):
    """A grant that is malformed, forged, expired, or not for this site, scope or op."""


class Claims(Frozen):
    site: str = Field(description="the serving site: whose data key signs it")
    sub: str = Field(description="who uses it: a site id, or 'broker'")
    scope: str = Field(
        description="obj:<digest> | ckpt:<tenant>/<job> | upload:<tenant>/<id> | "
        "backups:federation (the registry's backups kept at the site: brokers only)"
    )
    op: Op
    exp: float = Field(description="unix seconds it expires")

    @model_validator(mode="after")
    def _scope(self) -> Claims:
        kind, _, rest = self.scope.partition(":")
        if kind not in ("obj", "ckpt", "upload", "backups") or not rest:
            raise ValueError(f"unknown scope {self.scope!r}")
        return self


def mint(key: str, claims: Claims) -> str:
    """`claims` signed with `key` (the serving agent's data key): '<payload>.<mac>', base64url."""
    payload = base64.urlsafe_b64encode(claims.model_dump_json().encode()).rstrip(b"=")
    mac = hmac.new(key.encode(), payload, hashlib.sha256).digest()
    return f"{payload.decode()}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}"


def verify(key: str, token: str, *, site: str, now: float) -> Claims:
    """The claims of `token` if `key` signed it for `site` and it has not expired."""
    payload, dot, mac = token.partition(".")
    if not dot:
        raise GrantError("malformed grant")
    want = hmac.new(key.encode(), payload.encode(), hashlib.sha256).digest()
    try:
        given = base64.urlsafe_b64decode(mac + "=" * (-len(mac) % 4))
        raw = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
    except ValueError as exc:
        raise GrantError("malformed grant") from exc
    if not hmac.compare_digest(want, given):
        raise GrantError("grant not signed by this site")
    try:
        claims = Claims.model_validate_json(raw)
    except ValueError as exc:
        raise GrantError("malformed grant") from exc
    if claims.site != site:
        raise GrantError(f"grant is for site {claims.site}")
    if claims.exp < now:
        raise GrantError("grant expired")
    return claims


BACKUPS_SCOPE = "backups:federation"  # the registry's backups a site keeps (docs/backup.md)


def allows(claims: Claims, scope: str, op: Op) -> bool:
    """Whether `claims` cover `op` on `scope` (a write grant reads too)."""
    return claims.scope == scope and (claims.op == op or claims.op == "write")


def parse_ref(ref: str, *, tenant: str | None = None) -> tuple[str, str, int | None]:
    """'name', 'name@3', 'tenant/name@3' -> (tenant, name, version or None for the latest);
    ValueError naming what is wrong. `tenant`: the owner when the ref names none."""
    body, at, version = ref.partition("@")
    owner, slash, name = body.rpartition("/")
    if not slash:
        owner = tenant or ""
    if not owner:
        raise ValueError(f"{ref!r} names no tenant (tenant/name@version)")
    if not DATASET_NAME_RE.match(name):
        raise ValueError(
            f"dataset name {name!r} must be 1-63 of a-z 0-9 . _ -, starting with a letter or digit"
        )
    if not at:
        return owner, name, None
    if not version.isdigit() or int(version) < 1:
        raise ValueError(f"version in {ref!r} must be a whole number from 1")
    return owner, name, int(version)
