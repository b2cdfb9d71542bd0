"""OpenAI's own surface: `/v1/models`, `/v1/embeddings`, `/v1/chat/completions` and
`/v1/completions`, each one request workflow through admission (streamed answers through the
gateway's stream hub). `OpenAIPath.chat_input` is also how the translated surfaces (Responses,
Anthropic's Messages) build a chat, so a parameter is taken or refused alike on every surface."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from modelforge.domain import Deployment
from modelforge.failures import FailureClass
from modelforge.gateway._chat_path import BodyOf, OpenStream, RequestIdOf, Run, text_of, tokens_seen
from modelforge.gateway._context import GatewayError, _Catalog, _escaped, _invalid
from modelforge.gateway._params import (
    CHAT_OWN,
    COMPLETION_ONLY,
    COMPLETION_OWN,
    EMBEDDINGS_OWN,
    ChatCall,
    CompletionCall,
    EmbeddingsCall,
    parameters,
    refused,
    role_problem,
    runtime_taken,
    takes_parameters,
    token_ids,
    usage,
)
from modelforge.gateway._streams import StreamHub, chat_events
from modelforge.identifiers import shown
from modelforge.payloads import Float32Vectors
from modelforge.runtimes import fills_in_the_middle, speaks


@dataclass(frozen=True)
class OpenAIPath:
    """`create_app`'s shared pieces these routes use (its catalog cache, stream hub, body
    reader, admission run, ...)."""

    catalog: _Catalog
    hub: StreamHub
    body_of: BodyOf
    run: Run
    request_id_of: RequestIdOf
    open_stream: OpenStream
    hint: Callable[[Request, Any], Awaitable[None]]  # an urgency hint in the body (_hints.py)
    deployment_for_model: Callable[[str], Awaitable[Deployment]]
    refuse_parameters: Callable[[list[str], Deployment], GatewayError]

    async def chat_input(self, call: ChatCall) -> tuple[Deployment, dict[str, Any], list[dict[str, Any]]]:
        """The deployment, the runtime's input and its messages for a chat call: what
        /v1/chat/completions sends, and the routes translated to a chat (/v1/responses,
        /v1/messages) with it, so a parameter is taken or refused alike on every surface."""
        deployment = await self.deployment_for_model(call.model)
        given = parameters(call, CHAT_OWN)
        payload: dict[str, Any]
        if takes_parameters(deployment, "openai_chat"):
            # As the client sent them (content parts, tool calls, names): the server reads them.
            messages = [m.model_dump(mode="json", exclude_unset=True) for m in call.messages]
            payload = {"messages": messages}
            if given:
                payload["parameters"] = given
        else:
            taken = runtime_taken(deployment)
            if refused(given, taken):
                raise self.refuse_parameters(refused(given, taken), deployment)
            messages = plain_messages(call)
            payload = {"messages": messages}
            sampling = {name: value for name, value in given.items() if name in taken}
            if sampling:  # the simulated runtime's: it takes them and says so
                payload["parameters"] = sampling
        return deployment, payload, messages


def openai_router(path: OpenAIPath) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        known = await path.catalog.get()
        names = []
        for deployment in known.deployments:
            for name in [deployment.capability, *deployment.openai_models]:
                names.append(_model_object(name, deployment))
        return {"object": "list", "data": names}

    @router.get("/v1/models/{model:path}")
    async def model_(request: Request, model: str) -> dict[str, Any]:
        request.state.model = model
        deployment = await path.deployment_for_model(model)
        request.state.capability = deployment.capability
        return _model_object(model, deployment)

    @router.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        tenant: str = request.state.tenant
        call: EmbeddingsCall = await path.body_of(request, EmbeddingsCall)
        request.state.model = call.model
        await path.hint(request, call)
        ids = token_ids(call.input)
        texts: list[Any] = ids if ids is not None else [call.input] if isinstance(call.input, str) else list(call.input)
        if not texts or any(not t for t in texts):
            raise _invalid("input: give one or more non-empty strings or token id arrays", param="input")
        deployment = await path.deployment_for_model(call.model)
        request.state.capability = deployment.capability
        given = parameters(call, EMBEDDINGS_OWN)
        payload: dict[str, Any] = {"token_ids": ids} if ids is not None else {"texts": texts}
        if ids is not None and not takes_parameters(deployment, "openai_embeddings"):
            raise _invalid(
                f"input: token ids; {deployment.capability} (runtime {deployment.runtime}) embeds text only: send "
                "strings (LangChain's OpenAIEmbeddings sends token ids unless check_embedding_ctx_length=False), "
                "or serve the model from an OpenAI-compatible server (subprocess_http, api openai_embeddings)",
                code="invalid_value",
                param="input",
            )
        if takes_parameters(deployment, "openai_embeddings"):
            if given:
                payload["parameters"] = given
        elif refused(given):
            raise path.refuse_parameters(refused(given), deployment)
        request_id = path.request_id_of(request)
        result = await path.run(request, deployment.capability, payload, request_id, tenant=tenant)
        output = result.output or {}
        vectors = output.get("embeddings")
        if not isinstance(vectors, list) or len(vectors) != len(texts):
            raise GatewayError(
                FailureClass.INVALID_OUTPUT,
                f"{deployment.capability} returned no 'embeddings' list of {len(texts)} vectors",
                request_id=request_id,
            )
        if ids is not None:  # the ids are the tokens: counted, not estimated, if the server did not
            counts = usage(output, [], None)
            if counts["estimated"]:
                counts = {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids)), "estimated": False}
        else:
            counts = usage(output, texts, None)
        tokens_seen(request, counts)
        encoded: list[Any] = vectors
        if call.encoding_format == "base64":
            # A large answer came back as float32 bytes (modelforge/payloads.py): OpenAI's base64
            # is those bytes, row by row, with no float decoded or packed again.
            rows = vectors.row_bytes() if isinstance(vectors, Float32Vectors) else None
            if rows is not None:
                encoded = [base64.b64encode(row).decode() for row in rows]
            else:
                encoded = [_float32_base64(vector) for vector in vectors]
        body = {
            "object": "list",
            "data": [
                {"object": "embedding", "index": index, "embedding": embedding}
                for index, embedding in enumerate(encoded)
            ],
            "model": call.model,
            # The server's token counts, or estimated ("estimated": true): never words as tokens.
            "usage": counts,
        }
        # Written straight to JSON off the event loop: FastAPI's encoder walks every float (0.8 s
        # for 2,048 x 384 in "float"), and the loop serves the other requests meanwhile.
        return Response(await asyncio.to_thread(_json_bytes, body), media_type="application/json")

    @router.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        tenant: str = request.state.tenant
        call: ChatCall = await path.body_of(request, ChatCall)
        request.state.model = call.model
        await path.hint(request, call)
        problem = role_problem(call.messages)
        if problem is not None:
            raise _invalid(problem[1], code="invalid_value", param=problem[0])
        include_usage = False
        if call.stream_options is not None:
            if not call.stream:
                raise _invalid("stream_options: only with stream: true", param="stream_options")
            include_usage = bool(call.stream_options.get("include_usage"))
        deployment, payload, messages = await path.chat_input(call)
        request.state.capability = deployment.capability
        request_id = path.request_id_of(request)
        if call.stream:
            prompt_texts = [text_of(m.get("content")) for m in messages]
            return await streamed(
                path,
                request,
                deployment.capability,
                payload,
                request_id,
                tenant,
                model=call.model,
                include_usage=include_usage,
                counts=lambda output, text: usage(output, prompt_texts, [text]),
            )
        result = await path.run(request, deployment.capability, payload, request_id, tenant=tenant)
        output = result.output or {}
        text = output.get("text")
        if not isinstance(text, str):
            raise GatewayError(
                FailureClass.INVALID_OUTPUT, f"{deployment.capability} returned no 'text'", request_id=request_id
            )
        choices = output.get("choices")
        if not (isinstance(choices, list) and choices and all(isinstance(c, dict) for c in choices)):
            choices = [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": str(output.get("finish_reason", "stop")),
                }
            ]
        completions = [text_of((c.get("message") or {}).get("content")) for c in choices]
        counts = usage(output, [text_of(m.get("content")) for m in messages], completions)
        tokens_seen(request, counts)
        body = {
            "id": f"chatcmpl-{result.request_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": call.model,
            "choices": choices,
            # The server's token counts, or estimated ("estimated": true): never words as tokens.
            "usage": counts,
        }
        if output.get("parameters_applied"):  # a simulated model says what it was given
            body["parameters_applied"] = output["parameters_applied"]
        return body

    @router.post("/v1/completions")
    async def completions(request: Request) -> Any:
        """OpenAI's legacy text completions: the prompt as it is, on the model server's own
        completions route where the runtime takes raw prompts (an `openai_chat` server: its
        parameters pass whole, `echo`, `best_of` and `logprobs` too; `suffix` where the catalog
        says the model fills in the middle, `insert`; the simulated runtime takes the prompt and a
        suffix). Elsewhere a one-turn chat, which refuses a completion's own parameters."""
        tenant: str = request.state.tenant
        call: CompletionCall = await path.body_of(request, CompletionCall)
        request.state.model = call.model
        await path.hint(request, call)
        include_usage = False
        if call.stream_options is not None:
            if not call.stream:
                raise _invalid("stream_options: only with stream: true", param="stream_options")
            include_usage = bool(call.stream_options.get("include_usage"))
        prompt = call.prompt if isinstance(call.prompt, str) else call.prompt[0]
        if not prompt:
            raise _invalid("prompt: give a non-empty string", param="prompt")
        deployment = await path.deployment_for_model(call.model)
        request.state.capability = deployment.capability
        given = parameters(call, COMPLETION_OWN)
        raw = speaks(deployment).raw_prompt
        payload: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]}
        if raw:
            payload = {"prompt": prompt}
            suffix = given.pop("suffix", None)
            if suffix is not None:
                if not fills_in_the_middle(deployment):
                    raise _invalid(
                        f"suffix: {deployment.capability} does not fill in the middle (its catalog entry does not "
                        "list 'insert' in features)",
                        code="unsupported_parameter",
                        param="suffix",
                    )
                payload["suffix"] = suffix
            if call.stream and given.get("logprobs") is not None:
                raise _invalid(
                    "logprobs: a streamed completion does not carry them back yet; ask without stream",
                    code="unsupported_parameter",
                    param="logprobs",
                )
        for name in COMPLETION_ONLY:
            if name in given and not (raw and takes_parameters(deployment, "openai_chat")):
                raise _invalid(
                    f"{name}: {deployment.capability} (runtime {deployment.runtime}) cannot honour it",
                    code="unsupported_parameter",
                    param=name,
                )
        if takes_parameters(deployment, "openai_chat"):
            if given:
                payload["parameters"] = given
        else:
            taken = runtime_taken(deployment)
            if refused(given, taken):
                raise path.refuse_parameters(refused(given, taken), deployment)
            sampling = {name: value for name, value in given.items() if name in taken}
            if sampling:  # the simulated runtime's: it takes them and says so
                payload["parameters"] = sampling
        request_id = path.request_id_of(request)
        if call.stream:
            return await streamed(
                path,
                request,
                deployment.capability,
                payload,
                request_id,
                tenant,
                model=call.model,
                include_usage=include_usage,
                counts=lambda output, text: usage(output, [prompt], [text]),
                text_completion=True,
            )
        result = await path.run(request, deployment.capability, payload, request_id, tenant=tenant)
        output = result.output or {}
        text = output.get("text")
        if not isinstance(text, str):
            raise GatewayError(
                FailureClass.INVALID_OUTPUT, f"{deployment.capability} returned no 'text'", request_id=request_id
            )
        choices = output.get("choices")
        if isinstance(choices, list) and choices and all(isinstance(c, dict) for c in choices):
            texts = [text_of((c.get("message") or {}).get("content")) for c in choices]
            finishes = [str(c.get("finish_reason") or "stop") for c in choices]
            logprobs = [c.get("logprobs") for c in choices]  # the server's, as it gave them
        else:
            texts, finishes = [text], [str(output.get("finish_reason", "stop"))]
            logprobs = [None]
        counts = usage(output, [prompt], texts)
        tokens_seen(request, counts)
        applied = {"parameters_applied": output["parameters_applied"]} if output.get("parameters_applied") else {}
        return {
            **applied,
            "id": f"cmpl-{result.request_id}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": call.model,
            "choices": [
                {"index": n, "text": t, "logprobs": lp, "finish_reason": f}
                for n, (t, f, lp) in enumerate(zip(texts, finishes, logprobs, strict=True))
            ],
            "usage": counts,
        }

    return router


