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
"Ollama API" section; the translation rules live in `_ollama_translate.py`. In short:
- `stream` (Ollama's default is true) on chat and generate streams NDJSON lines as the model
  generates them (thinking and tool calls included), then the final one (`done: true`);
  `stream: false` answers one JSON object (other routes answer one final NDJSON line).
- Fields Ollama does not define are ignored, as Ollama ignores them; null is absent.
- `keep_alive` is a hint: honoured up to what the catalog keeps, said in the answer's
  `X-ModelForge-Keep-Alive` header, never a reason to fail; only an operator's key unloads.
- Options, `tools`, `format`, `think`, images and `logprobs` reach an OpenAI-compatible server
  under its names; a runtime that cannot honour one that changes the answer refuses it by name,
  and so do `template` and `context`. `/api/generate`'s `raw` prompt and `suffix` (code
  completion's fill-in-the-middle) go to the server's completions route as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

import modelforge
from modelforge.client import Result
from modelforge.domain import Deployment, Residency
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gateway import _context
from modelforge.gateway._errors import retry_after_s
from modelforge.gateway._ollama_translate import (
    KeepAlive,
    TranslationError,
    chat_messages,
    keep_alive_decision,
    ollama_logprobs,
    ollama_message,
    ollama_tool_calls,
    read_options,
    reasoning_of,
    response_format,
    thinking,
)
from modelforge.gateway._ollama_translate import Options as _Options
from modelforge.gateway._params import takes_parameters
from modelforge.gateway._streams import VERDICT, Stream, StreamHub, next_record
from modelforge.gateway._streams import outcome as outcome_of
from modelforge.gateway._verdict_source import verdict_status
from modelforge.identifiers import shown
from modelforge.policy import PoolStatus
from modelforge.runtimes import fills_in_the_middle, speaks
from modelforge.streaming import ChoiceAssembler

_log = logging.getLogger(__name__)

# The Ollama release whose API (docs/api.md, api/types.go) these routes follow: what
# `/api/version` answers, so that clients checking for a minimum version find a recent one.
OLLAMA_API_VERSION = "0.33.0"

NDJSON = "application/x-ndjson"

# Go's time.ParseDuration, as Ollama parses a keep_alive string: a signed sequence of decimal
# numbers, each with a unit ("300ms", "-1.5h", "2h45m"); "0" alone needs none.
_UNITS_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"([+-]?)((?:(?:\d+\.?\d*|\.\d+)(?:ns|us|µs|μs|ms|s|m|h))+)")
_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")

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
    # Ollama ignores fields it does not define, and so does this API (logged at debug): Open
    # WebUI's title generation puts `num_predict` at the root of /api/chat, newer clients send
    # fields of later Ollama releases. Null is absent everywhere.
    model_config = ConfigDict(extra="allow")


_Model = Annotated[str, Field(min_length=1, max_length=200)]
# keep_alive as the client sent it: read by parse_keep_alive (a bool is not coerced to 1 s).
_KeepAlive = Annotated[Any, Field(default=None)]


class _Message(_Body):
    role: Annotated[str, Field(min_length=1, max_length=40)]
    content: str | None = None
    images: list[str] | None = None
    thinking: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class _Generation(_Body):
    model: _Model
    stream: bool | None = None
    keep_alive: _KeepAlive = None
    options: dict[str, Any] | None = None
    format: str | dict[str, Any] | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


