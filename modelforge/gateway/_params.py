"""OpenAI's request surface at the gateway: the bodies of /v1/chat/completions and /v1/embeddings,
which of their parameters a deployment's runtime takes, and `usage`.

A parameter is never dropped silently. A deployment served by an OpenAI-compatible model server
(`subprocess_http` with `api = "openai_chat"` or `"openai_embeddings"`: vLLM, llama.cpp's server,
text-embeddings-inference's OpenAI route) receives every parameter as given, in the request
input's `parameters` object, unknown ones included (vLLM's `top_k`, `min_p`...): the server
takes it or refuses it (400). The simulated runtime takes a chat server's sampling parameters
(its `Speaks.parameters`: temperature, top_p, max_tokens, max_completion_tokens, stop, seed,
the penalties, n, user) and says in its answer which it got (`parameters_applied`). Any other
runtime (`sentence_transformers`, TEI's `/embed`), and the simulated one for any other
parameter, takes none: a parameter given with an effect is refused with REQUEST_INVALID (400,
`unsupported_parameter`) naming it. Values that change nothing (`n: 1`, `logprobs: false`, a
penalty of 0, `response_format: {"type": "text"}`, no tools, null) are accepted everywhere.

A chat message's role is one OpenAI's chat takes (ROLES): any other is refused, named, before
it reaches a model server. An embeddings `input` may be token ids (`[1, 2, 3]` or
`[[1, 2], [3]]`, LangChain's OpenAIEmbeddings' default): they reach a server that takes them
(`openai_embeddings`); any other runtime embeds text only and refuses them, saying what to send.

`usage` holds the model server's token counts where it reported them (`estimated: false`), else
the gateway's estimate (`estimated: true`): about four characters a token, OpenAI's rule of
thumb for English, never a count of words presented as tokens."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from modelforge.domain import Deployment
from modelforge.identifiers import shown
from modelforge.runtimes import speaks

# The roles OpenAI's chat takes ("function": its older tool results).
ROLES = ("system", "user", "assistant", "tool", "developer", "function")


def role_problem(messages: list[ChatMessage]) -> tuple[str, str] | None:
    """(param, message) for the first message whose role is not one of ROLES, else None."""
    for n, message in enumerate(messages):
        if message.role not in ROLES:
            return (
                f"messages.{n}.role",
                f"messages.{n}.role: {shown(message.role)} is not a chat role (one of {', '.join(ROLES)})",
            )
    return None


# Urgency hints ModelForge maps to its classes (_hints.py) and never passes to a model server:
# vLLM's `priority` (an integer, lower is more urgent) and OpenAI's `service_tier`.
VllmPriority = Annotated[int, Field(strict=True, ge=-1_000_000, le=1_000_000)]
ServiceTier = Literal["auto", "default", "flex", "priority", "scale", "fast"]


class ChatMessage(BaseModel):
    # Fields besides role and content (name, tool_calls, tool_call_id) are kept for the server.
    model_config = ConfigDict(extra="allow")

    role: Annotated[str, Field(min_length=1, max_length=40)]
    content: str | list[dict[str, Any]] | None = None


class ChatCall(BaseModel):
    # Fields the gateway does not know are kept: parameters for the model server.
    model_config = ConfigDict(extra="allow")

    model: Annotated[str, Field(min_length=1, max_length=200)]
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1000)]
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    max_tokens: Annotated[int, Field(gt=0)] | None = None
    max_completion_tokens: Annotated[int, Field(gt=0)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    logit_bias: dict[str, float] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    priority: VllmPriority | None = None
    service_tier: ServiceTier | None = None


TokenId = Annotated[int, Field(ge=0, lt=2**32)]


class EmbeddingsCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Annotated[str, Field(min_length=1, max_length=200)]
    # Text, or token ids (one input's, or several): OpenAI's four forms.
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(gt=0)] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    priority: VllmPriority | None = None
    service_tier: ServiceTier | None = None


class CompletionCall(BaseModel):
    """/v1/completions (OpenAI's legacy text completions): the prompt as it is where the runtime
    takes raw prompts, else a one-turn chat."""

    model_config = ConfigDict(extra="allow")

    model: Annotated[str, Field(min_length=1, max_length=200)]
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    max_tokens: Annotated[int, Field(gt=0)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    priority: VllmPriority | None = None
    service_tier: ServiceTier | None = None


# A completion's own parameters: passed to an `openai_chat` server's completions route, refused,
# named, by any other runtime (`suffix` also where the model does not fill in the middle).
COMPLETION_ONLY = ("echo", "suffix", "best_of", "logprobs")

# Fields the gateway serves itself; everything else in a body is a parameter.
# (`priority` and `service_tier` are hints for ModelForge's admission: never a server's.)
CHAT_OWN = frozenset({"model", "messages", "stream", "stream_options", "priority", "service_tier"})
COMPLETION_OWN = frozenset({"model", "prompt", "stream", "stream_options", "priority", "service_tier"})
EMBEDDINGS_OWN = frozenset({"model", "input", "encoding_format", "priority", "service_tier"})


def parameters(call: BaseModel, own: frozenset[str]) -> dict[str, Any]:
    """The parameters a body gave (null ones are not given), in the order it gave them."""
    given = call.model_dump(mode="json", exclude_unset=True)
    return {name: value for name, value in given.items() if name not in own and value is not None}


def _no_effect(name: str, value: Any, given: dict[str, Any]) -> bool:
    """Whether a parameter's value changes nothing, so a runtime that takes no parameters loses
    nothing by not receiving it."""
    if name == "n":
        return bool(value == 1)
    if name in ("logprobs", "parallel_tool_calls") and value is False:
        return True
    if name in ("presence_penalty", "frequency_penalty", "top_logprobs") and value == 0:
        return True
    if name in ("stop", "tools", "logit_bias") and not value:
        return True
    if name == "response_format" and value == {"type": "text"}:
        return True
    no_tools = not given.get("tools")
    return (name == "tool_choice" and value in ("none", "auto") and no_tools) or (
        name == "parallel_tool_calls" and no_tools
    )


def takes_parameters(deployment: Deployment, api: str) -> bool:
    """Whether the deployment's runtime passes parameters to an OpenAI-compatible server
    speaking `api` (the registry's `speaks`)."""
    return speaks(deployment).api == api


def refused(given: dict[str, Any], taken: frozenset[str] = frozenset()) -> list[str]:
    """The parameters a runtime that takes only `taken` (its `Speaks.parameters`; none by
    default) would lose, in the order given."""
    return [name for name, value in given.items() if name not in taken and not _no_effect(name, value, given)]


def runtime_taken(deployment: Deployment) -> frozenset[str]:
    """The parameters a runtime with no wire API takes itself (the simulated one's sampling)."""
    return speaks(deployment).parameters


def token_ids(value: Any) -> list[list[int]] | None:
    """An embeddings `input` of token ids as a list of inputs (None: it is text)."""
    if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        return [list(value)]
    if isinstance(value, list) and value and all(isinstance(row, list) for row in value):
        return [list(row) for row in value]
    return None


def estimate_tokens(text: str) -> int:
    """About four characters a token (OpenAI's rule of thumb for English); 0 for no text."""
    return math.ceil(len(text) / 4)


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def usage(output: dict[str, Any], prompt: list[str], completion: list[str] | None) -> dict[str, Any]:
    """OpenAI's `usage` for an answer: the server's counts (the runtime's `usage`) when it
    reported them, else estimated from the texts; `estimated` says which. `completion` None: an
    embeddings answer (no completion tokens)."""
    reported = output.get("usage")
    if isinstance(reported, dict):
        prompt_tokens = _count(reported.get("prompt_tokens"))
        completion_tokens = _count(reported.get("completion_tokens", 0))
        if prompt_tokens is not None and completion_tokens is not None:
            counts: dict[str, Any] = {"prompt_tokens": prompt_tokens}
            if completion is not None:
                counts["completion_tokens"] = completion_tokens
            counts["total_tokens"] = _count(reported.get("total_tokens")) or prompt_tokens + completion_tokens
            counts["estimated"] = False
            return counts
    counts = {"prompt_tokens": sum(estimate_tokens(t) for t in prompt)}
    if completion is not None:
        counts["completion_tokens"] = sum(estimate_tokens(t) for t in completion)
    counts["total_tokens"] = counts["prompt_tokens"] + counts.get("completion_tokens", 0)
    counts["estimated"] = True
    return counts
