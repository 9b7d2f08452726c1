"""Datasets through /v1/datasets (docs/data.md): list, describe, remove, share, replicate, and
a version's manifest. Putting and getting files stays with `cpn data put|get`, which stream
them resumably.

A dataset is named as the CLI names it: 'owner/name', 'owner/name@3' where a version is meant.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

from pydantic import BaseModel, ConfigDict, Field

from broker.model.datasets import DatasetInfo, DatasetMeta, DatasetSummary, ReplicationStarted
from cpn.sdk.errors import Invalid
from cpn.sdk.transport import Transport, parse, segment
from sites.model.data import Manifest, parse_ref

__all__ = ["AsyncDatasets", "DatasetPage"]

PAGE_SIZE = 1000  # the broker's largest page of datasets


class DatasetPage(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow", populate_by_name=True)

    items: list[DatasetSummary]
    continue_: str | None = Field(default=None, alias="continue")


def _named(ref: str, *, versioned: bool = False) -> tuple[str, int | None]:
    """'owner/name[@v]' as the path '/v1/datasets/owner/name' and the version; a ref that is
    not one is an Invalid naming `dataset`."""
    if not isinstance(ref, str):
        raise Invalid(0, f"a dataset is named 'owner/name', not {ref!r}", "dataset")
    try:
        owner, name, version = parse_ref(ref)
    except ValueError as exc:
        raise Invalid(0, str(exc), "dataset") from None
    if version is not None and not versioned:
        raise Invalid(0, f"{ref!r}: name the dataset without a version here", "dataset")
    return f"/v1/datasets/{segment(owner, 'dataset')}/{segment(name, 'dataset')}", version


class AsyncDatasets:
    def __init__(self, transport: Transport) -> None:
        self._t = transport

    async def list(self) -> AsyncIterator[DatasetSummary]:
        """The token's tenant's datasets and those shared with it (every one for an admin),
        by owner and name, fetched a page at a time as the iteration goes."""
        params = {"limit": str(PAGE_SIZE)}
        while True:
            page = parse(DatasetPage, await self._t.request("GET", "/v1/datasets", params=params))
            for item in page.items:
                yield item
            if not page.continue_:
                return
            params["continue"] = page.continue_

    async def get(self, ref: str) -> DatasetInfo:
        """A dataset and its versions, newest first: sizes, digests, the sites holding each."""
        path, _ = _named(ref)
        return parse(DatasetInfo, await self._t.request("GET", path))

    async def delete(self, ref: str) -> DatasetMeta:
        """Remove a dataset ('owner/name': every version) or one version ('owner/name@3');
        the dataset's meta before."""
        path, version = _named(ref, versioned=True)
        if version is not None:
            path += f"/versions/{version}"
        return parse(DatasetMeta, await self._t.request("DELETE", path))

    async def share(
        self, ref: str, *, add: Iterable[str] = (), remove: Iterable[str] = ()
    ) -> DatasetMeta:
        """Let tenants read and use it (`add`), or stop (`remove`)."""
        path, _ = _named(ref)
        for field, tenants in (("add", add), ("remove", remove)):
            if isinstance(tenants, str):
                raise Invalid(0, f"{field} is a list of tenant names, not {tenants!r}", field)
        body = {"add": list(add), "remove": list(remove)}
        return parse(DatasetMeta, await self._t.request("PUT", path + "/shares", json=body))

    async def replicate(
        self, ref: str, *, site: str | None = None, region: str | None = None
    ) -> ReplicationStarted:
        """Keep a version ('owner/name@3'; default the latest) at a site, or at the best site
        of a region (one of them)."""
        path, version = _named(ref, versioned=True)
        if (site is None) == (region is None):
            raise Invalid(0, "name a site or a region (one of them)", "site")
        body: dict[str, object] = {"site": site} if site else {"region": region}
        if version is not None:
            body["version"] = version
        return parse(
            ReplicationStarted, await self._t.request("POST", path + "/replicate", json=body)
        )

    async def manifest(self, ref: str) -> Manifest:
        """A version's files ('owner/name@3'), each with its size and digest."""
        path, version = _named(ref, versioned=True)
        if version is None:
            raise Invalid(0, f"{ref!r}: name the version, 'owner/name@N'", "dataset")
        return parse(Manifest, await self._t.request("GET", f"{path}/versions/{version}/manifest"))
