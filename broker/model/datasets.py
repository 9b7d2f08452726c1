"""Datasets: named, versioned, tenant-owned sets of files (docs/data.md). Pure: records, request
bodies and their checks, no I/O.

Stored (sites.model.keys):

    /cpn/v1/datasets/<tenant>/<name>/meta         DatasetMeta     owner, shares, latest version
    /cpn/v1/datasets/<tenant>/<name>/v/<version>  DatasetVersion  digest, size, files, made by
    /cpn/v1/index/datasets/<tenant>/<name>        ""              every dataset (an admin's list)
    /cpn/v1/index/tenants/<t>/datasets/<o>/<n>    ""              what tenant t owns or is shared
    /cpn/v1/data-refs/<digest>/<t>/<n>/<version>  ""              the versions naming a manifest
    /cpn/v1/data-manifests/<digest>               zlib(Manifest)  the files, once per digest

A version's bytes live in the sites' data stores (sites.model.data: a manifest's digest names
them); which sites hold a version complete is the agents' replica records, never stored here.
Every change of these keys is one transaction of broker.ops.datasets guarded on the meta's
mod_revision, so two commits at once get two versions and an interrupted put leaves nothing.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from broker.model.errors import NotFound
from broker.model.jobs import NAME_RE, given
from sites.model.data import DATASET_NAME_RE, Manifest

__all__ = [
    "MAX_SHARES",
    "DatasetInfo",
    "DatasetMeta",
    "DatasetNotFound",
    "DatasetSummary",
    "DatasetVersion",
    "PutBegin",
    "ReplicateRequest",
    "ReplicationStarted",
    "ShareRequest",
    "UploadCommit",
    "UploadStarted",
    "VersionInfo",
    "check_name",
]

MAX_SHARES = 32  # tenants a dataset is shared with: each is an index key in its writes
MAX_DESCRIPTION = 500

TenantName = Annotated[str, Field(pattern=NAME_RE)]
SiteName = Annotated[str, Field(pattern=NAME_RE)]


class DatasetNotFound(NotFound):
    """No such dataset or version, or one the caller may not see (the two read the same):
    404, naming the field that named it."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def check_name(name: str) -> str:
    """A dataset name (sites.model.data.DATASET_NAME_RE), else ValueError saying the rule."""
    if not DATASET_NAME_RE.match(name):
        raise ValueError(
            f"dataset name {name!r} must be 1-63 of a-z 0-9 . _ -, starting with a letter or digit"
        )
    return name


class DatasetMeta(Frozen):
    """/cpn/v1/datasets/<tenant>/<name>/meta: the dataset itself."""

    tenant: str = Field(description="the owner")
    name: str
    shared_with: tuple[str, ...] = Field(
        default=(), description="tenants that may read and use it (not write, share or delete)"
    )
    latest: int = Field(ge=0, description="the newest version; 0 before the first")
    created_at: float = Field(description="unix s")
    updated_at: float = Field(description="unix s: the last version, share or removal")
    description: str = Field(default="", max_length=MAX_DESCRIPTION)

    def visible_to(self, tenant: str | None) -> bool:
        """Whether `tenant` may read it (None: an admin's or operator's token, every tenant)."""
        return tenant is None or tenant == self.tenant or tenant in self.shared_with


class DatasetVersion(Frozen):
    """/cpn/v1/datasets/<tenant>/<name>/v/<version>: one immutable version."""

    tenant: str
    name: str
    version: int = Field(ge=1)
    digest: str = Field(description="the manifest's digest (sites.model.data.Manifest.digest)")
    bytes: int = Field(ge=0)
    files: int = Field(ge=0)
    created_at: float = Field(description="unix s")
    made_by: str = Field(description="'put by <token id>' or 'job <id>'")
    home: str = Field(description="the site it was first stored at")

    @property
    def ref(self) -> str:
        return f"{self.tenant}/{self.name}@{self.version}"


# -- request bodies ----------------------------------------------------------------------------


class PutBegin(Frozen):
    """POST /v1/datasets/{owner}/{name}/uploads: a new version's files, and where to store it
    (a site or a region, not both; neither: the best site)."""

    model_config = ConfigDict(
        json_schema_extra={"not": {"allOf": [given("site"), given("region")]}}
    )

    manifest: Manifest = Field(description="the files: path, size, sha256 (sorted, unique)")
    site: SiteName | None = Field(default=None, description="store it at this site")
    region: TenantName | None = Field(
        default=None, description="store it at a live site of this region"
    )
    description: str | None = Field(
        default=None, max_length=MAX_DESCRIPTION, description="sets the dataset's description"
    )

    @model_validator(mode="after")
    def _one_place(self) -> PutBegin:
        if self.site is not None and self.region is not None:
            raise ValueError("name a site or a region, not both")
        return self


class UploadStarted(Frozen):
    """The answer to a begun put: PUT each file under `upload`, then commit."""

    upload: str = Field(description="the upload's id, in the file and commit paths")
    site: str = Field(description="the site storing it")
    digest: str
    bytes: int
    files: int
    expires_at: float = Field(description="unix s: the upload's grant ends (begin again after)")


class UploadCommit(Frozen):
    """POST .../uploads/{id}/commit: the manifest the files were uploaded for."""

    manifest: Manifest
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION)


class ShareRequest(Frozen):
    """PUT /v1/datasets/{owner}/{name}/shares: tenants to add to and remove from its shares,
    at least one; a tenant in both lists is a 400 (not expressible in JSON Schema)."""

    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"required": ["add"], "properties": {"add": {"minItems": 1}}},
                {"required": ["remove"], "properties": {"remove": {"minItems": 1}}},
            ]
        }
    )

    add: tuple[TenantName, ...] = Field(default=(), max_length=MAX_SHARES)
    remove: tuple[TenantName, ...] = Field(default=(), max_length=MAX_SHARES)

    @model_validator(mode="after")
    def _disjoint(self) -> ShareRequest:
        both = sorted(set(self.add) & set(self.remove))
        if both:
            raise ValueError(f"tenant {both[0]!r} is both added and removed")
        if not self.add and not self.remove:
            raise ValueError("name tenants to add or remove")
        return self


class ReplicateRequest(Frozen):
    """POST /v1/datasets/{owner}/{name}/replicate: keep a version (default the latest) pinned
    at a site, or at the best site of a region."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [given("site"), given("region")]})

    version: int | None = Field(default=None, ge=1, description="default: the latest")
    site: SiteName | None = None
    region: TenantName | None = None

    @model_validator(mode="after")
    def _one_place(self) -> ReplicateRequest:
        if (self.site is None) == (self.region is None):
            raise ValueError("name a site or a region (one of them)")
        return self


class ReplicationStarted(Frozen):
    dataset: str = Field(description="tenant/name@version")
    digest: str
    site: str
    state: str = Field(description="ordered: the site pulls it; held: it has it already")
    sources: list[str] = Field(description="the sites it is pulled from")


# -- answers -----------------------------------------------------------------------------------


class DatasetSummary(Frozen):
    """One dataset in a list."""

    tenant: str
    name: str
    latest: int
    shared_with: tuple[str, ...]
    description: str
    created_at: float
    updated_at: float

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_name(value)


class VersionInfo(Frozen):
    version: int
    digest: str
    bytes: int
    files: int
    created_at: float
    made_by: str
    home: str
    replicas: list[str] = Field(description="sites holding it complete, now")


class DatasetInfo(DatasetSummary):
    """GET /v1/datasets/{owner}/{name}: the dataset and its versions, newest first."""

    versions: list[VersionInfo]
