"""Ollama's API on the gateway (`/api/*`), so an application built for Ollama changes its base
URL and works: `/api/chat`, `/api/generate`, `/api/embed`, `/api/embeddings`, `/api/tags`,
`/api/ps`, `/api/show`, `/api/version`, in the request and response shapes of Ollama's
docs/api.md and api/types.go (v0.33).

Each model call is one request workflow through the same helpers as the OpenAI routes
(`_app.py`: the body reader, `run`, the request id and priority headers) behind the same key
check; a model name maps to a deployment as there (its `capability`, `name` or an
`openai_models` entry; Ollama's default tag `:latest` may be added). Errors are Ollama's shape,
`{"error": "..."}`, with the ModelForge failure class in `failure_class`.

What is served and what is refused (never dropped silently), field by field, is in README.md's
"Ollama API" section; in short:
- `stream` (Ollama's default is true) on chat and generate streams NDJSON lines as the model
  generates them, then the final one (`done: true`); `stream: false` answers one JSON object
  (other routes answer one final NDJSON line when streamed).
- `keep_alive` is parsed as Ollama parses it and accepted where today's residency already does
  what it asks (`_keep_alive_problem`); anything else is 400, naming it.
- `options.temperature`, `top_p`, `stop` and `num_predict` (as `max_tokens`) reach the runtime;
  any other option, `tools`, `format`, images, `think`, `suffix`, `template`, `raw`, `context`
  and `logprobs` are refused with 400 when set.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

import modelforge
from modelforge.client import Result
from modelforge.domain import Deployment, Residency
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gateway import _app
from modelforge.gateway._errors import RETRY_AFTER_S
from modelforge.gateway._streams import Stream, StreamHub, next_record
from modelforge.gateway._streams import outcome as outcome_of
from modelforge.identifiers import shown
from modelforge.runtimes import speaks

_log = logging.getLogger(__name__)

# The Ollama release whose API (docs/api.md, api/types.go) these routes follow: what
# `/api/version` answers, so that clients checking for a minimum version find a recent one.
OLLAMA_API_VERSION = "0.33.0"

NDJSON = "application/x-ndjson"

# Ollama's own default when a request names no keep_alive (the residency policy decides here).
DEFAULT_KEEP_ALIVE_S = 300.0

# Go's time.ParseDuration, as Ollama parses a keep_alive string: a signed sequence of decimal
# numbers, each with a unit ("300ms", "-1.5h", "2h45m"); "0" alone needs none.
_UNITS_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"([+-]?)((?:(?:\d+\.?\d*|\.\d+)(?:ns|us|µs|μs|ms|s|m|h))+)")
_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")

# Ollama option -> the runtime input key it becomes (modelforge/runtimes/_http_api.py passes these).
_PASSED_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "stop": "stop", "num_predict": "max_tokens"}

# The zero time, as Ollama's Go prints an unset one: the catalog records no modification time.
_ZERO_TIME = "0001-01-01T00:00:00Z"
# What /api/ps says of a model that stays until evicted or removed (always_warm).
_FOREVER = "9999-12-31T23:59:59Z"


def parse_keep_alive(value: object) -> float | None:
    """Seconds, as Ollama reads `keep_alive`: a number of seconds or a Go duration string
    ("5m", "1h30m", "0"); any negative value means "keep loaded" (math.inf); None: not given.
    Anything else raises ValueError with the reason."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"is a {type(value).__name__}; give seconds (a number) or a duration such as '5m'")
    if isinstance(value, str):
        text = value.strip()
        if text in ("0", "+0", "-0"):
            return 0.0
        match = _DURATION.fullmatch(text)
        if match is None:
            raise ValueError(f"{shown(value[:40])} is not a duration (such as '5m', '1h30m', '300s', '0' or '-1m')")
        seconds = sum(float(n) * _UNITS_S[unit] for n, unit in _DURATION_PART.findall(match.group(2)))
        return math.inf if match.group(1) == "-" and seconds > 0 else seconds
    if not math.isfinite(value):
        raise ValueError("is not a finite number")
    return math.inf if value < 0 else float(value)


