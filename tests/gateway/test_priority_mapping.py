"""Priority from clients that know nothing of ModelForge, against the dev stack with API keys:
vLLM's `priority` body field (through the `openai` package's `extra_body`) and OpenAI's
`service_tier` map to the catalog's classes relative to the key's tenant's default, are capped
at its ceiling (said, never refused), reach admission (the lease's class) and are said in
X-ModelForge-Priority-Applied; Open WebUI's forwarded user is recorded and never changes the
tenant; `/health` answers without a key; every answer carries x-request-id."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import structlog
from temporalio.testing import WorkflowEnvironment

from modelforge.gateway import GatewayConfig
from modelforge.logging import configure
from tests.gateway.serving import CATALOG, TEAM_KEY, Served, serve
from workers.stack import running_stack

pytestmark = pytest.mark.workflow

# tests/catalogs/gateway.toml: tenant "default" is interactive with an interactive ceiling,
# "rag" production with a production ceiling (built-in classes: production > interactive >
# background > benchmark > maintenance).
RAG_KEY = "sk-rag-0123456789abcdef"
APPLIED = "x-modelforge-priority-applied"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def gateway(dev_server_env: WorkflowEnvironment, database_url: str) -> AsyncIterator[Served]:
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        async for served in serve(stack, GatewayConfig(api_keys={TEAM_KEY: "default", RAG_KEY: "rag"})):
            yield served


def _client(gateway: Served, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key=key, max_retries=0)


async def _granted(gateway: Served, request_id: str) -> dict[str, Any]:
    """The lease_granted event of a request: the class and tenant admission gave it. Up to 30 s:
    routine records are written lazily, once the oldest has waited 5 s (EVENT_WRITE_WAIT_S in
    workflows/scheduler.py), so polling for 5 s only raced the write (a failure seen in a full run)."""
    for _ in range(300):
        found = [e for e in await gateway.stack.events("lease_granted", at_least=1) if e["request_id"] == request_id]
        if found:
            payload: dict[str, Any] = found[0]["payload"]
            return payload
        await asyncio.sleep(0.1)
    raise AssertionError(f"no lease_granted for {request_id}")


async def test_vllm_priority_and_service_tier_map_to_classes_capped_at_the_keys_ceiling(gateway: Served) -> None:
    async with _client(gateway, TEAM_KEY) as team, _client(gateway, RAG_KEY) as rag:
        # service_tier="flex": one level below the tenant's default (interactive -> background).
        flex = await team.chat.completions.with_raw_response.create(
            model="small-chat", messages=HI, service_tier="flex", extra_headers={"X-Request-Id": "flex-1"}
        )
        assert flex.headers[APPLIED] == "background (asked service_tier=flex)"
        assert flex.headers["x-request-id"] == "flex-1"
        assert "hi" in (flex.parse().choices[0].message.content or "")
        assert (await _granted(gateway, "flex-1"))["priority"] == "background"

        # vLLM's priority -1 (more urgent) would be production: above the key's ceiling, capped
        # and said, not refused.
        urgent = await team.chat.completions.with_raw_response.create(
            model="small-chat", messages=HI, extra_body={"priority": -1}, extra_headers={"X-Request-Id": "urgent-1"}
        )
        assert urgent.headers[APPLIED] == "interactive (asked priority=-1, capped at the key's ceiling interactive)"
        assert (await _granted(gateway, "urgent-1"))["priority"] == "interactive"
        tier = await team.chat.completions.with_raw_response.create(
            model="small-chat", messages=HI, service_tier="priority"
        )
        assert (
            tier.headers[APPLIED]
            == "interactive (asked service_tier=priority, capped at the key's ceiling interactive)"
        )

        # Another key's tenant: production by default; priority 2 is two levels below it. The
        # legacy completions and embeddings take the hints too.
        low = await rag.completions.with_raw_response.create(
            model="small-chat", prompt="hi", extra_body={"priority": 2}, extra_headers={"X-Request-Id": "low-1"}
        )
        assert low.headers[APPLIED] == "background (asked priority=2)"
        assert (await _granted(gateway, "low-1"))["priority"] == "background"
        embedded = await rag.embeddings.with_raw_response.create(
            model="all-MiniLM-L6-v2",
            input="hello",
            extra_body={"service_tier": "flex"},  # the SDK's embeddings take no service_tier argument
            extra_headers={"X-Request-Id": "emb-1"},
        )
        assert embedded.headers[APPLIED] == "interactive (asked service_tier=flex)"
        assert (await _granted(gateway, "emb-1"))["priority"] == "interactive"
        # Far past the queue's ends: its lowest and (capped) highest class.
        bottom = await rag.embeddings.with_raw_response.create(
            model="all-MiniLM-L6-v2", input="hello", extra_body={"priority": 99}
        )
        assert bottom.headers[APPLIED] == "maintenance (asked priority=99)"
        top = await rag.embeddings.with_raw_response.create(
            model="all-MiniLM-L6-v2", input="hello", extra_body={"priority": -99}
        )
        assert top.headers[APPLIED] == "production (asked priority=-99)"

        # Streamed: the header is on the stream's answer.
        async with team.chat.completions.with_streaming_response.create(
            model="small-chat", messages=HI, stream=True, service_tier="flex"
        ) as streamed:
            assert streamed.headers[APPLIED] == "background (asked service_tier=flex)"
            assert [chunk async for chunk in await streamed.parse()]

        # ModelForge's own header names a class outright and wins; the hint is said unused.
        named = await team.chat.completions.with_raw_response.create(
            model="small-chat", messages=HI, service_tier="flex", extra_headers={"X-ModelForge-Priority": "benchmark"}
        )
        assert named.headers[APPLIED] == "benchmark (X-ModelForge-Priority; service_tier=flex not used)"

        # Without a hint nothing is said; the tenant's default applies as before.
        plain = await team.chat.completions.with_raw_response.create(model="small-chat", messages=HI)
        assert APPLIED not in plain.headers

        # What cannot be a hint is refused by name (typed 400), never passed to a model server.
        with pytest.raises(openai.BadRequestError) as both:
            await team.chat.completions.create(
                model="small-chat", messages=HI, service_tier="flex", extra_body={"priority": 1}
            )
        assert both.value.param == "service_tier" and both.value.body["modelforge_class"] == "REQUEST_INVALID"  # type: ignore[index]
        for bad in ({"priority": "high"}, {"priority": 1.5}, {"priority": True}, {"service_tier": "gold"}):
            with pytest.raises(openai.BadRequestError) as refused:
                await team.chat.completions.create(model="small-chat", messages=HI, extra_body=bad)
            assert refused.value.param == next(iter(bad)), bad


async def test_open_webui_user_headers_are_recorded_and_never_change_the_tenant(
    gateway: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = structlog.get_config()
    configure(logging.INFO)
    try:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as http:
            webui = {
                "Authorization": f"Bearer {TEAM_KEY}",
                "X-Request-Id": "webui-1",
                "X-OpenWebUI-User-Name": "Mallory",
                "X-OpenWebUI-User-Id": "8f0c-mallory",
                "X-OpenWebUI-User-Email": "mallory@example.com",
                "X-OpenWebUI-User-Role": "admin",
                "X-ModelForge-Tenant": "rag",  # a header naming another tenant changes nothing with keys
            }
            answer = await http.post(
                "/v1/chat/completions", json={"model": "small-chat", "messages": HI}, headers=webui
            )
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-request-id"] == "webui-1"
            # /health (vLLM's) and /healthz answer without a key, with a request id.
            for path in ("/health", "/healthz"):
                health = await http.get(path)
                assert (health.status_code, health.json()) == (200, {"status": "ok"})
                assert health.headers["x-request-id"]
            # Every other route still needs the key, whatever Open WebUI's headers say.
            refused = await http.post(
                "/v1/chat/completions",
                json={"model": "small-chat", "messages": HI},
                headers={k: v for k, v in webui.items() if k != "Authorization"},
            )
            assert refused.status_code == 401 and refused.headers["x-request-id"]
            # An id of bytes beyond ASCII, longer than kept: escaped, cut, and the call answered.
            odd = {**webui, "X-Request-Id": "webui-2", "X-OpenWebUI-User-Id": ("u\xe9" * 100).encode("latin-1")}
            answer = await http.post("/v1/chat/completions", json={"model": "small-chat", "messages": HI}, headers=odd)
            assert answer.status_code == 200, answer.text
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    finally:
        structlog.configure(**saved)
    granted = await _granted(gateway, "webui-1")
    assert (granted["tenant"], granted["priority"]) == ("default", "interactive")  # the key's, not a header's
    # The end user is on the request's story in the event log, beside its tenant.
    assert granted["end_user"] == "8f0c-mallory"
    odd = (await _granted(gateway, "webui-2"))["end_user"]
    assert len(odd) == 128 and odd.startswith("u\\xe9u\\xe9") and odd.isprintable()
    access = [a for a in lines if a.get("event") == "gateway_request" and a.get("request_id") == "webui-1"]
    assert [(a["status"], a["tenant"], a.get("end_user")) for a in access] == [
        (200, "default", "8f0c-mallory"),
        (401, "", None),  # without a valid key nothing of the request is taken, its user neither
    ]
    everything = json.dumps(lines)
    assert "mallory@example.com" not in everything and "Mallory" not in everything  # the id alone is kept
