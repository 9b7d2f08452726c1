"""Client: AsyncClient for blocking code. Each call runs the async implementation on the
client's own event loop in a background thread (its "portal"), so the two cannot drift apart
and a Client works where an event loop already runs (a notebook, a thread of an async app).

    with cpn.Client() as client:
        job = client.jobs.submit(Path("job.yaml").read_text())
        client.jobs.wait(job.id, timeout=600)
        for text in client.jobs.stream_logs(job.id, follow=True):
            print(text, end="")
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import AsyncIterator, Coroutine, Iterable, Iterator, Mapping
from datetime import date, datetime
from types import TracebackType
from typing import Any, TypeVar

from broker.model.datasets import DatasetInfo, DatasetMeta, DatasetSummary, ReplicationStarted
from broker.model.jobs import TERMINAL, JobRecord, JobSpec
from broker.model.services import ServiceSpec
from cpn.sdk.alerts import AsyncAlerts
from cpn.sdk.client import AsyncClient
from cpn.sdk.connection import Connection
from cpn.sdk.datasets import AsyncDatasets
from cpn.sdk.errors import CpnError
from cpn.sdk.jobs import PAGE_SIZE, AsyncJobs, AsyncWorkflows, States
from cpn.sdk.models import (
    Alert,
    JobPage,
    Service,
    ServiceSummary,
    UsageReport,
    WhoAmI,
    Workflow,
    WorkflowSummary,
)
from cpn.sdk.services import AsyncServices
from cpn.sdk.usage import AsyncUsage
from sites.model.data import Manifest

__all__ = ["Client"]

T = TypeVar("T")


class _Portal:
    """An event loop in a daemon thread that runs the async client's coroutines."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cpn-sdk", daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        if not self._thread.is_alive():
            coro.close()
            raise CpnError("the client is closed")
        if threading.current_thread() is self._thread:  # waiting here would wait forever
            coro.close()
            raise CpnError("a Client is not called from its own loop's thread")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # Ctrl-C while waiting: the request stops too
            raise

    def iterate(self, items: AsyncIterator[T]) -> Iterator[T]:
        try:
            while True:
                try:
                    item = self.call(_next(items))
                except StopAsyncIteration:
                    return
                yield item
        finally:
            close = getattr(items, "aclose", None)  # a generator left early: its finally runs
            if close is not None and self._thread.is_alive():
                self.call(close())

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        if threading.current_thread() is not self._thread:  # (collected in it: it just stops)
            self._thread.join()
            self._loop.close()


async def _next(items: AsyncIterator[T]) -> T:
    return await anext(items)


def _close(portal: _Portal, client: AsyncClient) -> None:
    try:
        portal.call(client.aclose())
    except CpnError:
        pass  # the portal is gone already
    portal.close()


class Jobs:
    """The blocking twin of cpn.sdk.jobs.AsyncJobs (each method's doc is there)."""

    def __init__(self, portal: _Portal, jobs: AsyncJobs) -> None:
        self._p, self._a = portal, jobs

    def submit(self, spec: JobSpec | Mapping[str, Any] | str) -> JobRecord:
        return self._p.call(self._a.submit(spec))

    def get(self, job_id: str) -> JobRecord:
        return self._p.call(self._a.get(job_id))

    def page(
        self,
        *,
        tenant: str | None = None,
        state: States | None = None,
        site: str | None = None,
        since: str | float | datetime | None = None,
        include_archived: bool = False,
        limit: int = PAGE_SIZE,
        continue_: str | None = None,
    ) -> JobPage:
        return self._p.call(
            self._a.page(
                tenant=tenant,
                state=state,
                site=site,
                since=since,
                include_archived=include_archived,
                limit=limit,
                continue_=continue_,
            )
        )

    def list(
        self,
        *,
        tenant: str | None = None,
        state: States | None = None,
        site: str | None = None,
        since: str | float | datetime | None = None,
        include_archived: bool = False,
        limit: int | None = None,
    ) -> Iterator[JobRecord]:
        return self._p.iterate(
            self._a.list(
                tenant=tenant,
                state=state,
                site=site,
                since=since,
                include_archived=include_archived,
                limit=limit,
            )
        )

    def cancel(self, job_id: str) -> JobRecord:
        return self._p.call(self._a.cancel(job_id))

    def suspend(self, job_id: str) -> JobRecord:
        return self._p.call(self._a.suspend(job_id))

    def resume(self, job_id: str) -> JobRecord:
        return self._p.call(self._a.resume(job_id))

    def logs(self, job_id: str) -> str:
        return self._p.call(self._a.logs(job_id))

    def stream_logs(self, job_id: str, *, follow: bool = False) -> Iterator[str]:
        return self._p.iterate(self._a.stream_logs(job_id, follow=follow))

    def wait(
        self,
        job_id: str,
        states: States = TERMINAL,
        *,
        timeout: float | None = None,
        poll_s: float = 2.0,
    ) -> JobRecord:
        return self._p.call(self._a.wait(job_id, states, timeout=timeout, poll_s=poll_s))


