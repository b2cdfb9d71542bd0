"""The gateway's access log and request metrics: one structured line and one observation per
HTTP request, whatever answered it (a route, a refusal, an unexpected failure).

What a request did is gathered in its ASGI scope's `state` by the application as it goes
(`tenant`, `capability`, `priority`, `failure_class`, `request_id`, `model`, token counts, the
hints applied and Open WebUI's end user id) and
read here once the answer is written. Never logged: API keys, headers, bodies, inputs and outputs.
The log level is MODELFORGE_LOG_LEVEL (`debug`, `info`, `warning`, `error`; `info` by default):
requests are logged at info (5xx at warning, 500 at error); /healthz, /metrics and nodes'
stream pushes at debug. A streamed answer adds its time to the first token."""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modelforge.failures import FailureClass, ModelForgeError
from modelforge.identifiers import REQUEST_ID
from modelforge.logging import get_logger
from modelforge.metrics import GatewayMetrics

LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
# Routes polled by machines: logged at debug, not counted.
_QUIET = ("/healthz", "/health", "/metrics", "/internal/streams/{stream_id}")
# A client's X-Request-Id is echoed only when it is a request id (modelforge/identifiers.py).


def log_level_from_env() -> int:
    """MODELFORGE_LOG_LEVEL as a logging level (info when unset); REQUEST_INVALID naming it otherwise."""
    text = os.environ.get("MODELFORGE_LOG_LEVEL", "").strip().lower()
    if not text:
        return logging.INFO
    if text not in LOG_LEVELS:
        raise ModelForgeError(
            FailureClass.REQUEST_INVALID,
            f"MODELFORGE_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, not {text[:40]!r}",
        )
    return LOG_LEVELS[text]


def _label(value: Any, limit: int = 200) -> str:
    # Printable ASCII, bounded: what a client chose (a model name) is never written raw.
    text = "" if value is None else str(value)
    return "".join(c if 32 <= ord(c) < 127 else f"\\x{ord(c):02x}" for c in text[:limit])


def _answer_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    """Headers every answer carries: `x-request-id` (the request's id: the one the client gave,
    the one the gateway chose, or a fresh one for an answer that never reached a request), and
    what the gateway applied of a client's hints (`x-modelforge-keep-alive`)."""
    state: dict[str, Any] = scope.setdefault("state", {})
    request_id = state.get("request_id")
    if not request_id:
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex[:16]
        state["request_id"] = request_id
    headers = [(b"x-request-id", _label(request_id).encode())]
    for name in ("keep_alive", "priority_applied", "deadline_applied", "tools_omitted"):
        note = state.get(name)
        if note:
            headers.append((f"x-modelforge-{name.replace('_', '-')}".encode(), _label(note, 500).encode()))
    return headers


class AccessLog:
    """ASGI middleware: the access log line and the metrics of every HTTP request."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                message["headers"] = [*message.get("headers", []), *_answer_headers(scope)]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except BaseException:
            status = 500  # the server's error handler answers it, outside this middleware
            raise
        finally:
            self._record(scope, status, time.perf_counter() - started, started)

    def _record(self, scope: Scope, status: int, seconds: float, started: float) -> None:
        state: dict[str, Any] = scope.get("state") or {}
        route = getattr(scope.get("route"), "path", None) or "unmatched"
        failure = state.get("failure_class") or ("INTERNAL_ERROR" if status == 500 else "")
        fields: dict[str, Any] = {
            "method": _label(scope.get("method"), 10),
            "route": route,
            "status": status,
            "duration_ms": round(seconds * 1000, 2),
            "tenant": state.get("tenant", ""),
            "capability": state.get("capability", ""),
            "priority": state.get("priority", ""),
            "failure_class": failure,
            "request_id": state.get("request_id", ""),
        }
        if route == "unmatched":
            fields["path"] = _label(scope.get("path"))
        if state.get("model"):
            fields["model"] = _label(state["model"])
        # What the gateway applied of a client's hints, and the end user an application named.
        for hint in ("keep_alive", "priority_applied", "deadline_applied", "tools_omitted", "end_user"):
            if state.get(hint):
                fields[hint] = _label(state[hint], 500)
        tokens = state.get("tokens")
        if tokens:
            fields.update(tokens)
        first_token_s = state["first_token_at"] - started if state.get("first_token_at") else None
        if first_token_s is not None:
            fields["time_to_first_token_ms"] = round(first_token_s * 1000, 2)
        client = scope.get("client")
        if client:
            fields["client"] = _label(client[0], 64)
        log = get_logger("modelforge.gateway")
        if route in _QUIET:
            log.debug("gateway_request", **fields)
            return
        self.metrics.observe(
            route=route,
            capability=fields["capability"],
            tenant=fields["tenant"],
            priority=fields["priority"],
            status=status,
            failure_class=failure,
            seconds=seconds,
            prompt_tokens=int((tokens or {}).get("prompt_tokens", 0)),
            completion_tokens=int((tokens or {}).get("completion_tokens", 0)),
            estimated=bool((tokens or {}).get("tokens_estimated", False)),
            first_token_s=first_token_s,
        )
        if status == 500:
            log.error("gateway_request", **fields)
        elif status >= 500:
            log.warning("gateway_request", **fields)
        else:
            log.info("gateway_request", **fields)
