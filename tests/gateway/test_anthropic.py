"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) with the real
`anthropic` package against the dev stack and the project's toy model server (no GPU): the key
as `x-api-key`, system and messages reaching the model as a chat with their parameters, a
tool_use round, the answer streamed as Anthropic's events, token counts, and errors in
Anthropic's shape with the ModelForge failure class."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.gateway import GatewayConfig
from modelforge.gateway._anthropic import _Conversation, chat_tools
from tests.gateway.serving import CATALOG, Served, serve, toy_deployment, toy_requests
from workers.stack import running_stack

KEY = "sk-team-default-0123456789"
TOYS = toy_deployment("toy.chat@1", "toy-chat", "openai_chat", "--token-delay-ms", "2")
TOOLS: Any = [
    {
        "name": "lookup",
        "description": "Look a city up.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        "cache_control": {"type": "ephemeral"},  # Claude Code marks its tools so: changes nothing
    }
]
ASK: Any = [{"role": "user", "content": [{"type": "text", "text": "please lookup Paris"}]}]
# The events Anthropic's API sends (the SDK's stream adds its own, such as "text").
RAW = {"message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta"}


@pytest.fixture
async def gateway(dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path) -> AsyncIterator[Served]:
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(CATALOG.read_text() + TOYS)
    async with running_stack(dev_server_env.client, database_url, catalog_path=catalog) as stack:
        async for served in serve(stack, GatewayConfig(api_keys={KEY: "default"})):
            yield served


