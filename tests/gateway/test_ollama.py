"""Ollama's API on the gateway against the dev stack, with the official `ollama` package as the
client: an application built for Ollama uses ModelForge by changing its base URL only."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import ollama
import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.gateway import GatewayConfig, load_api_keys
from modelforge.gateway._ollama import parse_keep_alive
from tests.gateway.serving import CATALOG, ON_DEMAND_AND_TOY_CHAT, TEAM_KEY, Served, serve
from workers.stack import running_stack


@pytest.fixture
async def gateway(dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path) -> AsyncIterator[Served]:
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(CATALOG.read_text() + ON_DEMAND_AND_TOY_CHAT)
    async with running_stack(dev_server_env.client, database_url, catalog_path=catalog) as stack:
        async for served in serve(stack, GatewayConfig()):
            yield served


@pytest.fixture
async def client(gateway: Served) -> AsyncIterator[ollama.AsyncClient]:
    # OLLAMA_HOST is what Ollama applications read; `host=` is the same base URL.
    found = ollama.AsyncClient(host=gateway.base_url, timeout=60)
    try:
        yield found
    finally:
        await found.close()  # type: ignore[no-untyped-call]


async def _refused(call: object, status: int) -> ollama.ResponseError:
    with pytest.raises(ollama.ResponseError) as refused:
        await call  # type: ignore[misc]
    assert refused.value.status_code == status, refused.value
    return refused.value


async def test_chat_and_generate_as_an_ollama_app_calls_them(gateway: Served, client: ollama.AsyncClient) -> None:
    # stream=False: one JSON object.
    chat = await client.chat(
        model="small-chat", messages=[{"role": "user", "content": "is the card busy?"}], stream=False
    )
    assert chat.done and chat.done_reason == "stop" and chat.message.role == "assistant"
    assert "is the card busy?" in (chat.message.content or "")
    assert chat.prompt_eval_count == 4 and chat.model == "small-chat"
    assert (chat.total_duration or 0) > 0

    # stream=True (Ollama's default): a line per piece as the model generates it, then the final one.
    parts = [
        part
        async for part in await client.chat(
            model="small-chat:latest",  # Ollama's default tag names the same model
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
            stream=True,
            keep_alive="5m",
        )
    ]
    assert len(parts) > 2 and parts[-1].done and not any(p.done for p in parts[:-1])
    whole = await client.chat(
        model="small-chat",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
        stream=False,
    )
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    assert parts[-1].done_reason == "stop" and parts[-1].prompt_eval_count == whole.prompt_eval_count

    # Sampling options reach a model server that reads them; runner options and num_ctx within the
    # model's context are accepted; null options are absent (LlamaIndex sends temperature: null).
    options = {"temperature": 0.2, "top_p": 0.9, "num_predict": 64, "stop": ["\n\n"], "num_thread": 8}
    toy = await client.chat(
        model="toy-chat", messages=[{"role": "user", "content": "hi toy"}], options={**options, "top_k": None}
    )
    assert (toy.message.content or "").startswith("[toy server]") and "hi toy" in (toy.message.content or "")
    too_long = await _refused(
        client.chat(model="toy-chat", messages=[{"role": "user", "content": "x"}], options={"num_ctx": 65536}), 400
    )
    assert "options.num_ctx" in str(too_long.error) and "32768" in str(too_long.error)

    generated = await client.generate(model="chat.small@1", prompt="why is the sky blue?", system="short answers")
    assert generated.done and "why is the sky blue?" in (generated.response or "")
    streamed = [part async for part in await client.generate(model="small-chat", prompt="hi", stream=True)]
    assert len(streamed) > 2 and streamed[-1].done and "hi" in "".join(p.response or "" for p in streamed)

    # The wire format Ollama clients parse: NDJSON when streaming (stream absent means true).
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as http:
        raw = await http.post("/api/generate", json={"model": "small-chat", "prompt": "hi"})
        assert raw.status_code == 200 and raw.headers["content-type"] == "application/x-ndjson"
        lines = raw.text.splitlines()
        assert raw.text.endswith("\n") and '"done":true' in lines[-1] and len(lines) > 2
        assert all('"done":false' in line for line in lines[:-1])

    # Every call was one request workflow with its lease in the ledger, like any other.
    granted = await gateway.stack.events("lease_granted", at_least=7)
    assert [e["deployment"] for e in granted].count("chat.small@1") == 6
    assert {e["deployment"] for e in granted} == {"chat.small@1", "chat.toy@1"}


async def test_embed_embeddings_tags_ps_show_and_version(gateway: Served, client: ollama.AsyncClient) -> None:
    embedded = await client.embed(model="all-MiniLM-L6-v2", input=["hello world", "goodbye"])
    assert len(embedded.embeddings) == 2 and all(len(v) == 8 for v in embedded.embeddings)  # simulated: 8
    assert embedded.embeddings[0] != embedded.embeddings[1] and embedded.prompt_eval_count == 3
    one = await client.embed(model="rag.embedding@1", input="hello world", dimensions=4)
    assert len(one.embeddings[0]) == 4 and math.isclose(sum(x * x for x in one.embeddings[0]), 1.0, rel_tol=1e-6)
    older = await client.embeddings(model="text-embedding-3-small", prompt="hello world")
    # Same text, same deployment, same vector, whichever route and name.
    assert list(older.embedding) == pytest.approx(list(embedded.embeddings[0]))

    # Listed as Ollama lists models, name:tag (Open WebUI looks a model up by it), each usable so.
    listed = {m.model: m for m in (await client.list()).models}
    assert {"small-chat:latest", "chat.small@1:latest", "all-MiniLM-L6-v2:latest", "ondemand-chat:latest"} <= set(
        listed
    )
    assert listed["small-chat:latest"].size == 4 * 1024**3 and listed["small-chat:latest"].details is not None
    for name in listed:
        assert (await client.show(name)).details is not None

    # What is loaded now: the embedding model just used, on the simulated card, with an expiry.
    running = {m.model: m for m in (await client.ps()).models}
    embedding = running["rag.embedding@1:latest"]
    assert embedding.size == embedding.size_vram == 1216348160 and embedding.expires_at is not None

    shown = await client.show("small-chat")
    assert shown.details is not None and shown.details.family == "chat.small@1"
    assert shown.modelinfo is not None and shown.modelinfo["modelforge.residency"] == "keep_warm"
    assert shown.capabilities is not None and "completion" in shown.capabilities
    assert shown.template and ".Suffix" not in shown.template  # no fill-in-the-middle asked of it
    toy = await client.show("toy-chat:latest")
    assert toy.capabilities is not None and {"completion", "tools", "thinking"} <= set(toy.capabilities)
    assert toy.modelinfo is not None and toy.modelinfo["subprocess_http.context_length"] == 32768
    assert toy.parameters == "num_ctx 32768"

    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as http:
        version = (await http.get("/api/version")).json()
        assert version["version"].count(".") == 2 and "modelforge" in version
        # Ollama's CLI checks HEAD / before any command.
        assert (await http.head("/")).status_code == 200 and (await http.get("/")).text == "Ollama is running"
        assert (await http.head("/api/tags")).status_code == 200

    # A model the catalog has is there already; nothing downloads, and the catalog stays the source.
    assert (await client.pull("small-chat")).status == "success"
    missing = await _refused(client.pull("llama3.2"), 404)
    assert "catalog" in str(missing.error)
    for call in (client.delete("small-chat"), client.copy("small-chat", "other-chat")):
        refused = await _refused(call, 400)
        assert "modelforge catalog apply" in str(refused.error)


async def test_refusals_are_ollama_errors_with_the_class(gateway: Served, client: ollama.AsyncClient) -> None:
    unknown = await _refused(client.chat(model="llama3.2", messages=[{"role": "user", "content": "x"}]), 404)
    assert "llama3.2" in str(unknown.error) and "not found" in str(unknown.error)
    await _refused(client.embed(model="llama3.2", input="x"), 404)
    await _refused(client.show("llama3.2"), 404)

    bad = await _refused(client.generate(model="small-chat", prompt="x", keep_alive="five minutes"), 400)
    assert "keep_alive" in str(bad.error)
    # A parameter that would change the answer and this runtime cannot honour: refused by name.
    refused = await _refused(client.generate(model="small-chat", prompt="x", format="json"), 400)
    assert "format" in str(refused.error)
    # Fill in the middle only where the catalog says the model does (`insert`).
    refused = await _refused(client.generate(model="small-chat", prompt="x", suffix="return x"), 400)
    assert "suffix" in str(refused.error) and "insert" in str(refused.error)
    # A raw prompt goes to the model as it is: what a template would have added is refused, named.
    refused = await _refused(client.generate(model="toy-chat", prompt="x", raw=True, system="be brief"), 400)
    assert "system" in str(refused.error) and "raw" in str(refused.error)
    refused = await _refused(client.chat(model="toy-chat", messages=[{"role": "wizard", "content": "x"}]), 400)
    assert "wizard" in str(refused.error) and "role" in str(refused.error)

    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as http:
        answer = await http.post("/api/chat", json={"model": "always-on", "messages": [], "keep_alive": 0})
        assert answer.status_code == 404 and answer.json()["failure_class"] == "CAPABILITY_UNAVAILABLE"
        answer = await http.post("/api/embeddings", json={"model": "nope", "prompt": "x"})
        assert (answer.status_code, answer.json()["failure_class"]) == (404, "CAPABILITY_UNAVAILABLE")
        # Fields Ollama does not define are ignored, as Ollama ignores them.
        answer = await http.post("/api/embed", json={"model": "rag.embedding@1", "input": "x", "surprise": 1})
        assert answer.status_code == 200 and len(answer.json()["embeddings"]) == 1, answer.text
        assert answer.headers["x-request-id"] == answer.json()["request_id"]
        # A full queue is 429 with Retry-After, in Ollama's shape.
        slow = {"capability": "slow.job@1", "input": {"simulate_invoke_s": 4}}
        running = asyncio.create_task(http.post("/v1/requests", json=slow))
        waiting = None
        for _ in range(100):
            if (await http.get("/v1/status")).json()["active_leases"] >= 1:
                waiting = asyncio.create_task(http.post("/v1/requests", json=slow))
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
        full = await http.post("/api/embeddings", json={"model": "slow.job@1", "prompt": "x"})
        assert full.status_code == 429 and full.json()["failure_class"] == "QUEUE_FULL", full.text
        assert int(full.headers["retry-after"]) > 0
        assert (await running).status_code == 200
        assert waiting is not None and (await waiting).status_code == 200
    # Nothing refused reached a workflow: only the embedding and the slow jobs hold leases.
    granted = await gateway.stack.events("lease_granted", at_least=3)
    assert {e["deployment"] for e in granted} == {"slow.job@1", "rag.embedding@1"}


async def test_keep_alive_is_a_hint_said_in_the_answer(gateway: Served, client: ollama.AsyncClient) -> None:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as http:
        # Continue's keep_alive 1800 on a model kept 300 s: served, capped, and the answer says so.
        chat = {"model": "small-chat", "messages": [{"role": "user", "content": "x"}], "stream": False}
        answer = await http.post("/api/chat", json={**chat, "keep_alive": 1800, "options": {"num_ctx": 8192}})
        assert answer.status_code == 200, answer.text
        assert "asked=1800s; applied=300s; capped" in answer.headers["x-modelforge-keep-alive"]
        # Pinning (negative) is an operator's action: served, not pinned.
        answer = await http.post("/api/chat", json={**chat, "keep_alive": "-1m"})
        assert answer.status_code == 200 and "modelforge pin" in answer.headers["x-modelforge-keep-alive"]
        # A positive keep_alive on a model that goes when its request ends: served, said.
        answer = await http.post("/api/chat", json={**chat, "model": "ondemand-chat", "keep_alive": "1m"})
        assert answer.status_code == 200 and "applied=0s" in answer.headers["x-modelforge-keep-alive"]
        # keep_alive true is not a duration (Ollama refuses it too): never read as 1 s.
        answer = await http.post("/api/chat", json={**chat, "keep_alive": True})
        assert answer.status_code == 400 and "keep_alive" in answer.json()["error"]
    # keep_alive 0 on a load_on_demand model: it goes when its last request ends, as always.
    answer = await client.chat(
        model="ondemand-chat", messages=[{"role": "user", "content": "once"}], keep_alive=0, stream=False
    )
    assert "once" in (answer.message.content or "")
    for _ in range(100):
        if "chat.ondemand@1:latest" not in {m.model for m in (await client.ps()).models}:
            break
        await asyncio.sleep(0.1)
    else:
        pytest.fail("chat.ondemand@1 still loaded 10 s after its request ended")


async def _loaded(client: ollama.AsyncClient) -> set[str]:
    return {m.model or "" for m in (await client.ps()).models}


async def test_no_tenant_unloads_what_the_catalog_keeps_warm(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    """The attack of the integrity round: a background tenant's Ollama unload idiom (an empty chat
    or prompt with keep_alive 0) kept production's embedding model cold. Now it releases only the
    caller's own hold; an operator's key unloads (drained, recorded with who asked)."""
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(f'[api_keys]\n"{TEAM_KEY}" = "default"\n"sk-ops-0123456789abcdef" = "rag"\n')
    config = GatewayConfig(api_keys=load_api_keys(keys_file), operator_tenants=frozenset({"rag"}))
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        async for served in serve(stack, config):
            tenant = ollama.AsyncClient(
                host=served.base_url, timeout=60, headers={"Authorization": f"Bearer {TEAM_KEY}"}
            )
            ops = ollama.AsyncClient(
                host=served.base_url, timeout=60, headers={"Authorization": "Bearer sk-ops-0123456789abcdef"}
            )
            try:
                await tenant.embed(model="rag.embedding@1", input="warm it")
                await tenant.chat(model="small-chat", messages=[{"role": "user", "content": "warm"}], stream=False)
                assert {"rag.embedding@1:latest", "chat.small@1:latest"} <= await _loaded(tenant)
                async with httpx.AsyncClient(
                    base_url=served.base_url, timeout=60, headers={"Authorization": f"Bearer {TEAM_KEY}"}
                ) as http:
                    for route, body, load_call in [
                        ("/api/chat", {"model": "small-chat", "messages": [], "keep_alive": 0}, True),
                        ("/api/generate", {"model": "small-chat", "prompt": "", "keep_alive": 0}, True),
                        ("/api/generate", {"model": "small-chat", "prompt": "bye", "keep_alive": 0}, False),
                        ("/api/embed", {"model": "rag.embedding@1", "input": "x", "keep_alive": 0}, False),
                    ]:
                        answer = await http.post(route, json={**body, "stream": False})
                        assert answer.status_code == 200, answer.text
                        assert "not unloaded" in answer.headers["x-modelforge-keep-alive"], answer.headers
                        if load_call:  # nothing unloaded: the answer does not say "unload"
                            assert answer.json()["done_reason"] == "load"
                await asyncio.sleep(2.0)
                assert {"rag.embedding@1:latest", "chat.small@1:latest"} <= await _loaded(tenant)
                # The operator's unload idiom unloads, once the model's leases end.
                done = await ops.chat(model="small-chat", messages=[], keep_alive=0)
                assert done.done_reason == "unload"
                for _ in range(100):
                    if "chat.small@1:latest" not in await _loaded(ops):
                        break
                    await asyncio.sleep(0.1)
                else:
                    pytest.fail("chat.small@1 still loaded 10 s after an operator's keep_alive 0")
                assert "rag.embedding@1:latest" in await _loaded(ops)
                # Streamed, the headers leave with the first piece: the final line says what
                # came of the operator's unload.
                async with httpx.AsyncClient(
                    base_url=served.base_url,
                    timeout=60,
                    headers={"Authorization": "Bearer sk-ops-0123456789abcdef"},
                ) as http:
                    body = {"model": "small-chat", "messages": [{"role": "user", "content": "bye"}], "keep_alive": 0}
                    streamed = await http.post("/api/chat", json={**body, "stream": True})
                    final = json.loads(streamed.text.strip().splitlines()[-1])
                    assert final["done"] is True and "modelforge_keep_alive" in final, final
                    assert "not unloaded" not in final["modelforge_keep_alive"], final
                for _ in range(100):
                    if "chat.small@1:latest" not in await _loaded(ops):
                        break
                    await asyncio.sleep(0.1)
                else:
                    pytest.fail("chat.small@1 still loaded 10 s after an operator's streamed keep_alive 0")
            finally:
                for opened in (tenant, ops):
                    await opened.close()  # type: ignore[no-untyped-call]
            asked = await stack.events("unload_requested", at_least=1)
            assert {e["deployment"] for e in asked} == {"chat.small@1"}
            assert "ollama keep_alive 0 by rag" in asked[0]["message"]
            assert not [e for e in await stack.events("unload", at_least=0) if e["deployment"] == "rag.embedding@1"]


async def test_api_keys_guard_the_ollama_routes(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(f'[api_keys]\n"{TEAM_KEY}" = "rag"\n')
    config = GatewayConfig(api_keys=load_api_keys(keys_file))
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        async for served in serve(stack, config):
            anonymous = ollama.AsyncClient(host=served.base_url, timeout=60)
            wrong = ollama.AsyncClient(host=served.base_url, timeout=60, headers={"Authorization": "Bearer sk-wrong"})
            team = ollama.AsyncClient(host=served.base_url, timeout=60, headers={"Authorization": f"Bearer {TEAM_KEY}"})
            try:
                for unauthorized in (anonymous, wrong):
                    refused = await _refused(unauthorized.embed(model="all-MiniLM-L6-v2", input="x"), 401)
                    assert "API key" in str(refused.error)
                    await _refused(unauthorized.list(), 401)
                    await _refused(unauthorized.ps(), 401)
                answer = await team.embed(model="all-MiniLM-L6-v2", input="x")
                assert len(answer.embeddings) == 1
                assert (await team.list()).models
            finally:
                for opened in (anonymous, wrong, team):
                    await opened.close()  # type: ignore[no-untyped-call]
            [granted] = await stack.events("lease_granted", at_least=1)
            assert granted["payload"]["tenant"] == "rag"


@pytest.mark.parametrize(
    ("given", "seconds"),
    [
        (None, None),
        (0, 0.0),
        ("0", 0.0),
        (300, 300.0),
        (1.5, 1.5),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("1.5h", 5400.0),
        ("300ms", 0.3),
        ("-1", math.inf),
        (-1, math.inf),
        ("-1m", math.inf),
    ],
)
def test_keep_alive_is_read_as_ollama_reads_it(given: object, seconds: float | None) -> None:
    if given == "-1":  # Go's ParseDuration wants a unit on any number but 0
        with pytest.raises(ValueError, match="not a duration"):
            parse_keep_alive(given)
        return
    assert parse_keep_alive(given) == (pytest.approx(seconds) if seconds not in (None, math.inf) else seconds)


@pytest.mark.parametrize("given", ["5 minutes", "", "m", "5", "1d", True, [1], {"s": 1}, float("nan")])
def test_bad_keep_alive_values_are_refused(given: object) -> None:
    with pytest.raises(ValueError):
        parse_keep_alive(given)
