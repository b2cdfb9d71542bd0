"""The gateway's FastAPI application. Every call starts one request workflow through the
`Requester` seam (the real one is `modelforge.client.ModelForgeClient`) and maps its typed
outcome to HTTP; the failure class is always in the body.

Order of checks on every call (docs/SECURITY.md, "The gateway"): the API key first (every route
but `/healthz`, before a byte of the body is read; 401 whatever the path or model name), then the
body read from the stream up to the maximum payload size (MODELFORGE_MAX_PAYLOAD_BYTES; 413 past
it, never buffered whole) within `body_timeout_s` (408), then its shape, parameters and
identifiers (`modelforge.identifiers`; 400), and only then a workflow. Errors are OpenAI's shape
(`error.type`, `error.code`, `error.param`) with the failure class in `error.modelforge_class`.
Header timeouts are the server's: `gateway_server` (`_server.py`). Every request is logged and
counted (`_observe.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import os
import tomllib
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from temporalio.exceptions import WorkflowAlreadyStartedError

from modelforge.client import Result
from modelforge.domain import Deployment
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gateway._admission_check import admission_router, dry_run, dry_run_asked, install_dry_run
from modelforge.gateway._anthropic import anthropic_router
from modelforge.gateway._chat_path import ChatPath
from modelforge.gateway._context import (
    INTERNAL_ERROR,
    CatalogSource,
    GatewayError,
    Requester,
    _Catalog,
    _check,
    _error_response,
    _escaped,
    _invalid,
)
from modelforge.gateway._deadlines import apply_deadline
from modelforge.gateway._hints import conflict as hint_conflict
from modelforge.gateway._hints import end_user, hinted
from modelforge.gateway._jobs import jobs_router
from modelforge.gateway._native import native_router
from modelforge.gateway._observe import AccessLog
from modelforge.gateway._ollama import ollama_router
from modelforge.gateway._openai import OpenAIPath, openai_router
from modelforge.gateway._params import (
    runtime_taken,
)
from modelforge.gateway._requests_view import requests_router
from modelforge.gateway._rerank import rerank_router
from modelforge.gateway._responses import responses_router
from modelforge.gateway._status_page import status_page_router
from modelforge.gateway._streams import (
    Stream,
    StreamHub,
    next_record,
    stream_buffer_bytes_from_env,
    stream_router,
    stream_stall_s_from_env,
)
from modelforge.gateway._verdict_source import VerdictSource
from modelforge.identifiers import PRIORITY_CLASS, identifier_problem, shown
from modelforge.messages import StreamTarget
from modelforge.metrics import GatewayMetrics
from modelforge.payloads import input_limit
from modelforge.policy import PoolStatus, tenant_view
from modelforge.settings import Settings

# Deeper JSON than this is refused (what the store keeps is cut at 64 levels anyway).
MAX_JSON_DEPTH = 64
# The key check as a FastAPI security dependency (so the OpenAPI document declares it). Module
# level: FastAPI resolves a dependency's annotations in its module's namespace.
_BEARER = HTTPBearer(
    auto_error=False,
    description="An API key from MODELFORGE_GATEWAY_API_KEYS_FILE (it chooses the tenant); "
    "required on every route but /healthz when keys are configured.",
)
_Credentials = Annotated[HTTPAuthorizationCredentials | None, Security(_BEARER)]


@dataclass(frozen=True)
class GatewayConfig:
    # API key -> tenant. Empty: no keys required, the tenant comes from X-ModelForge-Tenant.
    api_keys: dict[str, str] = field(default_factory=dict, repr=False)
    default_tenant: str = "default"
    catalog_ttl_s: float = 10.0
    # Bytes of one HTTP body, and of the input it forwards. None: the largest input the
    # requester's Temporal client sends (MODELFORGE_MAX_PAYLOAD_BYTES with the payload store, as
    # `modelforge gateway` connects; 1 MB without one), or MODELFORGE_MAX_PAYLOAD_BYTES for a
    # requester without a Temporal client.
    max_body_bytes: int | None = None
    # Seconds a client has to send the whole body once its headers are in (408 past it).
    body_timeout_s: float = 30.0
    # Where nodes push streamed answers to this gateway (MODELFORGE_GATEWAY_STREAM_URL, ending in
    # /internal/streams). None: the address the client's connection reached, which a node on
    # another host may not reach: set it on a cluster.
    stream_url: str | None = field(default_factory=lambda: os.environ.get("MODELFORGE_GATEWAY_STREAM_URL") or None)
    # Back-pressure on streamed answers (_streams.py): the unread bytes a stream may hold
    # (MODELFORGE_GATEWAY_STREAM_BUFFER_BYTES, 1 MiB), and how long a node's push waits for room
    # before the client counts as too slow (MODELFORGE_GATEWAY_STREAM_STALL_S, 10 s; at most 25).
    stream_buffer_bytes: int = field(default_factory=stream_buffer_bytes_from_env)
    stream_stall_s: float = field(default_factory=stream_stall_s_from_env)
    # Tenants whose API keys may load, unload, pin and unpin models (POST /v1/residency;
    # MODELFORGE_GATEWAY_OPERATORS, comma-separated). Only with API keys: without keys nobody may.
    operator_tenants: frozenset[str] = field(
        default_factory=lambda: frozenset(
            t.strip() for t in os.environ.get("MODELFORGE_GATEWAY_OPERATORS", "").split(",") if t.strip()
        )
    )
    # Tenants whose API keys see every tenant's traffic (/metrics, /v1/status, /api/ps) without
    # an operator's power (a monitoring key: Prometheus's; MODELFORGE_GATEWAY_OBSERVERS). With API
    # keys any other key sees only its own (`sees_everything`); without keys everyone sees all.
    observer_tenants: frozenset[str] = field(
        default_factory=lambda: frozenset(
            t.strip() for t in os.environ.get("MODELFORGE_GATEWAY_OBSERVERS", "").split(",") if t.strip()
        )
    )

    def sees_everything(self, tenant: str) -> bool:
        """Whether `tenant`'s key reads every tenant's traffic: no keys configured, an
        operator's or an observer's key."""
        return not self.api_keys or tenant in self.operator_tenants or tenant in self.observer_tenants


def load_api_keys(path: Path) -> dict[str, str]:
    """`[api_keys]` of a TOML file: `"<key>" = "<tenant>"`. Keys are secrets: never logged."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"{path}: cannot read: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"{path}: not TOML: {error}") from None
    except RecursionError:
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"{path}: nests too deeply to be a keys file") from None
    keys = data.get("api_keys")
    if not isinstance(keys, dict) or not keys:
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"{path}: needs an [api_keys] table of key = tenant")
    for key, tenant in keys.items():
        if identifier_problem("tenant", tenant) is not None or len(key) < 16:
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID,
                f"{path}: each API key is 16+ characters and maps to a tenant name (bad entry for "
                f"{shown(str(tenant))})",
            )
    return dict(keys)