@pytest.mark.workflow
async def test_anthropic_messages_tools_stream_count_and_errors(gateway: Served) -> None:
    async with anthropic.AsyncAnthropic(base_url=gateway.base_url, api_key=KEY, max_retries=0) as client:
        message = await client.messages.create(
            model="toy-chat",
            max_tokens=64,
            system=[{"type": "text", "text": "Answer briefly.", "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": "hello there"}],
            stop_sequences=["never said"],
            # This SDK has no temperature argument (earlier ones and other clients send it).
            extra_body={"temperature": 0.5, "top_k": 40},
        )
        assert [(b.type, getattr(b, "text", None)) for b in message.content] == [
            ("text", "[toy server] ready. You said: hello there")
        ]
        assert message.stop_reason == "end_turn" and message.role == "assistant"
        assert (message.usage.input_tokens, message.usage.output_tokens) == (5, 11)  # the toy server's counts
        body = (await toy_requests("toy.chat@1"))[-1]["body"]
        assert body["messages"] == [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "hello there"},
        ]
        assert (body["max_tokens"], body["temperature"], body["top_k"], body["stop"]) == (64, 0.5, 40, ["never said"])
        cut = await client.messages.create(model="toy-chat", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        assert cut.stop_reason == "max_tokens" and cut.content[0].text == "[toy server"  # type: ignore[union-attr]

        # A tool_use round: the call as a tool_use block, its result back as a tool_result.
        called = await client.messages.create(model="toy-chat", max_tokens=64, messages=ASK, tools=TOOLS)
        [use] = called.content
        assert called.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "lookup"
        assert use.input == {"said": "please lookup Paris"}
        answered = await client.messages.create(
            model="toy-chat",
            max_tokens=64,
            tools=TOOLS,
            messages=[
                *ASK,
                {"role": "assistant", "content": called.content},  # type: ignore[typeddict-item]
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
            ],
        )
        assert answered.content[0].text == "[toy server] ready. You said: sunny"  # type: ignore[union-attr]
        sent = (await toy_requests("toy.chat@1"))[-1]["body"]
        assert [m["role"] for m in sent["messages"]] == ["user", "assistant", "tool"]
        assert sent["messages"][2] == {"role": "tool", "tool_call_id": use.id, "content": "sunny"}
        assert sent["tools"][0]["function"]["parameters"] == TOOLS[0]["input_schema"]

        # Streamed: Anthropic's events, the text in several deltas; a tool call's input in JSON pieces.
        async with client.messages.stream(
            model="toy-chat", max_tokens=64, messages=[{"role": "user", "content": "stream it"}]
        ) as stream:
            events = [e async for e in stream]
            final = await stream.get_final_message()
        kinds = [e.type for e in events if e.type in RAW]
        deltas = [e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"]
        assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-2:] == [
            "content_block_stop",
            "message_delta",
        ]
        assert events[-1].type == "message_stop"
        assert len(deltas) > 3 and "".join(deltas) == "[toy server] ready. You said: stream it"
        assert final.content[0].text == "".join(deltas) and final.stop_reason == "end_turn"  # type: ignore[union-attr]
        async with client.messages.stream(model="toy-chat", max_tokens=64, messages=ASK, tools=TOOLS) as stream:
            pieces = [e.delta.partial_json async for e in stream if e.type == "content_block_delta"]  # type: ignore[union-attr]
            final = await stream.get_final_message()
        assert len(pieces) > 1 and final.stop_reason == "tool_use"
        assert [(b.type, b.input) for b in final.content] == [("tool_use", {"said": "please lookup Paris"})]  # type: ignore[union-attr]

        counted = await client.messages.count_tokens(
            model="toy-chat", system="Answer briefly.", messages=[{"role": "user", "content": "hello there"}]
        )
        assert (
            counted.input_tokens == 7 and (counted.model_extra or {})["estimated"] is True
        )  # 15 + 11 characters, ~4 a token

        # Errors in Anthropic's shape, with the class: an unknown model, a refused parameter.
        with pytest.raises(anthropic.NotFoundError) as missing:
            await client.messages.create(model="no-such-model", max_tokens=8, messages=ASK)
        error: Any = missing.value.body
        assert error["type"] == "error" and error["error"]["type"] == "not_found_error"
        assert error["error"]["modelforge_class"] == "CAPABILITY_UNAVAILABLE"
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.create(model="small-chat", max_tokens=8, messages=ASK, tools=TOOLS)
        error = refused.value.body
        assert error["error"]["modelforge_class"] == "REQUEST_INVALID" and error["error"]["message"].startswith("tools")
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.create(
                model="toy-chat", max_tokens=8, messages=ASK, tools=[{"type": "web_search_20250305", "name": "web"}]
            )
        assert refused.value.body["error"]["message"].startswith("tools.0")  # type: ignore[index]

    # A wrong key: Anthropic's authentication error. And x-api-key is a key on every route.
    async with anthropic.AsyncAnthropic(
        base_url=gateway.base_url, api_key="sk-wrong-wrong-wrong", max_retries=0
    ) as bad:
        with pytest.raises(anthropic.AuthenticationError) as denied:
            await bad.messages.create(model="toy-chat", max_tokens=8, messages=ASK)
        assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    async with httpx.AsyncClient(base_url=gateway.base_url) as http:
        assert (await http.get("/v1/models", headers={"x-api-key": KEY})).status_code == 200
        assert (await http.get("/v1/models", headers={"x-api-key": "sk-wrong-wrong-wrong"})).status_code == 401


def test_deferred_tools_alone_leave_the_model_nothing_to_choose_among() -> None:
    """Tools marked `defer_loading` are not shown to the model (Anthropic's API loads them only
    through a tool search); when every tool is deferred, an `auto` tool choice goes with them."""
    deferred = [{**TOOLS[0], "defer_loading": True}]
    call = _Conversation.model_validate(
        {"model": "toy-chat", "messages": ASK, "tools": deferred, "tool_choice": {"type": "auto"}}
    )
    assert chat_tools(call) == {}
    shown = _Conversation.model_validate({**call.model_dump(), "tools": [*deferred, {**TOOLS[0], "name": "find"}]})
    given = chat_tools(shown)
    assert [t["function"]["name"] for t in given["tools"]] == ["find"] and given["tool_choice"] == "auto"
