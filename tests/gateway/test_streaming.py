"""Streamed chat through the gateway, with the official `openai` package as the client: the
answer arrives in pieces equal to the whole answer; a client that disconnects mid-stream frees
the lease and stops the generation at the model server; preemption mid-stream ends the stream
with an error carrying its class; nodes cannot be impersonated on the push route."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.gateway import GatewayConfig
from modelforge.policy import PolicyConfig
from tests.gateway.serving import CATALOG, Served, serve
from workers.stack import _SERVERS, running_stack

pytestmark = pytest.mark.workflow

# The gateway tests' catalog and a chat model served by the toy server, streaming a token every
# 60 ms (its answers run to about 10 tokens: a stream of about 0.6 s); it fills in the middle.
_TOY = f"""
[[deployments]]
capability = "chat.toy@1"
envelope_bytes = 1073741824
residency = "keep_warm"
concurrency = 2
runtime = "subprocess_http"
command = [
    {json.dumps(sys.executable)}, "-m", "modelforge.runtimes.toy_server", "--port", "{{port}}", "--token-delay-ms", "60"
]
runtime_config = {{ api = "openai_chat", ready_timeout_s = "30" }}
openai_models = ["toy-chat"]
features = ["insert"]
"""

HELLO = [{"role": "user", "content": "hello there, tell me about the weather today please"}]

# For preemption: a slow background chat model (a token every 400 ms) and a production model
# that cannot fit beside it (24 GiB card, 6 GiB Ollama, 10 + 12 GiB).
_PREEMPTION = f"""
[[deployments]]
capability = "chat.background@1"
envelope_bytes = 10737418240
residency = "keep_warm"
concurrency = 1
preemptible = true
runtime = "subprocess_http"
command = [
    {json.dumps(sys.executable)}, "-m", "modelforge.runtimes.toy_server", "--port", "{{port}}",
    "--token-delay-ms", "400",
]
runtime_config = {{ api = "openai_chat", ready_timeout_s = "30" }}
openai_models = ["background-chat"]

[[deployments]]
capability = "big.production@1"
envelope_bytes = 12884901888
residency = "keep_warm"
concurrency = 1
measured_on = ["Simulated RTX 3090 24GB"]

