"""OpenAI's Responses API (`POST /v1/responses`) as Codex CLI and the OpenAI Agents SDK call it,
with the real `openai` package against the dev stack and the project's toy model server (no
GPU): instructions and input items reach the model as a chat, a function tool's call comes back
as a `function_call` item and its output goes back through `previous_response_id`, the answer
streams as the Responses event sequence, another tenant's response id is not found, and what
cannot be honoured is refused by name. The store that keeps conversations is tested on its own."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.gateway import GatewayConfig
from modelforge.gateway._responses import ResponseStore, _ResponsesCall, chat_parameters, served_tools
from tests.gateway.serving import CATALOG, Served, serve, toy_deployment, toy_requests
from workers.stack import running_stack

KEY = "sk-team-default-0123456789"  # tenant "default"
OTHER_KEY = "sk-team-rag-0123456789ab"  # tenant "rag"
TOYS = toy_deployment("toy.chat@1", "toy-chat", "openai_chat", "--token-delay-ms", "2") + toy_deployment(
    "toy.reasoner@1", "toy-reasoner", "openai_chat", "--token-delay-ms", "2", "--reasoning"
)
# A function tool as the Agents SDK sends one (not strict: the toy's arguments are its own).
TOOLS: Any = [
    {
        "type": "function",
        "name": "lookup",
        "description": "Look a city up.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": False,
    }
]
ASK: Any = [{"role": "user", "content": [{"type": "input_text", "text": "please lookup Paris"}]}]


@pytest.fixture
async def gateway(dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path) -> AsyncIterator[Served]:
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(CATALOG.read_text() + TOYS)
    config = GatewayConfig(api_keys={KEY: "default", OTHER_KEY: "rag"})
    async with running_stack(dev_server_env.client, database_url, catalog_path=catalog) as stack:
        async for served in serve(stack, config):
            yield served


def _client(gateway: Served, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key=key, max_retries=0)


@pytest.mark.workflow
async def test_responses_answer_call_tools_continue_and_stream(gateway: Served) -> None:
    async with _client(gateway) as client:
        # Instructions and input as a chat, with the sampling parameters the model server takes.
        first = await client.responses.create(
            model="toy-chat", instructions="Answer briefly.", input="hello there", max_output_tokens=50,
            temperature=0.2, top_p=0.9, background=None, conversation=None,  # null is absent
        )  # fmt: skip
        assert first.status == "completed" and first.output_text == "[toy server] ready. You said: hello there"
        assert first.usage is not None
        assert (first.usage.input_tokens, first.usage.output_tokens) == (5, 11)  # the toy server's own counts
        body = (await toy_requests("toy.chat@1"))[-1]["body"]
        assert body["messages"] == [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "hello there"},
        ]
        assert (body["max_tokens"], body["temperature"], body["top_p"]) == (50, 0.2, 0.9)

        # A function tool: the model's call is a function_call item; its output goes back with
        # previous_response_id alone carrying the conversation.
        called = await client.responses.create(model="toy-chat", input=ASK, tools=TOOLS)
        [call] = called.output
        assert call.type == "function_call" and call.name == "lookup"
        assert json.loads(call.arguments) == {"said": "please lookup Paris"}
        answered = await client.responses.create(
            model="toy-chat",
            previous_response_id=called.id,
            tools=TOOLS,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        )
        assert answered.output_text == "[toy server] ready. You said: sunny"
        sent = (await toy_requests("toy.chat@1"))[-1]["body"]
        assert [m["role"] for m in sent["messages"]] == ["user", "assistant", "tool"]
        assert sent["messages"][1]["tool_calls"][0]["id"] == call.call_id == sent["messages"][2]["tool_call_id"]
        assert sent["tools"] == [
            {"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}},
        ]

        # Streamed: the Responses event sequence, the text in several deltas.
        events = [e async for e in await client.responses.create(model="toy-chat", input="stream it", stream=True)]
        kinds = [e.type for e in events]
        assert kinds[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert kinds[-4:] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        completed = events[-1].response  # type: ignore[union-attr]
        assert len(deltas) > 3 and "".join(deltas) == completed.output_text == "[toy server] ready. You said: stream it"
        assert [e.sequence_number for e in events] == list(range(len(events)))

        # A streamed tool call (the SDK's own accumulator), then a streamed follow-up from it.
        async with client.responses.stream(model="toy-chat", input=ASK, tools=TOOLS) as stream:
            streamed = [e.type async for e in stream]
            final = await stream.get_final_response()
        assert streamed.count("response.function_call_arguments.delta") > 1
        [item] = final.output
        assert item.type == "function_call" and json.loads(item.arguments) == {"said": "please lookup Paris"}
        async with client.responses.stream(
            model="toy-chat",
            previous_response_id=final.id,
            input=[{"type": "function_call_output", "call_id": item.call_id, "output": "rainy"}],
            tools=TOOLS,
        ) as stream:
            after = await stream.get_final_response()
        assert after.output_text == "[toy server] ready. You said: rainy"

        # A kept response is read back as it was answered (a streamed one with the item ids the
        # stream carried), and deleted: then it is gone, for GET and for previous_response_id.
        again = await client.responses.retrieve(first.id)
        assert again.output_text == first.output_text and again.output[0].id == first.output[0].id
        assert (await client.responses.retrieve(final.id)).output[0].id == item.id
        unstored = await client.responses.create(model="toy-chat", input="forget me", store=False)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)
        await client.responses.delete(first.id)
        for gone in (client.responses.retrieve(first.id), client.responses.delete(first.id)):
            with pytest.raises(openai.NotFoundError) as missing:
                await gone
            assert missing.value.body["code"] == "response_not_found"  # type: ignore[index]

        # A reasoning model's thinking is a reasoning item before the message.
        thought = await client.responses.create(model="toy-reasoner", input="hello there")
        assert [i.type for i in thought.output] == ["reasoning", "message"]
        assert thought.output[0].content[0].text.startswith("The user said 'hello there'")  # type: ignore[union-attr]

        # What cannot be honoured is refused by name, before any workflow.
        for asked, named in (
            ({"background": True}, "background"),
            ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice"),
            ({"tools": [{"type": "local_shell"}]}, "tools.0"),
            ({"include": ["message.output_text.logprobs"]}, "include.0"),
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(model="toy-chat", input="x", **asked)
            assert refused.value.body["param"] == named  # type: ignore[index]
            assert refused.value.body["modelforge_class"] == "REQUEST_INVALID"  # type: ignore[index]
        # A runtime that takes no tools says so, as on the chat route.
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model="small-chat", input=ASK, tools=TOOLS)
        assert refused.value.body["param"] == "tools"  # type: ignore[index]

    # Another tenant cannot continue this one's conversation: not found, as an unknown id is.
    async with _client(gateway, OTHER_KEY) as other:
        with pytest.raises(openai.NotFoundError):
            await other.responses.retrieve(called.id)
        with pytest.raises(openai.NotFoundError):
            await other.responses.delete(called.id)
        for asked in (called.id, "resp_0123456789abcdef"):
            with pytest.raises(openai.NotFoundError) as missing:
                await other.responses.create(model="toy-chat", previous_response_id=asked, input="more", stream=True)
            error: Any = missing.value.body
            assert (error["param"], error["code"]) == ("previous_response_id", "previous_response_not_found")
            assert asked in error["message"] and error["modelforge_class"] == "REQUEST_INVALID"


def test_response_store_is_per_tenant_and_bounded() -> None:
    store = ResponseStore(entries=2, tenant_bytes=10_000, total_bytes=15_000)
    turn = [{"role": "user", "content": "hi"}]
    store.put("a", "r1", turn, {})
    store.put("a", "r2", turn, {})
    assert store.get("b", "r1") is None  # another tenant's id is not found
    assert store.get("a", "r1") == turn  # and r1 is now the most recently used of a's
    store.put("a", "r3", turn, {})
    assert (store.get("a", "r1"), store.get("a", "r2"), store.get("a", "r3")) == (turn, None, turn)
    # What a caller does with its copy changes nothing kept.
    copy = store.get("a", "r1")
    assert copy is not None
    copy.append({"role": "assistant", "content": "changed"})
    assert store.get("a", "r1") == turn
    # Bytes: past a tenant's share its oldest go; past the total, the least recently used of all.
    big = [{"role": "user", "content": "x" * 6_000}]
    store.put("b", "big1", big, {})
    store.put("b", "big2", big, {})
    assert store.get("b", "big1") is None and store.get("b", "big2") == big
    store.put("c", "big3", big, {})
    store.put("c", "big4", big, {})  # c's own share drops big3 first
    assert store.get("c", "big3") is None and store.get("c", "big4") == big
    store.put("d", "big5", big, {})  # over the total now: the least recently used of all go (a's, then b's)
    assert store.get("a", "r1") is None and store.get("b", "big2") is None and store.get("d", "big5") == big
    store.put("e", "huge", [{"role": "user", "content": "x" * 30_000}], {})  # larger than any share: never kept
    assert store.get("e", "huge") is None and len(store) == 2


def test_hosted_tools_alone_leave_the_model_nothing_to_choose_among() -> None:
    """Offered only tools that run on OpenAI's side, the model is shown no tools, so no
    `tool_choice` or `parallel_tool_calls` goes to its server either (OpenAI-compatible servers
    refuse a tool choice without tools); a function tool keeps both."""
    hosted = {"model": "toy-chat", "input": "x", "tools": [{"type": "web_search"}], "tool_choice": "auto"}
    call = _ResponsesCall.model_validate({**hosted, "parallel_tool_calls": True})
    tools = served_tools(call.tools)
    assert (tools.chat, tools.omitted) == (None, ["web_search"])
    given = chat_parameters(call, tools)
    assert "tools" not in given and "tool_choice" not in given and "parallel_tool_calls" not in given
    mixed = _ResponsesCall.model_validate({**hosted, "tools": [*TOOLS, {"type": "web_search_preview"}]})
    given = chat_parameters(mixed, served_tools(mixed.tools))
    assert [t["function"]["name"] for t in given["tools"]] == ["lookup"] and given["tool_choice"] == "auto"
