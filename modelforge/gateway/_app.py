"""The gateway's FastAPI application. Every call starts one request workflow through the
`Requester` seam (the real one is `modelforge.client.ModelForgeClient`) and maps its typed
outcome to HTTP; the failure class is always in the body."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hmac
import re
import struct
import time
import tomllib
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from modelforge.client import Result
from modelforge.domain import Catalog, Deployment
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gateway._errors import RETRY_AFTER_S, http_status
from modelforge.messages import MAX_INPUT_BYTES
from modelforge.policy import PoolStatus

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,99}$")


class Requester(Protocol):
    async def request(
        self,
        capability: str,
        input: dict[str, Any] | None = None,
        *,
        priority: str | None = None,
        tenant: str = "default",
        deadline_s: float | None = None,
        lease_timeout_s: float | None = None,
        request_id: str | None = None,
    ) -> Result: ...

    async def status(self) -> PoolStatus: ...


CatalogSource = Callable[[], Awaitable[Catalog]]


@dataclass(frozen=True)
class GatewayConfig:
    # API key -> tenant. Empty: no keys required, the tenant comes from X-ModelForge-Tenant.
    api_keys: dict[str, str] = field(default_factory=dict, repr=False)
    default_tenant: str = "default"
    catalog_ttl_s: float = 10.0
    # Bytes of one HTTP body; the workflow input limit applies to what is forwarded.
    max_body_bytes: int = 2 * MAX_INPUT_BYTES


def load_api_keys(path: Path) -> dict[str, str]:
    """`[api_keys]` of a TOML file: `"<key>" = "<tenant>"`. Keys are secrets: never logged."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"{path}: cannot read: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"{path}: not TOML: {error}") from None
    keys = data.get("api_keys")
    if not isinstance(keys, dict) or not keys:
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"{path}: needs an [api_keys] table of key = tenant")
    for key, tenant in keys.items():
        if not isinstance(tenant, str) or not _TENANT.match(tenant) or len(key) < 16:
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID,
                f"{path}: each API key is 16+ characters and maps to a tenant name (bad entry for {tenant!r})",
            )
    return dict(keys)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Lax(BaseModel):
    # OpenAI clients send fields ModelForge has no use for (temperature, user...): accepted, ignored.
    model_config = ConfigDict(extra="ignore")


class CapabilityCall(_Strict):
    capability: Annotated[str, Field(min_length=1, max_length=200)]
    input: dict[str, Any] = Field(default_factory=dict)
    priority: str | None = None
    tenant: str | None = None
    deadline_s: Annotated[float, Field(gt=0)] | None = None
    lease_timeout_s: Annotated[float, Field(gt=0)] | None = None
    request_id: str | None = None


class EmbeddingsCall(_Lax):
    model: Annotated[str, Field(min_length=1, max_length=200)]
    input: str | list[str]
    encoding_format: Literal["float", "base64"] = "float"


class ChatMessage(_Lax):
    role: Annotated[str, Field(min_length=1, max_length=40)]
    content: str | list[dict[str, Any]] | None = None


class ChatCall(_Lax):
    model: Annotated[str, Field(min_length=1, max_length=200)]
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1000)]
    max_tokens: Annotated[int, Field(gt=0)] | None = None
    max_completion_tokens: Annotated[int, Field(gt=0)] | None = None
    stream: bool = False


class GatewayError(Exception):
    def __init__(self, failure: FailureClass | str, message: str, *, status: int | None = None, request_id: str = ""):
        super().__init__(message)
        self.failure = failure.value if isinstance(failure, FailureClass) else failure
        self.message = message
        self.status = status if status is not None else http_status(self.failure)
        self.request_id = request_id


def _error_response(error: GatewayError) -> JSONResponse:
    # OpenAI's error shape, so its SDK raises the matching exception with our message and class.
    body = {
        "error": {"message": error.message, "type": error.failure, "code": error.failure, "param": None},
        "failure_class": error.failure,
        "request_id": error.request_id or None,
    }
    headers = {}
    try:
        retry_after = RETRY_AFTER_S.get(FailureClass(error.failure))
    except ValueError:
        retry_after = None
    if retry_after is not None and error.status in (429, 503):
        headers["Retry-After"] = str(retry_after)
    return JSONResponse(body, status_code=error.status, headers=headers)


