"""`GET /v1/requests/{request_id}`: one request by its id, so a client that lost its connection
reattaches: its state, its verdict while it waits, and its answer once it is done.

A request id names one workflow per capability (`request:<capability>:<request_id>`, the id
being the idempotency key), so the gateway looks the id up under every capability of the catalog
(or only `?capability=` when given) and answers the newest run it finds. `?wait_s=N` (at most
`MAX_WAIT_S`) waits up to N seconds for a request still in flight to end, and answers as it then
stands: the reattach a lost connection needs, without starting anything again.

The answer: `request_id`, `capability`, `workflow_id`, `state` (`waiting`, `running`,
`succeeded`, `failed`), `phase` (the request workflow's own), `verdict` while waiting
(`_verdict_source.py`), `result` once succeeded (`output`, `lease`, `timings`, as `POST
/v1/requests` answers) and `error` once failed (`failure_class`, `message`).

Per tenant: a request is found only by the tenant that made it; another tenant's id answers
the same 404 as an unknown one (`error.code` `request_not_found`), so nothing is learned about
who uses which id. An operator's or observer's key (`sees_everything`) finds any request, but
gets another tenant's output only as `result.output: null` (the answer is that tenant's)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError, TerminatedError
from temporalio.exceptions import TimeoutError as WorkflowTimeout
from temporalio.service import RPCError, RPCStatusCode

from modelforge.failures import FailureClass
from modelforge.gateway import _context
from modelforge.gateway._verdict_source import VerdictSource
from modelforge.identifiers import identifier_problem, shown
from modelforge.messages import RequestResult
from modelforge.names import request_workflow_id
from modelforge.payloads import OUTPUT_REF, PayloadMissing, get_output, payload_store

MAX_WAIT_S = 60.0
# Describes in flight at once while an id is looked up under every capability.
_LOOKUPS = 16
WAITING_PHASES = frozenset({"admitting", "queued"})


def _not_found(request_id: str) -> _context.GatewayError:
    return _context.GatewayError(
        FailureClass.REQUEST_INVALID,
        f"no request {shown(request_id)} of yours is known (a request id is kept as long as Temporal "
        "keeps its workflow)",
        status=404,
        code="request_not_found",
        param="request_id",
        request_id=request_id,
    )


@dataclasses.dataclass
class _Found:
    capability: str
    handle: WorkflowHandle[Any, RequestResult]
    status: WorkflowExecutionStatus | None
    started: float
    tenant: str


def requests_router(
    requester: Any, catalog: Any, sees_everything: Callable[[str], bool], verdicts: VerdictSource
) -> APIRouter:
    """`catalog`: the gateway's cached catalog (`get()`); `sees_everything(tenant)`: whether a
    key reads every tenant's traffic (GatewayConfig's)."""
    router = APIRouter()

    async def describe(capability: str, request_id: str, gate: asyncio.Semaphore) -> _Found | None:
        handle = requester.temporal.get_workflow_handle(
            request_workflow_id(capability, request_id), result_type=RequestResult
        )
        async with gate:
            try:
                described = await handle.describe(rpc_timeout=timedelta(seconds=10))
            except RPCError as error:
                if error.status == RPCStatusCode.NOT_FOUND:
                    return None
                raise _context.GatewayError(
                    FailureClass.CAPABILITY_UNAVAILABLE, f"Temporal did not answer: {error.status.name}"
                ) from None
            memo = await described.memo()
        tenant = memo.get("tenant")
        return _Found(
            capability,
            handle,
            described.status,
            described.start_time.timestamp(),
            tenant if isinstance(tenant, str) else "",
        )

    async def find(request_id: str, capability: str | None, tenant: str) -> _Found:
        names = [capability] if capability else sorted({d.capability for d in (await catalog.get()).deployments})
        gate = asyncio.Semaphore(_LOOKUPS)
        found = [f for f in await asyncio.gather(*(describe(c, request_id, gate) for c in names)) if f is not None]
        visible = [f for f in found if f.tenant == tenant or sees_everything(tenant)]
        if not visible:
            raise _not_found(request_id)
        return max(visible, key=lambda f: f.started)

    async def outcome(found: _Found, show_output: bool) -> dict[str, Any]:
        """`result` or `error` of a closed run."""
        try:
            result = await found.handle.result(follow_runs=False)
        except WorkflowFailureError as error:
            cause = error.cause
            if isinstance(cause, ApplicationError) and cause.type:
                return {"error": {"failure_class": cause.type, "message": cause.message}}
            failure = FailureClass.TIMEOUT if isinstance(cause, WorkflowTimeout | TerminatedError) else None
            return {
                "error": {
                    "failure_class": (failure or FailureClass.CAPABILITY_UNAVAILABLE).value,
                    "message": str(cause or error),
                }
            }
        output: Any = result.output
        if not show_output:
            output = None
        elif isinstance(output, dict) and OUTPUT_REF in output:  # a large answer the node kept in the store
            try:
                output = await asyncio.to_thread(get_output, payload_store(requester.temporal), output)
            except PayloadMissing as error:
                return {"error": {"failure_class": FailureClass.CAPABILITY_UNAVAILABLE.value, "message": error.message}}
        return {
            "result": {
                "output": output,
                "lease": dataclasses.asdict(result.lease) if result.lease else None,
                "timings": result.timings,
            }
        }

    @router.get("/v1/requests/{request_id}")
    async def request_by_id(
        request: Request,
        request_id: str,
        capability: Annotated[str | None, Query(max_length=200)] = None,
        wait_s: Annotated[float, Query(ge=0, le=MAX_WAIT_S)] = 0.0,
    ) -> dict[str, Any]:
        tenant: str = request.state.tenant
        for kind, value in (("request_id", request_id), ("capability", capability)):
            if value is not None and (problem := identifier_problem(kind, value)) is not None:
                raise _context.GatewayError(FailureClass.REQUEST_INVALID, problem, param=kind)
        request.state.request_id = request_id
        if getattr(requester, "temporal", None) is None:
            raise _context.GatewayError(FailureClass.CAPABILITY_UNAVAILABLE, "this gateway keeps no request workflows")
        found = await find(request_id, capability, tenant)
        request.state.capability = found.capability
        if found.status == WorkflowExecutionStatus.RUNNING and wait_s > 0:
            try:  # the reattach: the same run's end, however long it has been going
                await asyncio.wait_for(found.handle.result(follow_runs=False), timeout=wait_s)
            except (TimeoutError, WorkflowFailureError):
                pass
            found = await find(request_id, found.capability, tenant)
        answer: dict[str, Any] = {
            "request_id": request_id,
            "capability": found.capability,
            "workflow_id": found.handle.id,
            "tenant": found.tenant,
        }
        if found.status == WorkflowExecutionStatus.RUNNING:
            try:
                phase = str(await found.handle.query("phase", result_type=str, rpc_timeout=timedelta(seconds=5)))
            except Exception:  # its first task not yet run: it is being admitted
                phase = "admitting"
            waiting = phase in WAITING_PHASES
            answer |= {
                "state": "waiting" if waiting else "running",
                "phase": phase,
                "verdict": await verdicts.of_request(request_id, found.capability) if waiting else None,
            }
            return answer
        done = await outcome(found, show_output=found.tenant == tenant)
        succeeded = "result" in done
        answer |= {"state": "succeeded" if succeeded else "failed", "phase": "done" if succeeded else "failed"}
        return answer | done

    return router
