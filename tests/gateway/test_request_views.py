"""What a caller learns about a request beyond its answer, through the gateway on the dev stack:
a request looked up by its id (reattach after a lost connection, per tenant), a deadline taken
from the client's own timeout (the real `openai` package's header), a dry run that starts
nothing, and the verdict told while a stream waits (parsed by the real `openai` and `ollama`
packages)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.gateway import GatewayConfig
from tests.gateway.serving import CATALOG, Served, serve
from workers.stack import running_stack

pytestmark = pytest.mark.workflow

TEAM_KEY = "sk-team-0123456789abcdef"
OTHER_KEY = "sk-other-0123456789abcdef"

# A chat model served by the toy server one answer at a time, a token every 400 ms (about 4 s an
# answer): a second stream waits for the first.
_ONE_AT_A_TIME = f"""
[[deployments]]
capability = "chat.single@1"
envelope_bytes = 1073741824
residency = "keep_warm"
concurrency = 1
queue_limit = 8
runtime = "subprocess_http"
command = [
    {json.dumps(sys.executable)}, "-m", "modelforge.runtimes.toy_server", "--port", "{{port}}",
    "--token-delay-ms", "400",
]
runtime_config = {{ api = "openai_chat", ready_timeout_s = "30" }}
openai_models = ["single-chat"]

[[tenants]]
name = "team"
default_priority = "interactive"
max_priority = "interactive"

