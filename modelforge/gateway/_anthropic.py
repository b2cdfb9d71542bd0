"""Anthropic's Messages API on the gateway (`POST /v1/messages`, `POST /v1/messages/count_tokens`),
as the `anthropic` package and the agents built on it call it, translated to the chat path
(`_chat_path.py`): one request workflow through admission, like every call.

- `system` and `messages` (text, image, `tool_use` and `tool_result` blocks; `thinking` blocks,
  the model's own earlier thinking, are left out as chat templates leave it out; a `system`
  message within the conversation, as Claude Code sends its environment, stays a system message
  where it is) become chat messages; `tools` (client tools: name, description, input_schema;
  one marked `defer_loading` is left out of what the model is shown, as the API does until a
  tool search loads it) and `tool_choice` become chat tools, and the model's tool calls come
  back as `tool_use` blocks (stop_reason `tool_use`); `max_tokens`, `stop_sequences`,
  `temperature`, `top_p`, `top_k` and `thinking` become the chat's parameters, taken or refused
  by the deployment's runtime as on `/v1/chat/completions`; `thinking.display: "omitted"`
  answers thinking blocks without their text, as the API does. `cache_control` marks change
  nothing and are accepted. `context_management` edits that clear earlier thinking
  (`clear_thinking_*`) are what the gateway always does (earlier thinking is never in the
  prompt): accepted; any other edit (clearing tool results) is refused by name.
- `stream: true` answers Anthropic's events: message_start, content_block_start /
  content_block_delta (text_delta, thinking_delta, input_json_delta) / content_block_stop per
  block, message_delta (stop_reason, usage), message_stop; a failure after the stream began is
  an `error` event with its class.
- `count_tokens` answers an estimate (about four characters a token, `"estimated": true`): the
  gateway has no tokenizer, and counting starts no workflow.
- The key comes as `x-api-key` (or `Authorization: Bearer`), checked as on every route. Errors
  are Anthropic's shape, `{"type": "error", "error": {"type", "message", "modelforge_class"}}`,
  the failure class also in `failure_class`; the statuses are the gateway's.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from modelforge.failures import FailureClass
from modelforge.gateway import _context
from modelforge.gateway._chat_path import Answer, ChatPath, Piece, text_of
from modelforge.gateway._errors import http_status, retry_after_s
from modelforge.gateway._params import ChatCall, estimate_tokens
from modelforge.identifiers import shown

_log = logging.getLogger(__name__)

# Anthropic's error `type` per HTTP status (its API reference, "Errors").
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
# OpenAI's chat finish reasons as Anthropic's stop reasons.
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}
# Fields of the Messages API that would change the answer (or where it is made: inference_geo)
# and that ModelForge cannot honour.
_REFUSED = ("container", "mcp_servers", "inference_geo")
# `context_management` edits the gateway honours by construction: earlier thinking is never put
# in the prompt (`chat_messages`), whatever an edit says to keep.
_THINKING_EDIT = "clear_thinking_"
# Fields that change nothing in the answer: accepted, not passed on.
_NO_EFFECT = ("cache_control", "diagnostics", "user_profile_id", "workspace_id")
# The Messages API's own fields (everything else in a body is a chat parameter).
_OWN = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "system",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "stream",
        "metadata",
        "thinking",
        "service_tier",
        "output_config",
        "speed",
        *_REFUSED,
        *_NO_EFFECT,
    }
)


def _error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def _error_response(error: _context.GatewayError) -> JSONResponse:
    """Anthropic's error shape (the `anthropic` package raises the matching exception with the
    message), the ModelForge class in `error.modelforge_class` and `failure_class`."""
    status = 400 if error.status == 422 else error.status
    body = {
        "type": "error",
        "error": {
            "type": _error_type(status),
            "message": _context._printable(error.message),
            "modelforge_class": error.failure,
        },
        "failure_class": error.failure,
        "request_id": error.request_id or None,
    }
    headers = dict(error.headers)
    retry_after = retry_after_s(error.failure, status)
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    if status == 409:
        headers["x-should-retry"] = "false"  # the request id stays taken: the SDK's retries cannot help
    return JSONResponse(body, status_code=status, headers=headers)


class _Conversation(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Annotated[str, Field(min_length=1, max_length=200)]
    messages: Annotated[list[Any], Field(min_length=1, max_length=10000)]
    system: str | list[Any] | None = None
    tools: Annotated[list[Any], Field(max_length=128)] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None


class _MessagesCall(_Conversation):
    max_tokens: Annotated[int, Field(gt=0)]
    stop_sequences: Annotated[list[str], Field(max_length=16)] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(gt=0)] | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    output_config: dict[str, Any] | None = None
    speed: str | None = None


def _invalid(message: str) -> _context.GatewayError:
    return _context.GatewayError(FailureClass.REQUEST_INVALID, message, status=400)


def _unsupported(where: str, why: str) -> _context.GatewayError:
    return _invalid(f"{where}: {why}")


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    raw = block.get("source")
    source: dict[str, Any] = raw if isinstance(raw, dict) else {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    elif source.get("type") == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise _unsupported(f"{where}.source", "an image is served from base64 data or a URL")
    return {"type": "image_url", "image_url": {"url": url}}


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise _invalid(f"{where}.tool_use_id: the tool_use block's id (a string)")
    raw = block.get("content")
    if isinstance(raw, list):
        texts = []
        for m, part in enumerate(raw):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, dict) else None
                raise _unsupported(f"{where}.content.{m}", f"{shown(str(kind)[:40])} tool results are not served")
            texts.append(str(part.get("text") or ""))
        text = "".join(texts)
    elif isinstance(raw, str) or raw is None:
        text = raw or ""
    else:
        raise _invalid(f"{where}.content: a string or text blocks")
    if block.get("is_error"):
        text = f"Error: {text}"  # what the model must know: the tool failed
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _system_text(system: object, where: str) -> str:
    """A system prompt (a string, or text blocks joined by lines) as one text."""
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise _invalid(f"{where}: a string or text blocks")
    texts = []
    for n, block in enumerate(system):
        if not (isinstance(block, dict) and block.get("type") == "text"):
            raise _unsupported(f"{where}.{n}", "system blocks are text blocks")
        texts.append(str(block.get("text") or ""))
    return "\n".join(texts)


def chat_messages(system: str | list[Any] | None, messages: list[Any]) -> list[dict[str, Any]]:
    """Anthropic's system and messages as chat messages (module docstring)."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _system_text(system, "system")})
    for n, message in enumerate(messages):
        where = f"messages.{n}"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise _invalid(f"{where}.role: user, assistant or system")
        role, content = message["role"], message.get("content")
        if role == "system":
            out.append({"role": "system", "content": _system_text(content, where)})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _invalid(f"{where}.content: a string or a list of content blocks")
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for m, block in enumerate(content):
            at = f"{where}.content.{m}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block, dict):
                parts.append({"type": "text", "text": str(block.get("text") or "")})
            elif kind == "image" and isinstance(block, dict) and role == "user":
                parts.append(_image(block, at))
            elif kind == "tool_use" and isinstance(block, dict) and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise _invalid(f"{at}: a tool_use block has an id and a name")
                arguments = json.dumps(block.get("input") or {})
                calls.append(
                    {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}
                )
            elif kind == "tool_result" and isinstance(block, dict) and role == "user":
                results.append(_tool_result(block, at))
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # the model's own earlier thinking: chat templates leave it out of the prompt
            else:
                raise _unsupported(f"{at}.type", f"{shown(str(kind)[:40])} blocks are not served in a {role} message")
        # Tool results answer the previous assistant turn: they come first, as chat tool messages.
        out.extend(results)
        if role == "assistant" and calls:
            out.append({"role": "assistant", "content": _content(parts) or None, "tool_calls": calls})
        elif parts or not results:
            out.append({"role": role, "content": _content(parts)})
    return out