async def streamed(
    path: OpenAIPath,
    request: Request,
    capability: str,
    payload: dict[str, Any],
    request_id: str,
    tenant: str,
    *,
    model: str,
    include_usage: bool,
    counts: Callable[[dict[str, Any], str], dict[str, Any]],
    text_completion: bool = False,
) -> StreamingResponse:
    """A streamed chat answer as OpenAI's server-sent events."""
    stream, task, first = await path.open_stream(request, capability, payload, request_id, tenant)
    events = chat_events(
        hub=path.hub,
        stream=stream,
        task=task,
        first=first,
        state=request.state,
        completion_id=f"{'cmpl' if text_completion else 'chatcmpl'}-{request_id}",
        created=int(time.time()),
        model=model,
        include_usage=include_usage,
        counts=counts,
        request_id=request_id,
        text_completion=text_completion,
    )
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def plain_messages(call: ChatCall) -> list[dict[str, Any]]:
    """The messages as role and text, for a runtime that takes nothing else: a part or field
    it would lose (an image, a tool call) is refused, named."""
    messages = []
    for n, message in enumerate(call.messages):
        extra = sorted(message.model_extra or {})
        if extra:
            where = f"messages.{n}.{_escaped(extra[0], 40)}"
            raise _invalid(
                f"{where}: this model takes role and content only", code="unsupported_parameter", param=where
            )
        content = message.content
        if isinstance(content, list):  # content parts: text ones only
            for m, part in enumerate(content):
                if part.get("type") != "text":
                    where = f"messages.{n}.content.{m}"
                    raise _invalid(
                        f"{where}: this model takes text parts only, not {shown(str(part.get('type')))}",
                        code="unsupported_parameter",
                        param=where,
                    )
            content = "".join(str(part.get("text", "")) for part in content)
        messages.append({"role": message.role, "content": content or ""})
    return messages


def _model_object(name: str, deployment: Deployment) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "modelforge", "capability": deployment.capability}


def _float32_base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def _json_bytes(body: dict[str, Any]) -> bytes:
    """`body` as JSONResponse writes it (no NaN or infinity: those are not JSON)."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
