"""Streamed answers at the gateway: the node pushes them here (`activities/_stream_push.py`),
and the client's connection gets them as server-sent events (OpenAI) or NDJSON (Ollama).

A stream is opened before its request starts and named by a random id; the id travels to the
node in the request (`StreamTarget`), and the node's POSTs to `/internal/streams/{id}` land in
the stream's queue. When the client goes away the stream is marked gone and the node's next
POST is answered 410: the node closes the model server's stream and the generation stops, the
invoke ends and the lease is released. The internal route is not a client route: nodes sign the
stream id with MODELFORGE_STREAM_KEY (an HMAC; nothing secret is in the workflow's history), and
without a key only loopback peers may push (one host: `modelforge dev`).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from modelforge.streaming import SIGNATURE_HEADER, message_delta, signature, stream_key

# Bytes of one push (a batch of chunks): generous for text, bounded.
MAX_PUSH_BYTES = 4 * 1024 * 1024


@dataclass
class Stream:
    stream_id: str
    queue: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)
    gone: bool = False
    chunks: int = 0


class StreamHub:
    """The open streams of this gateway process, by id."""

    def __init__(self) -> None:
        self._streams: dict[str, Stream] = {}

    def open(self) -> Stream:
        stream = Stream(secrets.token_hex(16))
        self._streams[stream.stream_id] = stream
        return stream

    def close(self, stream: Stream) -> None:
        """The client is done with it (the answer ended, or the client went away): the node's
        next push is told so."""
        stream.gone = True
        self._streams.pop(stream.stream_id, None)

    def get(self, stream_id: str) -> Stream | None:
        return self._streams.get(stream_id)

    def __len__(self) -> int:
        return len(self._streams)


def _loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def stream_router(hub: StreamHub) -> APIRouter:
    router = APIRouter(include_in_schema=False)

    @router.post("/internal/streams/{stream_id}")
    async def push(stream_id: str, request: Request) -> JSONResponse:
        key = stream_key()
        if key is not None:
            presented = request.headers.get(SIGNATURE_HEADER, "")
            if not hmac.compare_digest(presented, signature(key, stream_id)):
                return JSONResponse({"error": "bad stream signature"}, status_code=403)
        elif not _loopback(request.client.host if request.client else None):
            return JSONResponse(
                {"error": "pushes from other hosts need MODELFORGE_STREAM_KEY on the gateway and the nodes"},
                status_code=403,
            )
        stream = hub.get(stream_id)
        if stream is None or stream.gone:
            return JSONResponse({"error": "the stream's client went away"}, status_code=410)
        body = b""
        async for part in request.stream():
            body += part
            if len(body) > MAX_PUSH_BYTES:
                return JSONResponse({"error": f"a push holds at most {MAX_PUSH_BYTES} bytes"}, status_code=413)
        for line in body.splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                return JSONResponse({"error": "each line must be a JSON object"}, status_code=400)
            if not isinstance(record, dict):
                return JSONResponse({"error": "each line must be a JSON object"}, status_code=400)
            stream.chunks += 1
            stream.queue.put_nowait(record)
        if stream.gone:
            return JSONResponse({"error": "the stream's client went away"}, status_code=410)
        return JSONResponse({"chunks": stream.chunks})

    return router


async def next_record(stream: Stream, request_task: asyncio.Task[Any]) -> dict[str, Any] | None:
    """The next pushed record, or None when the request ended first (its result then tells how:
    a failure before or during the invoke, or an answer that was not streamed)."""
    if not stream.queue.empty():
        return stream.queue.get_nowait()
    getting = asyncio.ensure_future(stream.queue.get())
    try:
        done, _ = await asyncio.wait({getting, request_task}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        getting.cancel()
        raise
    if getting in done:
        return getting.result()
    getting.cancel()
    # The request ended: anything pushed just before it did is still the stream's.
    return stream.queue.get_nowait() if not stream.queue.empty() else None


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def error_event(failure: str, message: str, request_id: str) -> dict[str, Any]:
    """The last event of a stream that failed after it began (OpenAI sends an `error` object
    on the stream): the class in `modelforge_class`, as in every gateway error."""
    from modelforge.gateway._errors import http_status, openai_error

    kind, code = openai_error(http_status(failure))
    return {
        "error": {
            "message": message,
            "type": kind,
            "code": code,
            "param": None,
            "modelforge_class": failure,
            "request_id": request_id,
        }
    }


def outcome(task: asyncio.Task[Any]) -> tuple[str | None, str, Any]:
    """(failure class or None, message, result) of a finished request task."""
    if task.cancelled():
        return "TIMEOUT", "the request was cancelled", None
    error = task.exception()
    if error is None:
        return None, "", task.result()
    failure = getattr(error, "failure", None)
    return (str(failure) if failure else "INTERNAL_ERROR"), str(getattr(error, "message", error))[:2000], None


def _index(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


async def chat_events(
    *,
    hub: StreamHub,
    stream: Stream,
    task: asyncio.Task[Any],
    first: dict[str, Any] | None,
    state: Any,
    completion_id: str,
    created: int,
    model: str,
    include_usage: bool,
    counts: Callable[[dict[str, Any], str], dict[str, Any]],
    request_id: str,
    text_completion: bool = False,
) -> AsyncIterator[str]:
    """OpenAI's `chat.completion.chunk` events for one stream (`text_completion` ones for
    /v1/completions), then `[DONE]`. Every choice the model server streamed passes through
    whole: its index, its delta (content, reasoning_content/reasoning, tool_calls, refusal and
    any field of the server's own), logprobs and its finish reason. A failure after the stream
    began (preemption, a crash) ends it with an error event carrying its class. The stream is
    closed however this ends: a client gone away makes the node's next push 410."""
    kind = "text_completion" if text_completion else "chat.completion.chunk"
    base = {"id": completion_id, "object": kind, "created": created, "model": model}
    texts: dict[int, list[str]] = {}  # each choice's content, for usage estimates
    seen: set[int] = {0}
    finished: set[int] = set()
    began = False

    def shaped(index: int, delta: dict[str, Any], finish: Any = None, logprobs: Any = None) -> dict[str, Any] | None:
        nonlocal began
        content = delta.get("content")
        if isinstance(content, str) and content:
            texts.setdefault(index, []).append(content)
        if not began and any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls")):
            began = True
            state.first_token_at = time.perf_counter()
        seen.add(index)
        if finish:
            finished.add(index)
        if text_completion:  # legacy completions stream text only
            if not (isinstance(content, str) and content) and not finish:
                return None
            text = content if isinstance(content, str) else ""
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish or None}
        choice: dict[str, Any] = {"index": index, "delta": delta}
        if logprobs is not None:
            choice["logprobs"] = logprobs
        choice["finish_reason"] = finish or None
        return choice

    def event(choices: list[dict[str, Any] | None], **extra: Any) -> str | None:
        kept = [c for c in choices if c is not None]
        return sse({**base, "choices": kept, **extra}) if kept else None

    def passed(record: dict[str, Any]) -> str | None:
        """One pushed record as an event: a model server's choices whole, or plain text."""
        choices = record.get("choices")
        if isinstance(choices, list):
            return event(
                [
                    shaped(
                        _index(c.get("index")),
                        dict(c["delta"]) if isinstance(c.get("delta"), dict) else {},
                        c.get("finish_reason"),
                        c.get("logprobs"),
                    )
                    for c in choices
                    if isinstance(c, dict)
                ]
            )
        delta = record.get("delta")
        return event([shaped(0, {"content": delta})]) if isinstance(delta, str) and delta else None

    def ending(finish: str, output: dict[str, Any]) -> list[str]:
        """The finish of every choice that has not had one, the usage chunk if asked, [DONE]."""
        whole = "".join(piece for index in sorted(texts) for piece in texts[index])
        usage = counts(output, whole)
        state.tokens = {
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "completion_tokens": usage.get("completion_tokens", 0),
            "tokens_estimated": usage.get("estimated", True),
        }
        extra = {"parameters_applied": output["parameters_applied"]} if output.get("parameters_applied") else {}
        events = []
        last = event([shaped(index, {}, finish) for index in sorted(seen - finished)], **extra)
        if last is not None:
            events.append(last)
        if include_usage:
            events.append(sse({**base, "choices": [], "usage": usage}))
        events.append(sse("[DONE]"))
        return events

    try:
        if not text_completion:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            yield sse({**base, "choices": [role]})
        record = first
        while record is not None:
            if "finish_reason" in record and "choices" not in record and not isinstance(record.get("delta"), str):
                for line in ending(str(record.get("finish_reason") or "stop"), record):
                    yield line
                return
            passing = passed(record)
            if passing is not None:
                yield passing
            record = await next_record(stream, task)
        failure, message, result = outcome(task)
        if failure is None:
            # Answered whole (a node that predates streaming): what was not streamed yet goes
            # out as one piece, every choice whole where the answer holds choices.
            output = getattr(result, "output", None) or {}
            answered = output.get("text")
            whole = answered if isinstance(answered, str) else ""
            so_far = "".join(texts.get(0, []))
            choices = output.get("choices")
            if not texts and isinstance(choices, list) and all(isinstance(c, dict) for c in choices):
                rest_line = event(
                    [
                        shaped(
                            _index(c.get("index", n)),
                            message_delta(c["message"]) if isinstance(c.get("message"), dict) else {},
                            c.get("finish_reason"),
                            c.get("logprobs"),
                        )
                        for n, c in enumerate(choices)
                    ]
                )
            else:
                rest = whole[len(so_far) :] if whole.startswith(so_far) else ""
                rest_line = event([shaped(0, {"content": rest})]) if rest else None
            if rest_line is not None:
                yield rest_line
            for line in ending(str(output.get("finish_reason", "stop")), output):
                yield line
            return
        state.failure_class = failure
        yield sse(error_event(failure, message, request_id))
        yield sse("[DONE]")
    finally:
        hub.close(stream)
