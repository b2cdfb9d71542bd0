"""The chat path that translated surfaces share: OpenAI's Responses API (`_responses.py`) and
Anthropic's Messages API (`_anthropic.py`) turn their request into a `ChatCall` and go through
the same steps as `/v1/chat/completions` (`create_app`'s helpers: the model's deployment, the
runtime's input with its parameters taken or refused by name, one request workflow through
admission, or one streamed through the gateway's stream hub), then shape the answer their way.

What they read back is surface-neutral: a whole answer (`Answer`: text, reasoning, tool calls,
finish reason, usage), or a stream of `Piece`s (text, reasoning, a tool call's head and argument
pieces, then the end with the whole answer, or a failure with its class), so no surface parses a
node's stream records itself."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Request
from pydantic import BaseModel

from modelforge.client import Result
from modelforge.domain import Deployment
from modelforge.gateway._ollama import stream_delta
from modelforge.gateway._ollama_translate import reasoning_of
from modelforge.gateway._params import ChatCall, usage
from modelforge.gateway._streams import Stream, StreamHub, next_record, outcome

BodyOf = Callable[[Request, type[BaseModel]], Awaitable[Any]]
ChatInput = Callable[[ChatCall], Awaitable[tuple[Deployment, dict[str, Any], list[dict[str, Any]]]]]
Run = Callable[..., Awaitable[Result]]
OpenStream = Callable[..., Awaitable[tuple[Stream, "asyncio.Task[Result]", dict[str, Any] | None]]]
RequestIdOf = Callable[[Request], str]
# vLLM's `priority` or OpenAI's `service_tier` in a chat call, as the class `run` asks for.
Hint = Callable[[Request, ChatCall], Awaitable[None]]


async def _no_hint(request: Request, call: ChatCall) -> None:
    return None


@dataclass
class ToolCall:
    call_id: str
    name: str
    arguments: str  # JSON text, as OpenAI's chat carries it


@dataclass
class Answer:
    text: str
    reasoning: str
    tool_calls: list[ToolCall]
    finish_reason: str  # OpenAI's chat finish reason: stop, length, tool_calls...
    usage: dict[str, Any]  # OpenAI's counts: prompt_tokens, completion_tokens, total_tokens, estimated
    request_id: str


@dataclass
class Piece:
    """One step of a streamed answer. `text`: a piece of the answer, of its reasoning, or of a
    tool call's arguments (`index`: which call; `call_id` and `name` on its first piece)."""

    kind: Literal["text", "reasoning", "tool_call", "end", "failed"]
    text: str = ""
    index: int = 0
    call_id: str = ""
    name: str = ""
    answer: Answer | None = None  # kind "end"
    failure: str = ""  # kind "failed": the failure class (text holds the message)


