"""Streamed answers at the gateway: the node pushes them here (`activities/_stream_push.py`),
and the client's connection gets them as server-sent events (OpenAI) or NDJSON (Ollama).

A stream is opened before its request starts and named by a random id; the id travels to the
node in the request (`StreamTarget`), and the node's POSTs to `/internal/streams/{id}` land in
the stream's queue. When the client goes away the stream is marked gone and the node's next
POST is answered 410: the node closes the model server's stream and the generation stops, the
invoke ends and the lease is released. The internal route is not a client route: nodes sign the
stream id with MODELFORGE_STREAM_KEY (an HMAC; nothing secret is in the workflow's history), and
without a key only loopback peers may push (one host: `modelforge dev`).

Back-pressure: a stream holds at most `limit_bytes` of pushed lines that its client has not
taken yet (MODELFORGE_GATEWAY_STREAM_BUFFER_BYTES). A push that does not fit waits for the
client to read (its HTTP answer is late, so the node reads the model server no further: the
model's output waits in TCP, not here), for at most `stall_s` (MODELFORGE_GATEWAY_STREAM_STALL_S).
A client too slow for that ends with a TIMEOUT error in its stream format, its unread lines are
dropped, and the push is answered 410 as for a client gone: the node stops the generation and
the lease is released. Without the bound a client reading 64 B/s made the gateway hold the whole
answer (2.3 MiB a second) while the model generated and held its lease.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import math
import os
import secrets
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import TypeAdapter, ValidationError

from modelforge.failures import FailureClass, ModelForgeError
from modelforge.settings import Bytes
from modelforge.streaming import SIGNATURE_HEADER, message_delta, signature, stream_key

# Bytes of one push (a batch of chunks): generous for text, bounded.
MAX_PUSH_BYTES = 4 * 1024 * 1024
# A stream's unread lines, at most (MODELFORGE_GATEWAY_STREAM_BUFFER_BYTES): a minute of a fast
# model's tokens (about 150 bytes a token as pushed, 100 tokens a second) with room to spare, a
# megabyte a stream of gateway memory at worst.
DEFAULT_STREAM_BUFFER_BYTES = 1024 * 1024
# How long a push waits for room (MODELFORGE_GATEWAY_STREAM_STALL_S); below the node's 30 s
# timeout on a push's answer (activities/_stream_push.py), which it would read as a gateway gone.
DEFAULT_STREAM_STALL_S = 10.0
MAX_STREAM_STALL_S = 25.0
BUFFER_VARIABLE = "MODELFORGE_GATEWAY_STREAM_BUFFER_BYTES"
STALL_VARIABLE = "MODELFORGE_GATEWAY_STREAM_STALL_S"

_BYTES: TypeAdapter[int] = TypeAdapter(Bytes)


def stream_buffer_bytes_from_env() -> int:
    """MODELFORGE_GATEWAY_STREAM_BUFFER_BYTES (`1048576`, `1 MiB`, `512KiB`), else the default."""
    given = os.environ.get(BUFFER_VARIABLE, "").strip()
    if not given:
        return DEFAULT_STREAM_BUFFER_BYTES
    try:
        return int(_BYTES.validate_python(given))
    except ValidationError:
        raise ModelForgeError(
            FailureClass.REQUEST_INVALID, f"{BUFFER_VARIABLE} must be a positive number of bytes, not {given[:80]!r}"
        ) from None


def stream_stall_s_from_env() -> float:
    """MODELFORGE_GATEWAY_STREAM_STALL_S, else the default."""
    given = os.environ.get(STALL_VARIABLE, "").strip()
    if not given:
        return DEFAULT_STREAM_STALL_S
    try:
        return _stall_s(float(given))
    except ValueError:
        raise ModelForgeError(
            FailureClass.REQUEST_INVALID,
            f"{STALL_VARIABLE} must be a number of seconds above 0 and at most {MAX_STREAM_STALL_S:g}, "
            f"not {given[:80]!r}",
        ) from None


def _stall_s(value: float) -> float:
    if not (0 < value <= MAX_STREAM_STALL_S) or math.isnan(value):
        raise ValueError("out of range")
    return value


@dataclass
class Stream:
    stream_id: str
    # Pushed NDJSON lines not yet taken by the client's answer, parsed as they are taken: bytes
    # held are about the bytes counted (a parsed record weighs several times its line).
    queue: asyncio.Queue[bytes] = field(default_factory=asyncio.Queue)
    gone: bool = False
    chunks: int = 0
    # Bytes of the lines in `queue`, and the most they may be.
    buffered: int = 0
    limit_bytes: int = DEFAULT_STREAM_BUFFER_BYTES
    # Why the gateway ended the stream itself (failure class, message): its client read too slowly.
    failure: tuple[str, str] | None = None
    # Set when lines are taken (or the stream closes): a push waiting for room looks again.
    taken: asyncio.Event = field(default_factory=asyncio.Event)
    # Until its first piece: what its request waits on (_verdict_source.py), told to the client
    # every VERDICT_EVERY_S as a `VERDICT` record (`next_record`). None once a piece came.
    verdict: Callable[[], Awaitable[dict[str, Any] | None]] | None = None

    def fits(self, size: int) -> bool:
        # An empty stream takes any push (one larger than the bound would never fit otherwise).
        return self.buffered == 0 or self.buffered + size <= self.limit_bytes

    def drop(self) -> None:
        """Let go of every unread line: nothing will read them (memory returned at once, not
        when the last reference to the stream goes)."""
        while not self.queue.empty():
            self.queue.get_nowait()
        self.buffered = 0
        self.taken.set()


class StreamHub:
    """The open streams of this gateway process, by id. `limit_bytes`: the unread bytes a stream
    may hold; `stall_s`: how long a push waits for room before its client counts as too slow."""

    def __init__(self, limit_bytes: int = DEFAULT_STREAM_BUFFER_BYTES, stall_s: float = DEFAULT_STREAM_STALL_S) -> None:
        if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes <= 0:
            raise ModelForgeError(FailureClass.REQUEST_INVALID, f"stream buffer bytes must be positive: {limit_bytes}")
        try:
            _stall_s(float(stall_s))
        except (TypeError, ValueError):
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID,
                f"stream stall seconds must be above 0 and at most {MAX_STREAM_STALL_S:g}: {stall_s}",
            ) from None
        self.limit_bytes = limit_bytes
        self.stall_s = float(stall_s)
        self._streams: dict[str, Stream] = {}

    def open(self) -> Stream:
        stream = Stream(secrets.token_hex(16), limit_bytes=self.limit_bytes)
        self._streams[stream.stream_id] = stream
        return stream

    def close(self, stream: Stream) -> None:
        """The client is done with it (the answer ended, or the client went away): the node's
        next push is told so, one waiting for room at once."""
        stream.gone = True
        stream.drop()
        self._streams.pop(stream.stream_id, None)

    def get(self, stream_id: str) -> Stream | None:
        return self._streams.get(stream_id)

    def buffered_bytes(self) -> int:
        """Unread bytes held for every open stream."""
        return sum(stream.buffered for stream in self._streams.values())

    async def room(self, stream: Stream, size: int) -> bool:
        """Wait until `size` more bytes fit in the stream, for at most `stall_s`. False: they do
        not (the stream closed meanwhile, or its client is too slow and the stream is ended with
        a TIMEOUT for it, its unread lines dropped)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.stall_s
        while not stream.gone and not stream.fits(size):
            stream.taken.clear()
            try:
                await asyncio.wait_for(stream.taken.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                if stream.gone or stream.fits(size):
                    break
                stream.failure = (
                    FailureClass.TIMEOUT.value,
                    f"the client read the stream too slowly: {stream.buffered} bytes of the answer waited for it "
                    f"and {size} more could not be taken within {self.stall_s:g} s "
                    f"({BUFFER_VARIABLE}={stream.limit_bytes}, {STALL_VARIABLE}={self.stall_s:g}); "
                    "the generation was stopped",
                )
                stream.gone = True
                stream.drop()
                self._streams.pop(stream.stream_id, None)
                return False
        return not stream.gone

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
        lines: list[bytes] = []
        for line in body.splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                return JSONResponse({"error": "each line must be a JSON object"}, status_code=400)
            if not isinstance(record, dict):
                return JSONResponse({"error": "each line must be a JSON object"}, status_code=400)
            lines.append(line)
        del body
        # Back-pressure: the answer to this push waits while the client has not read enough.
        if not await hub.room(stream, sum(len(line) for line in lines)):
            failure = stream.failure
            return JSONResponse({"error": failure[1] if failure else "the stream's client went away"}, status_code=410)
        for line in lines:
            stream.chunks += 1
            stream.buffered += len(line)
            stream.queue.put_nowait(line)
        return JSONResponse({"chunks": stream.chunks})

    return router


# Requests whose stream the gateway ended itself, and why (failure class, message): `outcome`
# tells it as the request's, whatever the request does meanwhile (its node stops at its next push).
_ENDED: weakref.WeakKeyDictionary[asyncio.Task[Any], tuple[str, str]] = weakref.WeakKeyDictionary()


def _taken(stream: Stream, line: bytes) -> dict[str, Any]:
    stream.buffered = max(0, stream.buffered - len(line))  # 0 already when the stream was dropped
    stream.taken.set()
    record: dict[str, Any] = json.loads(line)  # checked to be an object when pushed
    return record


# A record `next_record` makes itself while a stream's request waits for its first piece: the
# request's verdict, which each stream format tells in its own way (`verdict_comment`, Ollama's
# progress line) and never as a piece of the answer.
VERDICT = "modelforge_verdict"
# How often a waiting stream's verdict is told (and how long a stream's first piece is waited for
# before its request is looked for in a queue: a refusal on admission comes sooner, and is still
# a plain HTTP error).
VERDICT_EVERY_S = 2.0


async def next_record(stream: Stream, request_task: asyncio.Task[Any]) -> dict[str, Any] | None:
    """The next pushed record, or None when the request ended first (its result then tells how:
    a failure before or during the invoke, or an answer that was not streamed) or the gateway
    ended the stream (its client read too slowly: `outcome` then says so, typed). Before the
    first piece, a stream with a `verdict` gets `{VERDICT: verdict}` every VERDICT_EVERY_S while
    its request waits in a queue."""
    while True:
        if stream.failure is not None:
            _ENDED[request_task] = stream.failure
            return None
        if not stream.queue.empty():
            stream.verdict = None
            return _taken(stream, stream.queue.get_nowait())
        getting = asyncio.ensure_future(stream.queue.get())
        try:
            await asyncio.wait(
                {getting, request_task},
                timeout=VERDICT_EVERY_S if stream.verdict is not None else None,
                return_when=asyncio.FIRST_COMPLETED,
            )
        except BaseException:
            getting.cancel()
            raise
        if not getting.done():
            getting.cancel()
        elif not getting.cancelled():
            stream.verdict = None
            return _taken(stream, getting.result())
        if request_task.done():
            # The request ended: anything pushed just before it did is still the stream's.
            return _taken(stream, stream.queue.get_nowait()) if not stream.queue.empty() else None
        asked = stream.verdict
        verdict = await asked() if asked is not None else None
        if verdict is not None and stream.verdict is not None and stream.queue.empty():
            return {VERDICT: verdict}


def verdict_comment(verdict: dict[str, Any]) -> str:
    """A verdict in a server-sent event stream: a comment line, which every SSE client (the
    openai and anthropic packages included) skips, so a client that does not know it loses
    nothing."""
    return f": verdict {json.dumps(verdict, separators=(',', ':'))}\n\n"


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
    """(failure class or None, message, result) of a finished request task, or of one whose
    stream the gateway ended (`next_record` returned None for it), finished or not."""
    ended = _ENDED.get(task)
    if ended is not None:
        return ended[0], ended[1], None
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
            if VERDICT in record:  # still waiting for its first piece: what it waits on
                yield verdict_comment(record[VERDICT])
                record = await next_record(stream, task)
                continue
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
