"""OpenAI's Responses API on the gateway (`POST /v1/responses`), as Codex CLI and the OpenAI
Agents SDK call it, translated to the chat path (`_chat_path.py`): one request workflow through
admission, like every call.

- `input` (a string, or items: messages with text or image parts, `function_call` and
  `function_call_output` items; `reasoning` items, the model's own earlier thinking, are left
  out as chat templates leave it out) and `instructions` become chat messages; `tools` (function
  tools, and `namespace` groups of them: each function reaches the model as
  `<namespace>__<function>`, its calls come back with `name` and `namespace` apart) and
  `tool_choice` become chat tools, and the model's tool calls come back as `function_call` output
  items; tools OpenAI runs on its side (`web_search`, `file_search`, `code_interpreter`,
  `image_generation`, `mcp`: Codex offers web search on every turn) are left out of what the
  model is shown and the answer says so (`X-ModelForge-Tools-Omitted`, the access log's
  `tools_omitted`), and a `tool_choice` forcing one is refused; `max_output_tokens`,
  `temperature`, `top_p`, `reasoning.effort`, `text.format` and `text.verbosity` become the
  chat's parameters, taken or refused by the deployment's runtime as on `/v1/chat/completions`;
  fields the Responses API does not define reach the chat as parameters too (vLLM's `top_k`
  through the SDK's `extra_body`).
- `previous_response_id` continues a conversation kept in this gateway process's memory
  (`ResponseStore`: per tenant, least recently used first out, bounded in entries and bytes); a
  tenant reads its own only, and an unknown id is 404 naming it, whoever holds it.
- `stream: true` answers the Responses event sequence (response.created, response.in_progress,
  output_item.added, content_part.added, output_text.delta ... output_item.done,
  response.completed; reasoning_text and function_call_arguments events for those items).
- Fields that would change the answer and have no chat equivalent are refused by name
  (REQUEST_INVALID, 400 `unsupported_parameter`); null is absent. Errors are OpenAI's shape.
"""

from __future__ import annotations

import json
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from modelforge.failures import FailureClass
from modelforge.gateway import _context
from modelforge.gateway._chat_path import Answer, ChatPath, Piece
from modelforge.gateway._errors import http_status
from modelforge.gateway._params import ChatCall
from modelforge.identifiers import shown

# What the store keeps per tenant, and in all (a gateway without API keys has a tenant per
# X-ModelForge-Tenant value, so the total is bounded too): past either, the least recently used
# conversations go first.
STORE_ENTRIES_PER_TENANT = 1000
STORE_BYTES_PER_TENANT = 64 * 1024 * 1024
STORE_BYTES_TOTAL = 512 * 1024 * 1024

# Fields of the Responses API that would change the answer and that ModelForge cannot honour,
# with the values that change nothing (accepted).
_REFUSED: dict[str, tuple[Any, ...]] = {
    "background": (False,),
    "conversation": (),
    "prompt": (),
    "max_tool_calls": (),
    "truncation": ("disabled",),
    "top_logprobs": (0,),
    "context_management": ([],),
    "moderation": (),
    "image": (),
    "access_programs": (),
    "background_options": (),
}
# `include` values that ask for nothing this gateway leaves out: Codex asks for the encrypted
# reasoning it sends back, which a chat server has none of.
_INCLUDABLE = frozenset({"reasoning.encrypted_content"})
# Responses' own fields (everything else in a body is a chat parameter).
_OWN = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "stream",
        "previous_response_id",
        "max_output_tokens",
        "temperature",
        "top_p",
        "store",
        "metadata",
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "reasoning",
        "text",
        "include",
        "stream_options",
        "service_tier",
        *_REFUSED,
    }
)