def _idle_limit_s(deployment: Deployment) -> float:
    """How long ModelForge keeps this deployment loaded after its last request today."""
    if deployment.residency == Residency.ALWAYS_WARM:
        return math.inf
    if deployment.residency == Residency.KEEP_WARM:
        return deployment.ttl_s
    return 0.0  # load_on_demand and none: unloaded once its last lease ends and nobody waits


def _keep_alive_problem(deployment: Deployment, seconds: float | None) -> str | None:
    """Why this keep_alive cannot be honoured for this deployment, or None. Honoured: what the
    residency policy does (the catalog's `residency` and `ttl_s`), never past it; `0` unloads a
    keep_warm model when the call is done (unless another request holds it: it then stays by its
    TTL); a positive keep_alive up to the idle limit is met (the model stays loaded at least that
    long unless evicted to make room, as under Ollama). Pinning (negative) is an operator's
    decision (`modelforge pin`), not a tenant's: refused unless the catalog keeps it loaded."""
    if seconds is None:
        return None
    limit = _idle_limit_s(deployment)
    residency = deployment.residency.value
    today = (
        "it stays loaded until evicted to make room (residency always_warm)"
        if limit == math.inf
        else f"it stays loaded {limit:g} s after its last request (residency keep_warm)"
        if limit > 0
        else f"it is unloaded when its last request ends (residency {residency})"
    )
    name = deployment.deployment_id
    if seconds == 0 and limit == math.inf:
        return (
            f"keep_alive: 0 (unload when done) cannot unload {name}: the catalog keeps it loaded; {today}. "
            "Leave keep_alive out."
        )
    if seconds == math.inf and limit != math.inf:
        return (
            f"keep_alive: a negative value (keep loaded) is not supported yet: ModelForge cannot pin {name} "
            f"on request; {today}. Leave keep_alive out."
        )
    if 0 < seconds < math.inf and seconds > limit:
        return (
            f"keep_alive: {seconds:g} s is past the catalog's idle limit for {name}: {today}. "
            f"Ask for at most {limit:g} s or leave keep_alive out."
        )
    return None


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _rfc3339(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: object) -> int:
    return int(float(seconds) * 1e9) if isinstance(seconds, int | float) and not isinstance(seconds, bool) else 0


def _words(text: str) -> int:
    return len(text.split())


def _kinds(deployment: Deployment) -> list[str]:
    """Ollama's capabilities of a deployment: what its runtime answers (the registry's `speaks`)."""
    answers = speaks(deployment).answers
    return [kind for kind, answer in (("completion", "text"), ("embedding", "vectors")) if answer in answers]


def _details(deployment: Deployment) -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": deployment.runtime,
        "family": deployment.capability,
        "families": [deployment.capability],
        "parameter_size": "",
        "quantization_level": "",
    }


def _modelforge(deployment: Deployment) -> dict[str, Any]:
    # ModelForge's own view, beside Ollama's fields (Ollama clients ignore fields they do not know).
    return {
        "capability": deployment.capability,
        "deployment": deployment.deployment_id,
        "residency": deployment.residency.value,
        "ttl_s": deployment.ttl_s,
        "envelope_bytes": deployment.envelope_bytes,
        "names": [deployment.capability, *deployment.openai_models],
    }


class _Body(BaseModel):
    # A field Ollama does not define is refused by name, not ignored: nothing is dropped silently.
    model_config = ConfigDict(extra="forbid")


_Model = Annotated[str, Field(min_length=1, max_length=200)]


class _Message(_Body):
    role: Annotated[str, Field(min_length=1, max_length=40)]
    content: str | None = None
    images: list[str] | None = None
    thinking: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None


