"""Now, later or never, without starting anything: `POST /v1/admission/check`, and the
`X-ModelForge-Dry-Run: 1` header on any model call.

A check answers the JSON `modelforge.verdicts.AdmissionCheck` defines: `answer` (`now` when a
request asked at once would be granted without waiting, `later` when it would wait or load,
`never` when it would be refused), `pool`, `capability`, `priority`, `action`, `failure` (the
class it would be refused with), `message` (why), `eta` (`seconds`, `basis`, `quality`), and
`checked_at`. A check starts no workflow, holds no capacity and writes no history at a
scheduler: it reads the pools' answers to queries (here their `route` answers: free slots, warm
instances, room, waiting requests; `eta.seconds` only for `now`).

The header: a call (`/v1/chat/completions`, `/api/chat`, `/v1/requests`...) with
`X-ModelForge-Dry-Run: 1` (or `true`) is read and checked like the real call (a bad body is still
400), then answered 200 with the check instead of being run (`X-ModelForge-Dry-Run: 1` on the
answer too). A deadline (the body's `deadline_s` or the client's timeout, `_deadlines.py`) is
said with it (`deadline_s`)."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gateway import _app
from modelforge.gateway._deadlines import apply_deadline
from modelforge.identifiers import shown
from modelforge.routing import RouteInfo, RouteQuery

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
    raise _app.GatewayError(
        FailureClass.REQUEST_INVALID,
        f"X-ModelForge-Dry-Run: give 1 or 0, not {shown(given[:20])}",
        param="X-ModelForge-Dry-Run",
    )


class DryRun(Exception):
    """A call answered by its check (raised where the call would have started its request)."""

    def __init__(self, answer: dict[str, Any]) -> None:
        super().__init__(answer.get("answer", ""))
        self.answer = answer


class CheckCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The capability, or a model name as the OpenAI and Ollama routes take it.
    capability: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    model: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    priority: str | None = None
    deadline_s: Annotated[float, Field(gt=0, le=7 * 24 * 3600)] | None = None


async def check(requester: Any, capability: str, tenant: str, priority: str | None) -> dict[str, Any]:
    """The check of one request, from each pool's `route` answer for it (the best pool's)."""
    answer: dict[str, Any] = {
        "answer": "never",
        "pool": None,
        "capability": capability,
        "deployment": None,
        "priority": priority,
        "action": "reject",
        "accelerator": None,
        "failure": FailureClass.CAPABILITY_UNAVAILABLE.value,
        "message": "",
        "detail": "",
        "eta": {"seconds": None, "basis": None, "quality": None},
        "verdict": None,
        "checked_at": time.time(),
    }
    router = getattr(requester, "router", None)
    if router is None:
        answer["message"] = "this gateway has no pools to ask"
        return answer
    pools: list[str] = [requester.pool] if getattr(requester, "pool", None) else await router.pools()
    query = RouteQuery(capability=capability, tenant=tenant, priority=priority)
    answers = await asyncio.gather(*(router._route(pool, query) for pool in pools))
    infos = [info for info in answers if isinstance(info, RouteInfo) and info.ready]
    serving = [info for info in infos if info.serves]
    if not serving:
        silent = [f"{pool}: {info}" for pool, info in zip(pools, answers, strict=True) if isinstance(info, str)]
        known = [info.pool for info in infos if info.known]
        if known:
            answer["message"] = (
                f"pool {known[0]} has cards for {shown(capability)}, but none the class "
                f"{shown(priority or 'default')} may use (production work needs production-eligible, measured cards)"
            )
        else:
            answer["message"] = f"no pool serves {shown(capability)}" + (
                f" (not answering: {'; '.join(silent)})" if silent else ""
            )
        return answer
    best = max(serving, key=lambda i: (i.free_slots > 0 and i.queued == 0, i.room, i.warm, -i.queue_depth))
    answer |= {"pool": best.pool, "failure": None, "action": "wait"}
    if best.free_slots > 0 and best.queued == 0:
        answer |= {
            "answer": "now",
            "action": "grant",
            "message": f"{best.free_slots} free slot(s)",
            "eta": {"seconds": 0.0, "basis": "free_slot", "quality": "route"},
        }
    elif best.room and best.queued == 0:
        answer |= {"answer": "later", "action": "load", "message": "no instance is free: one would be loaded"}
    else:
        answer |= {
            "answer": "later",
            "message": f"{best.queued} request(s) of it wait ahead ({best.queue_depth} in the pool)"
            if best.queued
            else f"every instance is busy ({best.warm} warm, no card with room for another)",
        }
    return answer


def admission_router(requester: Any, deployment_for_model: Any, body_of: Any) -> APIRouter:
    """`deployment_for_model(name)`: the catalog's deployment for a model or capability name;
    `body_of(request, model)`: the body read and validated as every route reads it."""
    router = APIRouter()

    @router.post("/v1/admission/check")
    async def admission_check(request: Request) -> JSONResponse:
        call: CheckCall = await body_of(request, CheckCall)
        name = call.capability or call.model
        if name is None or (call.capability and call.model):
            raise _app.GatewayError(
                FailureClass.REQUEST_INVALID, "give capability or model (one of them)", param="capability"
            )
        deployment = await deployment_for_model(name)
        if call.priority is not None and not _app._PRIORITY.fullmatch(call.priority):
            raise _app.GatewayError(
                FailureClass.REQUEST_INVALID,
                f"priority {shown(call.priority)} is not a class name (a level, or 'queue.level')",
                param="priority",
            )
        request.state.capability = deployment.capability
        options: dict[str, Any] = {"deadline_s": call.deadline_s}
        try:
            apply_deadline(request.state, request.headers, options)
        except ModelForgeError as error:
            raise _app.GatewayError(error.failure, error.message, param="X-Request-Timeout") from None
        answer = await check(requester, deployment.capability, request.state.tenant, call.priority)
        answer["deadline_s"] = options.get("deadline_s")
        return JSONResponse(answer)

    return router


def install_dry_run(app: FastAPI) -> None:
    """Answer a call stopped by its dry run (`DryRun`) with its check."""

    @app.exception_handler(DryRun)
    async def _dry_run(request: Request, stopped: DryRun) -> JSONResponse:
        return JSONResponse(stopped.answer, headers={"X-ModelForge-Dry-Run": "1"})


async def dry_run(request: Request, requester: Any, capability: str, tenant: str, options: dict[str, Any]) -> DryRun:
    """The check of a call asked with X-ModelForge-Dry-Run, as the exception that answers it."""
    answer = await check(requester, capability, tenant, options.get("priority"))
    answer["deadline_s"] = options.get("deadline_s")
    answer["request_id"] = getattr(request.state, "request_id", None)
    return DryRun(answer)
