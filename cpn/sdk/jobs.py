"""Jobs and workflows through /v1/jobs and /v1/workflows (docs/sdk.md, docs/jobs.md).

A job is the broker's own `JobRecord`; a spec is sent as the broker's `JobSpec`, a mapping of
its fields, or a job file's YAML text (the broker parses it, a deadline's timestamp included).
"""

from __future__ import annotations

import asyncio
import codecs
from collections.abc import AsyncIterator, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel

from broker.model.jobs import TERMINAL, JobRecord, JobSpec, JobState
from cpn.sdk.errors import Invalid, JobEnded, RateLimited, ServerError, TransportError, WaitTimeout
from cpn.sdk.models import JobPage, Workflow, WorkflowList, WorkflowSummary
from cpn.sdk.transport import Transport, parse, segment

__all__ = ["AsyncJobs", "AsyncWorkflows", "States", "job_states", "spec_body"]

PAGE_SIZE = 500  # the broker's own maximum page of jobs
States = JobState | str | Iterable[JobState | str]


def job_states(states: States, field: str) -> frozenset[JobState]:
    """`states` (a state, a name in any case, or several) as JobStates; an unknown name is an
    Invalid naming `field`."""
    # a str (a JobState is one too) may name several, comma-separated, as the API's filter
    items = states.split(",") if isinstance(states, str) else list(states)
    out = set()
    for item in items:
        name = item.value if isinstance(item, JobState) else str(item).strip().upper()
        if name not in JobState.__members__:
            known = ", ".join(JobState.__members__)
            raise Invalid(0, f"unknown job state {item!r} (one of {known})", field)
        out.add(JobState[name])
    if not out:
        raise Invalid(0, "name at least one job state", field)
    return frozenset(out)


def spec_body(spec: object, what: str) -> dict[str, Any]:
    """(json, yaml) keyword arguments of Transport.request for a spec given as a model, a
    mapping or a YAML document's text."""
    if isinstance(spec, str):
        return {"yaml": spec}
    if isinstance(spec, BaseModel):
        # only what was set: the broker fills in its defaults (and refuses what it sets itself)
        return {"json": spec.model_dump(mode="json", exclude_unset=True)}
    if isinstance(spec, Mapping):
        return {"json": dict(spec)}
    raise Invalid(
        0, f"{what} must be a model, a mapping or YAML text, not {type(spec).__name__}", what
    )


def _since(value: str | float | datetime) -> str:
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).isoformat()
    if isinstance(value, bool):
        raise Invalid(
            0, f"since must be a time, a number of seconds or a duration, not {value!r}", "since"
        )
    return str(value)


