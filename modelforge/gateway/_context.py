"""What every API surface of the gateway shares, apart from the app that holds them: the
`Requester` seam (the real one is `modelforge.client.ModelForgeClient`), the typed error every
route raises (`GatewayError`) and OpenAI's error shape it answers by default, the cached catalog,
and the checks on what a body names. The routers (`_app.py`'s native and OpenAI routes,
`_ollama.py`, `_anthropic.py`, `_responses.py`, `_rerank.py`) import it; it imports none of them."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from modelforge.client import Result
from modelforge.domain import Catalog, Deployment
from modelforge.failures import FailureClass
from modelforge.gateway._errors import DEFAULT_RETRY_AFTER_S, RETRY_AFTER_S, http_status, openai_error
from modelforge.identifiers import identifier_problem, shown
from modelforge.messages import ResidencyControlReply, StreamTarget
from modelforge.policy import PoolStatus

# What an unexpected failure inside the gateway answers: a class, no details (they are logged).
INTERNAL_ERROR = "INTERNAL_ERROR"


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
        stream: StreamTarget | None = None,
        max_duration_s: float | None = None,
        end_user: str = "",
    ) -> Result: ...

    async def status(self) -> PoolStatus: ...

    async def residency(
        self, action: str, deployment: str, *, accelerator: str = "", drain: bool = False, actor: str = ""
    ) -> ResidencyControlReply: ...


CatalogSource = Callable[[], Awaitable[Catalog]]


class GatewayError(Exception):
    def __init__(
        self,
        failure: FailureClass | str,
        message: str,
        *,
        status: int | None = None,
        request_id: str = "",
        headers: dict[str, str] | None = None,
        code: str | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.failure = failure.value if isinstance(failure, FailureClass) else failure
        self.message = message
        self.status = status if status is not None else http_status(self.failure)
        self.request_id = request_id
        self.headers = headers or {}
        self.code = code
        self.param = param


def _invalid(
    message: str, status: int | None = None, *, code: str | None = None, param: str | None = None
) -> GatewayError:
    return GatewayError(FailureClass.REQUEST_INVALID, message, status=status, code=code, param=param)


def _model_not_found(model: str, request_id: str = "") -> GatewayError:
    return GatewayError(
        FailureClass.CAPABILITY_UNAVAILABLE,
        f"no capability serves model {shown(model)}",
        status=404,
        code="model_not_found",
        param="model",
        request_id=request_id,
    )


def _printable(text: str, limit: int = 2000) -> str:
    # Whatever a message quotes (a key from the body, a runtime's error): valid UTF-8, bounded.
    cut = text[:limit] + ("..." if len(text) > limit else "")
    return cut.encode("utf-8", "backslashreplace").decode("utf-8")


def _escaped(text: str, limit: int) -> str:
    # Printable ASCII, unquoted (a field name in a message): anything else as \x escapes.
    return "".join(c if 32 <= ord(c) < 127 else f"\\x{ord(c):02x}" for c in text[:limit])


def _error_response(error: GatewayError) -> JSONResponse:
    # OpenAI's error shape, so its SDK raises the matching exception (BadRequestError,
    # NotFoundError...) with our message; the failure class in a field of its own.
    kind, default_code = openai_error(error.status)
    body = {
        "error": {
            "message": _printable(error.message),
            "type": kind,
            "param": error.param,
            "code": error.code or default_code,
            "modelforge_class": error.failure,
        },
        "failure_class": error.failure,
        "request_id": error.request_id or None,
    }
    headers = dict(error.headers)
    try:
        retry_after = RETRY_AFTER_S.get(FailureClass(error.failure))
    except ValueError:
        retry_after = None
    if error.status == 429 and retry_after is None:
        retry_after = DEFAULT_RETRY_AFTER_S
    if retry_after is not None and error.status in (429, 503):
        headers["Retry-After"] = str(retry_after)
    if error.status == 409:
        headers["x-should-retry"] = "false"  # the id stays taken: the SDK's retries cannot help
    if error.failure == FailureClass.DEADLINE_CANNOT_BE_MET:
        headers["x-should-retry"] = "false"  # asked again with the same deadline, refused again
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
        raise _model_not_found(model)


def _check(kind: str, value: str) -> str:
    problem = identifier_problem(kind, value)
    if problem is not None:
        raise _invalid(problem)
    return value


class DryRun(Exception):
    """A call answered by its admission check instead of being run (X-ModelForge-Dry-Run; raised
    where the call would have started its request, answered by _admission_check.py's handler): an
    answer, not a failure, on every API surface."""

    def __init__(self, answer: dict[str, Any]) -> None:
        super().__init__(answer.get("answer", ""))
        self.answer = answer


def error_route(shape: Callable[[GatewayError], Response], log: logging.Logger, surface: str) -> type[APIRoute]:
    """A route class for an API surface whose errors have a shape of their own (Ollama's,
    Anthropic's): every failure of its routes, the key check included, answers in `shape`, the
    class recorded for the access log; anything unexpected is logged and answers
    INTERNAL_ERROR (500) without details."""

    class ErrorShapedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def route(request: Request) -> Response:
                try:
                    return await handler(request)
                except GatewayError as error:
                    request.state.failure_class = error.failure
                    return shape(error)
                except DryRun:
                    raise  # a dry run's answer, not a failure
                except Exception:
                    log.exception("%s route %s failed", surface, request.url.path)
                    request.state.failure_class = INTERNAL_ERROR
                    return shape(GatewayError(INTERNAL_ERROR, "the gateway failed; see its log", status=500))

            return route

    return ErrorShapedRoute
