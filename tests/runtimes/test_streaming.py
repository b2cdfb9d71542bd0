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
        with pytest.raises(ModelForgeError) as refused:
            _ = [c async for c in runtime.invoke_stream(model, {**HELLO, "parameters": {"n": 2}}, quiet)]
        assert refused.value.failure == FailureClass.REQUEST_INVALID and "n" in refused.value.message
    finally:
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