[[tenants]]
name = "other"
default_priority = "interactive"
max_priority = "interactive"
"""

HELLO = [{"role": "user", "content": "hello there, tell me about the weather today please"}]
SLOW = "slow.job@1"


@pytest.fixture
async def gateway(dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path) -> AsyncIterator[Served]:
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(CATALOG.read_text() + _ONE_AT_A_TIME)
    config = GatewayConfig(api_keys={TEAM_KEY: "team", OTHER_KEY: "other"})
    async with running_stack(dev_server_env.client, database_url, catalog_path=catalog) as stack:
        async for served in serve(stack, config):
            yield served


def _http(gateway: Served, key: str = TEAM_KEY) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=gateway.base_url, timeout=60, headers={"Authorization": f"Bearer {key}"})


async def _until_leased(http: httpx.AsyncClient, count: int = 1) -> None:
    for _ in range(300):
        if (await http.get("/v1/status")).json()["active_leases"] >= count:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("no lease was granted")


async def _until_free(http: httpx.AsyncClient) -> None:
    for _ in range(300):
        if (await http.get("/v1/status")).json()["active_leases"] == 0:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("a lease stayed held")


async def test_a_request_is_found_by_its_id_waiting_running_and_done_and_only_by_its_tenant(
    gateway: Served,
) -> None:
    async with _http(gateway) as http, _http(gateway, OTHER_KEY) as other:
        slow = {"capability": SLOW, "input": {"simulate_invoke_s": 4}}
        running = asyncio.create_task(http.post("/v1/requests", json={**slow, "request_id": "look-1"}))
        await _until_leased(http)
        waiting = asyncio.create_task(http.post("/v1/requests", json={**slow, "request_id": "look-2"}))
        seen = None
        for _ in range(50):
            seen = (await http.get("/v1/requests/look-2")).json()
            if seen.get("verdict"):
                break
            await asyncio.sleep(0.2)
        assert seen is not None and seen["state"] == "waiting" and seen["capability"] == SLOW, seen
        verdict = seen["verdict"]
        assert verdict["request_id"] == "look-2" and verdict["capability"] == SLOW, verdict
        assert (verdict["position"]["in_deployment"], verdict["position"]["deployment_depth"]) == (1, 1), verdict
        assert verdict["priority"] == "interactive" and verdict["waited_s"] >= 0 and verdict["tenant"] == "team"

        first = (await http.get("/v1/requests/look-1")).json()
        assert (first["state"], first["phase"], first["verdict"]) == ("running", "invoking", None), first

        # Another tenant learns nothing: the same answer as for an id nobody used.
        for path in ("/v1/requests/look-1", "/v1/requests/never-used"):
            refused = await other.get(path)
            assert refused.status_code == 404, refused.text
            assert (refused.json()["error"]["code"], refused.json()["failure_class"]) == (
                "request_not_found",
                "REQUEST_INVALID",
            )
        assert "team" not in refused.text
        assert (await http.get("/v1/requests/bad%20id")).status_code == 400

        # The client's connection is lost; it reattaches by id and gets the answer once done.
        waiting.cancel()
        done = (await http.get("/v1/requests/look-2", params={"wait_s": 30})).json()
        assert done["state"] == "succeeded", done
        assert done["result"]["output"]["simulated"] is True and done["result"]["lease"]["tenant"] == "team"
        assert (await running).status_code == 200


# Alone (./scripts/test): the refusal must come within a second of its deadline.
@pytest.mark.serial
async def test_the_clients_own_timeout_is_the_deadline_and_hopeless_work_is_refused_early(gateway: Served) -> None:
    # The openai package sends its read timeout (X-Stainless-Read-Timeout); the answer says the
    # deadline the gateway applied from it.
    async with openai.AsyncOpenAI(
        base_url=f"{gateway.base_url}/v1", api_key=TEAM_KEY, max_retries=0, timeout=30
    ) as client:
        raw = await client.chat.completions.with_raw_response.create(model="small-chat", messages=HELLO)  # type: ignore[arg-type]
        assert raw.headers["x-modelforge-deadline-applied"] == "29 (from X-Stainless-Read-Timeout 30)"
        assert raw.parse().choices[0].message.content
    async with _http(gateway) as http:
        # A job runs for 8 s; a request whose client waits 5 s cannot be served in time: it is
        # refused before the client would give up, instead of waiting to run for nobody.
        slow = {"capability": SLOW, "input": {"simulate_invoke_s": 8}}
        running = asyncio.create_task(http.post("/v1/requests", json=slow))
        await _until_leased(http)
        began = time.monotonic()
        hopeless = await http.post("/v1/requests", json=slow, headers={"X-Request-Timeout": "5"})
        took = time.monotonic() - began
        assert hopeless.status_code == 504, hopeless.text
        assert hopeless.json()["failure_class"] == "DEADLINE_CANNOT_BE_MET"
        assert hopeless.headers["x-should-retry"] == "false"  # the SDKs would be refused again
        assert hopeless.headers["x-modelforge-deadline-applied"] == "4 (from X-Request-Timeout 5)"
        # At the deadline applied (4 s), by the gateway's clock: not a second later when
        # Temporal's timer fires, nor before (the 8 s job was not known hopeless).
        assert 4.0 <= took < 5.0, took
        bad = await http.post("/v1/requests", json=slow, headers={"X-Request-Timeout": "soon"})
        assert (bad.status_code, bad.json()["error"]["param"]) == (400, "X-Request-Timeout")
        # The body's deadline wins over the header.
        quick = await http.post(
            "/v1/requests",
            json={"capability": "rag.embedding@1", "input": {"text": "x"}, "deadline_s": 50},
            headers={"X-Request-Timeout": "40"},
        )
        assert quick.headers["x-modelforge-deadline-applied"] == "50 (from the body's deadline_s)"
        assert (await running).status_code == 200


async def test_a_dry_run_answers_now_later_or_never_and_starts_nothing(gateway: Served) -> None:
    async with _http(gateway) as http:
        warm = await http.post("/v1/requests", json={"capability": "rag.embedding@1", "input": {"text": "x"}})
        assert warm.status_code == 200
        now = (await http.post("/v1/admission/check", json={"model": "all-MiniLM-L6-v2"})).json()
        assert (now["answer"], now["capability"], now["pool"]) == ("now", "rag.embedding@1", "default"), now
        assert (now["action"], now["eta"]["seconds"], now["failure"]) == ("grant", 0, None), now
        cold = (await http.post("/v1/admission/check", json={"capability": "chat.small@1"})).json()
        assert (cold["answer"], cold["action"], cold["eta"]["basis"]) == ("later", "load", "load_in_flight"), cold
        assert cold["eta"]["seconds"] is not None  # the catalog's load figure (0 s for the simulated runtime)

        slow = {"capability": SLOW, "input": {"simulate_invoke_s": 4}}
        running = asyncio.create_task(http.post("/v1/requests", json=slow))
        await _until_leased(http)
        busy = (await http.post("/v1/admission/check", json={"capability": SLOW})).json()
        assert busy["answer"] == "later" and busy["failure"] is None, busy
        assert busy["verdict"]["position"]["in_deployment"] == 1, busy
        # Its queue holds one: with one waiting, the next would be refused.
        behind = asyncio.create_task(http.post("/v1/requests", json=slow))
        never: dict[str, Any] = {}
        for _ in range(50):
            never = (await http.post("/v1/admission/check", json={"capability": SLOW})).json()
            if never["answer"] == "never":
                break
            await asyncio.sleep(0.1)
        assert (never["answer"], never["failure"]) == ("never", "QUEUE_FULL"), never
        assert never["message"]
        unknown = await http.post("/v1/admission/check", json={"model": "gpt-17"})
        assert unknown.status_code == 404

        # The header on a real call: checked, answered, nothing started (the id stays unknown).
        dry = await http.post(
            "/v1/chat/completions",
            json={"model": "small-chat", "messages": HELLO},
            headers={"X-ModelForge-Dry-Run": "1", "X-Request-Id": "dry-1"},
        )
        assert dry.status_code == 200 and dry.headers["x-modelforge-dry-run"] == "1", dry.text
        assert dry.json()["answer"] in ("now", "later") and dry.json()["capability"] == "chat.small@1"
        assert (await http.get("/v1/requests/dry-1")).status_code == 404
        typo = await http.post(
            "/v1/chat/completions",
            json={"model": "small-chat", "messages": HELLO},
            headers={"X-ModelForge-Dry-Run": "maybe"},
        )
        assert typo.status_code == 400
        assert (await running).status_code == 200 and (await behind).status_code == 200


async def _hold(gateway: Served) -> None:
    """A streamed answer of the one-at-a-time model, read to its end (about 4 s)."""
    async with (
        _http(gateway) as http,
        http.stream(
            "POST", "/v1/chat/completions", json={"model": "single-chat", "messages": HELLO, "stream": True}
        ) as answer,
    ):
        assert answer.status_code == 200
        async for _ in answer.aiter_lines():
            pass


async def _behind_a_held_answer(gateway: Served) -> asyncio.Task[None]:
    """Once the model is free, an answer that holds it; returns when it holds it."""
    async with _http(gateway) as http:
        await _until_free(http)
        holding = asyncio.create_task(_hold(gateway))
        await _until_leased(http)
    return holding


async def test_a_waiting_stream_tells_its_verdict_and_the_openai_and_ollama_packages_read_on(
    gateway: Served,
) -> None:
    async with openai.AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key=TEAM_KEY, max_retries=0) as client:
        whole = await client.chat.completions.create(model="single-chat", messages=HELLO)  # type: ignore[arg-type]
        expected = whole.choices[0].message.content
        assert expected

        # Raw: the verdict comment lines come before the answer's pieces.
        holding = await _behind_a_held_answer(gateway)
        lines: list[str] = []
        async with (
            _http(gateway) as http,
            http.stream(
                "POST", "/v1/chat/completions", json={"model": "single-chat", "messages": HELLO, "stream": True}
            ) as answer,
        ):
            assert answer.status_code == 200
            lines = [line async for line in answer.aiter_lines()]
        await holding
        verdicts = [json.loads(line.removeprefix(": verdict ")) for line in lines if line.startswith(": verdict ")]
        assert verdicts, lines[:5]
        assert verdicts[0]["capability"] == "chat.single@1" and verdicts[0]["position"]["in_deployment"] == 1
        assert verdicts[0]["tenant"] == "team" and verdicts[0]["reason"]
        first_piece = next(n for n, line in enumerate(lines) if '"content": "' in line and '"content": ""' not in line)
        assert max(n for n, line in enumerate(lines) if line.startswith(": verdict ")) < first_piece
        assert "data: [DONE]" in lines

        # The openai package: a waiting stream parses as before, the comments skipped.
        holding = await _behind_a_held_answer(gateway)
        began = time.monotonic()
        stream = await client.chat.completions.create(model="single-chat", messages=HELLO, stream=True)  # type: ignore[arg-type]
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]  # type: ignore[union-attr]
        assert time.monotonic() - began > 2.5  # it did wait behind the other answer
        assert "".join(pieces) == expected
        await holding

    # The ollama package: the progress lines read as empty pieces, the answer whole.
    async with ollama.AsyncClient(
        host=gateway.base_url, headers={"Authorization": f"Bearer {TEAM_KEY}"}, timeout=60
    ) as chat:
        holding = await _behind_a_held_answer(gateway)
        parts = [part async for part in await chat.chat(model="single-chat", messages=HELLO, stream=True)]
        await holding
    assert "".join(p.message.content or "" for p in parts) == expected
    assert parts[-1].done and not parts[0].message.content  # the first line was a progress line

    # Raw Ollama: a progress line, as `ollama pull` sends them, with the verdict.
    holding = await _behind_a_held_answer(gateway)
    async with (
        _http(gateway) as http,
        http.stream("POST", "/api/chat", json={"model": "single-chat", "messages": HELLO}) as answer,
    ):
        progress = [json.loads(line) async for line in answer.aiter_lines() if line.strip()]
    await holding
    waiting = [p for p in progress if "modelforge_verdict" in p]
    assert waiting and waiting[0]["status"].startswith("waiting: #1 of 1 in interactive"), progress[:3]
    assert waiting[0]["message"] == {"role": "assistant", "content": ""} and waiting[0]["done"] is False