class _Generation(_Body):
    model: _Model
    stream: bool | None = None
    keep_alive: float | str | None = None
    options: dict[str, Any] | None = None
    format: str | dict[str, Any] | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class _Chat(_Generation):
    messages: Annotated[list[_Message], Field(max_length=1000)] | None = None
    tools: list[dict[str, Any]] | None = None


class _Generate(_Generation):
    prompt: str | None = None
    system: str | None = None
    suffix: str | None = None
    images: list[str] | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    width: int | None = None
    height: int | None = None
    steps: int | None = None


class _Embed(_Body):
    model: _Model
    input: str | list[str] = ""
    truncate: bool | None = None
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None
    dimensions: Annotated[int, Field(gt=0)] | None = None


class _Embeddings(_Body):
    model: _Model
    prompt: str | None = None
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None


class _Pull(_Body):
    model: str | None = None
    name: str | None = None  # the older spelling of `model`
    insecure: bool | None = None
    stream: bool | None = None


class _Show(_Body):
    model: str | None = None
    name: str | None = None  # the older spelling of `model`
    verbose: bool | None = None


def _invalid(message: str) -> _app.GatewayError:
    return _app.GatewayError(FailureClass.REQUEST_INVALID, message, status=400)


def _not_supported(field: str, what: str) -> _app.GatewayError:
    return _invalid(f"{field}: {what} is not supported by ModelForge yet; leave it out")


def _refuse_set(fields: dict[str, object]) -> None:
    """400 for the first field given a value ModelForge cannot honour (unset, empty or false is fine)."""
    for name, value in fields.items():
        if value not in (None, "", [], {}, False, 0):
            raise _not_supported(name, f"{name} {shown(str(value)[:40])}")


def _takes_options(deployment: Deployment) -> bool:
    """Whether the runtime hands sampling options to its model server: only an OpenAI-compatible
    chat server (the registry's `speaks`: api openai_chat) reads them."""
    return speaks(deployment).api == "openai_chat"


def _sampling(options: dict[str, Any] | None, deployment: Deployment) -> dict[str, Any]:
    """The options the runtime receives (as its input keys); any other option is refused by
    name, and so is any option for a runtime that would not pass it on."""
    passed: dict[str, Any] = {}
    for name, value in (options or {}).items():
        if name not in _PASSED_OPTIONS:
            raise _invalid(
                f"options.{_app._escaped(name, 60)} is not supported by ModelForge yet (it passes "
                f"{', '.join(sorted(_PASSED_OPTIONS))}); leave it out"
            )
        number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if name == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 16:
                raise _invalid("options.stop: give up to 16 non-empty strings")
            if stops:
                passed["stop"] = stops
        elif name == "num_predict":
            if not number or int(value) != value or value == 0 or value < -1:
                raise _invalid("options.num_predict: a positive whole number, or -1 for no limit")
            if value > 0:
                passed["max_tokens"] = int(value)
        elif not number or value < 0 or (name == "top_p" and value > 1):
            raise _invalid(f"options.{name}: a number {'from 0 to 1' if name == 'top_p' else '0 or more'}")
        else:
            passed[_PASSED_OPTIONS[name]] = value
    if passed and not _takes_options(deployment):
        given = ", ".join(f"options.{name}" for name in sorted(options or {}) if name in _PASSED_OPTIONS)
        raise _invalid(
            f"{given}: {deployment.capability} (runtime {deployment.runtime}) takes no sampling options; leave "
            "them out, or serve the model from an OpenAI-compatible server (subprocess_http, api openai_chat)"
        )
    return passed


def _counts(output: dict[str, Any], prompt: list[str], answer: str | None) -> dict[str, int]:
    """Ollama's token counts: the model server's where it reported them (`usage`), else words
    (ModelForge does not tokenize; the figures are then estimates)."""
    usage = output.get("usage")
    if isinstance(usage, dict):
        names = {"prompt_eval_count": "prompt_tokens"}
        if answer is not None:
            names["eval_count"] = "completion_tokens"
        reported = {
            ours: value
            for ours, theirs in names.items()
            if isinstance(value := usage.get(theirs), int) and not isinstance(value, bool) and value >= 0
        }
        if len(reported) == len(names):
            return reported
    counts = {"prompt_eval_count": sum(_words(t) for t in prompt)}
    if answer is not None:
        counts["eval_count"] = _words(answer)
    return counts