[[tenants]]
name = "lab"
default_priority = "background"
max_priority = "background"
"""


@pytest.fixture
async def gateway(dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path) -> AsyncIterator[Served]:
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(CATALOG.read_text() + _TOY)
    async with running_stack(dev_server_env.client, database_url, catalog_path=catalog) as stack:
        async for served in serve(stack, GatewayConfig()):
            yield served


async def _toy_streams(gateway: Served) -> list[dict[str, Any]]:
    runtime = next(r for runtimes in _SERVERS.values() for r in runtimes if r._servers)
    [server] = runtime._servers.values()
    answer = await server.client.get("/streams")
    streams: list[dict[str, Any]] = answer.json()["streams"]
    return streams


async def test_a_streamed_answer_equals_the_whole_one_and_counts_usage(gateway: Served) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)
    whole = await client.chat.completions.create(model="toy-chat", messages=HELLO)  # type: ignore[arg-type]
    pieces: list[str] = []
    finish = None
    usage = None
    async with await client.chat.completions.create(
        model="toy-chat",
        messages=HELLO,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
    ) as stream:
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    pieces.append(choice.delta.content)
                finish = choice.finish_reason or finish
    assert len(pieces) > 3, pieces
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == "stop"
    assert usage is not None and whole.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    # The simulated chat model streams too (a word at a time), equal to its whole answer.
    simulated = await client.chat.completions.create(model="small-chat", messages=HELLO)  # type: ignore[arg-type]
    parts = [
        c.choices[0].delta.content or ""
        async for c in await client.chat.completions.create(model="small-chat", messages=HELLO, stream=True)  # type: ignore[arg-type]
        if c.choices
    ]
    assert "".join(parts) == simulated.choices[0].message.content and len([p for p in parts if p]) > 3
    await client.close()
    # The gateway measured the time to the first token of each stream.
    async with httpx.AsyncClient(base_url=gateway.base_url) as http:
        metrics = (await http.get("/metrics")).text
    counts = [
        line for line in metrics.splitlines() if line.startswith("modelforge_gateway_time_to_first_token_seconds_count")
    ]
    assert any('capability="chat.toy@1"' in line and not line.endswith(" 0.0") for line in counts), counts


async def test_a_client_that_disconnects_mid_stream_frees_the_lease_and_stops_the_model(gateway: Served) -> None:
    body = {"model": "toy-chat", "messages": HELLO, "stream": True}
    async with (
        httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as answer,
    ):
        assert answer.status_code == 200
        got = 0
        async for line in answer.aiter_lines():
            if line.startswith("data:") and '"content"' in line:
                got += 1
            if got >= 3:
                break  # the client goes away mid-answer
    stack = gateway.stack

    async def released() -> bool:
        return (await stack.status()).active_leases == 0

    for _ in range(100):
        if await released():
            break
        await asyncio.sleep(0.1)
    assert await released(), "the lease was held after the client left"
    # The server finds its client gone at its next write (a token later).
    for _ in range(50):
        streams = await _toy_streams(gateway)
        if streams[-1]["aborted"]:
            break
        await asyncio.sleep(0.1)
    assert streams[-1]["aborted"] and streams[-1]["sent"] < streams[-1]["pieces"], streams[-1]
    events = await stack.events("lease_released", at_least=1, within_s=10)
    assert events


async def test_preemption_mid_stream_ends_it_with_an_error_carrying_its_class(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(CATALOG.read_text() + _PREEMPTION)
    config = PolicyConfig(preempt_grace_s=0.5, preempt_min_runtime_s=0.0)
    async with running_stack(dev_server_env.client, database_url, catalog_path=catalog, config=config) as stack:
        async for gateway in serve(stack, GatewayConfig()):
            body = {"model": "background-chat", "messages": HELLO, "stream": True}
            events: list[dict[str, Any]] = []
            production: asyncio.Task[Any] | None = None
            async with (
                httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as http,
                http.stream(
                    "POST", "/v1/chat/completions", json=body, headers={"X-ModelForge-Tenant": "lab"}
                ) as answer,
            ):
                assert answer.status_code == 200
                async for line in answer.aiter_lines():
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    events.append(json.loads(line[5:]))
                    if production is None and any(
                        (c.get("delta") or {}).get("content") for e in events for c in e.get("choices", [])
                    ):
                        # Production work that needs the background model's room arrives.
                        production = asyncio.create_task(stack.start_request("big.production@1", tenant="rag"))
            assert production is not None
            error = events[-1].get("error")
            assert error is not None, events[-1]
            assert error["modelforge_class"] == "LEASE_CONFLICT" and "preempted" in error["message"]
            texts = [c["delta"].get("content") for e in events for c in e.get("choices", []) if c.get("delta")]
            assert any(texts), "nothing was streamed before the preemption"
            handle = await production
            assert (await handle.result()).output


async def test_a_push_from_outside_is_refused(gateway: Served) -> None:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=10) as http:
        unknown = await http.post("/internal/streams/nope", content=b'{"delta": "x"}\n')
        assert unknown.status_code == 410


async def test_legacy_completions_answer_and_stream_as_text_completions(gateway: Served) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)
    whole = await client.completions.create(model="toy-chat", prompt="say hello to the weather", max_tokens=50)
    assert whole.object == "text_completion" and whole.choices[0].text.startswith("[toy server]")
    assert whole.usage is not None and whole.usage.completion_tokens > 0
    pieces = [
        chunk.choices[0].text
        async for chunk in await client.completions.create(
            model="toy-chat", prompt="say hello to the weather", max_tokens=50, stream=True
        )
        if chunk.choices
    ]
    assert len([p for p in pieces if p]) > 3 and "".join(pieces) == whole.choices[0].text
    # The prompt goes to the server's completions route as it is, its own parameters with it.
    echoed = await client.completions.create(model="toy-chat", prompt="x y", echo=True, logprobs=1, max_tokens=4)
    [choice] = echoed.choices
    assert choice.text.startswith("x y[toy server]") and choice.logprobs is not None
    assert choice.logprobs.tokens and choice.logprobs.tokens[:2] == ["x", "y"]
    filled = await client.completions.create(model="toy-chat", prompt="def f(x):", suffix="    return y")
    assert "return y" in filled.choices[0].text and "fills in after" in filled.choices[0].text
    # A runtime that cannot honour one refuses it by name; a suffix only where the model fills in.
    for model, name, extra in (("small-chat", "echo", {"echo": True}), ("small-chat", "suffix", {"suffix": "z"})):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model=model, prompt="x", **extra)  # type: ignore[call-overload]
        assert refused.value.param == name
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model="toy-chat", prompt="x", logprobs=1, stream=True)
    assert refused.value.param == "logprobs"
    await client.close()