def text_of(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _calls(raw: Any) -> list[ToolCall]:
    calls = []
    for n, call in enumerate(raw if isinstance(raw, list) else []):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        arguments = function.get("arguments")
        calls.append(
            ToolCall(
                call_id=str(call.get("id") or f"call_{n}"),
                name=str(function.get("name") or ""),
                arguments=arguments if isinstance(arguments, str) else json.dumps(arguments or {}),
            )
        )
    return calls


def answer_of(output: dict[str, Any], prompt: list[str], request_id: str) -> Answer:
    """A runtime's whole chat output (its first choice) as an `Answer`."""
    choices = output.get("choices")
    first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    raw = first.get("message")
    message: dict[str, Any] = raw if isinstance(raw, dict) else {}
    text = text_of(message.get("content")) if message else str(output.get("text") or "")
    finish = str(first.get("finish_reason") or output.get("finish_reason") or "stop")
    return Answer(
        text=text,
        reasoning=reasoning_of(message) or "",
        tool_calls=_calls(message.get("tool_calls")),
        finish_reason=finish,
        usage=usage(output, prompt, [text]),
        request_id=request_id,
    )


def tokens_seen(request: Request, counts: dict[str, Any]) -> None:
    # For the access log and the token metrics, as the chat route records them.
    request.state.tokens = {
        "prompt_tokens": counts.get("prompt_tokens", 0),
        "completion_tokens": counts.get("completion_tokens", 0),
        "tokens_estimated": counts.get("estimated", True),
    }


@dataclass
class Streamed:
    """A chat answer being streamed: its first record is in (a refusal before it was a plain
    HTTP error), `pieces()` reads the rest."""

    request: Request
    hub: StreamHub
    stream: Stream
    task: asyncio.Task[Result]
    first: dict[str, Any] | None
    prompt: list[str]
    request_id: str
    _texts: list[str] = field(default_factory=list)
    _began: bool = False

    def _seen(self, piece: Piece) -> Piece:
        if not self._began:
            self._began = True
            self.request.state.first_token_at = time.perf_counter()
        if piece.kind == "text":
            self._texts.append(piece.text)
        return piece

    def _end(self, finish: str, output: dict[str, Any], calls: list[ToolCall], reasoning: str) -> Piece:
        text = "".join(self._texts)
        counts = usage(output, self.prompt, [text])
        tokens_seen(self.request, counts)
        answer = Answer(text, reasoning, calls, finish, counts, self.request_id)
        return Piece("end", answer=answer)

    async def pieces(self) -> AsyncGenerator[Piece, None]:
        """The answer's pieces as the model generates them, then `end` (or `failed`: the request
        failed after it began, preempted or crashed). The stream is closed however this ends, so
        a client gone away stops the generation at the node."""
        calls: dict[int, ToolCall] = {}
        thoughts: list[str] = []
        finish = "stop"
        try:
            record = self.first
            while record is not None:
                if "finish_reason" in record and "choices" not in record and not isinstance(record.get("delta"), str):
                    reason = str(record.get("finish_reason") or finish)
                    yield self._end(reason, record, list(calls.values()), "".join(thoughts))
                    return
                text, thought, deltas = stream_delta(record)
                if thought:
                    thoughts.append(thought)
                    yield self._seen(Piece("reasoning", thought))
                if text:
                    yield self._seen(Piece("text", text))
                for delta in deltas if isinstance(deltas, list) else []:
                    if not isinstance(delta, dict):
                        continue
                    index = delta.get("index")
                    index = index if isinstance(index, int) and not isinstance(index, bool) else len(calls)
                    raw = delta.get("function")
                    function: dict[str, Any] = raw if isinstance(raw, dict) else {}
                    arguments = str(function.get("arguments") or "")
                    call = calls.get(index)
                    if call is None:
                        call = calls[index] = ToolCall(str(delta.get("id") or f"call_{index}"), "", "")
                        call.name = str(function.get("name") or "")
                        yield self._seen(Piece("tool_call", arguments, index, call.call_id, call.name))
                    elif arguments:
                        yield self._seen(Piece("tool_call", arguments, index, call.call_id, call.name))
                    call.arguments += arguments
                for choice in record.get("choices") or []:
                    if isinstance(choice, dict) and choice.get("index", 0) == 0 and choice.get("finish_reason"):
                        finish = str(choice["finish_reason"])
                record = await next_record(self.stream, self.task)
            failure, message, result = outcome(self.task)
            if failure is None:
                # Answered in one piece (a runtime without a streaming call): what was not
                # streamed yet goes out now, as pieces of the same kinds.
                output = getattr(result, "output", None) or {}
                whole = answer_of(output, self.prompt, self.request_id)
                so_far = "".join(self._texts)
                if not thoughts and whole.reasoning:
                    thoughts.append(whole.reasoning)
                    yield self._seen(Piece("reasoning", whole.reasoning))
                rest = whole.text[len(so_far) :] if whole.text.startswith(so_far) else ""
                if rest:
                    yield self._seen(Piece("text", rest))
                if not calls:
                    for index, call in enumerate(whole.tool_calls):
                        calls[index] = call
                        yield self._seen(Piece("tool_call", call.arguments, index, call.call_id, call.name))
                yield self._end(whole.finish_reason, output, list(calls.values()), "".join(thoughts))
                return
            self.request.state.failure_class = failure
            yield Piece("failed", message, failure=failure)
        finally:
            self.hub.close(self.stream)


@dataclass(frozen=True)
class ChatPath:
    """`create_app`'s helpers, as the translated surfaces use them."""

    body_of: BodyOf
    chat_input: ChatInput
    run: Run
    open_stream: OpenStream
    request_id_of: RequestIdOf
    hub: StreamHub
    hint: Hint = _no_hint

    async def _prepared(self, request: Request, call: ChatCall) -> tuple[Deployment, dict[str, Any], list[str]]:
        request.state.model = call.model
        await self.hint(request, call)  # an urgency hint counts as on the chat route
        deployment, payload, messages = await self.chat_input(call)
        request.state.capability = deployment.capability
        return deployment, payload, [text_of(m.get("content")) for m in messages]

    async def answer(self, request: Request, call: ChatCall) -> Answer:
        """The whole answer to a chat call: one request workflow, through admission."""
        deployment, payload, prompt = await self._prepared(request, call)
        request_id = self.request_id_of(request)
        result = await self.run(request, deployment.capability, payload, request_id, tenant=request.state.tenant)
        answer = answer_of(result.output or {}, prompt, result.request_id)
        tokens_seen(request, answer.usage)
        return answer

    async def streamed(self, request: Request, call: ChatCall) -> Streamed:
        """A chat call's answer as it is generated: one request workflow, through admission,
        whose first piece is in when this returns."""
        deployment, payload, prompt = await self._prepared(request, call)
        request_id = self.request_id_of(request)
        tenant = request.state.tenant
        stream, task, first = await self.open_stream(request, deployment.capability, payload, request_id, tenant)
        return Streamed(request, self.hub, stream, task, first, prompt, request_id)