def _error_response(error: _app.GatewayError) -> JSONResponse:
    """Ollama's error shape, `{"error": message}`, the ModelForge class beside it. An invalid
    request is 400 as Ollama answers it (the shared helpers may say 422)."""
    status = 400 if error.status == 422 else error.status
    body = {
        "error": _app._printable(error.message),
        "failure_class": error.failure,
        "request_id": error.request_id or None,
    }
    headers = dict(error.headers)
    try:
        retry_after = RETRY_AFTER_S.get(FailureClass(error.failure))
    except ValueError:
        retry_after = None
    if retry_after is not None and status in (429, 503):
        headers["Retry-After"] = str(retry_after)
    return JSONResponse(body, status_code=status, headers=headers)


class _OllamaRoute(APIRoute):
    """Every failure of an Ollama route, the key check included, answers in Ollama's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except _app.GatewayError as error:
                request.state.failure_class = error.failure  # for the gateway's access log
                return _error_response(error)
            except Exception:
                _log.exception("ollama route %s failed", request.url.path)
                return _error_response(
                    _app.GatewayError(_app.INTERNAL_ERROR, "the gateway failed; see its log", status=500)
                )

        return route


def _answer(body: dict[str, Any], stream: bool | None) -> Response:
    """`stream: false`: one JSON object. Otherwise (Ollama's default) the stream's last line
    alone, holding the whole answer: what Ollama clients read as a stream that ended at once."""
    if stream is False:
        return JSONResponse(body)
    return Response(json.dumps(body, separators=(",", ":")) + "\n", media_type=NDJSON)


Run = Callable[..., Awaitable[Result]]
BodyOf = Callable[[Request, type[BaseModel]], Awaitable[Any]]
RequestIdOf = Callable[[Request], str]


OpenStream = Callable[..., Awaitable[tuple[Stream, "asyncio.Task[Result]", dict[str, Any] | None]]]


def ollama_router(
    catalog: _app._Catalog,
    requester: _app.Requester,
    body_of: BodyOf,
    run: Run,
    request_id_of: RequestIdOf,
    open_stream: OpenStream | None = None,
    hub: StreamHub | None = None,
) -> APIRouter:
    """The `/api/*` routes on `create_app`'s catalog cache, requester and helpers; included into
    its authenticated router, so the API key is checked first, as on every other route."""
    router = APIRouter(route_class=_OllamaRoute)

    async def deployment_of(model: str) -> Deployment:
        _app._check("capability", model)
        known = await catalog.get()
        names = [model, model.removesuffix(":latest")] if model.endswith(":latest") else [model]
        for name in names:
            for deployment in known.deployments:
                if name in (deployment.capability, deployment.name, *deployment.openai_models):
                    return deployment
        raise _app.GatewayError(
            FailureClass.CAPABILITY_UNAVAILABLE,
            f"model {shown(model)} not found: no ModelForge deployment serves it (GET /api/tags lists the models)",
            status=404,
        )

    async def resolve(model: str, keep_alive: object, kind: str) -> Deployment:
        try:
            seconds = parse_keep_alive(keep_alive)
        except ValueError as error:
            raise _invalid(f"keep_alive: {error}") from None
        deployment = await deployment_of(model)
        if kind not in _kinds(deployment):
            verb = {"completion": "chat or generate", "embedding": "embeddings"}[kind]
            raise _invalid(f"{shown(model)} does not support {verb} (it is {'/'.join(_kinds(deployment))})")
        problem = _keep_alive_problem(deployment, seconds)
        if problem is not None:
            raise _invalid(problem)
        return deployment

    async def unload_if_asked(keep_alive: object, deployment: Deployment) -> None:
        """keep_alive 0 on a model the catalog keeps warm: unloaded now that the call is done,
        unless another request holds it (then it stays by its TTL)."""
        if _idle_limit_s(deployment) <= 0 or parse_keep_alive(keep_alive) != 0:
            return
        with contextlib.suppress(ModelForgeError):
            await requester.residency("unload", deployment.deployment_id, actor="ollama keep_alive 0")

    async def invoke(request: Request, deployment: Deployment, payload: dict[str, Any]) -> Result:
        result: Result = await run(
            request, deployment.capability, payload, request_id_of(request), tenant=request.state.tenant
        )
        return result

    def timings(result: Result | None, began: float) -> dict[str, int]:
        # Ollama's durations in nanoseconds: the whole call, the wait for a lease (a model load
        # included), the invoke. ModelForge does not tokenize: counts are words (estimated).
        spent = result.timings if result is not None else {}
        return {
            "total_duration": int((time.monotonic() - began) * 1e9),
            "load_duration": _ns(spent.get("lease_s")),
            "eval_duration": _ns(spent.get("invoke_s")),
        }

    def loaded(model: str, key: str, began: float, unload: bool) -> dict[str, Any]:
        # Ollama's answer to a call with nothing to do (no messages, no prompt): it loads the
        # model, or with keep_alive 0 unloads it. ModelForge loads on the first real request.
        return {
            "model": model,
            "created_at": _now(),
            key: {"role": "assistant", "content": ""} if key == "message" else "",
            "done": True,
            "done_reason": "unload" if unload else "load",
            **timings(None, began),
        }

    def text_of(result: Result, deployment: Deployment) -> str:
        text = (result.output or {}).get("text")
        if not isinstance(text, str):
            raise _app.GatewayError(
                FailureClass.INVALID_OUTPUT, f"{deployment.capability} returned no 'text'", request_id=result.request_id
            )
        return text

    def vectors_of(result: Result, deployment: Deployment, count: int) -> list[list[float]]:
        vectors = (result.output or {}).get("embeddings")
        if not isinstance(vectors, list) or len(vectors) != count:
            raise _app.GatewayError(
                FailureClass.INVALID_OUTPUT,
                f"{deployment.capability} returned no 'embeddings' list of {count} vectors",
                request_id=result.request_id,
            )
        return vectors

    async def streamed(
        request: Request,
        deployment: Deployment,
        payload: dict[str, Any],
        *,
        model: str,
        key: str,
        prompt: list[str],
        began: float,
        keep_alive: object = None,
    ) -> Response:
        """Ollama's NDJSON stream: a line per piece as the model generates it (`done: false`),
        then the final line with the counts and durations (`done: true`). A failure after the
        first piece ends the stream with Ollama's `{"error": ...}` line."""
        assert open_stream is not None and hub is not None
        request_id = request_id_of(request)
        tenant = request.state.tenant
        stream, task, first = await open_stream(request, deployment.capability, payload, request_id, tenant)

        def piece(text: str) -> dict[str, Any]:
            content: Any = {"role": "assistant", "content": text} if key == "message" else text
            return {"model": model, "created_at": _now(), key: content, "done": False}

        async def lines() -> AsyncIterator[str]:
            text: list[str] = []
            try:
                record = first
                while record is not None:
                    delta = record.get("delta")
                    if isinstance(delta, str):
                        if not text:
                            request.state.first_token_at = time.perf_counter()
                        text.append(delta)
                        yield json.dumps(piece(delta), separators=(",", ":")) + "\n"
                    elif "finish_reason" in record:
                        whole = "".join(text)
                        last = piece("")
                        last.update(
                            done=True,
                            done_reason=str(record.get("finish_reason") or "stop"),
                            total_duration=int((time.monotonic() - began) * 1e9),
                            **_counts({"usage": record.get("usage")}, prompt, whole),
                            request_id=request_id,
                        )
                        yield json.dumps(last, separators=(",", ":")) + "\n"
                        return
                    record = await next_record(stream, task)
                failure, message, result = outcome_of(task)
                if failure is None and result is not None:
                    whole = (result.output or {}).get("text") or ""
                    rest = whole[len("".join(text)) :] if whole.startswith("".join(text)) else ""
                    last = piece(rest)
                    last.update(done=True, done_reason="stop", **timings(result, began), request_id=request_id)
                    yield json.dumps(last, separators=(",", ":")) + "\n"
                    return
                request.state.failure_class = failure or ""
                yield json.dumps({"error": message, "failure_class": failure, "request_id": request_id}) + "\n"
            finally:
                hub.close(stream)
                if keep_alive is not None and parse_keep_alive(keep_alive) == 0:
                    # The lease goes back when the invoke ends, a moment after the last piece.
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(asyncio.shield(task), timeout=30)
                    await unload_if_asked(keep_alive, deployment)

        return StreamingResponse(lines(), media_type=NDJSON)

    @router.post("/api/chat")
    async def chat(request: Request) -> Response:
        began = time.monotonic()
        call: _Chat = await body_of(request, _Chat)
        _refuse_unsupported_generation(call)
        _refuse_set({"tools": call.tools})
        messages = []
        for n, message in enumerate(call.messages or []):
            _refuse_set(
                {
                    f"messages[{n}].images": message.images,
                    f"messages[{n}].tool_calls": message.tool_calls,
                    f"messages[{n}].tool_name": message.tool_name,
                    f"messages[{n}].thinking": message.thinking,
                }
            )
            messages.append({"role": message.role, "content": message.content or ""})
        deployment = await resolve(call.model, call.keep_alive, "completion")
        payload: dict[str, Any] = {"messages": messages, **_sampling(call.options, deployment)}
        if not messages:  # Ollama's load (or, with keep_alive 0, unload) of a model
            await unload_if_asked(call.keep_alive, deployment)
            return _answer(loaded(call.model, "message", began, parse_keep_alive(call.keep_alive) == 0), call.stream)
        if call.stream is not False and open_stream is not None:
            return await streamed(
                request,
                deployment,
                payload,
                model=call.model,
                key="message",
                prompt=[m["content"] for m in messages],
                began=began,
                keep_alive=call.keep_alive,
            )
        result = await invoke(request, deployment, payload)
        text = text_of(result, deployment)
        await unload_if_asked(call.keep_alive, deployment)
        return _answer(
            {
                "model": call.model,
                "created_at": _now(),
                "message": {"role": "assistant", "content": text},
                "done": True,
                "done_reason": str((result.output or {}).get("finish_reason") or "stop"),
                **timings(result, began),
                **_counts(result.output or {}, [m["content"] for m in messages], text),
                "request_id": result.request_id,
            },
            call.stream,
        )

    @router.post("/api/generate")
    async def generate(request: Request) -> Response:
        began = time.monotonic()
        call: _Generate = await body_of(request, _Generate)
        _refuse_unsupported_generation(call)
        _refuse_set(
            {
                "suffix": call.suffix,
                "images": call.images,
                "template": call.template,
                "context": call.context,
                "raw": call.raw,
                "width": call.width,
                "height": call.height,
                "steps": call.steps,
            }
        )
        deployment = await resolve(call.model, call.keep_alive, "completion")
        sampling = _sampling(call.options, deployment)
        if not call.prompt:  # Ollama's load (or, with keep_alive 0, unload) of a model
            await unload_if_asked(call.keep_alive, deployment)
            return _answer(loaded(call.model, "response", began, parse_keep_alive(call.keep_alive) == 0), call.stream)
        # A one-turn chat: ModelForge's text runtimes speak chat (the model server applies the
        # model's own template, as Ollama does for a prompt that is not `raw`).
        messages = [{"role": "system", "content": call.system}] if call.system else []
        messages.append({"role": "user", "content": call.prompt})
        if call.stream is not False and open_stream is not None:
            return await streamed(
                request,
                deployment,
                {"messages": messages, **sampling},
                model=call.model,
                key="response",
                prompt=[m["content"] for m in messages],
                began=began,
                keep_alive=call.keep_alive,
            )
        result = await invoke(request, deployment, {"messages": messages, **sampling})
        text = text_of(result, deployment)
        await unload_if_asked(call.keep_alive, deployment)
        return _answer(
            {
                "model": call.model,
                "created_at": _now(),
                "response": text,
                "done": True,
                "done_reason": str((result.output or {}).get("finish_reason") or "stop"),
                **timings(result, began),
                **_counts(result.output or {}, [m["content"] for m in messages], text),
                "request_id": result.request_id,
            },
            call.stream,
        )

    @router.post("/api/embed")
    async def embed(request: Request) -> Response:
        began = time.monotonic()
        call: _Embed = await body_of(request, _Embed)
        if call.truncate is False:
            raise _not_supported("truncate", "truncate false (an error past the context length)")
        if call.options:
            raise _not_supported("options", f"options ({', '.join(sorted(call.options)[:5])}) on embeddings")
        texts = ([call.input] if call.input else []) if isinstance(call.input, str) else list(call.input)
        if any(not t for t in texts):
            raise _invalid("input: give one or more non-empty strings")
        deployment = await resolve(call.model, call.keep_alive, "embedding")
        if not texts:  # Ollama loads the model and answers no vectors
            return JSONResponse({"model": call.model, "embeddings": [], **timings(None, began)})
        result = await invoke(request, deployment, {"texts": texts})
        vectors = vectors_of(result, deployment, len(texts))
        if call.dimensions is not None:
            vectors = [_shortened(v, call.dimensions) for v in vectors]
        spent = timings(result, began)
        return JSONResponse(
            {
                "model": call.model,
                "embeddings": vectors,
                "total_duration": spent["total_duration"],
                "load_duration": spent["load_duration"],
                **_counts(result.output or {}, texts, None),
                "request_id": result.request_id,
            }
        )

    @router.post("/api/embeddings")
    async def embeddings(request: Request) -> Response:
        call: _Embeddings = await body_of(request, _Embeddings)
        if call.options:
            raise _not_supported("options", f"options ({', '.join(sorted(call.options)[:5])}) on embeddings")
        deployment = await resolve(call.model, call.keep_alive, "embedding")
        if not call.prompt:  # Ollama answers an empty prompt with an empty vector
            return JSONResponse({"embedding": []})
        result = await invoke(request, deployment, {"texts": [call.prompt]})
        [vector] = vectors_of(result, deployment, 1)
        return JSONResponse({"embedding": vector})

    @router.api_route("/api/tags", methods=["GET", "HEAD"], include_in_schema=False)
    async def tags() -> Response:
        known = await catalog.get()
        models = []
        for deployment in known.deployments:
            for name in [deployment.capability, *deployment.openai_models]:
                models.append(
                    {
                        "name": name,
                        "model": name,
                        "modified_at": _ZERO_TIME,
                        "size": deployment.resident_bytes,
                        "digest": deployment.artifact_sha256,
                        "details": _details(deployment),
                        "capabilities": _kinds(deployment),
                        "modelforge": _modelforge(deployment),
                    }
                )
        return JSONResponse({"models": models})

    @router.get("/api/ps")
    async def ps() -> Response:
        try:
            pool = await requester.status()
        except ModelForgeError as error:
            raise _app.GatewayError(error.failure, error.message) from None
        known = await catalog.get()
        kinds = {accelerator.id: accelerator.kind for accelerator in pool.accelerators}
        models = []
        for resident in pool.residents:
            deployment = known.deployment_for(resident.capability)
            if resident.expires_at is not None:
                expires = _rfc3339(resident.expires_at)
            elif resident.residency == Residency.ALWAYS_WARM.value:
                expires = _FOREVER
            elif resident.residency == Residency.KEEP_WARM.value:  # in use: its TTL starts when idle
                expires = _rfc3339(pool.now + resident.ttl_s)
            else:
                expires = _rfc3339(pool.now)
            models.append(
                {
                    "name": resident.capability,
                    "model": resident.capability,
                    "size": resident.bytes,
                    "digest": deployment.artifact_sha256 if deployment else "",
                    "details": _details(deployment) if deployment else {},
                    "expires_at": expires,
                    "size_vram": resident.bytes if kinds.get(resident.accelerator, "gpu") != "cpu" else 0,
                    "context_length": 0,
                    "modelforge": {
                        **(_modelforge(deployment) if deployment else {}),
                        "accelerator": resident.accelerator,
                        "state": resident.state,
                        "active_leases": resident.active_leases,
                    },
                }
            )
        return JSONResponse({"models": models})

    @router.post("/api/show")
    async def show(request: Request) -> Response:
        call: _Show = await body_of(request, _Show)
        model = call.model or call.name
        if not model:
            raise _invalid("model: required")
        deployment = await deployment_of(model)
        return JSONResponse(
            {
                "modelfile": "",
                "parameters": "",
                "template": "",
                "details": _details(deployment),
                "model_info": {
                    "general.architecture": deployment.runtime,
                    "modelforge.capability": deployment.capability,
                    "modelforge.deployment": deployment.deployment_id,
                    "modelforge.residency": deployment.residency.value,
                    "modelforge.ttl_s": deployment.ttl_s,
                    "modelforge.envelope_bytes": deployment.envelope_bytes,
                    "modelforge.concurrency": deployment.concurrency,
                },
                "capabilities": _kinds(deployment),
                "modified_at": _ZERO_TIME,
            }
        )

    @router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def heartbeat() -> Response:
        # What Ollama answers here; its CLI and some applications check it before anything else.
        return PlainTextResponse("Ollama is running")

    @router.post("/api/pull")
    async def pull(request: Request) -> Response:
        # Models are the catalog's (`modelforge catalog apply`): one it has is there already, as
        # a pull of an up-to-date model answers; any other is not found, and nothing downloads.
        call: _Pull = await body_of(request, _Pull)
        model = call.model or call.name
        if not model:
            raise _invalid("model: required")
        try:
            await deployment_of(model)
        except _app.GatewayError as error:
            raise _app.GatewayError(
                error.failure,
                f"{error.message}; ModelForge pulls nothing: its models are the catalog's (modelforge catalog apply)",
                status=error.status,
            ) from None
        return _answer({"status": "success"}, call.stream)

    async def managed_by_the_catalog(request: Request) -> Response:
        raise _invalid(
            f"{request.method} {request.url.path}: ModelForge's models are the catalog's; change them with "
            "`modelforge catalog apply`, not through the Ollama API"
        )

    for path, method in [
        ("/api/push", "POST"),
        ("/api/create", "POST"),
        ("/api/copy", "POST"),
        ("/api/delete", "DELETE"),
        ("/api/blobs/{digest}", "POST"),
        ("/api/blobs/{digest}", "HEAD"),
    ]:
        router.add_api_route(path, managed_by_the_catalog, methods=[method], include_in_schema=False)

    @router.api_route("/api/version", methods=["GET", "HEAD"], include_in_schema=False)
    async def version() -> Response:
        return JSONResponse({"version": OLLAMA_API_VERSION, "modelforge": modelforge.__version__})

    return router


def _refuse_unsupported_generation(call: _Generation) -> None:
    _refuse_set({"format": call.format, "think": call.think, "logprobs": call.logprobs})
    if call.top_logprobs:
        raise _not_supported("top_logprobs", "top_logprobs")


def _shortened(vector: list[float], dimensions: int) -> list[float]:
    """Ollama's `dimensions`: the first n values, scaled back to unit length."""
    if dimensions > len(vector):
        raise _invalid(f"dimensions: {dimensions} is more than the model's {len(vector)}")
    cut = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in cut))
    return [x / norm for x in cut] if norm else cut
