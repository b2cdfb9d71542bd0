"""The coding agents themselves, replayed: the first request Claude Code 2.1.332 (`claude -p`) and
Codex CLI 0.171.0 (`codex exec`) sent to the gateway, captured byte for byte from the real
binaries (tests/apps/requests/; their installation and session ids zeroed), sent again through
the gateway to the project's toy model server. Both failed on that first call before: Claude
Code's `context_management` was refused, and Codex's `namespace` and `web_search` tools.
scripts/agent_cli_check.py runs the binaries themselves (about 800 MB from npm: not in CI)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.gateway import GatewayConfig
from tests.gateway.serving import CATALOG, Served, serve, toy_deployment, toy_requests
from workers.stack import running_stack

REQUESTS = Path(__file__).resolve().parent / "requests"
KEY = "sk-team-default-0123456789"
TOYS = toy_deployment("toy.chat@1", "toy-chat", "openai_chat", "--token-delay-ms", "1")


@pytest.fixture
async def gateway(dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path) -> AsyncIterator[Served]:
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(CATALOG.read_text() + TOYS)
    async with running_stack(dev_server_env.client, database_url, catalog_path=catalog) as stack:
        async for served in serve(stack, GatewayConfig(api_keys={KEY: "default"})):
            yield served


def _captured(name: str) -> dict[str, Any]:
    captured: dict[str, Any] = json.loads((REQUESTS / name).read_text())
    captured["body"]["model"] = "toy-chat"
    return captured


def _events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event, data) of a server-sent event stream."""
    out = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in fields:
            out.append((fields.get("event", ""), json.loads(fields["data"])))
    return out


@pytest.mark.workflow
async def test_claude_codes_first_turn_is_answered_as_it_sent_it(gateway: Served) -> None:
    captured = _captured("claude_code_messages.json")
    body = captured["body"]
    assert body["context_management"]["edits"][0]["type"].startswith("clear_thinking_")
    headers = {**captured["headers"], "x-api-key": KEY}
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as http:
        answered = await http.post(captured["path"], json=body, headers=headers)
        assert answered.status_code == 200, answered.text
        events = _events(answered.text)
        kinds = [kind for kind, _ in events]
        assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
        # `thinking.display: "omitted"`: the thinking block is there, its text is not.
        blocks = [data["content_block"]["type"] for kind, data in events if kind == "content_block_start"]
        assert blocks == ["thinking", "text"]
        deltas = [data["delta"] for kind, data in events if kind == "content_block_delta"]
        assert {d["type"] for d in deltas} == {"text_delta"}
        text = "".join(d["text"] for d in deltas)
        # The toy answers the last message that is not a system one: the user's prompt.
        assert text.startswith("[toy server] ready. You said: <system-reminder>")

        sent = (await toy_requests("toy.chat@1"))[-1]["body"]
        # System prompt first; Claude Code's environment, a system message after the prompt, stays there.
        assert [m["role"] for m in sent["messages"]] == ["system", "user", "system"]
        assert sent["messages"][2]["content"].startswith("# Environment")
        # Its tools, but the one it marks `defer_loading` (shown only once a tool search loads it).
        offered = [t["function"]["name"] for t in sent["tools"]]
        deferred = [t["name"] for t in body["tools"] if t.get("defer_loading")]
        assert deferred and not set(deferred) & set(offered)
        assert len(offered) == len(body["tools"]) - len(deferred)
        assert sent["chat_template_kwargs"] == {"enable_thinking": True} and sent["reasoning_effort"] == "high"
        assert sent["max_tokens"] == 32000 and sent["stream"] is True

        # An edit that would change the prompt (clearing old tool results) is refused by name.
        cleared = {**body, "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}
        refused = await http.post(captured["path"], json=cleared, headers=headers)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error" and error["modelforge_class"] == "REQUEST_INVALID"
        assert error["message"].startswith("context_management.edits.0.type: 'clear_tool_uses_20250919'")


@pytest.mark.workflow
async def test_codexs_first_turn_and_a_namespaced_tool_call_round_trip(gateway: Served) -> None:
    captured = _captured("codex_responses.json")
    body = captured["body"]
    namespaces = [t for t in body["tools"] if t["type"] == "namespace"]
    assert namespaces and any(t["type"] == "web_search" for t in body["tools"])
    headers = {**captured["headers"], "authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as http:
        answered = await http.post(captured["path"], json=body, headers=headers)
        assert answered.status_code == 200, answered.text
        # Web search runs on OpenAI's side: left out of what the model is shown, and said.
        omitted = answered.headers["x-modelforge-tools-omitted"]
        assert omitted.startswith("web_search (run on OpenAI's side")
        events = _events(answered.text)
        assert events[-1][0] == "response.completed"
        assert events[-1][1]["response"]["output"][-1]["content"][0]["text"] == (
            "[toy server] ready. You said: hello from codex"
        )
        sent = (await toy_requests("toy.chat@1"))[-1]["body"]
        offered = [t["function"]["name"] for t in sent["tools"]]
        namespace = namespaces[0]
        inner = [t["name"] for t in namespace["tools"]]
        assert [f"{namespace['name']}__{name}" for name in inner] == [n for n in offered if "__" in n]
        assert "exec_command" in offered and len(offered) == len(body["tools"]) - 2 + len(inner)
        assert [m["role"] for m in sent["messages"]] == ["system", "system", "user", "user"]  # developer: system

        # The model calls a namespaced function: the item names it apart, as OpenAI's does...
        joined = f"{namespace['name']}__{inner[0]}"
        ask = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"use {joined}"}]}]
        turn = {**body, "input": ask, "stream": False}
        called = (await http.post("/v1/responses", json=turn, headers=headers)).json()
        [call] = [item for item in called["output"] if item["type"] == "function_call"]
        assert (call["namespace"], call["name"]) == (namespace["name"], inner[0])
        # ...and streamed.
        streamed = _events((await http.post("/v1/responses", json={**turn, "stream": True}, headers=headers)).text)
        done = [data for kind, data in streamed if kind == "response.function_call_arguments.done"]
        assert [d["name"] for d in done] == [inner[0]]
        items = [data["item"] for kind, data in streamed if kind == "response.output_item.done"]
        [item] = [i for i in items if i["type"] == "function_call"]
        assert (item["namespace"], item["name"]) == (namespace["name"], inner[0])
        # The call goes back in the next turn's input with its namespace: the model reads it joined.
        output = {"type": "function_call_output", "call_id": call["call_id"], "output": "closed"}
        echoed = {k: call[k] for k in ("type", "call_id", "name", "namespace", "arguments")}
        back = {**turn, "input": [*ask, echoed, output]}
        after = (await http.post("/v1/responses", json=back, headers=headers)).json()
        assert after["output"][-1]["content"][0]["text"] == "[toy server] ready. You said: closed"
        sent = (await toy_requests("toy.chat@1"))[-1]["body"]
        assert sent["messages"][-2]["tool_calls"][0]["function"]["name"] == joined

        # Forcing a tool that runs on OpenAI's side is refused by name.
        forced = await http.post("/v1/responses", json={**turn, "tool_choice": {"type": "web_search"}}, headers=headers)
        assert forced.status_code == 400 and forced.json()["error"]["param"] == "tool_choice"
