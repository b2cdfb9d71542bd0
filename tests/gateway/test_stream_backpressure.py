"""Back-pressure on streamed answers: a client that reads slower than the
model generates made the gateway hold the whole answer (an unbounded queue a stream) while the
model generated and held its lease. A stream now holds at most its bound of unread bytes; a push
that does not fit waits for the client, for a bounded time; a client too slow for it ends with a
TIMEOUT in its stream format, the node's push is answered 410 (the generation stops, the lease
goes back) and the unread lines are dropped.

The hub and the push route alone first (no Temporal), then the whole stack: the toy model server
streaming a long answer as fast as it can to a client that reads 64 bytes at a time."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from temporalio.testing import WorkflowEnvironment

from activities._stream_push import OUTBOX_BYTES
from modelforge.client import ModelForgeClient
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gateway import GatewayConfig, create_app, gateway_server
from modelforge.gateway._streams import (
    DEFAULT_STREAM_BUFFER_BYTES,
    DEFAULT_STREAM_STALL_S,
    Stream,
    StreamHub,
    chat_events,
    next_record,
    outcome,
    stream_router,
)
from tests.gateway.serving import CATALOG
from workers.stack import running_stack


def _line(text: str) -> bytes:
    return json.dumps({"delta": text}).encode() + b"\n"


@pytest.fixture
def pushes(monkeypatch: pytest.MonkeyPatch) -> tuple[StreamHub, httpx.AsyncClient]:
    """A hub with a 1000-byte bound and a 0.3 s stall, its push route served in process
    (loopback, no key, as `modelforge dev`)."""
    monkeypatch.delenv("MODELFORGE_STREAM_KEY", raising=False)
    monkeypatch.delenv("MODELFORGE_STREAM_KEY_FILE", raising=False)
    hub = StreamHub(limit_bytes=1000, stall_s=0.3)
    app = FastAPI()
    app.include_router(stream_router(hub))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")
    return hub, http


async def _forever() -> None:
    await asyncio.Event().wait()


async def test_a_full_stream_delays_the_push_until_its_client_reads(
    pushes: tuple[StreamHub, httpx.AsyncClient],
) -> None:
    hub, http = pushes
    stream = hub.open()
    request = asyncio.create_task(_forever())  # the request: still invoking
    url = f"/internal/streams/{stream.stream_id}"
    # 892 bytes fit; 292 more do not until the client has read.
    first = await http.post(url, content=_line("a" * 880))
    assert first.status_code == 200 and stream.buffered == len(_line("a" * 880)) - 1  # lines, without "\n"
    second = asyncio.create_task(http.post(url, content=_line("b" * 280)))
    await asyncio.sleep(0.1)
    assert not second.done(), "the push was taken although the stream was full"
    assert stream.buffered <= 1000
    record = await next_record(stream, request)  # the client reads: room for the push
    assert record == {"delta": "a" * 880}
    assert (await second).status_code == 200
    assert await next_record(stream, request) == {"delta": "b" * 280}
    assert stream.buffered == 0 and not stream.failure
    # A push larger than the bound is taken into an empty stream (else it never could be).
    assert (await http.post(url, content=_line("c" * 3000))).status_code == 200
    request.cancel()


async def test_a_client_too_slow_for_its_bound_ends_typed_and_its_lines_are_dropped(
    pushes: tuple[StreamHub, httpx.AsyncClient],
) -> None:
    hub, http = pushes
    stream = hub.open()
    request = asyncio.create_task(_forever())
    url = f"/internal/streams/{stream.stream_id}"
    assert (await http.post(url, content=_line("a" * 900))).status_code == 200
    began = time.monotonic()
    late = await http.post(url, content=_line("b" * 900))  # the client never reads
    waited = time.monotonic() - began
    # Answered as for a client gone (the node stops the generation), after the stall, with why.
    assert late.status_code == 410 and 0.25 <= waited < 2.0, (late.status_code, waited)
    assert "too slowly" in late.json()["error"]
    assert stream.failure is not None and stream.failure[0] == FailureClass.TIMEOUT.value
    # The unread lines are let go at once, and the stream is no longer the hub's.
    assert stream.buffered == 0 and stream.queue.empty() and hub.get(stream.stream_id) is None
    assert hub.buffered_bytes() == 0
    assert (await http.post(url, content=_line("c"))).status_code == 410
    # The client's answer ends with the class, though the request has not finished yet.
    assert await next_record(stream, request) is None
    failure, message, _ = outcome(request)
    assert failure == "TIMEOUT" and "too slowly" in message and not request.done()
    request.cancel()


async def test_the_openai_stream_of_a_too_slow_client_ends_with_an_error_event() -> None:
    hub = StreamHub(limit_bytes=1000, stall_s=0.2)
    stream = hub.open()
    request = asyncio.create_task(_forever())

    class State:
        failure_class = ""

    state = State()
    events = chat_events(
        hub=hub,
        stream=stream,
        task=request,
        first={"delta": "Hello"},
        state=state,
        completion_id="chatcmpl-x",
        created=0,
        model="m",
        include_usage=False,
        counts=lambda output, text: {},
        request_id="r1",
    )
    seen = [await anext(events), await anext(events)]  # the role, then "Hello"
    assert "Hello" in seen[1]
    stream.queue.put_nowait(_line("x" * 990))
    stream.buffered += len(_line("x" * 990))
    assert not await hub.room(stream, 500)  # the client did not read for the stall: ended
    rest = [event async for event in events]
    error = json.loads(rest[0].removeprefix("data: "))["error"]
    assert error["modelforge_class"] == "TIMEOUT" and error["request_id"] == "r1"
    assert rest[-1] == "data: [DONE]\n\n" and state.failure_class == "TIMEOUT"
    request.cancel()


async def test_the_bound_and_the_stall_come_from_the_config_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MODELFORGE_GATEWAY_STREAM_BUFFER_BYTES", raising=False)
    monkeypatch.delenv("MODELFORGE_GATEWAY_STREAM_STALL_S", raising=False)
    config = GatewayConfig()
    assert (config.stream_buffer_bytes, config.stream_stall_s) == (DEFAULT_STREAM_BUFFER_BYTES, DEFAULT_STREAM_STALL_S)
    monkeypatch.setenv("MODELFORGE_GATEWAY_STREAM_BUFFER_BYTES", "256 KiB")
    monkeypatch.setenv("MODELFORGE_GATEWAY_STREAM_STALL_S", "2.5")
    config = GatewayConfig()
    assert (config.stream_buffer_bytes, config.stream_stall_s) == (256 * 1024, 2.5)
    app = create_app(_NoRequests(), _no_catalog, config)
    assert (app.state.streams.limit_bytes, app.state.streams.stall_s) == (256 * 1024, 2.5)
    for variable, value in (
        ("MODELFORGE_GATEWAY_STREAM_BUFFER_BYTES", "lots"),
        ("MODELFORGE_GATEWAY_STREAM_BUFFER_BYTES", "0"),
        ("MODELFORGE_GATEWAY_STREAM_STALL_S", "0"),
        ("MODELFORGE_GATEWAY_STREAM_STALL_S", "60"),  # past the node's 30 s wait on a push
    ):
        monkeypatch.setenv(variable, value)
        with pytest.raises(ModelForgeError) as refused:
            GatewayConfig()
        assert refused.value.failure == FailureClass.REQUEST_INVALID and variable in refused.value.message
        monkeypatch.delenv(variable)
    with pytest.raises(ModelForgeError):
        StreamHub(limit_bytes=0)


class _NoRequests:
    async def request(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("no request in this test")

    async def status(self) -> Any:
        raise AssertionError("no status in this test")

    async def residency(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("no residency in this test")


async def _no_catalog() -> Any:
    raise AssertionError("no catalog in this test")


# The whole stack: the toy model server answers 200 000 tokens with no delay between them (a
# few MiB a second pushed), to a client that reads 64 bytes every 20 ms.
_FAST = f"""
[[deployments]]
capability = "chat.fast@1"
envelope_bytes = 1073741824
residency = "keep_warm"
concurrency = 1
runtime = "subprocess_http"
command = [
    {json.dumps(sys.executable)}, "-m", "modelforge.runtimes.toy_server", "--port", "{{port}}",
    "--answer-tokens", "200000",
]
runtime_config = {{ api = "openai_chat", ready_timeout_s = "30" }}
openai_models = ["fast-chat"]
"""

LIMIT = 64 * 1024


@pytest.fixture
async def fast_gateway(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> AsyncIterator[tuple[Any, FastAPI, int]]:
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(CATALOG.read_text() + _FAST)
    async with running_stack(dev_server_env.client, database_url, catalog_path=catalog) as stack:
        config = GatewayConfig(stream_buffer_bytes=LIMIT, stream_stall_s=1.0)
        app = create_app(ModelForgeClient(stack.client), stack.store.load_catalog, config)
        server = gateway_server(app, "127.0.0.1", 0)
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        try:
            yield stack, app, server.servers[0].sockets[0].getsockname()[1]
        finally:
            server.should_exit = True
            await task


@pytest.mark.workflow
async def test_a_slow_reader_is_held_to_its_bound_then_ended_typed_and_the_lease_released(
    fast_gateway: tuple[Any, FastAPI, int],
) -> None:
    stack, app, port = fast_gateway
    hub: StreamHub = app.state.streams
    body = json.dumps({"model": "fast-chat", "messages": [{"role": "user", "content": "go"}], "stream": True})
    # The kernel's socket buffers take a few MiB of the answer first (not the gateway's memory);
    # past them the gateway's stream fills.
    reader = socket.create_connection(("127.0.0.1", port))
    reader.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(
        reader,
        (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}"
        ).encode(),
    )
    received = bytearray()
    peak = 0
    opened: list[Stream] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            received += await loop.sock_recv(reader, 64)  # 64 bytes every 20 ms: 3.2 kB a second
            opened += [s for s in hub._streams.values() if s not in opened]
            peak = max(peak, hub.buffered_bytes())
            if opened and opened[0].failure is not None:
                break
            await asyncio.sleep(0.02)
        [stream] = opened
        assert stream.failure is not None, f"never ended; {len(received)} bytes read, {peak} buffered at most"
        # Held to the bound (a push may land in a stream that had room for less, never more
        # than the node's own bound of unsent lines past it), and let go of when it ended.
        assert 0 < peak <= LIMIT + OUTBOX_BYTES + 4096, peak
        assert stream.buffered == 0 and hub.buffered_bytes() == 0 and len(hub) == 0
        # Read the rest as fast as it comes: the answer ends with the error event and its class.
        while not received.endswith(b"0\r\n\r\n"):
            more = await asyncio.wait_for(loop.sock_recv(reader, 65536), timeout=30)
            if not more:
                break
            received += more
    finally:
        reader.close()
    events = [line[6:] for line in received.decode(errors="replace").splitlines() if line.startswith("data: {")]
    error = json.loads(events[-1])["error"]
    assert error["modelforge_class"] == "TIMEOUT" and "too slowly" in error["message"], error
    assert b"data: [DONE]" in received
    # The node was told at its next push: the generation stopped and the lease went back.
    for _ in range(100):
        if (await stack.status()).active_leases == 0:
            break
        await asyncio.sleep(0.1)
    assert (await stack.status()).active_leases == 0, "the lease was held after the stream ended"
    released = await stack.events("lease_released", at_least=1, within_s=10)
    assert released
