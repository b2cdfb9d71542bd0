"""OpenAI's request surface through the gateway, with the official `openai` package as the client,
against the dev stack: sampling and tool parameters reach an OpenAI-compatible model server (the
project's toy server, which records what it received) and act there; a runtime that takes no
parameters refuses them by name; `usage` is the server's or marked estimated; errors are
OpenAI's types; a 2,048-input embeddings call goes through, and a body past the configured
maximum payload size is refused with 413 before any workflow starts."""

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
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

from modelforge.client import ModelForgeClient
from modelforge.gateway import GatewayConfig, create_app, gateway_server
from modelforge.payloads import with_payload_store
from modelforge.runtimes import SubprocessHttpRuntime
from modelforge.settings import DEFAULT_PAYLOAD_THRESHOLD_BYTES
from workers.stack import _SERVERS, Stack, running_stack

pytestmark = pytest.mark.workflow

GATEWAY_CATALOG = Path(__file__).resolve().parents[1] / "catalogs" / "gateway.toml"
# The configured maximum payload size (MODELFORGE_MAX_PAYLOAD_BYTES) of the stack's client.
MAX_PAYLOAD = 512 * 1024
_TOY = json.dumps([sys.executable, "-m", "modelforge.runtimes.toy_server", "--port", "{port}"])
# The gateway tests' catalog plus two deployments served by the toy server.
TOY_DEPLOYMENTS = f"""
[[deployments]]
capability = "toy.chat@1"
envelope_bytes = 1073741824
residency = "keep_warm"
concurrency = 4
runtime = "subprocess_http"
command = {_TOY}
runtime_config = {{ api = "openai_chat", ready_timeout_s = "30" }}
openai_models = ["toy-chat"]

[[deployments]]
capability = "toy.embedding@1"
envelope_bytes = 1073741824
residency = "keep_warm"
concurrency = 4
runtime = "subprocess_http"
command = {_TOY}
runtime_config = {{ api = "openai_embeddings", ready_timeout_s = "30" }}
openai_models = ["toy-embed"]
"""


class _Served:
    def __init__(self, stack: Stack, base_url: str) -> None:
        self.stack = stack
        self.base_url = base_url

    def openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0)

    async def received(self, capability: str) -> list[dict[str, Any]]:
        """The request bodies the toy server serving `capability` received."""
        runtimes: list[SubprocessHttpRuntime] = [r for w in self.stack.node_workers.values() for r in _SERVERS[w]]
        [server] = [s for r in runtimes for key, s in r._servers.items() if key.startswith(capability)]
        answer = await server.client.get("/received")
        requests: list[dict[str, Any]] = answer.json()["requests"]
        return requests


@pytest.fixture
async def gateway(dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path) -> AsyncIterator[_Served]:
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(GATEWAY_CATALOG.read_text() + TOY_DEPLOYMENTS)
    # Every client and worker with the payload store, as `modelforge dev` and compose run them.
    client = with_payload_store(
        dev_server_env.client, tmp_path / "payloads", DEFAULT_PAYLOAD_THRESHOLD_BYTES, MAX_PAYLOAD
    )
    async with running_stack(client, database_url, catalog_path=catalog) as stack:
        # No max_body_bytes: the gateway takes the client's configured maximum.
        app = create_app(ModelForgeClient(stack.client), stack.store.load_catalog, GatewayConfig())
        assert app.state.max_body_bytes == MAX_PAYLOAD
        server = gateway_server(app, "127.0.0.1", 0)
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            yield _Served(stack, f"http://127.0.0.1:{port}")
        finally:
            server.should_exit = True
            await task


async def test_parameters_reach_the_model_server_and_act_there(gateway: _Served) -> None:
    async with gateway.openai() as client:
        chat = await client.chat.completions.create(
            model="toy-chat",
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
            temperature=0.3,
            top_p=0.8,
            seed=11,
            stop=["You"],
            n=2,
            max_tokens=50,
            presence_penalty=0.1,
            frequency_penalty=0.2,
            logprobs=True,
            top_logprobs=2,
            user="end-user-7",
            extra_body={"top_k": 4},  # a server's own parameter (vLLM's): passed as well
        )
        [body] = [r["body"] for r in await gateway.received("toy.chat@1") if r["body"].get("seed") == 11]
        sent = {
            "temperature": 0.3, "top_p": 0.8, "seed": 11, "stop": ["You"], "n": 2, "max_tokens": 50,
            "presence_penalty": 0.1, "frequency_penalty": 0.2, "logprobs": True, "top_logprobs": 2,
            "user": "end-user-7", "top_k": 4,
        }  # fmt: skip
        assert {k: body.get(k) for k in sent} == sent
        assert body["messages"][0] == {"role": "system", "content": "be brief"} and "stream" not in body
        # They acted at the server: two choices, each cut at the stop string, with logprobs.
        assert [c.message.content for c in chat.choices] == ["[toy server] ready. "] * 2
        assert [c.index for c in chat.choices] == [0, 1]
        assert chat.choices[1].logprobs is not None and chat.choices[1].logprobs.content
        # usage: the server's own counts, not estimated.
        assert chat.usage is not None and (chat.usage.model_extra or {})["estimated"] is False
        assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (4, 2 * 6)

        tools: Any = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
        called = await client.chat.completions.create(
            model="toy-chat",
            messages=[{"role": "user", "content": "find it"}],
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "lookup"}},
        )
        [call] = called.choices[0].message.tool_calls or []
        function = call.function  # type: ignore[union-attr]
        assert function.name == "lookup" and json.loads(function.arguments) == {"said": "find it"}
        assert called.choices[0].finish_reason == "tool_calls" and called.choices[0].message.content is None
        formatted = await client.chat.completions.create(
            model="toy-chat", messages=[{"role": "user", "content": "as json"}], response_format={"type": "json_object"}
        )
        assert json.loads(formatted.choices[0].message.content or "") == {"toy": True, "said": "as json"}

        vectors = await client.embeddings.create(model="toy-embed", input=["a cat on a mat", "hi"], dimensions=16)
        assert [len(d.embedding) for d in vectors.data] == [16, 16]
        assert (vectors.usage.prompt_tokens, (vectors.usage.model_extra or {})["estimated"]) == (6, False)
        assert (await gateway.received("toy.embedding@1"))[-1]["body"]["dimensions"] == 16

        # A value the server refuses: its 400 comes back as one, with the server's reason.
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="toy-chat", messages=[{"role": "user", "content": "x"}], n=9)
        assert "n must be from 1 to 8" in refused.value.message
        assert refused.value.body["modelforge_class"] == "REQUEST_INVALID"  # type: ignore[index]
        # Several choices stream too (tests/gateway/test_openai_passthrough.py: tools, reasoning...).
        streamed = [
            chunk
            async for chunk in await client.chat.completions.create(
                model="toy-chat", messages=[{"role": "user", "content": "x"}], n=2, stream=True
            )
        ]
        assert {c.index for chunk in streamed for c in chunk.choices} == {0, 1}