class AsyncJobs:
    def __init__(self, transport: Transport) -> None:
        self._t = transport

    async def submit(self, spec: JobSpec | Mapping[str, Any] | str) -> JobRecord:
        """Submit a job; its record (PENDING, or PLACED when the fast path placed it)."""
        body = await self._t.request("POST", "/v1/jobs", **spec_body(spec, "spec"))
        return parse(JobRecord, body)

    async def get(self, job_id: str) -> JobRecord:
        """A job's record: state, placement and its reasons, why it is pending
        (`unschedulable`), events, exit code."""
        body = await self._t.request("GET", f"/v1/jobs/{segment(job_id, 'job')}")
        return parse(JobRecord, body)

    async def page(
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
        """One page of jobs, newest first; pass its `continue_` back for the next one (with
        the same filters)."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise Invalid(0, f"limit must be an integer of at least 1, got {limit!r}", "limit")
        params = {"limit": str(limit)}
        if tenant:
            params["tenant"] = tenant
        if state is not None:
            params["state"] = ",".join(sorted(s.value for s in job_states(state, "state")))
        if site:
            params["site"] = site
        if since is not None:
            params["since"] = _since(since)
        if include_archived:
            params["include"] = "archived"
        if continue_:
            params["continue"] = continue_
        return parse(JobPage, await self._t.request("GET", "/v1/jobs", params=params))

    async def pages(
        self,
        *,
        tenant: str | None = None,
        state: States | None = None,
        site: str | None = None,
        since: str | float | datetime | None = None,
        include_archived: bool = False,
        limit: int | None = None,
        page_size: int = PAGE_SIZE,
    ) -> AsyncIterator[list[JobRecord]]:
        """Every page of jobs, newest first, until the last or `limit` jobs in all."""
        if limit is not None and (isinstance(limit, bool) or limit < 1):
            raise Invalid(0, f"limit must be at least 1, got {limit!r}", "limit")
        shown, token = 0, None
        while limit is None or shown < limit:
            size = page_size if limit is None else min(page_size, limit - shown)
            got = await self.page(
                tenant=tenant,
                state=state,
                site=site,
                since=since,
                include_archived=include_archived,
                limit=size,
                continue_=token,
            )
            yield got.items
            shown += len(got.items)
            token = got.continue_
            if not token:
                return

    async def list(
        self,
        *,
        tenant: str | None = None,
        state: States | None = None,
        site: str | None = None,
        since: str | float | datetime | None = None,
        include_archived: bool = False,
        limit: int | None = None,
    ) -> AsyncIterator[JobRecord]:
        """Jobs, newest first, fetched a page at a time as the iteration goes."""
        async for items in self.pages(
            tenant=tenant,
            state=state,
            site=site,
            since=since,
            include_archived=include_archived,
            limit=limit,
        ):
            for record in items:
                yield record

    async def _act(self, job_id: str, action: str) -> JobRecord:
        body = await self._t.request("POST", f"/v1/jobs/{segment(job_id, 'job')}/{action}")
        return parse(JobRecord, body)

    async def cancel(self, job_id: str) -> JobRecord:
        """Cancel a job for good (a finished one: Conflict)."""
        return await self._act(job_id, "cancel")

    async def suspend(self, job_id: str) -> JobRecord:
        """Stop a job and keep it (SUSPENDED), to resume later."""
        return await self._act(job_id, "suspend")

    async def resume(self, job_id: str) -> JobRecord:
        """Queue a suspended job again."""
        return await self._act(job_id, "resume")

    async def stream_logs(self, job_id: str, *, follow: bool = False) -> AsyncIterator[str]:
        """The current run's output as it arrives, from its site's agent; `follow`: until the
        run ends. A job that has not run yet: Conflict (code no_logs)."""
        params = {"follow": "1"} if follow else None
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        async for chunk in self._t.stream(f"/v1/jobs/{segment(job_id, 'job')}/logs", params):
            text = decoder.decode(chunk)
            if text:
                yield text
        tail = decoder.decode(b"", final=True)
        if tail:
            yield tail

    async def logs(self, job_id: str) -> str:
        """The current run's output so far."""
        return "".join([text async for text in self.stream_logs(job_id)])

    async def wait(
        self,
        job_id: str,
        states: States = TERMINAL,
        *,
        timeout: float | None = None,
        poll_s: float = 2.0,
    ) -> JobRecord:
        """The job's record once it is in one of `states` (default: finished). Raises
        WaitTimeout after `timeout` seconds (None: no limit), JobEnded if the job finishes in
        a state not among `states`. The broker is polled (every 0.1 s at first, backing off
        to `poll_s`); a broker that is briefly unavailable (5xx, 429, a broken connection) is
        asked again until the timeout."""
        wanted = job_states(states, "states")
        if timeout is not None and timeout < 0:
            raise Invalid(0, f"timeout must be at least 0, got {timeout!r}", "timeout")
        if poll_s <= 0:
            raise Invalid(0, f"poll_s must be above 0, got {poll_s!r}", "poll_s")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        interval = min(0.1, poll_s)
        record: JobRecord | None = None
        while True:
            try:
                record = await self.get(job_id)
            except (ServerError, RateLimited, TransportError):
                if deadline is not None and loop.time() >= deadline:
                    raise
            else:
                if record.state in wanted:
                    return record
                if record.state.terminal:
                    asked = ", ".join(sorted(s.value for s in wanted))
                    raise JobEnded(f"job {job_id} ended {record.state.value}, not {asked}", record)
            if deadline is not None:
                left = deadline - loop.time()
                if left <= 0:
                    state = record.state.value if record else "unknown"
                    raise WaitTimeout(f"job {job_id} is still {state} after {timeout:g} s", record)
                await asyncio.sleep(min(interval, left))
            else:
                await asyncio.sleep(interval)
            interval = min(poll_s, interval * 1.5)


class AsyncWorkflows:
    """DAGs of steps (docs/workflows.md): each step is a job of its own."""

    def __init__(self, transport: Transport) -> None:
        self._t = transport

    async def submit(self, spec: Mapping[str, Any] | str) -> Workflow:
        """Submit a workflow (a mapping of its fields, or its file's YAML text)."""
        body = await self._t.request("POST", "/v1/workflows", **spec_body(spec, "spec"))
        return parse(Workflow, body)

    async def list(
        self, *, tenant: str | None = None, limit: int | None = None
    ) -> list[WorkflowSummary]:
        """Workflows, newest first (the broker's default number, or `limit`)."""
        params = {}
        if tenant:
            params["tenant"] = tenant
        if limit is not None:
            if isinstance(limit, bool) or limit < 1:
                raise Invalid(0, f"limit must be at least 1, got {limit!r}", "limit")
            params["limit"] = str(limit)
        body = await self._t.request("GET", "/v1/workflows", params=params)
        return parse(WorkflowList, body).items

    async def get(self, workflow_id: str) -> Workflow:
        body = await self._t.request("GET", f"/v1/workflows/{segment(workflow_id, 'workflow')}")
        return parse(Workflow, body)

    async def _act(self, workflow_id: str, action: str, step: str | None) -> Workflow:
        path = f"/v1/workflows/{segment(workflow_id, 'workflow')}/{action}"
        body = await self._t.request("POST", path, params={"step": step} if step else None)
        return parse(Workflow, body)

    async def cancel(self, workflow_id: str, *, step: str | None = None) -> Workflow:
        """Cancel every unfinished step (or one)."""
        return await self._act(workflow_id, "cancel", step)

    async def retry(self, workflow_id: str, *, step: str | None = None) -> Workflow:
        """Run the failed or cancelled steps again (or one), with their dependents."""
        return await self._act(workflow_id, "retry", step)
