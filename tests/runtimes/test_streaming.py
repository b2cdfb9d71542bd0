"""Streamed answers at the runtimes and the node: the toy model server streams OpenAI's chunks,
the subprocess_http runtime passes them on as they come, a client that goes away stops the
generation at the server, and the node pushes the stream to the gateway's endpoint."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from activities import _stream_push as stream_push
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.messages import StreamTarget
from modelforge.runtimes import SubprocessHttpRuntime
from tests.runtimes.test_subprocess_http import devices, info, loaded, quiet, toy

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


async def test_tool_calls_reasoning_logprobs_and_choices_stream_whole_and_add_up_to_the_answer(
    tmp_path: Path,
) -> None:
    """What a server streams beyond text (a reasoning model's thinking, tool calls in pieces,
    logprobs, a second choice) reaches the gateway whole, and the node's result puts it back
    together as the server's own non-streamed answer."""
    runtime = SubprocessHttpRuntime(devices(), tmp_path)
    model = await loaded(runtime, toy("--token-delay-ms", "1", "--reasoning", api="openai_chat"))
    received: list[dict[str, Any]] = []
    server, task, port = await _serve(_gateway_stand_in(received, None))
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


async def _serve(app: FastAPI) -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, task, port


@pytest.mark.parametrize("hang_up_after", [None, 2])
async def test_the_node_pushes_the_stream_and_stops_when_the_gateway_hangs_up(
    tmp_path: Path, hang_up_after: int | None
) -> None:
    runtime = SubprocessHttpRuntime(devices(), tmp_path)
    model = await loaded(runtime, toy("--token-delay-ms", "50", api="openai_chat"))
    received: list[dict[str, Any]] = []
    server, task, port = await _serve(_gateway_stand_in(received, hang_up_after))
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
