"""The leader's outbox loop: registers the outputs of succeeded runs as dataset versions.

The write that marks a run SUCCEEDED puts a DataOutbox at /cpn/v1/data-outbox/<job>/<attempt>
(broker.leader.reports) naming what the run saved (OutputMade: digest, size, the sites holding
it). This loop reads the outbox a page at a time, fetches each output's manifest from a site
holding it (Datasets.fetch_manifest: a read grant minted with that agent's data key),
registers it as the next version of the tenant's dataset (Datasets.register with once=True: a
replay after a crash finds the version it made and makes no second one) and deletes the entry.
An entry that cannot be carried out now (its site down) stays for the next round; one that
never can (a malformed record) is logged and dropped, so no tenant's input stops the loop.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from pydantic import ValidationError

from broker.model.data_outbox import DataOutbox
from broker.model.errors import BrokerError
from broker.ops.datasets import DataPlaneError, Datasets
from sites.model import keys
from sites.model.data import Manifest, OutputMade
from sites.model.errors import RegistryError
from sites.registry.client import Guard, Registry

log = logging.getLogger(__name__)

PAGE = 100
MANIFEST_TIMEOUT_S = 30.0  # the outbox's session: one manifest read from a site, at most


class OutboxUnavailable(Exception):
    """An output's manifest cannot be read now (every holder down or unreachable)."""


class DataOutboxLoop:
    def __init__(
        self,
        *,
        registry: Registry,
        datasets: Datasets,
        http: aiohttp.ClientSession,
    ) -> None:
        self.registry = registry
        self.datasets = datasets
        self.http = http

    async def round(self) -> int:
        """One pass over (a page of) the outbox; the entries carried out."""
        kvs: list[tuple[str, bytes, int]] = []
        async for page in self.registry.iter_prefix(keys.DATA_OUTBOX, page_keys=PAGE):
            kvs = page.items
            break
        done = 0
        for key, raw, rev in kvs:
            try:
                box = DataOutbox.model_validate_json(raw)
            except ValidationError as exc:
                log.error("dropping malformed data outbox entry %s: %s", key, exc)
                await self._drop(key, rev)
                continue
            try:
                for made in box.outputs:
                    await self._register(box, made)
            except OutboxUnavailable as exc:
                log.warning("outputs of job %s wait: %s", box.job, exc)
                continue
            except (BrokerError, ValueError) as exc:
                log.error("outputs of job %s not registered: %s", box.job, exc)
            await self._drop(key, rev)
            done += 1
        return done

    async def _drop(self, key: str, rev: int) -> None:
        await self.registry.commit(guards=[Guard(key, mod_revision=rev)], deletes=[key])

    async def _register(self, box: DataOutbox, made: OutputMade) -> None:
        owner, _, name = made.dataset.partition("/")
        manifest = await self._manifest(made)
        await self.datasets.register(
            owner, name, manifest, made_by=f"job {box.job}", home=made.sites[0], once=True
        )

    async def _manifest(self, made: OutputMade) -> Manifest:
        """The output's manifest from the first of its sites that gives it."""
        for site in made.sites:
            try:
                return await self.datasets.fetch_manifest(site, made.digest, http=self.http)
            except DataPlaneError:
                continue
        raise OutboxUnavailable(f"no site of {', '.join(made.sites)} serves {made.digest[:12]}")


async def run_outbox(loop: DataOutboxLoop, *, sleep: float = 2.0) -> None:
    """Rounds forever (the leader's supervisor runs it while this replica leads)."""
    while True:
        try:
            await loop.round()
        except RegistryError as exc:
            log.warning("data outbox: %s", exc)
        await asyncio.sleep(sleep)
