"""/v1/workflows: submit a DAG of steps, list, describe, cancel and retry (broker.ops.workflows).

The jobs permissions apply (broker.api.access): jobs:submit to submit, jobs:read to read, jobs:act
to cancel and retry; a tenant's token sees and acts on its own tenant's workflows only
(another tenant's is a 404).
"""

from __future__ import annotations

from aiohttp import web
from pydantic import BaseModel, ConfigDict

from broker.api.access import note, principal, submitting
from broker.api.bodies import query_limit, read_model
from broker.api.openapi import Operation, Param, Reply
from broker.model.errors import InvalidRequest
from broker.model.jobs import NAME_RE
from broker.model.workflows import WorkflowSpec
from broker.ops.workflows import Workflows, WorkflowSummary, WorkflowView
from broker.state.auth import Forbidden

__all__ = ["workflow_operations"]

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
_STEP = Param(
    "step", "query", "only this step (its name in the workflow)",
    {"type": "string", "pattern": NAME_RE},
)  # fmt: skip
_WORKFLOW = Param("workflow", "path", "the workflow id")


class WorkflowList(BaseModel):
    """GET /v1/workflows: newest first."""

    model_config = ConfigDict(frozen=True)

    items: list[WorkflowSummary]


def _workflows(request: web.Request) -> Workflows:
    from broker.api.keys import BROKER

    return request.app[BROKER].workflows


def _json(view: WorkflowView, status: int = 200) -> web.Response:
    return web.json_response(view.model_dump(mode="json"), status=status)


async def submit(request: web.Request) -> web.Response:
    spec = await read_model(request, WorkflowSpec)
    submitting(request, spec.tenant)
    view = await _workflows(request).submit(spec)
    note(request, target=view.id)
    return _json(view, 201)


async def list_workflows(request: web.Request) -> web.Response:
    limit = query_limit(request.query, default=DEFAULT_LIMIT, maximum=MAX_LIMIT)
    tenant = request.query.get("tenant") or None
    who = principal(request)
    if who.tenant is not None:
        if tenant not in (None, who.tenant):
            raise Forbidden(
                f"a {who.role.value} token lists tenant {who.tenant}'s workflows only",
                field="tenant",
            )
        tenant = who.tenant
    items = await _workflows(request).list(tenant, limit)
    return web.json_response(WorkflowList(items=items).model_dump(mode="json"))


async def _visible(request: web.Request) -> WorkflowView:
    workflow_id = request.match_info["workflow"]
    view = await _workflows(request).get(workflow_id)
    principal(request).only_own(view.tenant, f"workflow {workflow_id!r}")
    return view


def _step(request: web.Request) -> str | None:
    step = request.query.get("step")
    if step is None:
        return None
    if not step:
        raise InvalidRequest("step must not be empty", field="step")
    return step


async def get_workflow(request: web.Request) -> web.Response:
    return _json(await _visible(request))


async def cancel(request: web.Request) -> web.Response:
    step = _step(request)
    seen = await _visible(request)
    note(request, tenant=seen.tenant, target=seen.id)
    return _json(await _workflows(request).cancel(seen.id, step))


async def retry(request: web.Request) -> web.Response:
    step = _step(request)
    seen = await _visible(request)
    note(request, tenant=seen.tenant, target=seen.id)
    return _json(await _workflows(request).retry(seen.id, step))


def workflow_operations() -> list[Operation]:
    ok: dict[int | str, Reply] = {
        200: Reply("the workflow: its DAG, each step's state", WorkflowView)
    }
    return [
        Operation(
            "POST", "/v1/workflows", submit, "Submit a workflow: a DAG of steps",
            "submit_workflow", body=WorkflowSpec,
            replies={201: Reply("submitted: the workflow and its steps", WorkflowView)},
            errors=(400, 409, 413, 415, 503),
        ),
        Operation(
            "GET", "/v1/workflows", list_workflows, "List workflows, newest first",
            "list_workflows",
            params=(
                Param("tenant", "query", "only this tenant's workflows"),
                Param(
                    "limit", "query", f"at most this many (default {DEFAULT_LIMIT})",
                    {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT},
                ),
            ),
            replies={200: Reply("workflows, newest first", WorkflowList)},
            errors=(400, 503),
        ),
        Operation(
            "GET", "/v1/workflows/{workflow}", get_workflow,
            "Describe a workflow: the DAG with each step's state", "get_workflow",
            params=(_WORKFLOW,), replies=ok, errors=(404, 503),
        ),
        Operation(
            "POST", "/v1/workflows/{workflow}/cancel", cancel,
            "Cancel a workflow's unfinished steps, or one step", "cancel_workflow",
            params=(_WORKFLOW, _STEP), replies=ok, errors=(400, 404, 409, 503),
        ),
        Operation(
            "POST", "/v1/workflows/{workflow}/retry", retry,
            "Run a workflow's failed or cancelled steps again (or one step), with their "
            "dependents", "retry_workflow",
            params=(_WORKFLOW, _STEP), replies=ok, errors=(400, 404, 409, 503),
        ),
    ]  # fmt: skip
