"""Datasets' operations (any replica): put (begin, files, commit), list, describe, remove,
replicate, share, resolve. docs/data.md has the long form; the leader's clearing of done
replication orders is broker.ops.data_orders. Over 600 lines: every write of the dataset keys
(put, remove, share, replicate) is here, so that they guard the same keys the same way.

Every change is ONE etcd transaction guarded on the mod_revision of what it read (the
dataset's meta first), carrying the call's audit entry (broker.model.audit_intent); a lost race
reads again and retries. A put is three steps: `begin` chooses the site and mints an upload
grant (nothing is written), each file goes to that site's agent under the grant, and `commit`
asks the agent to check the files against the manifest and then registers the version in one
transaction (version number from the meta's revision, the version record, the meta's latest,
the manifest, the reference): an interrupted put registers nothing; its unreferenced blobs are
the agent's to collect.

Visibility: a tenant sees its own datasets and those shared with it; another tenant's dataset
that is not shared with it reads exactly as one that does not exist (NotFound). A tenant it is
shared with may read and use it, never write, share or remove it (Forbidden).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote

import aiohttp
from pydantic import ValidationError

from broker.model.audit_intent import audit_puts, committed
from broker.model.datasets import (
    MAX_SHARES,
    DatasetInfo,
    DatasetMeta,
    DatasetNotFound,
    DatasetSummary,
    DatasetVersion,
    PutBegin,
    ReplicateRequest,
    ReplicationStarted,
    ShareRequest,
    UploadStarted,
    VersionInfo,
)
from broker.model.errors import BrokerError, Conflict, InvalidRequest, NotFound
from broker.model.jobs import NAME_RE
from broker.state.auth import Forbidden
from broker.state.data_index import DataIndex
from broker.state.view import View
from sites.kits.clock import Clock
from sites.model import keys
from sites.model.data import Manifest, ReplicationOrder, Source, parse_ref
from sites.registry.client import Guard, Registry

__all__ = [
    "DataPlaneError",
    "Datasets",
    "parse_upload",
]

log = logging.getLogger(__name__)

UPLOAD_TTL_S = 6 * 3600.0  # an upload's grant: begin again after it
ORDER_TTL_S = 24 * 3600.0  # a replication's read grants: the agent pulls within a day
READ_TTL_S = 3600.0  # a download's grant
RETRIES = 8  # a guarded write that lost a race reads again, at most this often
REMOVE_CHUNK = 24  # versions removed per transaction (4 ops each, within etcd's 128)
_UPLOAD_RE = re.compile(r"^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)\.([0-9a-f]{16})$")
_SITE_RE = re.compile(NAME_RE)


class DataPlaneError(BrokerError):
    """A site's agent refused or could not be reached: `status` (409, 502, 503) with a code."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field


def parse_upload(upload: str) -> str:
    """The site of an upload id ('<site>.<16 hex>'); InvalidRequest (field upload) if malformed."""
    m = _UPLOAD_RE.match(upload)
    if m is None:
        raise InvalidRequest(f"{upload!r} is not an upload id", field="upload")
    return m.group(1)


def _name(name: str, field: str = "name") -> str:
    try:
        parse_ref(f"x/{name}")
    except ValueError as exc:
        raise InvalidRequest(str(exc), field=field) from None
    return name


def _owner(owner: str) -> str:
    if not _SITE_RE.match(owner):
        raise InvalidRequest(f"{owner!r} is not a tenant name", field="owner")
    return owner


@dataclass(frozen=True)
class Found:
    """A dataset's meta as read, with its mod_revision."""

    meta: DatasetMeta
    revision: int


