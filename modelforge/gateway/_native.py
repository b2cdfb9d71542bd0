"""ModelForge's own API surface: a capability request (`POST /v1/requests`), an operator's
residency call (`POST /v1/residency`, `modelforge load|unload|pin|unpin` over HTTP), the pool's
status (`GET /v1/status`) and the Prometheus metrics (`GET /metrics`). Each read is what the
caller's key may see: an operator's or observer's key the whole pool, a tenant's its own."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from modelforge.domain import Deployment
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gateway._chat_path import BodyOf, Run
from modelforge.gateway._context import GatewayError, Requester, _Catalog, _check, _invalid
from modelforge.gateway._params import refused, runtime_taken, takes_parameters
from modelforge.identifiers import shown
from modelforge.metrics import GatewayMetrics, TenantSeries
from modelforge.policy import PoolStatus


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CapabilityCall(_Strict):
    capability: Annotated[str, Field(min_length=1, max_length=200)]
    input: dict[str, Any] = Field(default_factory=dict)
    priority: str | None = None
    tenant: str | None = None
    deadline_s: Annotated[float, Field(gt=0)] | None = None
    lease_timeout_s: Annotated[float, Field(gt=0)] | None = None
    request_id: str | None = None


class ResidencyCall(_Strict):
    action: Literal["load", "unload", "pin", "unpin"]
    deployment: Annotated[str, Field(min_length=1, max_length=200)]
    accelerator: Annotated[str, Field(max_length=200)] = ""
    drain: bool = False


def native_router(
    *,
    catalog: _Catalog,
    requester: Requester,
    metrics: GatewayMetrics,
    keyed: bool,
    is_operator: Callable[[Request], bool],
    sees_everything: Callable[[str], bool],
    status_for: Callable[[Request, PoolStatus], PoolStatus],
    body_of: BodyOf,
    request_id_of: Callable[[Request, str | None], str],
    priority_of: Callable[[Request, str | None], str | None],
    run: Run,
    refuse_parameters: Callable[[list[str], Deployment], GatewayError],
) -> APIRouter:
    """`keyed`: API keys are configured (the tenant comes from the key, never from a body)."""
    router = APIRouter()

    @router.post("/v1/requests")
    async def requests_(request: Request) -> JSONResponse:
        tenant: str = request.state.tenant
        call: CapabilityCall = await body_of(request, CapabilityCall)
        if call.tenant is not None:
            _check("tenant", call.tenant)
            if call.tenant != tenant and keyed:
                raise _invalid("the tenant comes from the API key, not the body")
        capability = _check("capability", call.capability)
        request_id = request_id_of(request, call.request_id)
        priority = priority_of(request, call.priority)
        known = await catalog.get()
        deployment = known.deployment_for(capability)
        if deployment is None:
            raise GatewayError(
                FailureClass.CAPABILITY_UNAVAILABLE,
                f"no deployment serves {shown(capability)}",
                status=404,
                request_id=request_id,
                code="model_not_found",
                param="capability",
            )
        given = call.input.get("parameters")
        if given and not any(takes_parameters(deployment, api) for api in ("openai_chat", "openai_embeddings")):
            names = refused(given, runtime_taken(deployment)) if isinstance(given, dict) else ["parameters"]
            if names:  # a runtime that takes none would drop them
                raise refuse_parameters([f"input.parameters.{n}" for n in names], deployment)
        result = await run(
            request,
            capability,
            call.input,
            request_id,
            tenant=call.tenant or tenant,
            priority=priority,
            deadline_s=call.deadline_s,
            lease_timeout_s=call.lease_timeout_s,
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

    @router.post("/v1/residency")
    async def residency(request: Request) -> dict[str, Any]:
        """An operator loads, unloads, pins or unpins a model (`modelforge load|unload|pin|unpin`
        over HTTP): only with API keys, and only for keys of MODELFORGE_GATEWAY_OPERATORS' tenants."""
        tenant: str = request.state.tenant
        if not is_operator(request):
            raise GatewayError(
                FailureClass.REQUEST_INVALID,
                "residency operations need an operator's API key (MODELFORGE_GATEWAY_OPERATORS)",
                status=403,
                code="permission_denied",
            )
        call: ResidencyCall = await body_of(request, ResidencyCall)
        _check("capability", call.deployment)
        request.state.capability = call.deployment
        try:
            reply = await requester.residency(
                call.action, call.deployment, accelerator=call.accelerator, drain=call.drain, actor=f"gateway:{tenant}"
            )
        except ModelForgeError as error:
            raise GatewayError(error.failure, error.message) from None
        return {"ok": reply.ok, "message": reply.message, "residents": reply.residents}

    @router.get("/v1/status")
    async def status(request: Request) -> JSONResponse:
        try:
            pool = await requester.status()
        except ModelForgeError as error:
            raise GatewayError(error.failure, error.message) from None
        return JSONResponse(dataclasses.asdict(status_for(request, pool)))

    @router.get("/metrics", include_in_schema=False)
    async def metrics_(request: Request) -> Response:
        # Prometheus text; behind the API key like every route (Prometheus sends it as a bearer).
        # A tenant's key reads its own series only; an operator's or observer's, every tenant's.
        tenant: str = request.state.tenant
        shown = metrics.registry if sees_everything(tenant) else TenantSeries(metrics.registry, tenant)
        return Response(generate_latest(shown), media_type=CONTENT_TYPE_LATEST)

    return router
