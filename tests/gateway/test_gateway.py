"""The HTTP gateway against the dev stack, with the official `openai` package as the client:
an application built on the OpenAI SDK uses ModelForge by changing its base URL only."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from temporalio.testing import WorkflowEnvironment

from modelforge.failures import FailureClass
from modelforge.gateway import GatewayConfig, http_status, load_api_keys
from tests.gateway.serving import CATALOG, TEAM_KEY, Served, serve
from workers.stack import running_stack

pytestmark = pytest.mark.workflow


@pytest.fixture
async def gateway(dev_server_env: WorkflowEnvironment, database_url: str) -> AsyncIterator[Served]:
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        async for served in serve(stack, GatewayConfig()):
            yield served


async def test_openai_sdk_embeddings_and_chat_through_the_gateway(gateway: Served) -> None:
    async with openai.AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        await _embeddings_and_chat(gateway, client)


async def _embeddings_and_chat(gateway: Served, client: openai.AsyncOpenAI) -> None:
    # The SDK asks for base64 unless told otherwise, and decodes it: both encodings must work.
    first = await client.embeddings.create(model="text-embedding-3-small", input=["hello world", "goodbye"])
    assert [d.index for d in first.data] == [0, 1]
    assert all(len(d.embedding) == 8 for d in first.data)  # the simulated runtime's 8 dimensions
    again = await client.embeddings.create(model="all-MiniLM-L6-v2", input="hello world", encoding_format="float")
    # Same text, same deployment: the same vector (float32 round trip through base64 aside).
    assert again.data[0].embedding == pytest.approx(first.data[0].embedding, abs=1e-6)
    assert first.data[0].embedding != pytest.approx(first.data[1].embedding, abs=1e-6)
    # The simulated runtime reports no token counts: estimated (11 and 7 characters, ~4 a token),
    # and marked so, never words presented as tokens.
    assert first.usage.prompt_tokens == 5 and first.model == "text-embedding-3-small"
    assert (first.usage.model_extra or {})["estimated"] is True

    chat = await client.chat.completions.create(
        model="small-chat", messages=[{"role": "user", "content": "is the card busy?"}]
    )
    assert "is the card busy?" in (chat.choices[0].message.content or "")
    assert chat.choices[0].finish_reason == "stop" and chat.usage is not None and chat.usage.prompt_tokens == 5
    assert (chat.usage.model_extra or {})["estimated"] is True

    models = {m.id for m in (await client.models.list()).data}
    assert {"small-chat", "all-MiniLM-L6-v2", "rag.embedding@1"} <= models

    with pytest.raises(openai.NotFoundError) as unknown:
        await client.embeddings.create(model="gpt-17", input="x")
    assert (unknown.value.code, unknown.value.param) == ("model_not_found", "model")
    assert unknown.value.body["modelforge_class"] == FailureClass.CAPABILITY_UNAVAILABLE.value  # type: ignore[index]
    # stream_options without stream is refused, named (streaming itself: tests/gateway/test_streaming.py).
    with pytest.raises(openai.BadRequestError) as options:
        await client.chat.completions.create(
            model="small-chat",
            messages=[{"role": "user", "content": "x"}],
            extra_body={"stream_options": {"include_usage": True}},
        )
    assert options.value.param == "stream_options" and options.value.type == "invalid_request_error"
    assert options.value.body["modelforge_class"] == FailureClass.REQUEST_INVALID.value  # type: ignore[index]

    # Each call was one request workflow, with the lease in the ledger like any other.
    granted = await gateway.stack.events("lease_granted", at_least=3)
    assert {e["deployment"] for e in granted} == {"rag.embedding@1", "chat.small@1"}


async def test_requests_status_and_failure_classes_over_http(gateway: Served) -> None:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as http:
        ok = await http.post(
            "/v1/requests",
            json={"capability": "rag.embedding@1", "input": {"text": "hi"}, "request_id": "gw-1"},
            headers={"X-ModelForge-Tenant": "rag"},
        )
        assert ok.status_code == 200, ok.text
        body = ok.json()
        assert body["request_id"] == "gw-1" and body["lease"]["tenant"] == "rag"
        assert body["lease"]["priority"] == "production" and body["output"]["simulated"] is True

        status = (await http.get("/v1/status")).json()
        [gpu] = status["accelerators"]
        assert gpu["id"] == "gpu-node/0" and gpu["simulated"] is True and gpu["external_bytes"] == 6 * 1024**3

        cases = [
            ({"capability": "rag.embedding@1", "input": "not an object"}, {}, 400, "REQUEST_INVALID"),
            ({"capability": "rag.embedding@1", "surprise": 1}, {}, 400, "REQUEST_INVALID"),
            ({"capability": "vision.ocr@9"}, {}, 404, "CAPABILITY_UNAVAILABLE"),
            ({"capability": "rag.embedding@1"}, {"X-ModelForge-Tenant": "mallory"}, 400, "REQUEST_INVALID"),
            ({"capability": "rag.embedding@1", "request_id": "../../etc"}, {}, 400, "REQUEST_INVALID"),
            ({"capability": "rag.embedding@1", "priority": "root"}, {}, 400, "REQUEST_INVALID"),
        ]
        for payload, headers, expected_status, failure in cases:
            answer = await http.post("/v1/requests", json=payload, headers=headers)
            assert (answer.status_code, answer.json()["failure_class"]) == (expected_status, failure), payload
            assert answer.json()["error"]["message"] and answer.json()["error"]["modelforge_class"] == failure

        huge = await http.post("/v1/requests", content=b"{" + b" " * (3 * 1024 * 1024) + b"}")
        assert (huge.status_code, huge.json()["failure_class"]) == (413, "REQUEST_INVALID")

        # A full queue is 429 with Retry-After: one slow job runs, one waits, the third is refused.
        slow = {"capability": "slow.job@1", "input": {"simulate_invoke_s": 6}}
        running = asyncio.create_task(http.post("/v1/requests", json=slow))
        for _ in range(100):
            if (await http.get("/v1/status")).json()["active_leases"] >= 1:
                break
            await asyncio.sleep(0.1)
        waiting = asyncio.create_task(http.post("/v1/requests", json=slow))
        await asyncio.sleep(1.0)
        full = await http.post("/v1/requests", json=slow)
        assert full.status_code == 429, full.text
        assert full.json()["failure_class"] == "QUEUE_FULL" and int(full.headers["retry-after"]) > 0
        assert (await running).status_code == 200 and (await waiting).status_code == 200


async def test_a_request_id_in_flight_is_a_conflict_and_the_priority_header_counts(gateway: Served) -> None:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as http:
        # X-ModelForge-Priority on /v1/requests: the lease is granted in the class it names.
        background = await http.post(
            "/v1/requests",
            json={"capability": "rag.embedding@1", "input": {"text": "hi"}},
            headers={"X-ModelForge-Tenant": "rag", "X-ModelForge-Priority": "background"},
        )
        assert background.status_code == 200, background.text
        assert background.json()["lease"]["priority"] == "background"

        # One tenant's request runs; another's with the same id is a typed conflict that does
        # not say whose the first one is.
        slow = {"capability": "slow.job@1", "input": {"simulate_invoke_s": 3}, "request_id": "shared-id-1"}
        first = asyncio.create_task(http.post("/v1/requests", json=slow))
        for _ in range(100):
            if (await http.get("/v1/status")).json()["active_leases"] >= 1:
                break
            await asyncio.sleep(0.1)
        second = await http.post("/v1/requests", json=slow, headers={"X-ModelForge-Tenant": "rag"})
        assert (second.status_code, second.json()["failure_class"]) == (409, "REQUEST_INVALID"), second.text
        assert "shared-id-1" in second.json()["error"]["message"] and "default" not in second.text
        assert (await first).status_code == 200
        # Done, the id may be used again.
        again = await http.post("/v1/requests", json={**slow, "input": {}})
        assert again.status_code == 200, again.text


# Any text: NUL, control characters, lone surrogates (JSON can carry them as escapes), other
# scripts, long runs; and the names that do exist, so some requests go all the way through.
_ANY_TEXT = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=30),
    st.integers(60, 3000).map(lambda n: "a" * n),
    st.sampled_from(["\x00", "a\x00b", "rag\n", "\ud800", "..", "a b", "a@1@2", "é", "rag:x", "-x", "x" * 65]),
)
_IDENT = st.one_of(_ANY_TEXT, st.sampled_from(["rag", "default", "id-1", "team:run.7", "background", "interactive"]))
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | _ANY_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_ANY_TEXT, inner, max_size=3),
    max_leaves=8,
)
_NESTED = st.integers(1, 400).map(lambda depth: json.loads('{"a":' * depth + "1" + "}" * depth))
_HEADER = st.text(st.sampled_from([chr(c) for c in [*range(0x21, 0x7F), *range(0xA0, 0x100)]]), min_size=1, max_size=80)
_BODIES = st.one_of(
    st.tuples(
        st.just("/v1/requests"),
        st.fixed_dictionaries(
            {"capability": st.one_of(st.just("rag.embedding@1"), _IDENT)},
            optional={
                "request_id": _IDENT,
                "tenant": _IDENT,
                "priority": _IDENT,
                "input": st.one_of(st.dictionaries(_ANY_TEXT, _JSON, max_size=3), _NESTED, _JSON),
            },
        ),
    ),
    st.tuples(
        st.just("/v1/embeddings"),
        st.fixed_dictionaries(
            {
                "model": st.one_of(st.just("all-MiniLM-L6-v2"), _IDENT),
                "input": st.one_of(_ANY_TEXT, st.lists(_ANY_TEXT, max_size=3), _NESTED),
            }
        ),
    ),
    st.tuples(
        st.just("/v1/chat/completions"),
        st.fixed_dictionaries(
            {
                "model": st.one_of(st.just("small-chat"), _IDENT),
                "messages": st.lists(st.fixed_dictionaries({"role": _IDENT, "content": _ANY_TEXT}), max_size=2),
            }
        ),
    ),
)


def _typed(answer: httpx.Response, path: str) -> None:
    body = answer.json()
    if answer.status_code == 200:
        assert {"/v1/requests": "request_id", "/v1/embeddings": "data", "/v1/chat/completions": "choices"}[path] in body
        return
    failure = body["failure_class"]
    assert body["error"]["modelforge_class"] == failure and body["error"]["message"], body
    assert body["error"]["type"] == "invalid_request_error", body
    # Refused as invalid; or, a well-formed name that nothing serves, 404.
    assert (answer.status_code in (400, 409, 413) and failure == "REQUEST_INVALID") or (
        answer.status_code == 404 and failure == "CAPABILITY_UNAVAILABLE"
    ), (answer.status_code, body)


async def test_hostile_bodies_and_identifiers_get_typed_answers_and_leave_it_serving(gateway: Served) -> None:
    """Every answer to arbitrary bodies, identifiers and headers is a typed success or a typed
    refusal, and an ordinary request right after each one still succeeds (on the dev stack)."""
    ordinary = {"model": "all-MiniLM-L6-v2", "input": "hello"}

    @settings(
        max_examples=40,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(
        call=_BODIES,
        raw_surrogates=st.booleans(),
        headers=st.dictionaries(
            st.sampled_from(["X-ModelForge-Tenant", "X-Request-Id", "X-ModelForge-Priority"]), _HEADER, max_size=2
        ),
    )
    def property_(call: tuple[str, dict[str, Any]], raw_surrogates: bool, headers: dict[str, str]) -> None:
        path, body = call
        # JSON's \u escapes, or the characters themselves (lone surrogates as invalid UTF-8).
        content = (
            json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
            if raw_surrogates
            else json.dumps(body).encode()
        )
        sent = {k: v.strip().encode("latin-1") for k, v in headers.items()}
        with httpx.Client(base_url=gateway.base_url, timeout=60) as http:
            _typed(http.post(path, content=content, headers=sent), path)  # type: ignore[arg-type]
            after = http.post("/v1/embeddings", json=ordinary)
            assert after.status_code == 200, after.text

    await asyncio.to_thread(property_)


async def test_api_keys_choose_the_tenant(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(f'[api_keys]\n"{TEAM_KEY}" = "rag"\n')
    config = GatewayConfig(api_keys=load_api_keys(keys_file))
    assert TEAM_KEY not in repr(config)  # keys never show in logs or reprs
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        async for served in serve(stack, config):
            base_url = f"{served.base_url}/v1"
            async with openai.AsyncOpenAI(base_url=base_url, api_key="sk-wrong-wrong-wrong", max_retries=0) as anon:
                with pytest.raises(openai.AuthenticationError):
                    await anon.embeddings.create(model="all-MiniLM-L6-v2", input="x")
            async with openai.AsyncOpenAI(base_url=base_url, api_key=TEAM_KEY, max_retries=0) as team:
                await team.embeddings.create(model="all-MiniLM-L6-v2", input="x")
            [granted] = await stack.events("lease_granted", at_least=1)
            assert granted["payload"]["tenant"] == "rag"


@pytest.mark.parametrize(
    ("failure", "status"),
    [
        ("REQUEST_INVALID", 400),
        ("QUEUE_FULL", 429),
        ("DEADLINE_CANNOT_BE_MET", 504),
        ("LEASE_TIMEOUT", 504),
        ("CAPABILITY_UNAVAILABLE", 503),
        ("INSUFFICIENT_SCHEDULABLE_VRAM", 503),
        ("RUNTIME_CRASH", 502),
        ("something new", 500),
    ],
)
def test_every_failure_class_has_an_http_status(failure: str, status: int) -> None:
    assert http_status(failure) == status


def test_every_failure_class_is_mapped_explicitly() -> None:
    assert all(http_status(f.value) != 500 for f in FailureClass)


def test_bad_key_files_are_refused_with_the_reason(tmp_path: Path) -> None:
    from modelforge.failures import ModelForgeError

    for text, fragment in [
        ("nonsense = [", "not TOML"),
        ("[other]\n", "[api_keys]"),
        ('[api_keys]\n"short" = "rag"\n', "16+"),
        ('[api_keys]\n"sk-0123456789abcdef" = "rag:prod"\n', "tenant"),
        ("x = " + "[" * 100_000 + "]" * 100_000, "nests too deeply"),
    ]:
        path = tmp_path / "k.toml"
        path.write_text(text)
        with pytest.raises(ModelForgeError, match=fragment.replace("[", r"\[").replace("+", r"\+")):
            load_api_keys(path)