class Datasets:
    """The datasets' operations over the registry, the DataIndex and the view."""

    def __init__(
        self,
        *,
        registry: Registry,
        index: DataIndex,
        clock: Clock,
        view: Callable[[], View],
    ) -> None:
        self.registry = registry
        self.index = index
        self.clock = clock
        self.view = view

    # -- reads ---------------------------------------------------------------------------------

    async def _meta(self, owner: str, name: str) -> Found | None:
        got = await self.registry.get_raw(keys.dataset_meta(owner, name))
        if got is None:
            return None
        return Found(DatasetMeta.model_validate_json(got[0]), got[1])

    async def visible(self, owner: str, name: str, *, tenant: str | None) -> Found:
        """The dataset if `tenant` may read it (None: any); NotFound else, as if absent."""
        found = await self._meta(_owner(owner), _name(name))
        if found is None or not found.meta.visible_to(tenant):
            raise DatasetNotFound(f"no dataset {owner}/{name}", field="name")
        return found

    async def writable(self, owner: str, name: str, *, tenant: str | None) -> Found | None:
        """The dataset (None: not there yet) if `tenant` may change it; a tenant it is only
        shared with is Forbidden, one that cannot see it gets NotFound."""
        found = await self._meta(_owner(owner), _name(name))
        if tenant is None or tenant == owner:
            return found
        if found is not None and found.meta.visible_to(tenant):
            raise Forbidden(
                f"dataset {owner}/{name} is shared with {tenant}: read it, not change it",
                field="owner",
            )
        raise DatasetNotFound(f"no dataset {owner}/{name}", field="name")

    async def _version(self, owner: str, name: str, version: int) -> tuple[DatasetVersion, int]:
        got = await self.registry.get_raw(keys.dataset_version(owner, name, version))
        if got is None:
            raise NotFound(f"no version {version} of dataset {owner}/{name}")
        return DatasetVersion.model_validate_json(got[0]), got[1]

    async def resolve(
        self, *, tenant: str | None, ref: str, field: str = "dataset"
    ) -> DatasetVersion:
        """The version `ref` names ('name@v', 'name' for the latest, 'owner/name@v'; the owner
        defaults to `tenant`) if `tenant` may read it. A malformed ref is InvalidRequest naming
        `field`; one that is not there or not visible is NotFound (never which of the two)."""
        try:
            owner, name, version = parse_ref(ref, tenant=tenant)
        except ValueError as exc:
            raise InvalidRequest(str(exc), field=field) from None
        found = await self._meta(owner, name)
        if found is None or not found.meta.visible_to(tenant):
            raise DatasetNotFound(f"no dataset {owner}/{name}", field=field)
        wanted = version if version is not None else found.meta.latest
        if wanted < 1:
            raise DatasetNotFound(f"dataset {owner}/{name} has no version yet", field=field)
        try:
            return (await self._version(owner, name, wanted))[0]
        except NotFound:
            raise DatasetNotFound(
                f"no version {wanted} of dataset {owner}/{name}", field=field
            ) from None

    async def manifest(self, digest: str) -> Manifest:
        got = await self.registry.get_raw(keys.data_manifest(digest))
        if got is None:
            raise NotFound(f"no manifest {digest}")
        return Manifest.model_validate_json(zlib.decompress(got[0]))

    async def page(
        self, *, tenant: str | None, limit: int, after: str | None
    ) -> tuple[list[DatasetSummary], str | None]:
        """A page of the datasets `tenant` owns or is shared (None: every dataset), by owner
        and name; the continue token is the next one's 'owner/name'. Reads the index page and
        the page's metas only."""
        prefix = keys.DATASET_INDEX if tenant is None else keys.tenant_datasets(tenant)
        start = prefix
        if after:
            owner, slash, name = after.partition("/")
            if not slash or not _SITE_RE.match(owner) or not name:
                raise InvalidRequest(f"{after!r} is not a continue token", field="continue")
            start = prefix + after
        found: list[str] = []
        async for page in self.registry.iter_range(start, prefix=prefix, page_keys=limit + 1):
            found += [key for key, _, _ in page.items]
            if len(found) > limit:
                break
        token = None
        if len(found) > limit:
            token, found = found[limit][len(prefix) :], found[:limit]
        names = [key[len(prefix) :].split("/", 1) for key in found]
        metas = await self.registry.get_many([keys.dataset_meta(o, n) for o, n in names])
        out = []
        for owner, name in names:
            got = metas.get(keys.dataset_meta(owner, name))
            if got is None:
                continue  # removed between the two reads
            meta = DatasetMeta.model_validate_json(got[0])
            out.append(DatasetSummary(**meta.model_dump()))
        return out, token

    async def describe(self, owner: str, name: str, *, tenant: str | None) -> DatasetInfo:
        found = await self.visible(owner, name, tenant=tenant)
        _, kvs = await self.registry.list_prefix(keys.dataset_versions(owner, name))
        versions = []
        for _, raw, _ in reversed(kvs):
            v = DatasetVersion.model_validate_json(raw)
            versions.append(
                VersionInfo(
                    version=v.version,
                    digest=v.digest,
                    bytes=v.bytes,
                    files=v.files,
                    created_at=v.created_at,
                    made_by=v.made_by,
                    home=v.home,
                    replicas=sorted(self.index.holders(v.digest)),
                )  # fmt: skip
            )
        meta = found.meta
        return DatasetInfo(**meta.model_dump(), versions=versions)

    # -- put -----------------------------------------------------------------------------------

    def _store_sites(self, region: str | None) -> list[str]:
        """Live sites with a data store, in `region` if given."""
        view = self.view()
        specs = view.sites.specs
        return sorted(
            site
            for site in self.index.stores()
            if site in specs
            and view.site_up(site)
            and (region is None or specs[site].region == region)
        )

    def choose_site(self, *, site: str | None, region: str | None, field: str = "site") -> str:
        """Where a new version goes: `site` if it has a live data store; else the live store
        of `region` holding the fewest replicas; else any live store's (the fewest)."""
        if site is not None:
            if site not in self._store_sites(None):
                raise InvalidRequest(f"site {site!r} is not up with a data store now", field=field)
            return site
        candidates = self._store_sites(region)
        if not candidates:
            where = f"in region {region!r}" if region else "in the federation"
            raise InvalidRequest(
                f"no site {where} is up with a data store now",
                field="region" if region else field,
            )
        return min(candidates, key=lambda s: (len(self.index.held_at(s)), s))

    async def begin(
        self, owner: str, name: str, body: PutBegin, *, tenant: str | None
    ) -> UploadStarted:
        """Choose the site and hand out an upload id and grant; writes nothing."""
        await self.writable(owner, name, tenant=tenant)
        site = self.choose_site(site=body.site, region=body.region)
        upload = f"{site}.{secrets.token_hex(8)}"
        manifest = body.manifest
        return UploadStarted(
            upload=upload,
            site=site,
            digest=manifest.digest,
            bytes=manifest.bytes,
            files=len(manifest.files),
            expires_at=self.clock.time() + UPLOAD_TTL_S,
        )

    def upload_target(self, owner: str, upload: str) -> Source:
        """The agent that takes `upload`'s files, with a write grant for it."""
        site = parse_upload(upload)
        if site not in self.view().sites.specs:
            raise DatasetNotFound(f"no upload {upload}: no site {site}", field="upload")
        got = self.index.source(
            site, sub="broker", scope=f"upload:{owner}/{upload}", op="write", ttl_s=UPLOAD_TTL_S
        )
        if got is None:
            raise DataPlaneError(503, "site_down", f"site {site} has no data store up now")
        return got

    async def commit(
        self,
        owner: str,
        name: str,
        upload: str,
        manifest: Manifest,
        *,
        tenant: str | None,
        made_by: str,
        description: str | None,
        http: aiohttp.ClientSession,
    ) -> DatasetVersion:
        """The agent checks the uploaded files against `manifest` (409 naming what is wrong
        or missing), then the version is registered in one transaction."""
        await self.writable(owner, name, tenant=tenant)
        target = self.upload_target(owner, upload)
        url = f"{target.url}/data/uploads/{quote(upload)}/commit"
        headers = {"X-Cpn-Grant": target.grant}
        try:
            async with http.post(url, data=manifest.model_dump_json(), headers=headers) as answer:
                body = await answer.read()
                status = answer.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise DataPlaneError(
                502, "site_unreachable", f"cannot reach the agent of {target.site}: {exc}"
            ) from None
        if status not in (200, 201):
            code, message, field = _agent_error(body, status)
            if status in (400, 404, 409, 422):
                raise DataPlaneError(409, code, message, _manifest_field(field))
            raise DataPlaneError(502, "site_error", f"{target.site}: {message}")
        return await self.register(
            owner, name, manifest, made_by=made_by, home=target.site, description=description
        )

    async def register(
        self,
        owner: str,
        name: str,
        manifest: Manifest,
        *,
        made_by: str,
        home: str,
        description: str | None = None,
        once: bool = False,
    ) -> DatasetVersion:
        """A new version of owner/name holding `manifest`, stored at `home`, in one transaction:
        the next version number (guarded on the meta's revision), the version record, the meta's
        latest, the manifest (zlib) and its reference. `once`: if the latest version already
        has this digest and `made_by` (a replayed job output), that version is returned."""
        _owner(owner)
        _name(name)
        digest = manifest.digest
        packed = zlib.compress(manifest.model_dump_json().encode())
        meta_key, manifest_key = keys.dataset_meta(owner, name), keys.data_manifest(digest)
        order_key = keys.data_order(home, digest)
        for _ in range(RETRIES):
            now = self.clock.time()
            got = await self.registry.get_many([meta_key, manifest_key, order_key])
            meta_got, manifest_got = got.get(meta_key), got.get(manifest_key)
            meta = DatasetMeta.model_validate_json(meta_got[0]) if meta_got else None
            if once and meta is not None and meta.latest:
                last, _ = await self._version(owner, name, meta.latest)
                if last.digest == digest and last.made_by == made_by:
                    return last
            number = (meta.latest if meta else 0) + 1
            version = DatasetVersion(
                tenant=owner, name=name, version=number, digest=digest, bytes=manifest.bytes,
                files=len(manifest.files), created_at=now, made_by=made_by, home=home,
            )  # fmt: skip
            if meta is None:
                meta = DatasetMeta(
                    tenant=owner, name=name, latest=number, created_at=now, updated_at=now,
                    description=description or "",
                )  # fmt: skip
            else:
                meta = meta.model_copy(
                    update={
                        "latest": number,
                        "updated_at": now,
                        "description": meta.description if description is None else description,
                    }
                )
            version_key = keys.dataset_version(owner, name, number)
            puts = {
                meta_key: meta.model_dump_json().encode(),
                version_key: version.model_dump_json().encode(),
                keys.data_ref(digest, owner, name, number): b"",
                # put even when there: its new revision fails a removal that read no reference
                manifest_key: packed,
            }
            guards = [
                Guard(meta_key, mod_revision=meta_got[1] if meta_got else 0),
                Guard(version_key, mod_revision=0),
                Guard(manifest_key, mod_revision=manifest_got[1] if manifest_got else 0),
            ]
            if meta_got is None:
                puts[keys.dataset_index(owner, name)] = b""
                puts[keys.tenant_dataset(owner, owner, name)] = b""
            deletes = []
            order = got.get(order_key)
            if order is not None and _is_drop(order[0]):
                # a removal's drop of these very bytes at their new home: they stay
                deletes.append(order_key)
                guards.append(Guard(order_key, mod_revision=order[1]))
            puts.update(audit_puts(owner, version.ref))
            if await self.registry.commit(guards=guards, puts=puts, deletes=deletes):
                committed()
                return version
        raise Conflict(f"dataset {owner}/{name} changed too often; try again", field="name")

    async def fetch_manifest(
        self, site: str, digest: str, *, http: aiohttp.ClientSession
    ) -> Manifest:
        """The manifest `digest` from `site`'s agent (a job's output made there: register it
        with `register(..., once=True)`); DataPlaneError when the site cannot give it."""
        source = self.index.source(
            site, sub="broker", scope=f"obj:{digest}", op="read", ttl_s=READ_TTL_S
        )
        if source is None:
            raise DataPlaneError(503, "site_down", f"site {site} has no data store up now")
        url = f"{source.url}/data/manifests/{digest}"
        try:
            async with http.get(url, headers={"X-Cpn-Grant": source.grant}) as answer:
                body = await answer.read()
                status = answer.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise DataPlaneError(502, "site_unreachable", f"cannot reach {site}: {exc}") from None
        if status != 200:
            code, message, _ = _agent_error(body, status)
            raise DataPlaneError(502, code, f"{site}: {message}")
        try:
            manifest = Manifest.model_validate_json(body)
        except ValidationError as exc:
            raise DataPlaneError(502, "site_error", f"{site}: a bad manifest: {exc}") from None
        if manifest.digest != digest:
            raise DataPlaneError(502, "site_error", f"{site}: manifest {digest} does not match")
        return manifest

    # -- remove ---------------------------------------------------------------------------------

    async def remove(
        self, owner: str, name: str, version: int | None, *, tenant: str | None
    ) -> DatasetMeta:
        """Remove one version, or (None) the whole dataset. A manifest no version names any
        more is deleted with the last version naming it, and each site holding it gets a drop
        order. A whole dataset of many versions goes REMOVE_CHUNK versions a transaction, the
        meta and its index entries with the last."""
        found = await self.writable(owner, name, tenant=tenant)
        if found is None:
            raise DatasetNotFound(f"no dataset {owner}/{name}", field="name")
        if version is not None:
            if version < 1:
                raise InvalidRequest("version must be a whole number from 1", field="version")
            await self._version(owner, name, version)
        lost = 0
        while lost < RETRIES:
            found = await self._meta(owner, name)
            if found is None:
                raise DatasetNotFound(f"no dataset {owner}/{name}", field="name")
            _, kvs = await self.registry.list_prefix(keys.dataset_versions(owner, name))
            versions = [(DatasetVersion.model_validate_json(raw), rev) for _, raw, rev in kvs]
            if version is not None:
                versions = [(v, r) for v, r in versions if v.version == version]
                if not versions:
                    raise NotFound(f"no version {version} of dataset {owner}/{name}")
            whole = version is None and len(versions) <= REMOVE_CHUNK
            done = await self._remove(found, versions[:REMOVE_CHUNK], whole=whole)
            if done and (version is not None or whole):
                return found.meta
            lost += 0 if done else 1
        raise Conflict(f"dataset {owner}/{name} changed too often; try again", field="name")

    async def _remove(
        self, found: Found, versions: list[tuple[DatasetVersion, int]], *, whole: bool
    ) -> bool:
        meta = found.meta
        owner, name = meta.tenant, meta.name
        now = self.clock.time()
        meta_key = keys.dataset_meta(owner, name)
        guards = [Guard(meta_key, mod_revision=found.revision)]
        deletes: list[str] = []
        puts: dict[str, bytes] = {}
        gone = {v.version for v, _ in versions}
        for v, rev in versions:
            guards.append(Guard(keys.dataset_version(owner, name, v.version), mod_revision=rev))
            deletes += [
                keys.dataset_version(owner, name, v.version),
                keys.data_ref(v.digest, owner, name, v.version),
            ]
        # the manifests no version names once these are gone: deleted, their replicas dropped
        for digest in {v.digest for v, _ in versions}:
            _, refs = await self.registry.list_prefix(keys.data_refs(digest))
            mine = {keys.data_ref(digest, owner, name, n) for n in gone}
            if any(key not in mine for key, _, _ in refs):
                continue
            manifest_key = keys.data_manifest(digest)
            got = await self.registry.get_raw(manifest_key)
            if got is not None:
                guards.append(Guard(manifest_key, mod_revision=got[1]))
                deletes.append(manifest_key)
            example = next(v for v, _ in versions if v.digest == digest)
            ordered = {s for s, d in self.index.orders() if d == digest}
            for site in sorted(self.index.holders(digest) | ordered):
                order = ReplicationOrder(
                    digest=digest, dataset=example.ref, bytes=example.bytes, action="drop",
                    pin=False, ordered_at=now,
                )  # fmt: skip
                puts[keys.data_order(site, digest)] = order.model_dump_json().encode()
        if whole:
            deletes += [meta_key, keys.dataset_index(owner, name)]
            deletes += [keys.tenant_dataset(t, owner, name) for t in (owner, *meta.shared_with)]
            target = f"{owner}/{name}"
        else:
            latest = meta.latest
            if latest in gone:
                _, kvs = await self.registry.list_prefix(keys.dataset_versions(owner, name))
                left = [
                    int(key.rsplit("/", 1)[1])
                    for key, _, _ in kvs
                    if int(key.rsplit("/", 1)[1]) not in gone
                ]
                latest = max(left, default=0)
            # `latest` only goes down here: the next put numbers from the highest ever + 1
            # is not kept, so a removed latest number may come back (docs/data.md)
            update = meta.model_copy(update={"latest": latest, "updated_at": now})
            puts[meta_key] = update.model_dump_json().encode()
            target = f"{owner}/{name}@{','.join(str(n) for n in sorted(gone))}"
        puts.update(audit_puts(owner, target))
        if await self.registry.commit(guards=guards, puts=puts, deletes=deletes):
            committed()
            return True
        return False

    # -- share ---------------------------------------------------------------------------------

    async def share(
        self, owner: str, name: str, body: ShareRequest, *, tenant: str | None
    ) -> DatasetMeta:
        """Add and remove tenants that may read owner/name, in one guarded transaction."""
        for _ in range(RETRIES):
            found = await self.writable(owner, name, tenant=tenant)
            if found is None:
                raise DatasetNotFound(f"no dataset {owner}/{name}", field="name")
            if owner in body.add:
                raise InvalidRequest(f"{owner} owns {owner}/{name}: no need to share", field="add")
            meta = found.meta
            shared = (set(meta.shared_with) | set(body.add)) - set(body.remove)
            if len(shared) > MAX_SHARES:
                raise InvalidRequest(
                    f"a dataset is shared with at most {MAX_SHARES} tenants", field="add"
                )
            update = meta.model_copy(
                update={"shared_with": tuple(sorted(shared)), "updated_at": self.clock.time()}
            )
            meta_key = keys.dataset_meta(owner, name)
            puts = {meta_key: update.model_dump_json().encode()}
            puts.update({keys.tenant_dataset(t, owner, name): b"" for t in body.add})
            deletes = [
                keys.tenant_dataset(t, owner, name) for t in body.remove if t in meta.shared_with
            ]
            puts.update(audit_puts(owner, f"{owner}/{name}"))
            if await self.registry.commit(
                guards=[Guard(meta_key, mod_revision=found.revision)], puts=puts, deletes=deletes
            ):
                committed()
                return update
        raise Conflict(f"dataset {owner}/{name} changed too often; try again", field="name")

    # -- replicate -------------------------------------------------------------------------------

    def _inbound_usd_per_gb(self, site: str, holders: frozenset[str]) -> float:
        """What one GB costs to pull to `site` from its cheapest holder (free in-region)."""
        specs = self.view().sites.specs
        here = specs.get(site)
        best = float("inf")
        for holder in holders:
            spec = specs.get(holder)
            if spec is None:
                continue
            same = here is not None and spec.region == here.region
            best = min(best, 0.0 if same else spec.prices.usd_per_gb_egress)
        return best

    async def replicate(
        self, owner: str, name: str, body: ReplicateRequest, *, tenant: str | None
    ) -> ReplicationStarted:
        """A pull order at a site (or the region's best: a holder, else the cheapest to pull
        to), with read grants on the current holders; the leader's OrderKeeper
        (broker.ops.data_orders) deletes it once the site's replica record is there."""
        found = await self.writable(owner, name, tenant=tenant)
        if found is None:
            raise DatasetNotFound(f"no dataset {owner}/{name}", field="name")
        number = body.version or found.meta.latest
        if number < 1:
            raise NotFound(f"dataset {owner}/{name} has no version yet")
        version, _ = await self._version(owner, name, number)
        digest = version.digest
        holders = self.index.holders(digest)
        if body.site is not None:
            site = self.choose_site(site=body.site, region=None)
        else:
            candidates = self._store_sites(body.region)
            if not candidates:
                raise InvalidRequest(
                    f"no site in region {body.region!r} is up with a data store now",
                    field="region",
                )
            site = min(
                candidates,
                key=lambda s: (
                    s not in holders,
                    self._inbound_usd_per_gb(s, holders),
                    len(self.index.held_at(s)),
                    s,
                ),
            )
        record = self.index.replica(site, digest)
        if record is not None and record.pinned:
            return ReplicationStarted(
                dataset=version.ref, digest=digest, site=site, state="held", sources=[]
            )
        sources = self.index.sources(digest, sub=site, ttl_s=ORDER_TTL_S, exclude=frozenset({site}))
        if not sources and record is None:
            raise Conflict(
                f"no site can serve {version.ref} now (its holders are down)", field="version"
            )
        order = ReplicationOrder(
            digest=digest, dataset=version.ref, bytes=version.bytes, action="pull",
            sources=sources, pin=True, ordered_at=self.clock.time(),
        )  # fmt: skip
        key = keys.data_order(site, digest)
        for _ in range(RETRIES):
            got = await self.registry.get_raw(key)
            puts = {key: order.model_dump_json().encode()}
            puts.update(audit_puts(owner, f"{version.ref} -> {site}"))
            if await self.registry.commit(
                guards=[Guard(key, mod_revision=got[1] if got else 0)], puts=puts
            ):
                committed()
                return ReplicationStarted(
                    dataset=version.ref, digest=digest, site=site, state="ordered",
                    sources=[s.site for s in sources],
                )  # fmt: skip
        raise Conflict(f"the order at {site} changed too often; try again", field="site")

    # -- download ---------------------------------------------------------------------------------

    def download_sources(self, version: DatasetVersion) -> list[Source]:
        """The holders that can serve `version` now, with read grants: the home first, then by
        site id (the handler tries them in turn)."""
        sources = list(self.index.sources(version.digest, sub="broker", ttl_s=READ_TTL_S))
        if not any(s.site == version.home for s in sources):
            # just put there: its replica record may not have reached this replica's watch
            home = self.index.source(
                version.home, sub="broker", scope=f"obj:{version.digest}", op="read",
                ttl_s=READ_TTL_S,
            )  # fmt: skip
            if home is not None:
                sources.append(home)
        sources.sort(key=lambda s: (s.site != version.home, s.site))
        return sources


def _is_drop(raw: bytes) -> bool:
    try:
        return ReplicationOrder.model_validate_json(raw).action == "drop"
    except ValidationError:
        return False


def _agent_error(body: bytes, status: int) -> tuple[str, str, str | None]:
    """(code, message, field) of an agent's JSON error answer (its text when not JSON)."""
    try:
        error = json.loads(body)["error"]
        return str(error.get("code") or "refused"), str(error["message"]), error.get("field")
    except (ValueError, KeyError, TypeError):
        return "refused", body.decode(errors="replace").strip()[:300] or f"HTTP {status}", None


def _manifest_field(field: str | None) -> str:
    """The agent names a file (its path) or a field of the manifest: ours is under `manifest`."""
    if not field:
        return "manifest"
    return field if field.startswith("manifest") else f"manifest.{field}"