class _ResponsesCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Annotated[str, Field(min_length=1, max_length=200)]
    input: str | Annotated[list[Any], Field(max_length=10000)] | None = None
    instructions: str | None = None
    tools: Annotated[list[Any], Field(max_length=128)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    previous_response_id: Annotated[str, Field(max_length=200)] | None = None
    max_output_tokens: Annotated[int, Field(gt=0)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    service_tier: str | None = None


def _invalid(message: str, param: str, *, status: int = 400, code: str = "invalid_value") -> _context.GatewayError:
    return _context.GatewayError(FailureClass.REQUEST_INVALID, message, status=status, code=code, param=param)


def _unsupported(param: str, why: str) -> _context.GatewayError:
    return _invalid(f"{param}: {why}", param, code="unsupported_parameter")


@dataclass
class _Stored:
    messages: list[dict[str, Any]]  # the conversation so far as chat messages, instructions aside
    response: dict[str, Any]  # the response object as it was answered, for GET /v1/responses/{id}
    size: int


class ResponseStore:
    """The conversations `previous_response_id` continues, kept in this gateway process's
    memory: per tenant, least recently used first out past `entries` or `tenant_bytes`, and past
    `total_bytes` over all tenants. Keyed by (tenant, id): a tenant never reads another's. A
    gateway restart forgets them all (the client then sends the whole conversation again)."""

    def __init__(
        self,
        entries: int = STORE_ENTRIES_PER_TENANT,
        tenant_bytes: int = STORE_BYTES_PER_TENANT,
        total_bytes: int = STORE_BYTES_TOTAL,
    ) -> None:
        self.entries, self.tenant_bytes, self.total_bytes = entries, tenant_bytes, total_bytes
        self._all: OrderedDict[tuple[str, str], _Stored] = OrderedDict()  # every tenant's, by last use
        self._by_tenant: dict[str, OrderedDict[str, None]] = {}
        self._tenant_size: dict[str, int] = {}
        self._size = 0

    def get(self, tenant: str, response_id: str) -> list[dict[str, Any]] | None:
        stored = self._touch(tenant, response_id)
        if stored is None:
            return None
        copy: list[dict[str, Any]] = json.loads(json.dumps(stored.messages))  # the caller extends it
        return copy

    def response(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        stored = self._touch(tenant, response_id)
        return None if stored is None else stored.response

    def delete(self, tenant: str, response_id: str) -> bool:
        found = (tenant, response_id) in self._all
        self._drop(tenant, response_id)
        return found

    def _touch(self, tenant: str, response_id: str) -> _Stored | None:
        stored = self._all.get((tenant, response_id))
        if stored is not None:
            self._all.move_to_end((tenant, response_id))
            self._by_tenant[tenant].move_to_end(response_id)
        return stored

    def put(self, tenant: str, response_id: str, messages: list[dict[str, Any]], response: dict[str, Any]) -> None:
        size = len(json.dumps(messages)) + len(json.dumps(response))
        if size > min(self.tenant_bytes, self.total_bytes):
            return  # never kept: a follow-up is told the id is not known
        self._drop(tenant, response_id)
        self._all[(tenant, response_id)] = _Stored(messages, response, size)
        self._by_tenant.setdefault(tenant, OrderedDict())[response_id] = None
        self._tenant_size[tenant] = self._tenant_size.get(tenant, 0) + size
        self._size += size
        mine = self._by_tenant[tenant]
        while len(mine) > self.entries or self._tenant_size[tenant] > self.tenant_bytes:
            self._drop(tenant, next(iter(mine)))
        while self._size > self.total_bytes:
            oldest_tenant, oldest_id = next(iter(self._all))
            self._drop(oldest_tenant, oldest_id)

    def _drop(self, tenant: str, response_id: str) -> None:
        stored = self._all.pop((tenant, response_id), None)
        if stored is None:
            return
        self._size -= stored.size
        self._tenant_size[tenant] -= stored.size
        mine = self._by_tenant[tenant]
        mine.pop(response_id, None)
        if not mine:
            del self._by_tenant[tenant], self._tenant_size[tenant]

    def __len__(self) -> int:
        return len(self._all)


def _refused_fields(call: _ResponsesCall) -> None:
    given = call.model_dump(exclude_unset=True)
    for name, harmless in _REFUSED.items():
        value = given.get(name)
        if value is not None and value not in harmless:
            raise _unsupported(name, "ModelForge serves a chat model's answer and cannot honour it; leave it out")
    for n, value in enumerate(call.include or []):
        if value not in _INCLUDABLE:
            raise _unsupported(f"include.{n}", f"{shown(value[:60])} cannot be included by ModelForge")


def _parts_text(content: list[Any], where: str) -> str | list[dict[str, Any]]:
    """Input content parts as chat content: text (joined, when that is all there is) and images."""
    parts: list[dict[str, Any]] = []
    for m, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal") and isinstance(part, dict):
            text = part.get("text", part.get("refusal"))
            parts.append({"type": "text", "text": str(text or "")})
        elif kind == "input_image" and isinstance(part, dict) and isinstance(part.get("image_url"), str):
            image: dict[str, Any] = {"url": part["image_url"]}
            if part.get("detail") in ("low", "high"):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise _unsupported(
                f"{where}.{m}", f"{shown(str(kind)[:40])} parts are not served (text and images by URL are)"
            )
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def input_messages(value: str | list[Any] | None) -> list[dict[str, Any]]:
    """Responses input as chat messages: a string is one user message; items map one by one,
    consecutive `function_call` items joining one assistant message."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for n, item in enumerate(value):
        where = f"input.{n}"
        if isinstance(item, str):
            messages.append({"role": "user", "content": item})
            continue
        if not isinstance(item, dict):
            raise _invalid(f"{where}: an input item is an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _invalid(
                    f"{where}.role: {shown(str(role)[:40])} is not user, system, developer or assistant", where
                )
            content = item.get("content")
            if isinstance(content, list):
                shaped = _parts_text(content, f"{where}.content")
            elif isinstance(content, str):
                shaped = content
            else:
                raise _invalid(f"{where}.content: a string or a list of content parts", f"{where}.content")
            # A developer message is the system message of a chat (what OpenAI's chat models read).
            messages.append({"role": "system" if role == "developer" else role, "content": shaped})
        elif kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(arguments, str):
                raise _invalid(f"{where}: a function_call has call_id, name and arguments (strings)", where)
            if isinstance(item.get("namespace"), str):
                name = f"{item['namespace']}{NAMESPACE_JOIN}{name}"
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise _invalid(f"{where}.call_id: the function_call's call_id (a string)", f"{where}.call_id")
            text = _parts_text(output, f"{where}.output") if isinstance(output, list) else output
            if not isinstance(text, str):
                raise _invalid(f"{where}.output: a string or text parts", f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue  # the model's own earlier thinking: chat templates leave it out of the prompt
        else:
            raise _unsupported(
                f"{where}.type",
                f"{shown(str(kind)[:40])} items are not served (messages, function_call, function_call_output are)",
            )
    return messages


# A namespace's function reaches a chat model as `<namespace>__<function>` (a name every chat
# server's tool grammar takes); its calls come back split again (`ServedTools.namespaced`).
NAMESPACE_JOIN = "__"
# Tools OpenAI runs on its side: ModelForge has none of them to run (module docstring).
_HOSTED = ("web_search", "file_search", "code_interpreter", "image_generation", "mcp")


@dataclass(frozen=True)
class ServedTools:
    """What a call's `tools` become: the chat's tools, the namespaced functions among them (chat
    name -> (namespace, function)), and the hosted tools left out (their types)."""

    chat: list[dict[str, Any]] | None = None
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    omitted: list[str] = field(default_factory=list)


def _function(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise _unsupported(where, f"{shown(str(kind)[:40])} tools are not served (function tools are)")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def served_tools(tools: list[Any] | None) -> ServedTools:
    """Function tools and namespaces of them as a chat's tools; hosted tools left out (said);
    any other kind refused by name."""
    if not tools:
        return ServedTools()
    shaped: list[dict[str, Any]] = []
    namespaced: dict[str, tuple[str, str]] = {}
    omitted: list[str] = []
    for n, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind.startswith(_HOSTED):
            omitted.append(kind)
        elif kind == "namespace" and isinstance(tool, dict) and isinstance(tool.get("name"), str):
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise _invalid(f"tools.{n}.tools: a namespace's function tools", f"tools.{n}.tools")
            for m, function in enumerate(inner):
                served = _function(function, f"tools.{n}.tools.{m}")
                inner_name = served["function"]["name"]
                served["function"]["name"] = joined = f"{tool['name']}{NAMESPACE_JOIN}{inner_name}"
                shaped.append(served)
                namespaced[joined] = (tool["name"], inner_name)
        else:
            shaped.append(_function(tool, f"tools.{n}"))
    names = [t["function"]["name"] for t in shaped]
    if len(set(names)) != len(names):
        clash = next(name for name in names if names.count(name) > 1)
        raise _invalid(f"tools: two tools are called {shown(clash[:80])} (a namespace's joined name included)", "tools")
    return ServedTools(shaped or None, namespaced, omitted)


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _unsupported("tool_choice", "'auto', 'none', 'required' or a function ({'type': 'function', 'name'})")


def chat_parameters(call: _ResponsesCall, tools: ServedTools) -> dict[str, Any]:
    """The chat parameters a Responses call gives (null ones are not given)."""
    given: dict[str, Any] = {
        "max_tokens": call.max_output_tokens,
        "temperature": call.temperature,
        "top_p": call.top_p,
        "tools": tools.chat,
        "tool_choice": chat_tool_choice(call.tool_choice),
        "parallel_tool_calls": call.parallel_tool_calls,
        "user": call.user,
        # An urgency hint, as on the chat route: a class of the tenant's queue, never the server's.
        "service_tier": call.service_tier,
    }
    if call.reasoning is not None and call.reasoning.get("effort") is not None:
        given["reasoning_effort"] = call.reasoning["effort"]
    text = call.text or {}
    shape = text.get("format")
    if isinstance(shape, dict) and shape.get("type") == "json_object":
        given["response_format"] = {"type": "json_object"}
    elif isinstance(shape, dict) and shape.get("type") == "json_schema":
        schema = {k: shape[k] for k in ("name", "schema", "strict", "description") if shape.get(k) is not None}
        given["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif shape is not None and not (isinstance(shape, dict) and shape.get("type") == "text"):
        raise _unsupported("text.format", "'text', 'json_object' or 'json_schema'")
    if text.get("verbosity") is not None:
        given["verbosity"] = text["verbosity"]
    if tools.chat is None and given["tool_choice"] in ("auto", "none"):
        # Every tool offered was a hosted one, left out: there is nothing to choose among.
        given["tool_choice"] = given["parallel_tool_calls"] = None
    # Fields the Responses API does not define: the model server's own (as on the chat route).
    given.update({name: value for name, value in (call.model_extra or {}).items() if name not in _OWN})
    return {name: value for name, value in given.items() if value is not None}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _usage(counts: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = counts.get("prompt_tokens", 0), counts.get("completion_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": counts.get("total_tokens", prompt + completion),
        "estimated": counts.get("estimated", True),  # as on every route: never a guess passed as a count
    }


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "added" else []
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": "in_progress" if status == "added" else status,
        "content": content,
    }


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status != "added" else []
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": content,
        "status": "in_progress" if status == "added" else status,
    }


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str, namespaced: dict[str, tuple[str, str]]
) -> dict[str, Any]:
    item = {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "in_progress" if status == "added" else status,
    }
    if name in namespaced:
        item["namespace"], item["name"] = namespaced[name]
    return item


def _output_items(answer: Answer, namespaced: dict[str, tuple[str, str]]) -> list[dict[str, Any]]:
    items = []
    if answer.reasoning:
        items.append(_reasoning_item(_new_id("rs"), answer.reasoning, "completed"))
    if answer.text or not answer.tool_calls:
        items.append(_message_item(_new_id("msg"), answer.text, "completed"))
    for call in answer.tool_calls:
        items.append(_call_item(_new_id("fc"), call.call_id, call.name, call.arguments, "completed", namespaced))
    return items


def _assistant_turn(answer: Answer) -> dict[str, Any]:
    """The answer as the chat message the next turn's conversation holds."""
    turn: dict[str, Any] = {"role": "assistant", "content": answer.text or None}
    if answer.tool_calls:
        turn["tool_calls"] = [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in answer.tool_calls
        ]
    elif turn["content"] is None:
        turn["content"] = ""
    return turn


def _status(finish: str) -> tuple[str, dict[str, Any] | None]:
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def responses_router(path: ChatPath, store: ResponseStore | None = None) -> APIRouter:
    """`POST /v1/responses` on `create_app`'s chat path; included into its authenticated router,
    so the API key (or the tenant header) is checked first, as on every other route."""
    router = APIRouter()
    kept = store if store is not None else ResponseStore()

    def skeleton(call: _ResponsesCall, response_id: str, created: float) -> dict[str, Any]:
        return {
            "id": response_id,
            "object": "response",
            "created_at": created,
            "status": "in_progress",
            "model": call.model,
            "output": [],
            "error": None,
            "incomplete_details": None,
            "instructions": call.instructions,
            "metadata": call.metadata or {},
            "parallel_tool_calls": call.parallel_tool_calls if call.parallel_tool_calls is not None else True,
            "tool_choice": call.tool_choice if call.tool_choice is not None else "auto",
            "tools": call.tools or [],
            "temperature": call.temperature,
            "top_p": call.top_p,
            "max_output_tokens": call.max_output_tokens,
            "previous_response_id": call.previous_response_id,
            "reasoning": call.reasoning,
            "text": call.text or {"format": {"type": "text"}},
            "truncation": "disabled",
            "store": call.store is not False,
            "user": call.user,
            "usage": None,
        }

    def finished(body: dict[str, Any], answer: Answer, output: list[dict[str, Any]]) -> dict[str, Any]:
        status, incomplete = _status(answer.finish_reason)
        return {
            **body,
            "status": status,
            "incomplete_details": incomplete,
            "completed_at": time.time(),
            "output": output,
            "usage": _usage(answer.usage),
        }

    def keep(
        tenant: str,
        call: _ResponsesCall,
        body: dict[str, Any],
        history: list[dict[str, Any]],
        answer: Answer,
        response: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Keeps the conversation for `previous_response_id` and the response for GET, unless
        `store: false`; `response` is the streamed one (its items' ids as the client saw them)."""
        response = response or finished(body, answer, _output_items(answer, served_tools(call.tools).namespaced))
        if call.store is not False:
            kept.put(tenant, body["id"], [*history, _assistant_turn(answer)], response)
        return response

    def not_kept(response_id: str) -> _context.GatewayError:
        # The same answer whether the id was never made, evicted or another tenant's.
        return _invalid(
            f"no response {shown(response_id[:80])} is kept for this key (unknown, not stored, or evicted: "
            f"this gateway keeps the latest {kept.entries} per tenant in memory)",
            "response_id",
            status=404,
            code="response_not_found",
        )

    @router.get("/v1/responses/{response_id}")
    async def retrieve(request: Request, response_id: str) -> Any:
        found = kept.response(request.state.tenant, response_id)
        if found is None:
            raise not_kept(response_id)
        return found

    @router.delete("/v1/responses/{response_id}")
    async def delete(request: Request, response_id: str) -> Any:
        if not kept.delete(request.state.tenant, response_id):
            raise not_kept(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @router.post("/v1/responses")
    async def create(request: Request) -> Any:
        tenant: str = request.state.tenant
        call: _ResponsesCall = await path.body_of(request, _ResponsesCall)
        request.state.model = call.model
        _refused_fields(call)
        history: list[dict[str, Any]] = []
        if call.previous_response_id is not None:
            found = kept.get(tenant, call.previous_response_id)
            if found is None:
                # The same answer whether the id was never made, evicted or another tenant's.
                raise _invalid(
                    f"previous_response_id: no response {shown(call.previous_response_id[:80])} is kept for this "
                    "key (unknown, not stored, or evicted: this gateway keeps the latest "
                    f"{kept.entries} per tenant in memory); send the whole conversation as input instead",
                    "previous_response_id",
                    status=404,
                    code="previous_response_not_found",
                )
            history = found
        history += input_messages(call.input)
        tools = served_tools(call.tools)
        if tools.omitted:
            request.state.tools_omitted = (
                f"{', '.join(dict.fromkeys(tools.omitted))} (run on OpenAI's side; ModelForge has none to run)"
            )
        if not history:
            raise _invalid("input: give a string or one or more input items", "input")
        # Instructions are this call's only: not carried over to the next response.
        system = [{"role": "system", "content": call.instructions}] if call.instructions else []
        try:
            chat = ChatCall.model_validate(
                {"model": call.model, "messages": [*system, *history], **chat_parameters(call, tools)}
            )
        except ValidationError as error:
            first = error.errors(include_url=False, include_input=False)[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            raise _invalid(f"{where}: {first['msg']}", where) from None
        response_id = _new_id("resp")
        created = time.time()
        body = skeleton(call, response_id, created)
        if not call.stream:
            return keep(tenant, call, body, history, await path.answer(request, chat))
        streamed = await path.streamed(request, chat)
        return StreamingResponse(
            _events(
                streamed.pieces(),
                body,
                lambda answer, done: keep(tenant, call, body, history, answer, done),
                finished,
                tools.namespaced,
            ),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    return router


Finished = Callable[[dict[str, Any], Answer, list[dict[str, Any]]], dict[str, Any]]
Keep = Callable[[Answer, dict[str, Any]], Any]


async def _events(
    pieces: AsyncGenerator[Piece, None],
    body: dict[str, Any],
    keep: Keep,
    finished: Finished,
    namespaced: dict[str, tuple[str, str]],
) -> AsyncIterator[str]:
    """`_response_events`, closing `pieces` however it ends: a client that goes away closes it
    at once, which tells the node to stop generating."""
    try:
        async for line in _response_events(pieces, body, keep, finished, namespaced):
            yield line
    finally:
        await pieces.aclose()


async def _response_events(
    pieces: AsyncIterator[Piece],
    body: dict[str, Any],
    keep: Keep,
    finished: Finished,
    namespaced: dict[str, tuple[str, str]],
) -> AsyncIterator[str]:
    """The Responses event sequence for a streamed answer: each output item added, its content
    streamed, then done, in the order the model produced them; response.completed (or
    response.incomplete at max_output_tokens) with the whole response; response.failed with
    the failure class when the request failed after the stream began."""
    sequence = 0
    output: list[dict[str, Any]] = []  # finished items
    current: dict[str, Any] | None = None  # the item being streamed: kind, id, text, index, ...

    def event(kind: str, **fields: Any) -> str:
        nonlocal sequence
        data = {"type": kind, "sequence_number": sequence, **fields}
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def close() -> list[str]:
        nonlocal current
        if current is None:
            return []
        at, item_id, text = len(output), current["id"], current["text"]
        events = []
        if current["kind"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item = _message_item(item_id, text, "completed")
            events.append(
                event(
                    "response.output_text.done",
                    item_id=item_id,
                    output_index=at,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            )
            events.append(
                event("response.content_part.done", item_id=item_id, output_index=at, content_index=0, part=part)
            )
        elif current["kind"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item = _reasoning_item(item_id, text, "completed")
            events.append(
                event("response.reasoning_text.done", item_id=item_id, output_index=at, content_index=0, text=text)
            )
            events.append(
                event("response.content_part.done", item_id=item_id, output_index=at, content_index=0, part=part)
            )
        else:
            item = _call_item(item_id, current["call_id"], current["name"], text, "completed", namespaced)
            events.append(
                event(
                    "response.function_call_arguments.done",
                    item_id=item_id,
                    output_index=at,
                    name=item["name"],
                    arguments=text,
                )
            )
        events.append(event("response.output_item.done", output_index=at, item=item))
        output.append(item)
        current = None
        return events

    def open_item(kind: str, piece: Piece) -> list[str]:
        nonlocal current
        at = len(output)
        if kind == "message":
            item_id = _new_id("msg")
            item = _message_item(item_id, "", "added")
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        elif kind == "reasoning":
            item_id = _new_id("rs")
            item = _reasoning_item(item_id, "", "added")
            part = {"type": "reasoning_text", "text": ""}
        else:
            item_id = _new_id("fc")
            item = _call_item(item_id, piece.call_id, piece.name, "", "added", namespaced)
        current = {
            "kind": kind,
            "id": item_id,
            "text": "",
            "index": piece.index,
            "call_id": piece.call_id,
            "name": piece.name,
        }
        events = [event("response.output_item.added", output_index=at, item=item)]
        if kind != "function_call":
            events.append(
                event("response.content_part.added", item_id=item_id, output_index=at, content_index=0, part=part)
            )
        return events

    def add(kind: str, piece: Piece) -> list[str]:
        events: list[str] = []
        same_call = current is not None and current["kind"] == "function_call" and current["index"] == piece.index
        if current is None or current["kind"] != kind or (kind == "function_call" and not same_call):
            events += close()
            events += open_item(kind, piece)
        assert current is not None
        if not piece.text:
            return events
        current["text"] += piece.text
        at, item_id = len(output), current["id"]
        if kind == "message":
            events.append(
                event(
                    "response.output_text.delta",
                    item_id=item_id,
                    output_index=at,
                    content_index=0,
                    delta=piece.text,
                    logprobs=[],
                )
            )
        elif kind == "reasoning":
            events.append(
                event(
                    "response.reasoning_text.delta", item_id=item_id, output_index=at, content_index=0, delta=piece.text
                )
            )
        else:
            events.append(
                event("response.function_call_arguments.delta", item_id=item_id, output_index=at, delta=piece.text)
            )
        return events

    yield event("response.created", response=body)
    yield event("response.in_progress", response=body)
    async for piece in pieces:
        if piece.kind in ("text", "reasoning", "tool_call"):
            kind = {"text": "message", "reasoning": "reasoning", "tool_call": "function_call"}[piece.kind]
            for line in add(kind, piece):
                yield line
        elif piece.kind == "end" and piece.answer is not None:
            if not any(item["type"] in ("message", "function_call") for item in output) and (
                current is None or current["kind"] == "reasoning"
            ):
                for line in add("message", Piece("text")):  # an empty answer is still a message
                    yield line
            for line in close():
                yield line
            done = finished(body, piece.answer, output)
            keep(piece.answer, done)
            kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
            yield event(kind, response=done)
        elif piece.kind == "failed":
            for line in close():
                yield line
            code = "rate_limit_exceeded" if http_status(piece.failure) == 429 else "server_error"
            error = {"code": code, "message": piece.text, "modelforge_class": piece.failure}
            yield event("response.failed", response={**body, "status": "failed", "output": output, "error": error})
