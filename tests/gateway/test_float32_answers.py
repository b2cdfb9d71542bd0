"""A 2,048-input embeddings call on the real all-MiniLM-L6-v2 (CPU device) through the gateway,
whose answer (2,048 x 384) travels from the node as float32 (modelforge/payloads.py): the
official `openai` package gets the vectors the runtime computes, in both encodings; the Python
API (what `modelforge request` prints) gets plain lists; Ollama's /api/embed answers the same."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.client import ModelForgeClient
from modelforge.domain import Deployment, GiB
from modelforge.gateway import GatewayConfig
from modelforge.gpu import CPU_DEVICE_INDEX, HostMemoryDevice, NodeDevices, SimulatedGpuBackend
from modelforge.payloads import OUTPUT_REF, with_payload_store
from modelforge.runtimes import SentenceTransformersRuntime
from modelforge.settings import DEFAULT_MAX_PAYLOAD_BYTES, DEFAULT_PAYLOAD_THRESHOLD_BYTES
from tests.gateway.serving import Served, serve
from workers.stack import running_stack

pytestmark = pytest.mark.workflow

CPU_CATALOG = Path(__file__).resolve().parents[1] / "catalogs" / "cpu_embedding.toml"

CAPABILITY = "rag.embedding.cpu@1"
# Short texts: 2,048 of them encode in a second or two on a shared CPU.
TEXTS = [f"note {n} on cats" if n % 2 else f"tax rule {n}" for n in range(2048)]


def quiet(_: str) -> None:
    return None


def _furthest(a: list[list[float]], b: list[list[float]]) -> float:
    assert len(a) == len(b) and all(len(x) == len(y) for x, y in zip(a, b, strict=True))
    return max(abs(p - q) for x, y in zip(a, b, strict=True) for p, q in zip(x, y, strict=True))


@pytest.fixture(scope="module")
async def direct() -> AsyncIterator[dict[int, list[list[float]]]]:
    """TEXTS, and their first 64, on a MiniLM loaded here, called directly: what the model
    computes (by count: a batch of other texts pads differently, which moves the last bits)."""
    pytest.importorskip("sentence_transformers")
    runtime = SentenceTransformersRuntime(NodeDevices(SimulatedGpuBackend([]), HostMemoryDevice("n", 4 * GiB)))
    deployment = Deployment(capability="emb@1", envelope_bytes=GiB, runtime="sentence_transformers")
    model = await runtime.load("emb@1@n/cpu", deployment, CPU_DEVICE_INDEX, "", quiet)
    try:
        called = {n: (await runtime.invoke(model, {"texts": TEXTS[:n]}, quiet))["embeddings"] for n in (2048, 64)}
    finally:
        await runtime.unload(model)
    yield called


@pytest.fixture
async def gateway(dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path) -> AsyncIterator[Served]:
    pytest.importorskip("sentence_transformers")
    # Every client and worker with the payload store, as `modelforge dev` and compose run them.
    client = with_payload_store(
        dev_server_env.client, tmp_path / "payloads", DEFAULT_PAYLOAD_THRESHOLD_BYTES, DEFAULT_MAX_PAYLOAD_BYTES
    )
    async with running_stack(client, database_url, CPU_CATALOG) as stack:
        async for served in serve(stack, GatewayConfig()):
            yield served


async def test_2048_inputs_through_the_gateway_are_the_runtimes_vectors_in_both_encodings(
    gateway: Served, direct: dict[int, list[list[float]]]
) -> None:
    async with openai.AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
        # The SDK asks for base64 by default: the float32 bytes the node stored, row by row.
        based = await client.embeddings.create(
            model="all-MiniLM-L6-v2", input=TEXTS, extra_headers={"X-Request-Id": "f32-base64"}
        )
        floats = await client.embeddings.create(
            model="all-MiniLM-L6-v2", input=TEXTS, encoding_format="float", extra_headers={"X-Request-Id": "f32-float"}
        )
    for answer in (based, floats):
        assert [d.index for d in answer.data] == list(range(2048))
        # Equal to the direct call within float32 rounding (the model computes in float32; the
        # answer carries its float32 values unchanged).
        assert _furthest([list(d.embedding) for d in answer.data], direct[2048]) <= 1e-6
    # The answer did go by reference as float32, not JSON, and the history only names it.
    raw = await gateway.stack.client.get_workflow_handle(f"request:{CAPABILITY}:f32-base64").result()
    assert raw["output"][OUTPUT_REF]["format"] == "float32"

    # "float" is JSON numbers on the wire, the base64 form one string per vector.
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=120) as http:
        wire = await http.post(
            "/v1/embeddings",
            json={"model": "all-MiniLM-L6-v2", "input": TEXTS[:64], "encoding_format": "base64"},
        )
    assert wire.status_code == 200 and wire.headers["content-type"] == "application/json"
    assert all(isinstance(d["embedding"], str) and len(d["embedding"]) == 2048 for d in wire.json()["data"])


async def test_the_python_api_gets_plain_lists_and_ollama_embed_answers(
    gateway: Served, direct: dict[int, list[list[float]]]
) -> None:
    result = await ModelForgeClient(gateway.stack.client).request(CAPABILITY, {"texts": TEXTS}, deadline_s=300)
    assert result.ok and result.output is not None, (result.failure_class, result.message)
    vectors = result.output["embeddings"]
    assert all(type(v) is list and all(type(x) is float for x in v[:5]) for v in vectors)
    assert _furthest(vectors, direct[2048]) <= 1e-6
    # What `modelforge request --json` prints: JSON numbers, the same values.
    assert _furthest(json.loads(json.dumps(result.output))["embeddings"], direct[2048]) <= 1e-6

    # Ollama's /api/embed on an answer large enough for the float32 form (64 x 384 values).
    async with ollama.AsyncClient(host=gateway.base_url, timeout=120) as client:
        embedded = await client.embed(model="all-MiniLM-L6-v2", input=TEXTS[:64])
        shortened = await client.embed(model="all-MiniLM-L6-v2", input=TEXTS[:64], dimensions=16)
    assert _furthest([list(v) for v in embedded.embeddings], direct[64]) <= 1e-6
    assert len(shortened.embeddings) == 64 and all(len(v) == 16 for v in shortened.embeddings)
