"""A streamed answer, pushed from the node to the gateway as the model generates it.

Why a direct push and not the SDK's workflow streams: `bench/stream_paths.py` measured both on
one dev server (100 tokens at 100 a second): through `temporalio.contrib.workflow_streams` the
first token took 17.7 ms and the last 134 ms after it was generated (the signal-per-flush and
long-poll-update path falls behind the model), and the request's history gained 444 events;
pushed straight over one chunked HTTP request, 1.1 ms and 0.4 ms, and 11 events. The workflow
still owns the lease: it holds it for the whole invoke, and the node pushes only while the invoke
activity runs.

The wire: `POST {target.url}/{stream_id}` with NDJSON bodies, one object a line:
`{"delta": "..."}` for plain text of the first choice; `{"choices": [{"index", "delta",
"logprobs"?, "finish_reason"?}], "delta"?: "..."}` for anything more, the model server's choices
whole (reasoning, tool calls, logprobs, `n` choices; for readers of the first choice only,
`delta` holds its text and `choice_delta` its delta merged); then `{"finish_reason": ...,
"usage": {...}}` at the end; a POST carries what was generated while the previous one
travelled. When the gateway's client has gone away it answers 410, and the generation is
cancelled at the model server (its HTTP stream is closed): no GPU time is spent for nobody. The
key (MODELFORGE_STREAM_KEY, by reference like every secret) signs the stream id, so nothing
secret is in the workflow's history.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import weakref
from collections.abc import AsyncIterator
from typing import Any

import httpx

from modelforge.failures import FailureClass, ModelForgeError
from modelforge.messages import StreamTarget
from modelforge.streaming import (
    SIGNATURE_HEADER,
    ChoiceAssembler,
    first_choice_delta,
    message_delta,
    signature,
    stream_key,
)


async def push(target: StreamTarget, chunks: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    """Push the chunks to the gateway as they come; returns the whole answer in the runtime's
    output shape (`text`, `finish_reason`, `usage`, and `choices` put back together when the
    stream held more than the first choice's text), with `client_gone` when the client left.

    Each POST carries what the model generated while the previous one was on its way (one
    chunk when the model is slower than the network, several when it is faster), so reading the
    model never waits on the gateway; the answer to each (410: the client left) stops the
    generation within one chunk. The chunk iterator is closed on every exit."""
    text: list[str] = []
    assembled = ChoiceAssembler()
    final: dict[str, Any] = {"finish_reason": "stop", "usage": None}
    # NDJSON lines not sent yet, and their bytes (JSON is ASCII here: characters are bytes).
    outbox: list[str] = []
    outbox_bytes = 0
    wake = asyncio.Event()
    taken = asyncio.Event()  # the sender took the outbox: there is room again
    finished = False
    gone: list[str] = []  # why, once the gateway said its client left (or cannot be reached)

    headers = {"Content-Type": "application/x-ndjson"}
    key = stream_key()
    if key is not None:
        headers[SIGNATURE_HEADER] = signature(key, target.stream_id)
    url = f"{target.url.rstrip('/')}/{target.stream_id}"

    async def send(http: httpx.AsyncClient) -> None:
        nonlocal outbox_bytes
        while True:
            await wake.wait()
            wake.clear()
            while outbox:
                body = "".join(outbox)
                del outbox[:]
                outbox_bytes = 0
                taken.set()
                try:
                    response = await http.post(url, content=body, headers=headers)
                except (httpx.HTTPError, OSError) as error:  # the gateway is gone, and its client with it
                    gone.append(f"{type(error).__name__}: {error}")
                    return
                if response.status_code == 410:  # the client left, or read too slowly (the gateway says)
                    gone.append(_said(response) or "the client went away")
                    return
                if response.status_code >= 400:
                    raise ModelForgeError(
                        FailureClass.REQUEST_INVALID,
                        f"the gateway refused the stream ({response.status_code}): {response.text[:200]}",
                    )
            if finished:
                return

    def put(record: dict[str, Any]) -> None:
        nonlocal outbox_bytes
        line = json.dumps(record) + "\n"
        outbox.append(line)
        outbox_bytes += len(line)
        wake.set()

    async def room() -> None:
        """Read the model no further ahead of the gateway than OUTBOX_BYTES: while the gateway
        delays its answer to a push (its client reads slowly), the model server's stream waits
        in TCP rather than here."""
        while outbox_bytes >= OUTBOX_BYTES and not sender.done():
            taken.clear()
            waiting = asyncio.ensure_future(taken.wait())
            try:
                await asyncio.wait({waiting, sender}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiting.cancel()

    http = _http()
    sender = asyncio.create_task(send(http))
    try:
        async for chunk in chunks:
            if sender.done():
                break
            delta = chunk.get("delta")
            choices = chunk.get("choices")
            if isinstance(choices, list):
                for choice in choices:
                    if isinstance(choice, dict):
                        assembled.add(choice)
                if isinstance(delta, str):
                    text.append(delta)
                record: dict[str, Any] = {"choices": choices}
                if isinstance(delta, str) and delta:
                    record["delta"] = delta
                first = first_choice_delta(choices)
                if first is not None:
                    record["choice_delta"] = first
                put(record)
                await room()
            elif isinstance(delta, str):
                text.append(delta)
                assembled.text(delta)
                put({"delta": delta})
                await room()
            else:
                final.update({k: v for k, v in chunk.items() if k in _FINAL and v is not None})
        if not sender.done():
            put(dict(final))
            finished = True
        await sender
    finally:
        if not sender.done():
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender
        await _close(chunks)
    output = _output(text, final, client_gone=bool(gone), detail=gone[0] if gone else "")
    if assembled.rich:
        output["choices"] = assembled.choices(str(final.get("finish_reason") or "stop"))
        output["finish_reason"] = assembled.finish_of(0) or output["finish_reason"]
        if gone:
            for choice in output["choices"]:
                choice["finish_reason"] = "client_gone"
    return output


# What the end record may carry (the simulated runtime says which parameters it took).
_FINAL = ("finish_reason", "usage", "parameters_applied")
# Bytes generated but not yet pushed that the node holds, at most (and one record more): also
# what one push carries at most, well under the gateway's 4 MiB a push and its stream buffer.
OUTBOX_BYTES = 64 * 1024


def _said(response: httpx.Response) -> str:
    """The gateway's reason in a refusal's body (`error`), if it gave one."""
    try:
        said = response.json().get("error")
    except (ValueError, AttributeError):
        return ""
    return said[:300] if isinstance(said, str) else ""


# One HTTP client per event loop for every stream of this node: making an httpx client loads the
# CA certificates (about 30 to 50 ms of event loop each time, measured), which every streamed
# answer paid before its first token; kept, it also keeps its connections to the gateway open.
_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = weakref.WeakKeyDictionary()


def _http() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    client = _CLIENTS.get(loop)
    if client is None or client.is_closed:
        client = httpx.AsyncClient(timeout=httpx.Timeout(30.0), trust_env=False)
        _CLIENTS[loop] = client
    return client


async def _close(chunks: AsyncIterator[dict[str, Any]]) -> None:
    """Close the runtime's iterator: a model server's HTTP stream closed is its generation
    cancelled. Safe to call twice."""
    closer = getattr(chunks, "aclose", None)
    if closer is not None:
        with contextlib.suppress(Exception):
            await closer()


def _output(text: list[str], final: dict[str, Any], client_gone: bool, detail: str = "") -> dict[str, Any]:
    output: dict[str, Any] = {
        "text": "".join(text),
        "finish_reason": final.get("finish_reason", "stop"),
        "streamed": True,
    }
    if final.get("usage"):
        output["usage"] = final["usage"]
    if final.get("parameters_applied"):
        output["parameters_applied"] = final["parameters_applied"]
    if client_gone:
        output["finish_reason"] = "client_gone"
        output["client_gone"] = True
        if detail:
            output["detail"] = detail[:300]
    return output


async def single_chunk(output: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """A runtime without a streaming call: its whole answer as one chunk (honest: one delta),
    every choice whole (tool calls, reasoning, logprobs) where it answered `choices`."""
    text = output.get("text")
    choices = output.get("choices")
    if isinstance(choices, list) and choices and all(isinstance(c, dict) for c in choices):
        record: dict[str, Any] = {"choices": [_as_delta(n, c) for n, c in enumerate(choices)]}
        if isinstance(text, str) and text:
            record["delta"] = text
        yield record
    elif isinstance(text, str):
        yield {"delta": text}
    end = {k: output.get(k) for k in _FINAL}
    end["finish_reason"] = output.get("finish_reason", "stop")
    yield end


def _as_delta(n: int, choice: dict[str, Any]) -> dict[str, Any]:
    message = choice.get("message")
    shaped: dict[str, Any] = {
        "index": choice.get("index", n),
        "delta": message_delta(message) if isinstance(message, dict) else {},
    }
    if choice.get("logprobs") is not None:
        shaped["logprobs"] = choice["logprobs"]
    if choice.get("finish_reason"):
        shaped["finish_reason"] = choice["finish_reason"]
    return shaped
