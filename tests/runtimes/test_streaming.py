"""Streamed answers at the runtimes and the node: the toy model server streams OpenAI's chunks,
the subprocess_http runtime passes them on as they come, a client that goes away stops the
generation at the server, and the node pushes the stream to the gateway's endpoint."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from activities import _stream_push as stream_push
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.messages import StreamTarget
from modelforge.runtimes import SubprocessHttpRuntime
from tests.asgi_server import serve_app
from tests.runtimes.toy_servers import devices, info, loaded, quiet, toy

HELLO = {"messages": [{"role": "user", "content": "hello there, how are you today"}]}


async def _streams(runtime: SubprocessHttpRuntime, model: Any) -> list[dict[str, Any]]:
    answer = await runtime._servers[model.resident_key].client.get("/streams")
    streams: list[dict[str, Any]] = answer.json()["streams"]
    return streams


async def test_a_streamed_chat_answer_comes_in_pieces_equal_to_the_whole(tmp_path: Path) -> None:
    runtime = SubprocessHttpRuntime(devices(), tmp_path)
    model = await loaded(runtime, toy("--token-delay-ms", "5", api="openai_chat"))
    try:
        whole = await runtime.invoke(model, HELLO, quiet)
        chunks = [chunk async for chunk in runtime.invoke_stream(model, HELLO, quiet)]
        deltas = [c["delta"] for c in chunks if "delta" in c]
        assert len(deltas) > 3
        assert "".join(deltas) == whole["text"]
        assert chunks[-1] == {"finish_reason": "stop", "usage": whole["usage"]}
        # Several choices stream too: each by its index, the first's text also as plain `delta`.
        several = [c async for c in runtime.invoke_stream(model, {**HELLO, "parameters": {"n": 2}}, quiet)]
        second = [
            choice["delta"].get("content") or ""
            for c in several
            for choice in c.get("choices", [])
            if choice["index"] == 1
        ]
        assert "".join(second) == whole["text"]
        assert "".join(c.get("delta") or "" for c in several[:-1]) == whole["text"]
        with pytest.raises(ModelForgeError) as refused:  # what is the gateway's own is not a parameter
            _ = [c async for c in runtime.invoke_stream(model, {**HELLO, "parameters": {"stream": False}}, quiet)]
        assert refused.value.failure == FailureClass.REQUEST_INVALID and "stream" in refused.value.message
    finally:
        await runtime.unload(model)


async def test_a_raw_prompt_and_a_suffix_go_to_the_completions_route_whole_and_streamed(tmp_path: Path) -> None:
    """An input with a `prompt` and no `messages` (Ollama's `raw` prompt, code completion's
    fill-in-the-middle `suffix`) goes to the server's /v1/completions as it is, no chat template;
    its answer, whole or streamed, comes back in the chat answer's shape."""
    runtime = SubprocessHttpRuntime(devices(), tmp_path)
    model = await loaded(runtime, toy("--token-delay-ms", "2", api="openai_chat"))
    fim = {"prompt": "def add(a, b):\n    ", "suffix": "\nprint(add(1, 2))", "parameters": {"max_tokens": 64}}
    try:
        whole = await runtime.invoke(model, fim, quiet)
        assert whole["text"].startswith("[toy server] fills in after") and "print(add(1, 2))" in whole["text"]
        assert whole["finish_reason"] == "stop" and whole["usage"]["completion_tokens"] > 0
        received = (await runtime._servers[model.resident_key].client.get("/received")).json()["requests"][-1]
        assert received["path"] == "/v1/completions" and "messages" not in received["body"]
        assert (received["body"]["prompt"], received["body"]["suffix"]) == (fim["prompt"], fim["suffix"])
        chunks = [chunk async for chunk in runtime.invoke_stream(model, fim, quiet)]
        assert len(chunks) > 3 and "".join(c.get("delta") or "" for c in chunks) == whole["text"]
        assert chunks[-1] == {"finish_reason": "stop", "usage": whole["usage"]}
        cut = await runtime.invoke(model, {"prompt": "<PRE> x <SUF>", "parameters": {"max_tokens": 2}}, quiet)
        assert cut["finish_reason"] == "length" and cut["text"] == "[toy"
        for bad in ({"prompt": 3}, {"prompt": "", "suffix": None}, {"prompt": "x", "suffix": ["y"]}):
            with pytest.raises(ModelForgeError) as refused:
                await runtime.invoke(model, bad, quiet)
            assert refused.value.failure == FailureClass.REQUEST_INVALID
        with pytest.raises(ModelForgeError) as refused:  # what ModelForge fills is not a parameter
            await runtime.invoke(model, {"prompt": "x", "parameters": {"suffix": "y"}}, quiet)
        assert "suffix" in refused.value.message
    finally:
        await runtime.unload(model)