class _Catalog:
    """The catalog as of at most `ttl_s` ago; the last good one when the store cannot answer."""

    def __init__(self, source: CatalogSource, ttl_s: float) -> None:
        self._source = source
        self._ttl_s = ttl_s
        self._catalog: Catalog | None = None
        self._loaded_at = 0.0
        self._lock = asyncio.Lock()

    async def get(self) -> Catalog:
        async with self._lock:
            if self._catalog is None or time.monotonic() - self._loaded_at > self._ttl_s:
                try:
                    self._catalog = await self._source()
                    self._loaded_at = time.monotonic()
                except Exception as error:
                    if self._catalog is None:
                        raise GatewayError(
                            FailureClass.CAPABILITY_UNAVAILABLE, f"the catalog cannot be read: {type(error).__name__}"
                        ) from None
            return self._catalog

    async def deployment_for_model(self, model: str) -> Deployment:
        catalog = await self.get()
        for deployment in catalog.deployments:
            if model == deployment.capability or model == deployment.name or model in deployment.openai_models:
                return deployment
        raise GatewayError(
            FailureClass.CAPABILITY_UNAVAILABLE, f"no capability serves model {model[:200]!r}", status=404
        )


def _words(text: str) -> int:
    return len(text.split())


def _float32_base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def create_app(requester: Requester, catalog_source: CatalogSource, config: GatewayConfig | None = None) -> FastAPI:
    config = config or GatewayConfig()
    catalog = _Catalog(catalog_source, config.catalog_ttl_s)
    app = FastAPI(title="ModelForge gateway", version="1", docs_url="/docs", redoc_url=None)

    @app.exception_handler(GatewayError)
    async def _typed(_: Request, error: GatewayError) -> JSONResponse:
        return _error_response(error)

    async def body_of(request: Request, model: type[BaseModel]) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > config.max_body_bytes):
            raise GatewayError(
                FailureClass.REQUEST_INVALID, f"the body is over the {config.max_body_bytes}-byte limit", status=413
            )
        raw = await request.body()
        if len(raw) > config.max_body_bytes:
            raise GatewayError(
                FailureClass.REQUEST_INVALID, f"the body is over the {config.max_body_bytes}-byte limit", status=413
            )
        try:
            return model.model_validate_json(raw or b"{}")
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            raise GatewayError(FailureClass.REQUEST_INVALID, f"{where}: {first['msg']}") from None

    def tenant_of(request: Request) -> str:
        if config.api_keys:
            header = request.headers.get("authorization", "")
            presented = header[7:].strip() if header.lower().startswith("bearer ") else ""
            for key, tenant in config.api_keys.items():
                if presented and hmac.compare_digest(presented.encode(), key.encode()):
                    return tenant
            raise GatewayError(
                FailureClass.REQUEST_INVALID, "a valid API key is required (Authorization: Bearer)", status=401
            )
        tenant = request.headers.get("x-modelforge-tenant", config.default_tenant)
        if not _TENANT.match(tenant):
            raise GatewayError(FailureClass.REQUEST_INVALID, "X-ModelForge-Tenant is not a tenant name")
        return tenant

    def request_id_of(request: Request, given: str | None = None) -> str:
        request_id = given or request.headers.get("x-request-id") or uuid.uuid4().hex[:16]
        if not _REQUEST_ID.match(request_id):
            raise GatewayError(FailureClass.REQUEST_INVALID, "a request id is 1-64 letters, digits, '.', '_' or '-'")
        return request_id

    async def run(
        request: Request, capability: str, payload: dict[str, Any], request_id: str, **options: Any
    ) -> Result:
        priority = request.headers.get("x-modelforge-priority")
        if priority is not None:
            options.setdefault("priority", priority)
        try:
            result = await requester.request(capability, payload, request_id=request_id, **options)
        except ModelForgeError as error:  # Temporal unreachable or refusing
            raise GatewayError(error.failure, error.message, request_id=request_id) from None
        if not result.ok:
            raise GatewayError(
                result.failure_class or FailureClass.CAPABILITY_UNAVAILABLE, result.message, request_id=request_id
            )
        return result

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/requests")
    async def requests_(request: Request) -> JSONResponse:
        call: CapabilityCall = await body_of(request, CapabilityCall)
        tenant = tenant_of(request)
        if call.tenant is not None and call.tenant != tenant and config.api_keys:
            raise GatewayError(FailureClass.REQUEST_INVALID, "the tenant comes from the API key, not the body")
        request_id = request_id_of(request, call.request_id)
        known = await catalog.get()
        if known.deployment_for(call.capability) is None:
            raise GatewayError(
                FailureClass.CAPABILITY_UNAVAILABLE,
                f"no deployment serves {call.capability!r}",
                status=404,
                request_id=request_id,
            )
        result = await run(
            request,
            call.capability,
            call.input,
            request_id,
            tenant=call.tenant or tenant,
            priority=call.priority,
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

    @app.get("/v1/status")
    async def status() -> JSONResponse:
        try:
            pool = await requester.status()
        except ModelForgeError as error:
            raise GatewayError(error.failure, error.message) from None
        return JSONResponse(dataclasses.asdict(pool))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        known = await catalog.get()
        names = []
        for deployment in known.deployments:
            for name in [deployment.capability, *deployment.openai_models]:
                names.append({"id": name, "object": "model", "created": 0, "owned_by": "modelforge"})
        return {"object": "list", "data": names}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict[str, Any]:
        call: EmbeddingsCall = await body_of(request, EmbeddingsCall)
        texts = [call.input] if isinstance(call.input, str) else list(call.input)
        if not texts or any(not t for t in texts):
            raise GatewayError(FailureClass.REQUEST_INVALID, "input: give one or more non-empty strings")
        deployment = await catalog.deployment_for_model(call.model)
        tenant = tenant_of(request)
        request_id = request_id_of(request)
        result = await run(request, deployment.capability, {"texts": texts}, request_id, tenant=tenant)
        vectors = (result.output or {}).get("embeddings")
        if not isinstance(vectors, list) or len(vectors) != len(texts):
            raise GatewayError(
                FailureClass.INVALID_OUTPUT,
                f"{deployment.capability} returned no 'embeddings' list of {len(texts)} vectors",
                request_id=request_id,
            )
        tokens = sum(_words(t) for t in texts)
        return {
            "object": "list",
            "data": [
                {
                    "object": "embedding",
                    "index": index,
                    "embedding": _float32_base64(vector) if call.encoding_format == "base64" else vector,
                }
                for index, vector in enumerate(vectors)
            ],
            "model": call.model,
            # Whitespace-separated words: ModelForge does not tokenize; the count is approximate.
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        call: ChatCall = await body_of(request, ChatCall)
        if call.stream:
            raise GatewayError(FailureClass.REQUEST_INVALID, "stream: streaming responses are not served yet")
        deployment = await catalog.deployment_for_model(call.model)
        messages = []
        for message in call.messages:
            content = message.content
            if isinstance(content, list):  # content parts: the text ones
                content = "".join(str(part.get("text", "")) for part in content if part.get("type") == "text")
            messages.append({"role": message.role, "content": content or ""})
        payload: dict[str, Any] = {"messages": messages}
        max_tokens = call.max_completion_tokens or call.max_tokens
        if max_tokens is not None:
            payload["max_tokens"] = max_tokens
        tenant = tenant_of(request)
        request_id = request_id_of(request)
        result = await run(request, deployment.capability, payload, request_id, tenant=tenant)
        text = (result.output or {}).get("text")
        if not isinstance(text, str):
            raise GatewayError(
                FailureClass.INVALID_OUTPUT, f"{deployment.capability} returned no 'text'", request_id=request_id
            )
        prompt_tokens = sum(_words(m["content"]) for m in messages)
        completion_tokens = _words(text)
        return {
            "id": f"chatcmpl-{result.request_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": call.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": str((result.output or {}).get("finish_reason", "stop")),
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    return app