class _Chat(_Generation):
    messages: Annotated[list[_Message], Field(max_length=1000)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None


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
    input: str | list[str] | None = None
    truncate: bool | None = None
    options: dict[str, Any] | None = None
    keep_alive: _KeepAlive = None
    dimensions: Annotated[int, Field(gt=0)] | None = None


class _Embeddings(_Body):
    model: _Model
    prompt: str | None = None
    options: dict[str, Any] | None = None
    keep_alive: _KeepAlive = None


class _Pull(_Body):
    model: str | None = None
    name: str | None = None  # the older spelling of `model`
    insecure: bool | None = None
    stream: bool | None = None


class _Show(_Body):
    model: str | None = None
    name: str | None = None  # the older spelling of `model`
    verbose: bool | None = None


def _ignored(call: BaseModel, where: str = "") -> None:
    """Fields this API does not define, ignored as Ollama ignores them: logged at debug."""
    extra = sorted(call.model_extra or {})
    if extra:
        _log.debug(
            "ollama request: ignored field(s) %s%s", where, ", ".join(_context._escaped(n, 40) for n in extra[:20])
        )


def _invalid(message: str) -> _context.GatewayError:
    return _context.GatewayError(FailureClass.REQUEST_INVALID, message, status=400)


def _not_supported(field: str, what: str) -> _context.GatewayError:
    return _invalid(f"{field}: {what} is not supported by ModelForge yet; leave it out")


def _refuse_set(fields: dict[str, object]) -> None:
    """400 for the first field given a value ModelForge cannot honour (unset, empty or false is fine)."""
    for name, value in fields.items():
        if value not in (None, "", [], {}, False, 0):
            raise _not_supported(name, f"{name} {shown(str(value)[:40])}")


def _rich(deployment: Deployment) -> bool:
    """Whether the runtime hands the request to an OpenAI-compatible chat server (the registry's
    `speaks`: api openai_chat): it then takes sampling options, tools, formats, images."""
    return speaks(deployment).api == "openai_chat"


def _sampling_taken(deployment: Deployment) -> frozenset[str] | None:
    """The sampling parameters the runtime honours: all for an OpenAI-compatible server (None),
    else those its registry entry says it takes itself (the simulated runtime's)."""
    return None if takes_parameters(deployment, "openai_chat") else speaks(deployment).parameters


def _translated(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except TranslationError as error:
        raise _invalid(str(error)) from None


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


def _error_response(error: _context.GatewayError) -> JSONResponse:
    """Ollama's error shape, `{"error": message}`, the ModelForge class beside it. An invalid
    request is 400 as Ollama answers it (the shared helpers may say 422)."""
    status = 400 if error.status == 422 else error.status
    body = {
        "error": _context._printable(error.message),
        "failure_class": error.failure,
        "request_id": error.request_id or None,
    }
    headers = dict(error.headers)
    retry_after = retry_after_s(error.failure, status)
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return JSONResponse(body, status_code=status, headers=headers)


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


def tagged(name: str) -> str:
    """A catalog name as Ollama lists it: `name:tag`, `:latest` when the name has no tag."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def _names(deployment: Deployment) -> list[str]:
    return list(dict.fromkeys([deployment.capability, *deployment.openai_models]))


def _template(deployment: Deployment) -> str:
    # A Go template as Ollama's /api/show gives it. The model server applies the model's own chat
    # template; this one says what ModelForge sends: system and prompt, and `.Suffix` only where
    # the model fills in the middle (`insert`): applications such as Continue read `.Suffix` in
    # it as "send fill-in-the-middle requests", and otherwise send their own tokens with `raw`.
    if "completion" not in _kinds(deployment):
        return ""
    chat = "{{ if .System }}{{ .System }}\n\n{{ end }}{{ .Prompt }}"
    if "insert" not in _capabilities(deployment):
        return chat
    # (A Go template comment: the model's own fill-in-the-middle tokens are the server's to add.)
    middle = "{{/* filled in by the model server */}}{{ .Prompt }}{{ .Suffix }}"
    return "{{ if .Suffix }}" + middle + "{{ else }}" + chat + "{{ end }}"


def _parameters_text(deployment: Deployment) -> str:
    # Ollama's `parameters`: one "name value" per line; what the catalog fixes for every caller.
    lines = [f"num_ctx {deployment.context_length}"] if deployment.context_length else []
    return "\n".join(lines)


def _capabilities(deployment: Deployment) -> list[str]:
    """Ollama's capability names: what the runtime answers, and the catalog's `features` (tools,
    vision, thinking, insert) where the runtime passes them through (an OpenAI-compatible server;
    the simulated runtime fills in the middle too)."""
    kinds = _kinds(deployment)
    if "completion" in kinds:
        rich, fills = _rich(deployment), fills_in_the_middle(deployment)
        kinds += [f for f in deployment.features if rich or (f == "insert" and fills)]
    return kinds


def ollama_router(
    catalog: _context._Catalog,
    requester: _context.Requester,
    body_of: BodyOf,
    run: Run,
    request_id_of: RequestIdOf,
    open_stream: OpenStream | None = None,
    hub: StreamHub | None = None,
    is_operator: Callable[[Request], bool] = lambda request: False,
    status_view: Callable[[Request, PoolStatus], PoolStatus] = lambda request, status: status,
) -> APIRouter:
    """The `/api/*` routes on `create_app`'s catalog cache, requester and helpers; included into
    its authenticated router, so the API key is checked first, as on every other route.
    `is_operator`: whether the caller's key is an operator's (it may unload through keep_alive).
    `status_view`: the pool's status as the caller may see it (`/api/ps`: a tenant's own leases)."""
    router = APIRouter(route_class=_context.error_route(_error_response, _log, "ollama"))

    async def deployment_of(model: str) -> Deployment:
        """A model name as Ollama applications send it: a catalog name, with or without `:latest`,
        or without the tag of the one catalog name that has it (`qwen` for `qwen:7b`)."""
        _context._check("capability", model.removesuffix(":latest"))
        known = await catalog.get()
        wanted = [model, model.removesuffix(":latest")] if model.endswith(":latest") else [model]
        for name in wanted:
            for deployment in known.deployments:
                if name in _names(deployment) or name == deployment.name:
                    return deployment
        base = model.removesuffix(":latest")
        if ":" not in base:
            untagged = {d.deployment_id: d for d in known.deployments for n in _names(d) if n.split(":")[0] == base}
            if len(untagged) == 1:
                return next(iter(untagged.values()))
        raise _context.GatewayError(
            FailureClass.CAPABILITY_UNAVAILABLE,
            f"model {shown(model)} not found: no ModelForge deployment serves it (GET /api/tags lists the models)",
            status=404,
        )

    async def resolve(
        request: Request, model: str, keep_alive: object, kind: str
    ) -> tuple[Deployment, KeepAlive | None]:
        """The deployment a call names, and what its keep_alive does for this caller (said in the
        answer's X-ModelForge-Keep-Alive header and the access log)."""
        try:
            seconds = parse_keep_alive(keep_alive)
        except ValueError as error:
            raise _invalid(f"keep_alive: {error}") from None
        deployment = await deployment_of(model)
        if kind not in _kinds(deployment):
            verb = {"completion": "chat or generate", "embedding": "embeddings"}[kind]
            raise _invalid(f"{shown(model)} does not support {verb} (it is {'/'.join(_kinds(deployment))})")
        decision = keep_alive_decision(deployment, seconds, operator=is_operator(request))
        if decision is not None:
            request.state.keep_alive = decision.header()
        return deployment, decision

    async def unload_if_asked(request: Request, decision: KeepAlive | None, deployment: Deployment) -> bool:
        """An operator's keep_alive 0: the model drains (no new lease) and unloads when its last
        lease ends, recorded with who asked. Whether it was done; why not is in the header."""
        if decision is None or not decision.unload:
            return False
        try:
            reply = await requester.residency(
                "unload", deployment.deployment_id, drain=True, actor=f"ollama keep_alive 0 by {request.state.tenant}"
            )
        except ModelForgeError as error:
            request.state.keep_alive = f"{decision.header()}; not unloaded: {error.message}"
            return False
        if not reply.ok:
            request.state.keep_alive = f"{decision.header()}; not unloaded: {reply.message}"
        return reply.ok

    async def unload_after(
        task: asyncio.Task[Any], request: Request, decision: KeepAlive, deployment: Deployment
    ) -> bool:
        """An operator's keep_alive 0 on a streamed call: the lease goes back when the invoke
        ends, a moment after the last piece; then the unload is asked."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(task), timeout=30)
        return await unload_if_asked(request, decision, deployment)

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

    def loaded(model: str, key: str, began: float, unloaded: bool) -> dict[str, Any]:
        # Ollama's answer to a call with nothing to do (no messages, no prompt): it loads the
        # model, or with keep_alive 0 unloads it. ModelForge loads on the first real request;
        # "unload" is said only when an unload was really asked of the scheduler.
        return {
            "model": model,
            "created_at": _now(),
            key: {"role": "assistant", "content": ""} if key == "message" else "",
            "done": True,
            "done_reason": "unload" if unloaded else "load",
            **timings(None, began),
        }

    def text_of(result: Result, deployment: Deployment) -> str:
        output = result.output or {}
        text = output.get("text")
        if not isinstance(text, str):
            raise _context.GatewayError(
                FailureClass.INVALID_OUTPUT, f"{deployment.capability} returned no 'text'", request_id=result.request_id
            )
        return text

    def vectors_of(result: Result, deployment: Deployment, count: int) -> list[list[float]]:
        vectors = (result.output or {}).get("embeddings")
        if not isinstance(vectors, list) or len(vectors) != count:
            raise _context.GatewayError(
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
        decision: KeepAlive | None,
    ) -> Response:
        """Ollama's NDJSON stream: a line per piece as the model generates it (`done: false`),
        its thinking and tool calls included, then the final line with the counts and durations
        (`done: true`). A failure after the first piece ends the stream with Ollama's
        `{"error": ...}` line."""
        assert open_stream is not None and hub is not None
        request_id = request_id_of(request)
        tenant = request.state.tenant
        stream, task, first = await open_stream(request, deployment.capability, payload, request_id, tenant)

        def piece(text: str, thought: str | None = None, calls: Any = None) -> dict[str, Any]:
            content: Any = text
            if key == "message":
                content = {"role": "assistant", "content": text}
                if thought:
                    content["thinking"] = thought
                if calls:
                    content["tool_calls"] = ollama_tool_calls(calls)
            elif thought:
                return {"model": model, "created_at": _now(), key: text, "thinking": thought, "done": False}
            return {"model": model, "created_at": _now(), key: content, "done": False}

        async def lines() -> AsyncIterator[str]:
            text: list[str] = []
            unload_tried = False
            # OpenAI streams a tool call in pieces (its name, then its arguments a few characters
            # at a time); Ollama sends each call whole, its arguments an object: the pieces are
            # put together and sent in one line when the answer ends.
            calling = ChoiceAssembler()
            try:
                record = first
                while record is not None:
                    if VERDICT in record:  # waiting for its first piece: a progress line, as `ollama pull`'s
                        waiting = piece("") | {"status": verdict_status(record[VERDICT]), VERDICT: record[VERDICT]}
                        yield json.dumps(waiting, separators=(",", ":")) + "\n"
                        record = await next_record(stream, task)
                        continue
                    delta, thought, calls = stream_delta(record)
                    if calls:
                        calling.add({"index": 0, "delta": {"tool_calls": calls}})
                    if delta or thought or calls:
                        if not text:
                            request.state.first_token_at = time.perf_counter()
                        text.append(delta)
                    if delta or thought:
                        yield json.dumps(piece(delta, thought), separators=(",", ":")) + "\n"
                    if "finish_reason" in record:
                        held = calling.choices("tool_calls")[0]["message"].get("tool_calls") if calling.rich else None
                        if held:
                            yield json.dumps(piece("", None, held), separators=(",", ":")) + "\n"
                        whole = "".join(text)
                        last = piece("")
                        last.update(
                            done=True,
                            done_reason=str(record.get("finish_reason") or "stop"),
                            total_duration=int((time.monotonic() - began) * 1e9),
                            **_counts({"usage": record.get("usage")}, prompt, whole),
                            request_id=request_id,
                        )
                        if decision is not None and decision.unload:
                            # The headers went out with the first piece: whether the unload was
                            # done, and why not, is said in the final line.
                            unload_tried = True
                            await unload_after(task, request, decision, deployment)
                            last["modelforge_keep_alive"] = request.state.keep_alive
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
                if decision is not None and decision.unload and not unload_tried:
                    await unload_after(task, request, decision, deployment)

        return StreamingResponse(lines(), media_type=NDJSON)

    def chat_payload(call: _Chat, deployment: Deployment, options: _Options) -> dict[str, Any]:
        """The runtime's input for an Ollama chat: OpenAI's shape, with tools, format, think and
        logprobs as parameters for an OpenAI-compatible server; refused by name for a runtime that
        would lose them."""
        rich = _rich(deployment)
        raw = [m.model_dump(exclude_none=True) for m in call.messages or []]
        messages = _translated(lambda: chat_messages(raw, rich=rich))
        extras: dict[str, Any] = {}
        if call.tools:
            extras["tools"] = call.tools
        extras.update(_translated(lambda: generation_parameters(call)))
        if extras and not rich:
            first = next(iter(extras))
            shown_name = {"response_format": "format", "chat_template_kwargs": "think", "reasoning_effort": "think"}
            raise _invalid(
                f"{shown_name.get(first, first)}: {deployment.capability} (runtime {deployment.runtime}) cannot honour "
                "it; serve the model from an OpenAI-compatible server (subprocess_http, api openai_chat)"
            )
        parameters = {**options.sampling, **extras}
        payload: dict[str, Any] = {"messages": messages}
        if parameters:
            payload["parameters"] = parameters
        return payload

    def completion_payload(call: _Generate, deployment: Deployment, options: _Options) -> dict[str, Any]:
        """The runtime's input for a raw prompt (`raw: true`: no template, as code completion
        sends its own fill-in-the-middle tokens) or a fill-in-the-middle request (`suffix`: the
        text after the cursor): the prompt as it is, for the model server's completions route
        (OpenAI's /v1/completions), which fills in before a suffix with the model's own tokens.
        A suffix only where the catalog says the model does that (`features` "insert", which
        /api/show then offers); what a template would have placed is refused, named."""
        what = "suffix" if call.suffix else "raw"
        if not speaks(deployment).raw_prompt:
            raise _invalid(
                f"{what}: {deployment.capability} (runtime {deployment.runtime}) takes no prompt as it is; serve "
                "the model from an OpenAI-compatible server (subprocess_http, api openai_chat)"
            )
        if call.suffix and not fills_in_the_middle(deployment):
            raise _invalid(
                f"suffix: {deployment.capability} does not fill in the middle (its catalog entry does not list "
                "'insert' in features); send the model's own fill-in-the-middle tokens with raw: true"
            )
        for name, value in (
            ("system", call.system),
            ("images", call.images),
            ("format", call.format),
            ("think", call.think),
            ("logprobs", call.logprobs),
        ):
            if value not in (None, "", [], False):
                raise _invalid(f"{name}: not taken with {what} (the prompt goes to the model as it is); leave it out")
        payload: dict[str, Any] = {"prompt": call.prompt or ""}
        if call.suffix:
            payload["suffix"] = call.suffix
        if options.sampling:
            payload["parameters"] = dict(options.sampling)
        return payload

    def generation_parameters(call: _Generation) -> dict[str, Any]:
        extras: dict[str, Any] = {}
        shaped = response_format(call.format)
        if shaped is not None:
            extras["response_format"] = shaped
        extras.update(thinking(call.think))
        if call.logprobs:
            extras["logprobs"] = True
            if call.top_logprobs:
                extras["top_logprobs"] = call.top_logprobs
        return extras

    def final_message(output: dict[str, Any]) -> dict[str, Any]:
        return ollama_message(output)

    @router.post("/api/chat")
    async def chat(request: Request) -> Response:
        began = time.monotonic()
        call: _Chat = await body_of(request, _Chat)
        _ignored(call, "/api/chat: ")
        deployment, decision = await resolve(request, call.model, call.keep_alive, "completion")
        options = _translated(lambda: read_options(call.options, deployment, taken=_sampling_taken(deployment)))
        if not call.messages:  # Ollama's load (or, with keep_alive 0, unload) of a model
            unloaded = await unload_if_asked(request, decision, deployment)
            return _answer(loaded(call.model, "message", began, unloaded), call.stream)
        payload = chat_payload(call, deployment, options)
        prompt = [m.content or "" for m in call.messages]
        if call.stream is not False and open_stream is not None:
            return await streamed(
                request,
                deployment,
                payload,
                model=call.model,
                key="message",
                prompt=prompt,
                began=began,
                decision=decision,
            )
        result = await invoke(request, deployment, payload)
        text = text_of(result, deployment)
        output = result.output or {}
        await unload_if_asked(request, decision, deployment)
        body: dict[str, Any] = {
            "model": call.model,
            "created_at": _now(),
            "message": final_message(output),
            "done": True,
            "done_reason": str(output.get("finish_reason") or "stop"),
            **timings(result, began),
            **_counts(output, prompt, text),
            "request_id": result.request_id,
        }
        logprobs = ollama_logprobs(output) if call.logprobs else None
        if logprobs is not None:
            body["logprobs"] = logprobs
        return _answer(body, call.stream)

    @router.post("/api/generate")
    async def generate(request: Request) -> Response:
        began = time.monotonic()
        call: _Generate = await body_of(request, _Generate)
        _ignored(call, "/api/generate: ")
        # Each of these changes the answer and has no equivalent here: refused by name.
        _refuse_set(
            {
                "template": call.template,
                "context": call.context,
                "width": call.width,
                "height": call.height,
                "steps": call.steps,
            }
        )
        deployment, decision = await resolve(request, call.model, call.keep_alive, "completion")
        options = _translated(lambda: read_options(call.options, deployment, taken=_sampling_taken(deployment)))
        if not call.prompt and not call.suffix:  # Ollama's load (or, with keep_alive 0, unload) of a model
            unloaded = await unload_if_asked(request, decision, deployment)
            return _answer(loaded(call.model, "response", began, unloaded), call.stream)
        if call.raw or call.suffix:
            payload = completion_payload(call, deployment, options)
            prompt = [call.prompt or "", call.suffix or ""]
        else:
            # A one-turn chat: the model server applies the model's own template, as Ollama does
            # for a prompt that is not `raw`.
            turns: list[dict[str, Any]] = [{"role": "system", "content": call.system}] if call.system else []
            turns.append({"role": "user", "content": call.prompt, **({"images": call.images} if call.images else {})})
            as_chat = _Chat.model_validate(
                {
                    "model": call.model,
                    "messages": turns,
                    "format": call.format,
                    "think": call.think,
                    "logprobs": call.logprobs,
                    "top_logprobs": call.top_logprobs,
                }
            )
            payload = chat_payload(as_chat, deployment, options)
            prompt = [str(m["content"]) for m in turns]
        if call.stream is not False and open_stream is not None:
            return await streamed(
                request,
                deployment,
                payload,
                model=call.model,
                key="response",
                prompt=prompt,
                began=began,
                decision=decision,
            )
        result = await invoke(request, deployment, payload)
        text = text_of(result, deployment)
        output = result.output or {}
        await unload_if_asked(request, decision, deployment)
        body: dict[str, Any] = {
            "model": call.model,
            "created_at": _now(),
            "response": text,
            "done": True,
            "done_reason": str(output.get("finish_reason") or "stop"),
            **timings(result, began),
            **_counts(output, prompt, text),
            "request_id": result.request_id,
        }
        thought = final_message(output).get("thinking")
        if thought:
            body["thinking"] = thought
        logprobs = ollama_logprobs(output) if call.logprobs else None
        if logprobs is not None:
            body["logprobs"] = logprobs
        return _answer(body, call.stream)

    def embedding_options(options: dict[str, Any] | None, deployment: Deployment) -> None:
        # LangChain's OllamaEmbeddings sends 13 options, null unless set. Runner options and
        # num_ctx are accepted; a sampling option means nothing to an embedding and is ignored.
        _translated(lambda: read_options(options, deployment))

    @router.post("/api/embed")
    async def embed(request: Request) -> Response:
        began = time.monotonic()
        call: _Embed = await body_of(request, _Embed)
        _ignored(call, "/api/embed: ")
        if call.truncate is False:
            raise _not_supported("truncate", "truncate false (an error past the context length)")
        given = call.input or ""
        texts = ([given] if given else []) if isinstance(given, str) else list(given)
        if any(not t for t in texts):
            raise _invalid("input: give one or more non-empty strings")
        deployment, _ = await resolve(request, call.model, call.keep_alive, "embedding")
        embedding_options(call.options, deployment)
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
        _ignored(call, "/api/embeddings: ")
        deployment, _ = await resolve(request, call.model, call.keep_alive, "embedding")
        embedding_options(call.options, deployment)
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
            for name in _names(deployment):
                models.append(
                    {
                        "name": tagged(name),
                        "model": tagged(name),
                        "modified_at": _ZERO_TIME,
                        "size": deployment.resident_bytes,
                        "digest": deployment.artifact_sha256,
                        "details": _details(deployment),
                        "capabilities": _capabilities(deployment),
                        "modelforge": _modelforge(deployment),
                    }
                )
        return JSONResponse({"models": models})

    @router.get("/api/ps")
    async def ps(request: Request) -> Response:
        try:
            pool = status_view(request, await requester.status())
        except ModelForgeError as error:
            raise _context.GatewayError(error.failure, error.message) from None
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
                    "name": tagged(resident.capability),
                    "model": tagged(resident.capability),
                    "size": resident.bytes,
                    "digest": deployment.artifact_sha256 if deployment else "",
                    "details": _details(deployment) if deployment else {},
                    "expires_at": expires,
                    "size_vram": resident.bytes if kinds.get(resident.accelerator, "gpu") != "cpu" else 0,
                    "context_length": deployment.context_length if deployment else 0,
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
        info: dict[str, Any] = {
            "general.architecture": deployment.runtime,
            "modelforge.capability": deployment.capability,
            "modelforge.deployment": deployment.deployment_id,
            "modelforge.residency": deployment.residency.value,
            "modelforge.ttl_s": deployment.ttl_s,
            "modelforge.envelope_bytes": deployment.envelope_bytes,
            "modelforge.concurrency": deployment.concurrency,
        }
        if deployment.context_length:
            # Where Ollama clients read it: `<architecture>.context_length` (Continue, Open WebUI).
            info[f"{deployment.runtime}.context_length"] = deployment.context_length
        return JSONResponse(
            {
                "modelfile": "",
                "parameters": _parameters_text(deployment),
                "template": _template(deployment),
                "details": _details(deployment),
                "model_info": info,
                "capabilities": _capabilities(deployment),
                "modified_at": _ZERO_TIME,
            }
        )

    @router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def heartbeat() -> Response:
        # What Ollama answers here; its CLI and some applications check it before anything else.
        return PlainTextResponse("Ollama is running")

    @router.api_route("/api/status", methods=["GET", "HEAD"], include_in_schema=False)
    async def api_status() -> Response:
        # Ollama's cloud-status route, which newer clients probe: this server is local.
        return JSONResponse({"cloud": {"disabled": True, "source": "modelforge"}})

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
        except _context.GatewayError as error:
            raise _context.GatewayError(
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


def stream_delta(record: dict[str, Any]) -> tuple[str, str | None, Any]:
    """A streamed record's text, thinking and tool calls (the first choice's: Ollama streams one)."""
    delta = record.get("delta")
    shaped: dict[str, Any] = delta if isinstance(delta, dict) else {}
    choices = record.get("choices")
    if isinstance(choices, list):  # OpenAI's chunk shape: the first choice's delta
        first = [c for c in choices if isinstance(c, dict) and c.get("index", 0) in (0, None)]
        if not first:
            return "", None, None
        found = first[0].get("delta")
        shaped = found if isinstance(found, dict) else {}
    text: str = delta if isinstance(delta, str) else str(shaped.get("content") or "")
    return text, reasoning_of(shaped), shaped.get("tool_calls") or None


def _shortened(vector: list[float], dimensions: int) -> list[float]:
    """Ollama's `dimensions`: the first n values, scaled back to unit length."""
    if dimensions > len(vector):
        raise _invalid(f"dimensions: {dimensions} is more than the model's {len(vector)}")
    cut = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in cut))
    return [x / norm for x in cut] if norm else cut
