"""AsyncClient: the SDK's one implementation (cpn.sdk.sync's Client runs it for blocking code).

async with cpn.AsyncClient() as client:
    job = await client.jobs.submit({"name": "train", "tenant": "acme", "cpu": 4,
                                    "command": ["python", "train.py"]})
    done = await client.jobs.wait(job.id, timeout=3600)
"""

from __future__ import annotations

from types import TracebackType

from cpn.sdk.alerts import AsyncAlerts
from cpn.sdk.connection import Connection, resolve
from cpn.sdk.datasets import AsyncDatasets
from cpn.sdk.jobs import AsyncJobs, AsyncWorkflows
from cpn.sdk.models import WhoAmI
from cpn.sdk.services import AsyncServices
from cpn.sdk.transport import Transport, parse
from cpn.sdk.usage import AsyncUsage

__all__ = ["AsyncClient"]


class AsyncClient:
    """A client of one broker.

    `url`, `token` and `ca` default to what the `cpn` CLI uses ($CPN_BROKER, $CPN_TOKEN,
    $CPN_CA, the config file, a running `cpn up`: cpn.sdk.connection). `timeout_s` bounds each
    request (None: unbounded; a log stream is never bounded); `connect_timeout_s` the connect.
    Resources: `jobs`, `workflows`, `services`, `usage`, `alerts`, `datasets`; `whoami()`.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        ca: str | None = None,
        timeout_s: float | None = 60.0,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.connection: Connection = resolve(url, token, ca)
        self._transport = Transport(
            self.connection, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s
        )
        self.jobs = AsyncJobs(self._transport)
        self.workflows = AsyncWorkflows(self._transport)
        self.services = AsyncServices(self._transport)
        self.usage = AsyncUsage(self._transport)
        self.alerts = AsyncAlerts(self._transport)
        self.datasets = AsyncDatasets(self._transport)

    @property
    def url(self) -> str:
        return self.connection.url

    async def whoami(self) -> WhoAmI:
        """The token's role and tenant, and whether the broker checks tokens at all."""
        return parse(WhoAmI, await self._transport.request("GET", "/v1/whoami"))

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"AsyncClient({self.url!r})"