async def test_tool_calls_reasoning_logprobs_and_choices_stream_whole_and_add_up_to_the_answer(
    tmp_path: Path,
) -> None:
    """What a server streams beyond text (a reasoning model's thinking, tool calls in pieces,
    logprobs, a second choice) reaches the gateway whole, and the node's result puts it back
    together as the server's own non-streamed answer."""
    runtime = SubprocessHttpRuntime(devices(), tmp_path)
    model = await loaded(runtime, toy("--token-delay-ms", "1", "--reasoning", api="openai_chat"))
    received: list[dict[str, Any]] = []
    server, task, port = await serve_app(_gateway_stand_in(received, None))
    tools = [{"type": "function", "function": {"name": name}} for name in ("lookup", "weather")]
    asks = {
        "tools": {
            "messages": [{"role": "user", "content": "lookup and weather for Paris"}],
            "parameters": {"tools": tools},
        },
        "text": {**HELLO, "parameters": {"n": 2, "logprobs": True}},
    }
    try:
        for n, (kind, ask) in enumerate(asks.items()):
            target = StreamTarget(url=f"http://127.0.0.1:{port}/internal/streams", stream_id=f"s{n}")
            del received[:]
            output = await stream_push.push(target, runtime.invoke_stream(model, ask, quiet))
            whole = await runtime.invoke(model, ask, quiet)
            assert output["choices"] == whole["choices"], kind
            assert output["finish_reason"] == whole["finish_reason"] == ("tool_calls" if kind == "tools" else "stop")
            pushed = [c for r in received for c in r.get("choices", [])]
            reasoning = [c for c in pushed if c["delta"].get("reasoning_content")]
            assert len(reasoning) > 3 and {c["index"] for c in reasoning} == ({0} if kind == "tools" else {0, 1})
            # Readers of the first choice only (the Ollama routes) find its delta merged.
            assert any("reasoning_content" in (r.get("choice_delta") or {}) for r in received)
            if kind == "tools":
                calls = [t for c in pushed for t in c["delta"].get("tool_calls", [])]
                assert [t["function"]["name"] for t in calls if "id" in t] == ["lookup", "weather"]
                assert len(calls) > 4  # the names, then the arguments in pieces
            else:
                assert all(c.get("logprobs") for c in pushed if c["delta"].get("content"))
                assert {c["index"] for c in pushed if c.get("finish_reason")} == {1}  # the first's ends the stream
                assert received[-1]["finish_reason"] == "stop"
    finally:
        server.should_exit = True
        await task
        await runtime.unload(model)


async def test_closing_the_stream_stops_the_generation_at_the_server(tmp_path: Path) -> None:
    runtime = SubprocessHttpRuntime(devices(), tmp_path)
    model = await loaded(runtime, toy("--token-delay-ms", "100", api="openai_chat"))
    try:
        stream = runtime.invoke_stream(model, HELLO, quiet)
        first = await anext(stream)
        assert "delta" in first
        await stream.aclose()  # what the node does when the gateway's client went away
        await asyncio.sleep(0.5)
        [record] = await _streams(runtime, model)
        assert record["aborted"] and not record["done"]
        assert record["sent"] < record["pieces"]
    finally:
        await runtime.unload(model)
    assert info is not None


def _gateway_stand_in(received: list[dict[str, Any]], hang_up_after: int | None) -> FastAPI:
    app = FastAPI()

    @app.post("/internal/streams/{stream_id}")
    async def receive(stream_id: str, request: Request) -> JSONResponse:
        if hang_up_after is not None and len(received) >= hang_up_after:
            return JSONResponse({"gone": True}, status_code=410)
        for line in (await request.body()).splitlines():
            received.append(json.loads(line))
        return JSONResponse({"received": len(received)})

    return app


