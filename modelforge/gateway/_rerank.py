"""Reranking at the gateway: `POST /v1/rerank`, `/rerank` and `/v2/rerank`, the Cohere/Jina-style
API that vLLM, llama.cpp's server, TEI-compatible servers and llama-swap serve, and that Open
WebUI's external reranker calls.

Request: `{model, query, documents: [str | {text}], top_n?, return_documents?}` (and vLLM's
`priority` or OpenAI's `service_tier` as on the other routes: `_hints.py`). Answer: `{id, model,
results: [{index, relevance_score, document?: {text}}], usage}`, highest score first, cut to
`top_n`; `document` unless `return_documents: false` (vLLM and Jina return it by default).

Each call is one request workflow through `create_app`'s `run`, admitted like any request. The
deployment must be a reranker (the registry's `speaks(...).answers` holds "scores"):
`subprocess_http` with `runtime_config.api = "rerank"` (the request goes to the server's
`/v1/rerank`, other body fields with it as parameters, which the server takes or refuses) or
`sentence_transformers` with `runtime_config.task = "rerank"` (a cross-encoder from a local model
directory; it takes no other field: one that would change the answer is refused by name). Any
other deployment answers 400 saying why, before any workflow starts."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from modelforge.client import Result
from modelforge.domain import Deployment
from modelforge.failures import FailureClass
from modelforge.gateway import _context
from modelforge.gateway._params import ServiceTier, VllmPriority, parameters, refused, takes_parameters, usage
from modelforge.identifiers import shown
from modelforge.runtimes import speaks
from modelforge.runtimes._http_api import MAX_DOCUMENTS

RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")


class RerankCall(BaseModel):
    # Fields the gateway does not know are kept: parameters for a reranking server.
    model_config = ConfigDict(extra="allow")

    model: Annotated[str, Field(min_length=1, max_length=200)]
    query: Annotated[str, Field(min_length=1)]
    # Strings, or objects with `text` as Cohere's v1 and Jina's APIs also take them (other fields
    # of such an object are the client's own metadata, not sent to the model).
    documents: Annotated[list[str | dict[str, Any]], Field(min_length=1, max_length=MAX_DOCUMENTS)]
    top_n: Annotated[int, Field(ge=1)] | None = None
    return_documents: bool | None = None
    priority: VllmPriority | None = None
    service_tier: ServiceTier | None = None


RERANK_OWN = frozenset({"model", "query", "documents", "top_n", "return_documents", "priority", "service_tier"})

DeploymentFor = Callable[[str], Awaitable[Deployment]]
BodyOf = Callable[[Request, type[BaseModel]], Awaitable[Any]]
Run = Callable[..., Awaitable[Result]]
RequestIdOf = Callable[[Request], str]
HintPriority = Callable[[Request, Any], Awaitable[None]]


def not_a_reranker(model: str, deployment: Deployment) -> _context.GatewayError:
    what = " and ".join(sorted(speaks(deployment).answers)) or "nothing"
    api = deployment.runtime_config.get("api", "")
    runtime = deployment.runtime + (f" with api {api!r}" if api else "")
    return _context._invalid(
        f"model {shown(model)} ({deployment.capability}, runtime {runtime}) cannot rerank: it answers {what}. A "
        "reranker is a deployment with runtime subprocess_http and runtime_config api = 'rerank' (a server's "
        "/v1/rerank: vLLM, llama.cpp, TEI) or sentence_transformers with task = 'rerank' (a cross-encoder)",
        code="invalid_value",
        param="model",
    )


def _results(output: dict[str, Any], count: int, capability: str, request_id: str) -> list[tuple[int, float]]:
    """(index, score) of every result the runtime gave, highest first; INVALID_OUTPUT otherwise."""
    rows = output.get("results")
    found: list[tuple[int, float]] = []
    for row in rows if isinstance(rows, list) else [None]:
        index = row.get("index") if isinstance(row, dict) else None
        score = row.get("relevance_score") if isinstance(row, dict) else None
        if (
            isinstance(index, bool)
            or not isinstance(index, int)
            or not 0 <= index < count
            or isinstance(score, bool)
            or not isinstance(score, int | float)
        ):
            raise _context.GatewayError(
                FailureClass.INVALID_OUTPUT,
                f"{capability} returned no 'results' list of document indexes and scores",
                request_id=request_id,
            )
        found.append((index, float(score)))
    return sorted(found, key=lambda pair: (-pair[1], pair[0]))


def rerank_router(
    deployment_for_model: DeploymentFor, body_of: BodyOf, run: Run, request_id_of: RequestIdOf, hint: HintPriority
) -> APIRouter:
    """The rerank routes on `create_app`'s helpers (its model lookup, body reader, `run`, request
    id and priority hint); included into its authenticated router."""
    router = APIRouter()

    async def rerank(request: Request) -> dict[str, Any]:
        tenant: str = request.state.tenant
        call: RerankCall = await body_of(request, RerankCall)
        request.state.model = call.model
        await hint(request, call)
        deployment = await deployment_for_model(call.model)
        request.state.capability = deployment.capability
        if "scores" not in speaks(deployment).answers:
            raise not_a_reranker(call.model, deployment)
        texts: list[str] = []
        for n, document in enumerate(call.documents):
            text = document if isinstance(document, str) else document.get("text")
            if not isinstance(text, str):
                raise _context._invalid(
                    f"documents.{n}: a document is a string or an object with 'text' (a string)",
                    code="invalid_value",
                    param=f"documents.{n}",
                )
            texts.append(text)
        payload: dict[str, Any] = {"query": call.query, "documents": texts}
        if call.top_n is not None:
            payload["top_n"] = call.top_n
        given = parameters(call, RERANK_OWN)
        if takes_parameters(deployment, "rerank"):
            if given:
                payload["parameters"] = given
        elif refused(given):
            names = refused(given)
            raise _context._invalid(
                f"{', '.join(_context._escaped(n, 60) for n in names[:10])}: {deployment.capability} (runtime "
                f"{deployment.runtime}) takes model, query, documents, top_n and return_documents only; leave them "
                f"out, or serve the model from a reranking server (subprocess_http with api 'rerank')",
                code="unsupported_parameter",
                param=_context._escaped(names[0], 60),
            )
        request_id = request_id_of(request)
        result = await run(request, deployment.capability, payload, request_id, tenant=tenant)
        output = result.output or {}
        ranked = _results(output, len(texts), deployment.capability, request_id)[: call.top_n]
        counts = usage(output, [call.query, *texts], None)
        request.state.tokens = {
            "prompt_tokens": counts.get("prompt_tokens", 0),
            "completion_tokens": 0,
            "tokens_estimated": counts.get("estimated", True),
        }
        with_documents = call.return_documents is not False
        return {
            "id": f"rerank-{result.request_id}",
            "model": call.model,
            "results": [
                {
                    "index": index,
                    "relevance_score": score,
                    **({"document": {"text": texts[index]}} if with_documents else {}),
                }
                for index, score in ranked
            ],
            "usage": counts,
        }

    for path in RERANK_PATHS:
        router.add_api_route(path, rerank, methods=["POST"])
    return router
