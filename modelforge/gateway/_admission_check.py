"""Now, later or never, without starting anything: `POST /v1/admission/check`, and the
`X-ModelForge-Dry-Run: 1` header on any model call.

A check is the scheduler's own dry run (`modelforge.verdicts.admission_check`: the policy's
decision for the request as if it arrived now, taken on a copy of the pool's state), answered as
`AdmissionCheck.to_json()`: `answer` `now` (granted at once), `later` (it would wait or load; with
its verdict and ETA) or `never` (refused: `failure` is the class, `message` why, `detail` the
memory figures), with the deadline applied (`deadline_s`). A check starts no workflow, holds no
capacity and writes no history event: it is a query.

The header: a call (`/v1/chat/completions`, `/api/chat`, `/v1/requests`...) with
`X-ModelForge-Dry-Run: 1` (or `true`) is read and checked like the real call (a bad body is still
400), then answered 200 with the check instead of being run (`X-ModelForge-Dry-Run: 1` on the
answer too), its class, deadline and lease length those the call would have asked for."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gateway import _context
from modelforge.gateway._context import DryRun
from modelforge.gateway._deadlines import apply_deadline
from modelforge.gateway._verdict_source import VerdictSource
from modelforge.identifiers import PRIORITY_CLASS, shown
from modelforge.verdicts import CheckSpec

DRY_RUN_HEADER = "x-modelforge-dry-run"
_TRUE = frozenset({"1", "true", "yes"})


def dry_run_asked(request: Request) -> bool:
    """Whether the call asks for a check instead of a run (REQUEST_INVALID for a value that is
    neither yes nor no: a typo must not run the real thing)."""
    given = request.headers.get(DRY_RUN_HEADER)
    if given is None or given.strip().lower() in {"0", "false", "no", ""}:
        return False
    if given.strip().lower() in _TRUE:
        return True
    raise _context.GatewayError(
        FailureClass.REQUEST_INVALID,
        f"X-ModelForge-Dry-Run: give 1 or 0, not {shown(given[:20])}",
        param="X-ModelForge-Dry-Run",
    )


class CheckCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The capability, or a model name as the OpenAI and Ollama routes take it.
    capability: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    model: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    priority: str | None = None
    deadline_s: Annotated[float, Field(gt=0, le=7 * 24 * 3600)] | None = None


async def check(verdicts: VerdictSource, capability: str, tenant: str, options: dict[str, Any]) -> dict[str, Any]:
    """The check of a request as `options` (a call's: priority, deadline_s, max_duration_s,
    lease_timeout_s) would ask it; a scheduler that does not answer is the call's error."""
    spec = CheckSpec(
        capability=capability,
        tenant=tenant,
        priority=options.get("priority"),
        deadline_s=options.get("deadline_s"),
        max_duration_s=options.get("max_duration_s"),
        lease_timeout_s=options.get("lease_timeout_s"),
    )
    try:
        answer = await verdicts.check(spec)
    except ModelForgeError as error:
        raise _context.GatewayError(error.failure, error.message) from None
    answer["deadline_s"] = options.get("deadline_s")
    return answer


def admission_router(verdicts: VerdictSource, deployment_for_model: Any, body_of: Any) -> APIRouter:
    """`deployment_for_model(name)`: the catalog's deployment for a model or capability name;
    `body_of(request, model)`: the body read and validated as every route reads it."""
    router = APIRouter()

    @router.post("/v1/admission/check")
    async def admission_check(request: Request) -> JSONResponse:
        call: CheckCall = await body_of(request, CheckCall)
        name = call.capability or call.model
        if name is None or (call.capability and call.model):
            raise _context.GatewayError(
                FailureClass.REQUEST_INVALID, "give capability or model (one of them)", param="capability"
            )
        deployment = await deployment_for_model(name)
        if call.priority is not None and not PRIORITY_CLASS.fullmatch(call.priority):
            raise _context.GatewayError(
                FailureClass.REQUEST_INVALID,
                f"priority {shown(call.priority)} is not a class name (a level, or 'queue.level')",
                param="priority",
            )
        request.state.capability = deployment.capability
        options: dict[str, Any] = {"deadline_s": call.deadline_s}
        try:
            apply_deadline(request.state, request.headers, options)
        except ModelForgeError as error:
            raise _context.GatewayError(error.failure, error.message, param="X-Request-Timeout") from None
        options["priority"] = call.priority
        return JSONResponse(await check(verdicts, deployment.capability, request.state.tenant, options))

    return router


def install_dry_run(app: FastAPI) -> None:
    """Answer a call stopped by its dry run (`DryRun`) with its check."""

    @app.exception_handler(DryRun)
    async def _dry_run(request: Request, stopped: DryRun) -> JSONResponse:
        return JSONResponse(stopped.answer, headers={"X-ModelForge-Dry-Run": "1"})


async def dry_run(
    request: Request, verdicts: VerdictSource, capability: str, tenant: str, options: dict[str, Any]
) -> DryRun:
    """The check of a call asked with X-ModelForge-Dry-Run, as the exception that answers it."""
    answer = await check(verdicts, capability, tenant, options)
    answer["request_id"] = getattr(request.state, "request_id", None)
    return DryRun(answer)