@pytest.mark.parametrize("hang_up_after", [None, 2])
async def test_the_node_pushes_the_stream_and_stops_when_the_gateway_hangs_up(
    tmp_path: Path, hang_up_after: int | None
) -> None:
    runtime = SubprocessHttpRuntime(devices(), tmp_path)
    model = await loaded(runtime, toy("--token-delay-ms", "50", api="openai_chat"))
    received: list[dict[str, Any]] = []
    server, task, port = await serve_app(_gateway_stand_in(received, hang_up_after))
    try:
        target = StreamTarget(url=f"http://127.0.0.1:{port}/internal/streams", stream_id="s1")
        output = await stream_push.push(target, runtime.invoke_stream(model, HELLO, quiet))
        await asyncio.sleep(0.5)
        [record] = await _streams(runtime, model)
        if hang_up_after is None:
            whole = await runtime.invoke(model, HELLO, quiet)
            assert output["text"] == whole["text"] and output["usage"] == whole["usage"]
            assert received[-1]["finish_reason"] == "stop"
            assert "".join(r["delta"] for r in received if "delta" in r) == whole["text"]
            assert record["done"]
        else:
            # The gateway's client left: the node stops reading, and the server stops generating.
            assert output["client_gone"] and output["finish_reason"] == "client_gone"
            assert record["aborted"] and record["sent"] < record["pieces"]
    finally:
        server.should_exit = True
        await task
        await runtime.unload(model)


async def test_the_node_reads_the_model_no_further_ahead_than_its_bound_while_the_gateway_waits() -> None:
    """While the gateway delays its answer to a push (its client reads
    slowly), the node read the model on into an unbounded outbox. Now it holds at most
    OUTBOX_BYTES unsent (and one record): the model's stream waits, and resumes when answered."""
    pulled = [0]
    record_bytes = len(json.dumps({"delta": "x" * 100})) + 1

    async def fast_model() -> AsyncIterator[dict[str, Any]]:
        for n in range(20_000):  # 2.3 MB of records, as fast as they can be read
            pulled[0] += 1
            yield {"delta": "x" * 100}
            if n % 50 == 0:
                await asyncio.sleep(0)  # as a socket read would, now and then
        yield {"finish_reason": "stop"}

    received: list[dict[str, Any]] = []
    held = asyncio.Event()
    release = asyncio.Event()
    app = FastAPI()

    @app.post("/internal/streams/{stream_id}")
    async def receive(stream_id: str, request: Request) -> JSONResponse:
        body = await request.body()
        if not held.is_set():  # the first push waits for the client, as a full stream's does
            held.set()
            await release.wait()
        received.extend(json.loads(line) for line in body.splitlines())
        return JSONResponse({"chunks": len(received)})

    server, task, port = await serve_app(app)
    target = StreamTarget(url=f"http://127.0.0.1:{port}/internal/streams", stream_id="s1")
    pushing = asyncio.create_task(stream_push.push(target, fast_model()))
    try:
        await held.wait()
        await asyncio.sleep(0.5)
        unsent = (pulled[0] - len(received)) * record_bytes
        # One push in flight and one bound's worth waiting (each a record past the bound at most).
        bound = 2 * (stream_push.OUTBOX_BYTES + record_bytes) + record_bytes
        assert unsent <= bound, f"{unsent} bytes read from the model and not pushed"
        release.set()
        output = await asyncio.wait_for(pushing, timeout=60)
        assert output["text"] == "x" * 100 * 20_000 and not output.get("client_gone")
        assert "".join(r.get("delta", "") for r in received) == output["text"]
        assert received[-1]["finish_reason"] == "stop"
    finally:
        release.set()  # a held push would keep the server from stopping
        pushing.cancel()
        server.should_exit = True
        await task


async def test_a_node_waiting_for_room_stops_the_model_when_the_gateway_ends_the_stream() -> None:
    closed = asyncio.Event()

    async def fast_model() -> AsyncIterator[dict[str, Any]]:
        try:
            for n in range(1_000_000):
                yield {"delta": "x" * 100}
                if n % 50 == 0:
                    await asyncio.sleep(0)
        finally:
            closed.set()  # the model server's stream closed: its generation cancelled

    app = FastAPI()
    pushes = [0]

    @app.post("/internal/streams/{stream_id}")
    async def receive(stream_id: str, request: Request) -> JSONResponse:
        pushes[0] += 1
        if pushes[0] == 1:
            return JSONResponse({"chunks": 1})
        await asyncio.sleep(0.3)  # the stall, then: the client reads too slowly
        return JSONResponse({"error": "the client read the stream too slowly"}, status_code=410)

    server, task, port = await serve_app(app)
    try:
        target = StreamTarget(url=f"http://127.0.0.1:{port}/internal/streams", stream_id="s1")
        output = await asyncio.wait_for(stream_push.push(target, fast_model()), timeout=30)
        assert len(output["text"]) <= 3 * stream_push.OUTBOX_BYTES  # read no further than its bound
        assert output["client_gone"] and output["finish_reason"] == "client_gone"
        assert "too slowly" in output["detail"] and closed.is_set()  # the gateway's reason, told
    finally:
        server.should_exit = True
        await task
