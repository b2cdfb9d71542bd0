"""`POST /v1/jobs`: a job (runtime subprocess_job) run to its end under a lease of
`max_duration_s`, `ModelForgeClient.submit_job` over HTTP. Its own router on `create_app`'s
helpers (the body reader, the request id and priority headers, `run`); included into the
authenticated router, so the API key is checked first, as on every other route."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from modelforge.client import MAX_GPU_COUNT, Result, job_input
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gateway._context import GatewayError, _Catalog, _check
from modelforge.identifiers import MAX_DURATION_S, MIN_DURATION_S, shown
from modelforge.runtimes import runtime_names, speaks


class JobCall(BaseModel):
    """POST /v1/jobs: a job (runtime subprocess_job) whose deployment's command gets `args`."""

    model_config = ConfigDict(extra="forbid")

    capability: Annotated[str, Field(min_length=1, max_length=200)]
    args: Annotated[list[str], Field(max_length=200)] = Field(default_factory=list)
    max_duration_s: Annotated[float, Field(ge=MIN_DURATION_S, le=MAX_DURATION_S)]
    gpu_count: Annotated[int, Field(ge=1, le=MAX_GPU_COUNT)] | None = None
    nvlink: StrictBool = False
    priority: str | None = None
    request_id: str | None = None


def jobs_router(
    catalog: _Catalog,
    body_of: Callable[[Request, type[BaseModel]], Awaitable[Any]],
    request_id_of: Callable[[Request, str | None], str],
    priority_of: Callable[[Request, str | None], str | None],
    run: Callable[..., Awaitable[Result]],
) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/jobs")
    async def jobs_(request: Request) -> JSONResponse:
        """A job (runtime subprocess_job) run to its end under a lease of `max_duration_s`: its
        Result (the job's output, timings, request id), or the typed error. `ModelForgeClient.
        submit_job` over HTTP; a deployment of any other runtime is refused (400, named)."""
        tenant: str = request.state.tenant
        call: JobCall = await body_of(request, JobCall)
        capability = _check("capability", call.capability)
        request_id = request_id_of(request, call.request_id)
        priority = priority_of(request, call.priority)
        deployment = (await catalog.get()).deployment_for(capability)
        if deployment is None:
            raise GatewayError(
                FailureClass.CAPABILITY_UNAVAILABLE,
                f"no deployment serves {shown(capability)}",
                status=404,
                request_id=request_id,
                code="model_not_found",
                param="capability",
            )
        if not speaks(deployment).job:
            jobs = " or ".join(runtime_names(lambda spec: spec.job))
            raise GatewayError(
                FailureClass.REQUEST_INVALID,
                f"{shown(capability)} runs on runtime {shown(deployment.runtime)}, not {jobs}: "
                "it is not a job (POST /v1/requests serves it)",
                status=400,
                request_id=request_id,
                code="invalid_value",
                param="capability",
            )
        if call.nvlink and not deployment.nvlink_required:  # what the node would refuse, before any workflow
            raise GatewayError(
                FailureClass.REQUEST_INVALID,
                f"nvlink: the job asks for cards joined by NVLink, but {deployment.deployment_id} does not require an "
                "NVLink group (its catalog entry has no nvlink_required = true), so its placement does not "
                "promise one; submit without nvlink or use a deployment that requires NVLink",
                status=400,
                request_id=request_id,
                code="invalid_value",
                param="nvlink",
            )
        try:
            payload = job_input(call.args, call.gpu_count, call.nvlink)
        except ModelForgeError as error:
            raise GatewayError(error.failure, error.message, request_id=request_id) from None
        result = await run(
            request,
            capability,
            payload,
            request_id,
            tenant=tenant,
            priority=priority,
            max_duration_s=call.max_duration_s,
        )
        return JSONResponse(
            {
                "request_id": result.request_id,
                "capability": result.capability,
                "output": result.output,
                "lease": dataclasses.asdict(result.lease) if result.lease else None,
                "timings": result.timings,
                "workflow_id": result.workflow_id,
            }
        )

    return router