class Workflows:
    """The blocking twin of cpn.sdk.jobs.AsyncWorkflows."""

    def __init__(self, portal: _Portal, workflows: AsyncWorkflows) -> None:
        self._p, self._a = portal, workflows

    def submit(self, spec: Mapping[str, Any] | str) -> Workflow:
        return self._p.call(self._a.submit(spec))

    def list(self, *, tenant: str | None = None, limit: int | None = None) -> list[WorkflowSummary]:
        return self._p.call(self._a.list(tenant=tenant, limit=limit))

    def get(self, workflow_id: str) -> Workflow:
        return self._p.call(self._a.get(workflow_id))

    def cancel(self, workflow_id: str, *, step: str | None = None) -> Workflow:
        return self._p.call(self._a.cancel(workflow_id, step=step))

    def retry(self, workflow_id: str, *, step: str | None = None) -> Workflow:
        return self._p.call(self._a.retry(workflow_id, step=step))


class Services:
    """The blocking twin of cpn.sdk.services.AsyncServices."""

    def __init__(self, portal: _Portal, services: AsyncServices) -> None:
        self._p, self._a = portal, services

    def apply(self, spec: ServiceSpec | Mapping[str, Any] | str) -> Service:
        return self._p.call(self._a.apply(spec))

    def get(self, name: str) -> Service:
        return self._p.call(self._a.get(name))

    def list(self, *, tenant: str | None = None) -> Iterator[ServiceSummary]:
        return self._p.iterate(self._a.list(tenant=tenant))

    def delete(self, name: str) -> Service:
        return self._p.call(self._a.delete(name))


class Usage:
    """The blocking twin of cpn.sdk.usage.AsyncUsage."""

    def __init__(self, portal: _Portal, usage: AsyncUsage) -> None:
        self._p, self._a = portal, usage

    def get(
        self,
        *,
        tenant: str | None = None,
        site: str | None = None,
        from_: date | str | None = None,
        to: date | str | None = None,
        by: str | tuple[str, ...] | list[str] = ("tenant",),
    ) -> UsageReport:
        return self._p.call(self._a.get(tenant=tenant, site=site, from_=from_, to=to, by=by))


class Alerts:
    """The blocking twin of cpn.sdk.alerts.AsyncAlerts."""

    def __init__(self, portal: _Portal, alerts: AsyncAlerts) -> None:
        self._p, self._a = portal, alerts

    def list(self, *, state: str | None = None, rule: str | None = None) -> Iterator[Alert]:
        return self._p.iterate(self._a.list(state=state, rule=rule))


class Datasets:
    """The blocking twin of cpn.sdk.datasets.AsyncDatasets."""

    def __init__(self, portal: _Portal, datasets: AsyncDatasets) -> None:
        self._p, self._a = portal, datasets

    def list(self) -> Iterator[DatasetSummary]:
        return self._p.iterate(self._a.list())

    def get(self, ref: str) -> DatasetInfo:
        return self._p.call(self._a.get(ref))

    def delete(self, ref: str) -> DatasetMeta:
        return self._p.call(self._a.delete(ref))

    def share(
        self, ref: str, *, add: Iterable[str] = (), remove: Iterable[str] = ()
    ) -> DatasetMeta:
        return self._p.call(self._a.share(ref, add=add, remove=remove))

    def replicate(
        self, ref: str, *, site: str | None = None, region: str | None = None
    ) -> ReplicationStarted:
        return self._p.call(self._a.replicate(ref, site=site, region=region))

    def manifest(self, ref: str) -> Manifest:
        return self._p.call(self._a.manifest(ref))


class Client:
    """A blocking client of one broker; AsyncClient's arguments (cpn.sdk.client)."""

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        ca: str | None = None,
        timeout_s: float | None = 60.0,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self._async = AsyncClient(
            url, token=token, ca=ca, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s
        )  # first: a bad URL or config file raises before a thread starts
        self._portal = _Portal()
        self.jobs = Jobs(self._portal, self._async.jobs)
        self.workflows = Workflows(self._portal, self._async.workflows)
        self.services = Services(self._portal, self._async.services)
        self.usage = Usage(self._portal, self._async.usage)
        self.alerts = Alerts(self._portal, self._async.alerts)
        self.datasets = Datasets(self._portal, self._async.datasets)
        # a client never closed is closed when collected, or at the interpreter's exit (while
        # its daemon thread still runs), so its connections do not leak with a warning
        self._finalizer = weakref.finalize(self, _close, self._portal, self._async)

    @property
    def connection(self) -> Connection:
        return self._async.connection

    @property
    def url(self) -> str:
        return self._async.url

    def whoami(self) -> WhoAmI:
        return self._portal.call(self._async.whoami())

    def close(self) -> None:
        self._finalizer()  # once: a second close does nothing

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.url!r})"