def _body_limit(config: GatewayConfig, requester: Requester) -> int:
    if config.max_body_bytes is not None:
        return config.max_body_bytes
    if hasattr(requester, "temporal"):  # ModelForgeClient: what its converter lets it send
        return input_limit(requester.temporal)
    return Settings.from_env().max_payload_bytes


def _json_depth(value: Any) -> int:
    """How deep a parsed JSON value nests, without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth > MAX_JSON_DEPTH:
                return depth
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def create_app(
    requester: Requester,
    catalog_source: CatalogSource,
    config: GatewayConfig | None = None,
    *,
    metrics: GatewayMetrics | None = None,
) -> FastAPI:
    """The gateway. `metrics`: where its request metrics go (a fresh registry by default; served
    on its `/metrics`, and kept as `app.state.metrics`)."""
    config = config or GatewayConfig()
    catalog = _Catalog(catalog_source, config.catalog_ttl_s)
    body_limit = _body_limit(config, requester)
    metrics = metrics or GatewayMetrics()
    metrics.count_starts(requester)
    # The documentation routes are served below, behind the same key check as the API.
    app = FastAPI(title="ModelForge gateway", version="1", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics
    app.state.max_body_bytes = body_limit
    hub = StreamHub(config.stream_buffer_bytes, config.stream_stall_s)
    app.state.streams = hub
    verdicts = app.state.verdicts = VerdictSource(requester)  # what waiting requests wait on
    app.add_middleware(AccessLog, metrics=metrics)  # the access log line and metrics of every request
    keys = [(key.encode(), tenant) for key, tenant in config.api_keys.items()]

    def tenant_of_key(presented: str | None) -> str | None:
        if not keys or not presented:
            return None
        # Every key is compared, in constant time, whichever matches: no early return to time.
        found = None
        candidate = presented.encode("utf-8", "surrogateescape")
        for key, tenant in keys:
            if hmac.compare_digest(candidate, key):
                found = tenant
        return found

    def unauthorized() -> GatewayError:
        return GatewayError(
            FailureClass.REQUEST_INVALID,
            "a valid API key is required (Authorization: Bearer <key>, or x-api-key: <key>)",
            status=401,
            headers={"WWW-Authenticate": "Bearer"},
        )

    def presented_key(request: Request, credentials: HTTPAuthorizationCredentials | None) -> str | None:
        # Anthropic's clients send their key as `x-api-key`, OpenAI's and Ollama's as a bearer
        # token: either names the tenant, on every route; the bearer token wins when both come.
        return credentials.credentials if credentials else request.headers.get("x-api-key")

    async def authenticate(request: Request, credentials: _Credentials) -> None:
        """The caller's tenant (`request.state.tenant`): from its API key when keys are
        configured (401 without a valid one), else from X-ModelForge-Tenant. Every route but
        /healthz depends on it, and it runs before any body is read."""
        if keys:
            tenant = tenant_of_key(presented_key(request, credentials))
            if tenant is None:
                raise unauthorized()
        else:
            tenant = _check("tenant", request.headers.get("x-modelforge-tenant", config.default_tenant))
        request.state.tenant = tenant
        # Open WebUI's forwarded end user: recorded (the access log), never the tenant (_hints.py).
        if user := end_user(request.headers):
            request.state.end_user = user

    def authenticated(request: Request) -> bool:
        header = request.headers.get("authorization", "")
        scheme, _, presented = header.partition(" ")
        bearer = presented.strip() if scheme.lower() == "bearer" else None
        return tenant_of_key(bearer or request.headers.get("x-api-key")) is not None

    def answer(request: Request, error: GatewayError) -> JSONResponse:
        request.state.failure_class = error.failure  # for the access log and metrics
        if error.request_id:
            request.state.request_id = error.request_id
        return _error_response(error)

    @app.exception_handler(GatewayError)
    async def _typed(request: Request, error: GatewayError) -> JSONResponse:
        return answer(request, error)

    @app.exception_handler(StarletteHTTPException)
    async def _routing(request: Request, error: StarletteHTTPException) -> JSONResponse:
        # No such route or method: with keys configured, a caller without one learns nothing more.
        if keys and not authenticated(request):
            return answer(request, unauthorized())
        return answer(
            request, _invalid(f"{request.method} {shown(request.url.path)}: {error.detail}", error.status_code)
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, error: RequestValidationError) -> JSONResponse:
        return answer(request, _invalid(f"the request is not valid: {len(error.errors())} problem(s)"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        # Logged by the server; the client gets a class, never a traceback or another's data.
        return answer(request, GatewayError(INTERNAL_ERROR, "the gateway failed; see its log", status=500))

    async def read_body(request: Request) -> bytes:
        """At most `max_body_bytes` of the body, from the stream as it arrives, within
        `body_timeout_s`: past either the client gets its answer and the rest is never read."""
        limit = body_limit
        too_big = _invalid(
            f"the body is over the {limit}-byte limit (MODELFORGE_MAX_PAYLOAD_BYTES)", status=413, param="body"
        )
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise too_big
        body = bytearray()
        try:
            async with asyncio.timeout(config.body_timeout_s):
                async for chunk in request.stream():
                    if len(body) + len(chunk) > limit:
                        raise too_big
                    body += chunk
        except TimeoutError:
            raise _invalid(f"the body did not arrive within {config.body_timeout_s:g} s", status=408) from None
        except ClientDisconnect:
            raise _invalid("the client went away before its body arrived", status=400) from None
        return bytes(body)

    async def body_of(request: Request, model: type[BaseModel]) -> Any:
        raw = await read_body(request)
        try:
            call = model.model_validate_json(raw or b"{}")
        except ValidationError as error:
            first = error.errors(include_url=False, include_input=False)[0]
            where = ".".join(_escaped(str(p), 40) for p in first["loc"]) or "body"
            code = "missing_required_parameter" if first["type"] == "missing" else "invalid_value"
            raise _invalid(f"{where}: {first['msg']}", code=code, param=where) from None
        except (RecursionError, ValueError, UnicodeError) as error:
            raise _invalid(f"body: not valid JSON ({type(error).__name__})") from None
        if _json_depth(call.model_dump(mode="python")) > MAX_JSON_DEPTH:
            raise _invalid(f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels")
        return call

    def request_id_of(request: Request, given: str | None = None) -> str:
        header = request.headers.get("x-request-id")
        if given is not None and header is not None and given != header:
            raise _invalid("request_id in the body and X-Request-Id differ")
        chosen = given if given is not None else header
        return _check("request_id", chosen) if chosen is not None else uuid.uuid4().hex[:16]

    def priority_of(request: Request, given: str | None = None) -> str | None:
        header = request.headers.get("x-modelforge-priority")
        if given is not None and header is not None and given != header:
            raise _invalid("priority in the body and X-ModelForge-Priority differ")
        chosen = given if given is not None else header
        if chosen is not None and not PRIORITY_CLASS.fullmatch(chosen):
            raise _invalid(
                f"priority {shown(chosen)} is not a class name (a level such as 'interactive', or 'queue.level')"
            )
        return chosen

    # (capability, request id) -> (tenant, calls) of the requests in flight through this gateway:
    # a request id names one workflow (`request:<capability>:<id>`), and asking again attaches
    # to it, so one tenant's id must not answer another tenant.
    in_flight: dict[tuple[str, str], tuple[str, int]] = {}

    def conflict(request_id: str) -> GatewayError:
        # Whose request it is stays unsaid: it may be another tenant's.
        return GatewayError(
            FailureClass.REQUEST_INVALID,
            f"request id {shown(request_id)} is taken by another request; use another id",
            status=409,
            request_id=request_id,
        )

    async def run(
        request: Request, capability: str, payload: dict[str, Any], request_id: str, *, tenant: str, **options: Any
    ) -> Result:
        if "priority" not in options:  # read the header once
            # X-ModelForge-Priority, else the class a body's hint mapped to (`hint_priority`).
            options["priority"] = priority_of(request) or getattr(request.state, "hinted_priority", None)
        state = request.state
        state.capability, state.request_id, state.priority = capability, request_id, options["priority"] or ""
        try:  # the body's deadline, else the client's own wait from its headers (_deadlines.py)
            apply_deadline(state, request.headers, options)
        except ModelForgeError as error:
            raise _invalid(error.message, param="X-Request-Timeout") from None
        if dry_run_asked(request):  # a check instead of the run (_admission_check.py)
            raise await dry_run(request, verdicts, capability, tenant, options)
        # The input as the client measures it (JSON, ASCII escapes): past the limit, 413 here,
        # before any workflow, rather than the client's 400.
        with contextlib.suppress(TypeError, ValueError, RecursionError):
            size = len(json.dumps(payload, allow_nan=False).encode())
            if size > body_limit:
                raise _invalid(
                    f"the input is {size} bytes; the limit is {body_limit} (MODELFORGE_MAX_PAYLOAD_BYTES)",
                    status=413,
                    param="input",
                )
        key = (capability, request_id)
        holder, calls = in_flight.get(key, (tenant, 0))
        if holder != tenant:
            raise conflict(request_id)
        in_flight[key] = (tenant, calls + 1)
        if getattr(state, "end_user", ""):  # Open WebUI's forwarded user: on the lease's events
            options["end_user"] = state.end_user
        try:
            result = await requester.request(capability, payload, request_id=request_id, tenant=tenant, **options)
        except ModelForgeError as error:  # Temporal unreachable or refusing
            raise GatewayError(error.failure, error.message, request_id=request_id) from None
        except WorkflowAlreadyStartedError:
            raise conflict(request_id) from None
        finally:
            holder, calls = in_flight[key]
            if calls > 1:
                in_flight[key] = (holder, calls - 1)
            else:
                del in_flight[key]
        if result.lease is not None and result.lease.tenant != tenant:
            # Attached to a run of this id that another tenant started (through another gateway
            # process, or finished earlier): its output is not this caller's to see.
            raise conflict(request_id)
        if result.lease is not None:
            state.priority = result.lease.priority  # the class granted
        if not result.ok:
            raise GatewayError(
                result.failure_class or FailureClass.CAPABILITY_UNAVAILABLE, result.message, request_id=request_id
            )
        return result

    async def deployment_for_model(model: str) -> Deployment:
        return await catalog.deployment_for_model(_check("capability", model))

    async def hint_priority(request: Request, call: Any) -> None:
        """vLLM's `priority` or OpenAI's `service_tier` in a body, as the class `run` asks for,
        capped at the tenant's ceiling and said in X-ModelForge-Priority-Applied (_hints.py)."""
        if hint_conflict(call):
            raise _invalid("give priority or service_tier, not both", code="invalid_value", param="service_tier")
        if getattr(call, "priority", None) is None and getattr(call, "service_tier", None) is None:
            return
        header = request.headers.get("x-modelforge-priority")
        chosen = hinted(await catalog.get(), request.state.tenant, call, header, keyed=bool(keys))
        request.state.hinted_priority = chosen.priority
        if chosen.note:
            request.state.priority_applied = chosen.note

    @app.get("/health")  # vLLM's
    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    api = APIRouter(dependencies=[Depends(authenticate)])

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @api.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="ModelForge gateway")

    def refuse_parameters(names: list[str], deployment: Deployment) -> GatewayError:
        api = deployment.runtime_config.get("api", "")
        runtime = deployment.runtime + (f" with api {api!r}" if api else "")
        taken = sorted(runtime_taken(deployment))
        takes = f"takes only {', '.join(taken)}" if taken else "takes no request parameters"
        return _invalid(
            f"{', '.join(_escaped(n, 60) for n in names[:10])}: {deployment.capability} (runtime {runtime}) "
            f"{takes}; leave them out, or serve the model from an OpenAI-compatible "
            "server (subprocess_http)",
            code="unsupported_parameter",
            param=_escaped(names[0], 60),
        )

    api.include_router(jobs_router(catalog, body_of, request_id_of, priority_of, run))

    def status_for(request: Request, pool: PoolStatus) -> PoolStatus:
        """The pool's status as the caller's key may see it: whole, or its tenant's own view."""
        tenant: str = request.state.tenant
        return pool if config.sees_everything(tenant) else tenant_view(pool, tenant)

    def is_operator(request: Request) -> bool:
        return bool(keys) and request.state.tenant in config.operator_tenants

    # ModelForge's own: /v1/requests, /v1/residency, /v1/status, /metrics (_native.py).
    api.include_router(
        native_router(
            catalog=catalog,
            requester=requester,
            metrics=metrics,
            keyed=bool(keys),
            is_operator=is_operator,
            sees_everything=config.sees_everything,
            status_for=status_for,
            body_of=body_of,
            request_id_of=request_id_of,
            priority_of=priority_of,
            run=run,
            refuse_parameters=refuse_parameters,
        )
    )

    async def open_stream(
        request: Request, capability: str, payload: dict[str, Any], request_id: str, tenant: str
    ) -> tuple[Stream, asyncio.Task[Result], dict[str, Any] | None]:
        """Start a request whose answer the node pushes to a stream of this gateway, and wait
        for its first piece: a refusal before it (no room, bad input, a full queue) is raised
        here, so it is still a plain HTTP error with its status."""
        server = request.scope.get("server") or ("127.0.0.1", 0)
        url = config.stream_url or f"http://{server[0]}:{server[1]}/internal/streams"
        stream = hub.open()
        # Until its first piece, the stream tells what the request waits on (`next_record`).
        stream.verdict = functools.partial(verdicts.of_request, request_id, capability)
        target = StreamTarget(url=url, stream_id=stream.stream_id)
        task = asyncio.create_task(run(request, capability, payload, request_id, tenant=tenant, stream=target))
        # Its outcome is read by the events when they need it; never an unretrieved exception.
        task.add_done_callback(lambda done: done.cancelled() or done.exception())
        try:
            first = await next_record(stream, task)
        except BaseException:
            hub.close(stream)  # the client left while the request waited: the node is told so
            raise
        if first is None and task.exception() is not None:
            hub.close(stream)
            raise task.exception()  # type: ignore[misc]
        return stream, task, first

    # OpenAI's /v1/models, /v1/embeddings, /v1/chat/completions, /v1/completions (_openai.py).
    openai = OpenAIPath(
        catalog=catalog,
        hub=hub,
        body_of=body_of,
        run=run,
        request_id_of=request_id_of,
        open_stream=open_stream,
        hint=hint_priority,
        deployment_for_model=deployment_for_model,
        refuse_parameters=refuse_parameters,
    )
    api.include_router(openai_router(openai))

    # Ollama's /api/*
    api.include_router(
        ollama_router(
            catalog,
            requester,
            body_of,
            run,
            request_id_of,
            open_stream,
            hub,
            is_operator=is_operator,
            status_view=status_for,
        )
    )
    # OpenAI's Responses API and Anthropic's Messages API, each translated to the chat above.
    chat_path = ChatPath(body_of, openai.chat_input, run, open_stream, request_id_of, hub, hint_priority)
    api.include_router(responses_router(chat_path))
    # Cohere/Jina-style reranking (/v1/rerank, /rerank).
    api.include_router(rerank_router(deployment_for_model, body_of, run, request_id_of, hint_priority))
    api.include_router(anthropic_router(chat_path))
    # A request by its id (reattach), with the verdict of a waiting one (_requests_view.py).
    api.include_router(requests_router(requester, catalog, config.sees_everything, verdicts))
    api.include_router(admission_router(verdicts, deployment_for_model, body_of))  # now / later / never
    install_dry_run(app)
    app.include_router(api)
    # The operator's status page: its own key check, which also takes HTTP Basic (a browser's).
    app.include_router(status_page_router(bool(keys), tenant_of_key, config.sees_everything, verdicts))
    # Nodes push streamed answers here: not a client route (no API key; signed or loopback only).
    app.include_router(stream_router(hub))
    return app