def chat_tools(call: _Conversation) -> dict[str, Any]:
    """`tools` and `tool_choice` as the chat's parameters; server tools refused by name."""
    given: dict[str, Any] = {}
    if call.tools:
        tools = []
        for n, tool in enumerate(call.tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or kind not in (None, "custom") or not isinstance(tool.get("name"), str):
                raise _unsupported(f"tools.{n}", f"{shown(str(kind)[:40])} tools are not served (client tools are)")
            if tool.get("defer_loading"):
                continue  # not shown to the model until a tool search loads it (module docstring)
            function: dict[str, Any] = {"name": tool["name"], "parameters": tool.get("input_schema") or {}}
            if tool.get("description"):
                function["description"] = tool["description"]
            tools.append({"type": "function", "function": function})
        if tools:
            given["tools"] = tools
    choice = call.tool_choice
    if choice is not None and "tools" not in given and choice.get("type") in ("auto", "none"):
        choice = None  # every tool was deferred: there is nothing to choose among
    if choice is not None:
        kind = choice.get("type")
        if kind == "tool" and isinstance(choice.get("name"), str):
            given["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        elif kind in ("auto", "any", "none"):
            given["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
        else:
            raise _unsupported("tool_choice.type", "auto, any, tool (with a name) or none")
        if choice.get("disable_parallel_tool_use") and call.tools:
            given["parallel_tool_calls"] = False
    return given


def _context_management(management: dict[str, Any] | None) -> None:
    """Honoured by construction or refused by name (module docstring)."""
    for name, value in (management or {}).items():
        if name != "edits" and value is not None:
            raise _unsupported(f"context_management.{_context._escaped(name, 40)}", "only edits are served")
    edits = (management or {}).get("edits") or []
    if not isinstance(edits, list):
        raise _invalid("context_management.edits: a list of edits")
    for n, edit in enumerate(edits):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if not (isinstance(kind, str) and kind.startswith(_THINKING_EDIT)):
            raise _unsupported(
                f"context_management.edits.{n}.type",
                f"{shown(str(kind)[:60])} cannot be honoured (earlier thinking is never in the prompt: "
                "clear_thinking edits are served)",
            )


def _omits_thinking(thinking: dict[str, Any] | None) -> bool:
    """`thinking.display: "omitted"`: thinking blocks are answered without their text."""
    return thinking is not None and thinking.get("display") == "omitted"


def _thinking(thinking: dict[str, Any] | None) -> dict[str, Any]:
    # Extended thinking on: the chat template's switch (vLLM, llama.cpp); off is the default.
    if thinking is None or thinking.get("type") == "disabled":
        return {}
    if thinking.get("type") in ("enabled", "adaptive"):
        return {"chat_template_kwargs": {"enable_thinking": True}}
    raise _unsupported("thinking.type", "enabled, adaptive or disabled")


def _output_config(config: dict[str, Any] | None) -> dict[str, Any]:
    """`output_config`: its effort as `reasoning_effort`, its JSON schema as `response_format`."""
    given: dict[str, Any] = {}
    for name, value in (config or {}).items():
        if value is None:
            continue
        if name == "effort" and isinstance(value, str):
            given["reasoning_effort"] = value
        elif name == "format" and isinstance(value, dict) and value.get("type") == "json_schema":
            schema = {"name": "output", "schema": value.get("schema") or {}, "strict": True}
            given["response_format"] = {"type": "json_schema", "json_schema": schema}
        else:
            raise _unsupported(
                f"output_config.{_context._escaped(name, 40)}", "effort and a json_schema format are served"
            )
    return given


def _chat_call(call: _MessagesCall) -> ChatCall:
    for name in _REFUSED:
        if (call.model_extra or {}).get(name) is not None:
            raise _unsupported(name, "ModelForge serves a chat model's answer and cannot honour it; leave it out")
    if call.service_tier not in (None, "auto", "standard_only"):
        raise _unsupported("service_tier", "auto or standard_only (ModelForge's priority is X-ModelForge-Priority)")
    if call.speed not in (None, "standard"):
        raise _unsupported("speed", "standard only (ModelForge's priority is X-ModelForge-Priority)")
    _context_management(call.context_management)
    given: dict[str, Any] = {
        "max_tokens": call.max_tokens,
        "stop": call.stop_sequences or None,
        "temperature": call.temperature,
        "top_p": call.top_p,
        "top_k": call.top_k,
        **chat_tools(call),
        **_thinking(call.thinking),
        **_output_config(call.output_config),
    }
    # Fields the Messages API does not define: the model server's own (as on the chat route).
    given.update({name: value for name, value in (call.model_extra or {}).items() if name not in _OWN})
    body = {"model": call.model, "messages": chat_messages(call.system, call.messages)}
    body.update({name: value for name, value in given.items() if value is not None})
    return _validated(body)


def _validated(body: dict[str, Any]) -> ChatCall:
    try:
        return ChatCall.model_validate(body)
    except ValidationError as error:
        first = error.errors(include_url=False, include_input=False)[0]
        raise _invalid(f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _input(arguments: str, request_id: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise _context.GatewayError(
            FailureClass.INVALID_OUTPUT,
            f"the model called a tool with arguments that are not a JSON object: {arguments[:200]!r}",
            request_id=request_id,
        )
    return value


def _usage(counts: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_tokens": counts.get("prompt_tokens", 0),
        "output_tokens": counts.get("completion_tokens", 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "estimated": counts.get("estimated", True),  # as on every route: never a guess passed as a count
    }


def _blocks(answer: Answer, omit_thinking: bool) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if answer.reasoning:
        blocks.append({"type": "thinking", "thinking": "" if omit_thinking else answer.reasoning, "signature": ""})
    if answer.text or not answer.tool_calls:
        blocks.append({"type": "text", "text": answer.text})
    for call in answer.tool_calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": call.call_id,
                "name": call.name,
                "input": _input(call.arguments, answer.request_id),
            }
        )
    return blocks


def anthropic_router(path: ChatPath) -> APIRouter:
    """`/v1/messages` and `/v1/messages/count_tokens` on `create_app`'s chat path; included into its
    authenticated router, so the API key is checked first, as on every other route."""
    router = APIRouter(route_class=_context.error_route(_error_response, _log, "anthropic"))

    @router.post("/v1/messages")
    async def messages(request: Request) -> Any:
        call: _MessagesCall = await path.body_of(request, _MessagesCall)
        request.state.model = call.model
        chat = _chat_call(call)
        message_id = _new_id("msg")
        if not call.stream:
            answer = await path.answer(request, chat)
            return {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "model": call.model,
                "content": _blocks(answer, _omits_thinking(call.thinking)),
                "stop_reason": _STOP_REASONS.get(answer.finish_reason, "end_turn"),
                "stop_sequence": None,
                "usage": _usage(answer.usage),
            }
        streamed = await path.streamed(request, chat)
        estimate = sum(estimate_tokens(text) for text in streamed.prompt)
        start: dict[str, Any] = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": call.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": estimate, "output_tokens": 0},
        }
        return StreamingResponse(
            _events(streamed.pieces(), start, _omits_thinking(call.thinking)),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        """An estimate: the messages, system and tools the chat would carry, about four
        characters a token. The model must exist and take what is asked (the chat path's checks);
        no workflow starts."""
        call: _Conversation = await path.body_of(request, _Conversation)
        request.state.model = call.model
        given = {**chat_tools(call), **_thinking(call.thinking)}
        body = {"model": call.model, "messages": chat_messages(call.system, call.messages), **given}
        chat = _validated(body)
        deployment, _, sent = await path.chat_input(chat)
        request.state.capability = deployment.capability
        # What the model reads: each message's text and tool calls, and the tools' definitions.
        texts = [text_of(m.get("content")) + json.dumps(m.get("tool_calls") or "") for m in sent]
        texts.append(json.dumps(given.get("tools") or ""))
        return {"input_tokens": sum(estimate_tokens(t.strip('"')) for t in texts), "estimated": True}

    return router


async def _events(
    pieces: AsyncGenerator[Piece, None], start: dict[str, Any], omit_thinking: bool
) -> AsyncIterator[str]:
    """Anthropic's stream events for a streamed answer (module docstring). A client that goes
    away closes `pieces` at once, which tells the node to stop generating."""
    try:
        async for line in _anthropic_events(pieces, start, omit_thinking):
            yield line
    finally:
        await pieces.aclose()


async def _anthropic_events(
    pieces: AsyncIterator[Piece], start: dict[str, Any], omit_thinking: bool
) -> AsyncIterator[str]:
    index = -1
    current: tuple[str, int] | None = None  # the open block: its kind, and the tool call's index

    def event(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    def switch(kind: str, piece: Piece) -> list[str]:
        nonlocal index, current
        events = []
        if current is not None:
            events.append(event("content_block_stop", index=index))
        index += 1
        current = (kind, piece.index)
        if kind == "text":
            block: dict[str, Any] = {"type": "text", "text": ""}
        elif kind == "thinking":
            block = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            block = {"type": "tool_use", "id": piece.call_id, "name": piece.name, "input": {}}
        events.append(event("content_block_start", index=index, content_block=block))
        return events

    yield event("message_start", message=start)
    async for piece in pieces:
        if piece.kind in ("text", "reasoning", "tool_call"):
            kind = {"text": "text", "reasoning": "thinking", "tool_call": "tool_use"}[piece.kind]
            if current is None or current[0] != kind or (kind == "tool_use" and current[1] != piece.index):
                for line in switch(kind, piece):
                    yield line
            if not piece.text or (kind == "thinking" and omit_thinking):
                continue
            if kind == "text":
                delta = {"type": "text_delta", "text": piece.text}
            elif kind == "thinking":
                delta = {"type": "thinking_delta", "thinking": piece.text}
            else:
                delta = {"type": "input_json_delta", "partial_json": piece.text}
            yield event("content_block_delta", index=index, delta=delta)
        elif piece.kind == "end" and piece.answer is not None:
            if current is not None:
                yield event("content_block_stop", index=index)
            reason = _STOP_REASONS.get(piece.answer.finish_reason, "end_turn")
            counts = piece.answer.usage
            usage = {
                "input_tokens": counts.get("prompt_tokens", 0),
                "output_tokens": counts.get("completion_tokens", 0),
            }
            yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": None}, usage=usage)
            yield event("message_stop")
        elif piece.kind == "failed":
            if current is not None:
                yield event("content_block_stop", index=index)
            status = http_status(piece.failure)
            error = {"type": _error_type(status), "message": piece.text, "modelforge_class": piece.failure}
            yield event("error", error=error, failure_class=piece.failure)