async def test_a_runtime_that_takes_no_parameters_refuses_them_by_name(gateway: _Served) -> None:
    async with gateway.openai() as client:
        hello: Any = [{"role": "user", "content": "hello"}]
        # Values that change nothing are fine on any runtime.
        plain = await client.chat.completions.create(
            model="small-chat",
            messages=hello,
            n=1,
            logprobs=False,
            presence_penalty=0,
            response_format={"type": "text"},
        )
        assert plain.choices[0].message.content == "[simulated chat.small@1] you said: hello"
        # The simulated runtime takes sampling parameters as a real server does (and says so:
        # test_openai_passthrough.py); what it cannot do is refused by name.
        refusals: list[tuple[dict[str, Any], str]] = [
            ({"logprobs": True}, "logprobs"),
            ({"response_format": {"type": "json_object"}}, "response_format"),
            ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
            ({"extra_body": {"guided_choice": ["a", "b"]}}, "guided_choice"),
            ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, ""),
        ]
        for options, name in refusals:
            arguments = {"model": "small-chat", "messages": hello, **options}
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(**arguments)
            error = refused.value
            assert error.code == "unsupported_parameter" and error.type == "invalid_request_error", options
            assert error.param == (name or "messages.0.content.0") and (name or "image_url") in error.message
            assert error.body["modelforge_class"] == "REQUEST_INVALID"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.embeddings.create(model="all-MiniLM-L6-v2", input="x", dimensions=4)
        assert refused.value.param == "dimensions"
        # Nothing refused reached the scheduler: the one lease is the plain call's.
        granted = await gateway.stack.events("lease_granted", at_least=1)
        assert len(granted) == 1

        # Models one by one; an unknown one is OpenAI's 404 model_not_found.
        model = await client.models.retrieve("small-chat")
        assert (model.id, model.owned_by, (model.model_extra or {})["capability"]) == (
            "small-chat",
            "modelforge",
            "chat.small@1",
        )
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.models.retrieve("gpt-17")
        assert (unknown.value.code, unknown.value.param) == ("model_not_found", "model")
        with pytest.raises(openai.BadRequestError) as invalid:
            await client.embeddings.create(model="all-MiniLM-L6-v2", input=[])
        assert invalid.value.param == "input"


async def test_2048_inputs_go_through_and_a_payload_past_the_maximum_starts_nothing(gateway: _Served) -> None:
    texts = [f"document {n}: how a GPU lease is granted, held and released" for n in range(2048)]
    async with gateway.openai() as client:
        answer = await client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)
    assert [d.index for d in answer.data] == list(range(2048))
    assert all(len(d.embedding) == 8 for d in answer.data)  # the simulated runtime's 8 dimensions
    assert answer.data[5].embedding != answer.data[6].embedding
    assert answer.usage.prompt_tokens == sum(-(-len(t) // 4) for t in texts)  # estimated, marked so
    assert (answer.usage.model_extra or {})["estimated"] is True

    big = [("x" * 300) + str(n) for n in range(2048)]  # ~620 KB: past the 512 KiB maximum
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as http:
        too_big = await http.post(
            "/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": big}, headers={"X-Request-Id": "too-big-1"}
        )
    assert too_big.status_code == 413, too_big.text
    error = too_big.json()["error"]
    assert (error["type"], error["code"], error["modelforge_class"]) == (
        "invalid_request_error",
        "request_too_large",
        "REQUEST_INVALID",
    )
    assert str(MAX_PAYLOAD) in error["message"]
    async with gateway.openai() as client:
        with pytest.raises(openai.APIStatusError) as refused:
            await client.embeddings.create(
                model="all-MiniLM-L6-v2", input=big, extra_headers={"X-Request-Id": "too-big-2"}
            )
        assert refused.value.status_code == 413
    for request_id in ("too-big-1", "too-big-2"):  # no workflow was started for either
        with pytest.raises(RPCError) as missing:
            await gateway.stack.client.get_workflow_handle(f"request:rag.embedding@1:{request_id}").describe()
        assert missing.value.status == RPCStatusCode.NOT_FOUND
