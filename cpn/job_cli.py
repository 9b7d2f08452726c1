"""`cpn submit`, `cpn jobs`, `cpn describe`, `cpn workflow list|describe|cancel|retry`,
`cpn cancel|suspend|resume`, `cpn logs`: jobs and workflows (docs/workflows.md), through the
Python SDK (cpn.sdk, docs/sdk.md) over the broker's API (/v1/jobs, /v1/workflows).

A job file that is not a YAML mapping exits 2 with one line (UsageError); the broker's
refusal (HTTP 4xx) exits 2 with its message.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cpn import render
from cpn.cli_base import BrokerArg, CliParser, UsageError
from cpn.sdk.errors import NotFound
from sites.kits.clock import SystemClock

if TYPE_CHECKING:
    from cpn.sdk.client import AsyncClient

__all__ = [
    "JOBS_PAGE",
    "add_parsers",
    "cmd_describe",
    "cmd_job_action",
    "cmd_jobs",
    "cmd_logs",
    "cmd_submit",
    "cmd_workflow",
]


def _load_job_file(path: str) -> Any:
    from sites.model.config import read_yaml

    data = read_yaml(Path(path))
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a mapping of job fields")
    return data


async def cmd_submit(args: argparse.Namespace) -> int:
    data = _load_job_file(args.file)  # a readable YAML mapping, or exit 2 with one line
    # sent as the YAML it is: the broker parses it (timestamps such as a deadline included)
    text = Path(args.file).read_text()
    async with _client(args) as client:
        if "steps" in data:  # a workflow file: a DAG of steps (docs/workflows.md)
            workflow = await client.workflows.submit(text)
            if args.output == "json":
                print(json.dumps(workflow.model_dump(mode="json"), indent=2))
            else:
                steps = ", ".join(f"{s.name}={s.job}" for s in workflow.steps)
                print(f"workflow {workflow.id} submitted ({workflow.state.value}): {steps}")
            return 0
        record = await client.jobs.submit(text)
    if args.output == "json":
        print(json.dumps(record.model_dump(mode="json"), indent=2))
    else:
        print(f"job {record.id} submitted ({record.state.value})")
    return 0


JOBS_PAGE = 500


async def cmd_jobs(args: argparse.Namespace) -> int:
    """Page through GET /v1/jobs, newest first, printing each page as it comes."""
    if args.limit is not None and args.limit < 1:
        raise UsageError("--limit must be at least 1")
    table = render.PagedTable(render.JOB_HEADERS)
    now = SystemClock().time()
    shown = 0
    if args.output == "json":
        print("[")
    async with _client(args) as client:
        pages = client.jobs.pages(
            tenant=args.tenant or None,
            state=args.state or None,
            site=args.site or None,
            since=args.since or None,
            include_archived=args.all,
            limit=args.limit,
            page_size=JOBS_PAGE,
        )
        async for records in pages:
            items = [record.model_dump(mode="json") for record in records]
            for i, item in enumerate(items):
                if args.output == "json":
                    sep = "," if shown + i > 0 else ""
                    print(sep + json.dumps(item, indent=2))
                elif args.output == "jsonl":
                    print(json.dumps(item, separators=(",", ":")))
            if args.output == "table":
                for line in table.lines(render.job_rows(items, now=now)):
                    print(line)
            shown += len(items)
    if args.output == "json":
        print("]")
    elif args.output == "table" and shown == 0:
        print("no jobs")
    return 0


async def cmd_describe(args: argparse.Namespace) -> int:
    """A job, or else a workflow of that id (its DAG and each step's state)."""
    async with _client(args) as client:
        try:
            record = (await client.jobs.get(args.job)).model_dump(mode="json")
        except NotFound:
            try:
                record = (await client.workflows.get(args.job)).model_dump(mode="json")
            except NotFound:
                raise NotFound(404, f"no job or workflow {args.job!r}", code="not_found") from None
    if args.output == "json":
        print(json.dumps(record, indent=2))
    elif "steps" in record:
        print(render.describe_workflow(record))
    else:
        print(render.describe_job(record))
    return 0


async def cmd_workflow(args: argparse.Namespace) -> int:
    """cpn workflow list | describe | cancel | retry (docs/workflows.md)."""
    step = getattr(args, "step", None) or None
    async with _client(args) as client:
        workflows = client.workflows
        if args.workflow_command == "list":
            items = await workflows.list()
            if args.output == "json":
                print(json.dumps([item.model_dump(mode="json") for item in items], indent=2))
            for item in items if args.output != "json" else ():
                print(f"{item.id}  tenant {item.tenant}  {item.steps} steps")
            return 0
        if args.workflow_command == "describe":
            workflow = await workflows.get(args.workflow)
        elif args.workflow_command == "cancel":
            workflow = await workflows.cancel(args.workflow, step=step)
        else:
            workflow = await workflows.retry(args.workflow, step=step)
    record = workflow.model_dump(mode="json")
    if args.output == "json":
        print(json.dumps(record, indent=2))
    else:
        print(render.describe_workflow(record))
    return 0


async def cmd_job_action(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        jobs = client.jobs
        act = {"cancel": jobs.cancel, "suspend": jobs.suspend, "resume": jobs.resume}[args.action]
        record = await act(args.job)
    print(f"job {record.id} {record.state.value}")
    return 0


async def cmd_logs(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        async for text in client.jobs.stream_logs(args.job, follow=args.follow):
            sys.stdout.write(text)
            sys.stdout.flush()
    return 0


def _client(args: argparse.Namespace) -> AsyncClient:
    """The SDK's client of --broker (else what cpn.config finds); a command's calls are not
    bounded in time (a page of a long history, a submit behind a busy registry). Imported
    here: `cpn --help` builds this module's parsers without the SDK's models."""
    from cpn.sdk.client import AsyncClient

    return AsyncClient(args.broker, timeout_s=None)


def add_parsers(add: Callable[..., argparse.ArgumentParser], broker_arg: BrokerArg) -> None:
    """The job and workflow commands, added with cpn.cli's `add` and `broker_arg`."""
    submit = add("submit", help="submit a job from a YAML file")
    submit.add_argument("file", metavar="FILE")
    broker_arg(submit)
    submit.set_defaults(func=cmd_submit)

    jobs = add("jobs", help="list jobs, newest first (all pages)")
    jobs.add_argument("--tenant", help="only this tenant's jobs")
    jobs.add_argument("--state", help="only jobs in these states (comma-separated)")
    jobs.add_argument("--site", help="only jobs placed on this site")
    jobs.add_argument(
        "--since", help="only jobs created since: RFC 3339 time, unix seconds, or '24h' ago"
    )
    jobs.add_argument("--all", action="store_true", help="archived jobs too (the history)")
    jobs.add_argument("--limit", type=int, metavar="N", help="show at most N jobs")
    broker_arg(jobs, ("table", "json", "jsonl"))
    jobs.set_defaults(func=cmd_jobs)

    describe = add(
        "describe", help="a job's placement, state and events; a workflow's DAG and steps"
    )
    describe.add_argument("job", metavar="JOB")
    broker_arg(describe)
    describe.set_defaults(func=cmd_describe)

    workflow = add("workflow", help="workflows: DAGs of steps (docs/workflows.md)")
    wf_sub = workflow.add_subparsers(dest="workflow_command", required=True, parser_class=CliParser)
    wf_list = wf_sub.add_parser("list", help="workflows, newest first")
    broker_arg(wf_list)
    wf_list.set_defaults(func=cmd_workflow)
    for name, text in (
        ("describe", "the DAG with each step's state"),
        ("cancel", "cancel every unfinished step (or one: --step)"),
        ("retry", "run the failed or cancelled steps again (or one: --step), with dependents"),
    ):
        p = wf_sub.add_parser(name, help=text)
        p.add_argument("workflow", metavar="NAME", help="the workflow's id, as submit printed it")
        if name != "describe":
            p.add_argument("--step", metavar="S", help="only this step")
        broker_arg(p)
        p.set_defaults(func=cmd_workflow)

    for action, text in (
        ("cancel", "cancel a job"),
        ("suspend", "stop a job, keep it"),
        ("resume", "re-queue a suspended job"),
    ):
        job = add(action, help=text)
        job.add_argument("job", metavar="JOB")
        broker_arg(job)
        job.set_defaults(func=cmd_job_action, action=action)

    logs = add("logs", help="a job's output from its site")
    logs.add_argument("job", metavar="JOB")
    logs.add_argument("-f", "--follow", action="store_true", help="stream until the run ends")
    broker_arg(logs)
    logs.set_defaults(func=cmd_logs)
