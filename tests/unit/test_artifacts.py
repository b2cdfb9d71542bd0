"""Artifacts are read only from the configured roots and only when they are the bytes the
catalog names: traversal, absolute paths elsewhere and symlinks out are refused; a changed file
is ARTIFACT_CORRUPT, before any runtime opens it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.node import NodeActivities
from modelforge.catalog import example_catalog_path, load_catalog_file
from modelforge.domain import Deployment
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.messages import LoadInput
from modelforge.runtimes import SimulatedRuntime, artifact_digest, resolve_artifact, verify_artifact
from workers.node import simulated_backend


@pytest.fixture
def roots(tmp_path: Path) -> list[Path]:
    root = tmp_path / "models"
    (root / "minilm").mkdir(parents=True)
    (root / "minilm" / "model.safetensors").write_bytes(b"weights" * 100)
    (root / "minilm" / "config.json").write_text("{}")
    (tmp_path / "secret.txt").write_text("not a model")
    (root / "escape").symlink_to(tmp_path / "secret.txt")
    return [root]


@pytest.mark.parametrize(
    ("artifact", "failure"),
    [
        ("../secret.txt", FailureClass.REQUEST_INVALID),
        ("minilm/../../secret.txt", FailureClass.REQUEST_INVALID),
        ("/etc/passwd", FailureClass.REQUEST_INVALID),
        ("escape", FailureClass.REQUEST_INVALID),  # a symlink pointing out of the root
        ("minilm\x00.bin", FailureClass.REQUEST_INVALID),
        ("missing.bin", FailureClass.MODEL_LOAD_FAILED),
    ],
)
def test_paths_outside_the_roots_are_refused(roots: list[Path], artifact: str, failure: FailureClass) -> None:
    with pytest.raises(ModelForgeError) as refused:
        resolve_artifact(artifact, roots)
    assert refused.value.failure == failure


def test_paths_inside_the_roots_resolve(roots: list[Path]) -> None:
    assert resolve_artifact("minilm", roots) == (roots[0] / "minilm").resolve()
    assert resolve_artifact(str(roots[0] / "minilm" / "config.json"), roots).name == "config.json"
    with pytest.raises(ModelForgeError, match="no artifact roots"):
        resolve_artifact("minilm", [])


def test_checksums_of_files_and_model_directories(roots: list[Path]) -> None:
    weights = roots[0] / "minilm" / "model.safetensors"
    assert artifact_digest(weights) == hashlib.sha256(b"weights" * 100).hexdigest()
    directory = artifact_digest(roots[0] / "minilm")
    verify_artifact(roots[0] / "minilm", directory)
    weights.write_bytes(b"tampered" * 100)
    with pytest.raises(ModelForgeError) as corrupt:
        verify_artifact(roots[0] / "minilm", directory)
    assert corrupt.value.failure == FailureClass.ARTIFACT_CORRUPT


async def test_a_load_checks_the_artifact_before_the_runtime_sees_it(roots: list[Path]) -> None:
    catalog, external = load_catalog_file(example_catalog_path())
    backend = simulated_backend("gpu-node", catalog, external)
    node = NodeActivities("gpu-node", backend, {"simulated": SimulatedRuntime(backend)}, artifact_roots=roots)
    env = ActivityEnvironment()
    good = artifact_digest(roots[0] / "minilm")

    def load(artifact: str, sha256: str) -> LoadInput:
        deployment = Deployment(capability="emb@1", envelope_bytes=1 << 30, artifact=artifact, artifact_sha256=sha256)
        return LoadInput(
            key=f"emb@1@{artifact}@{sha256[:4]}",
            deployment=deployment,
            accelerator_id="gpu-node/0",
            device_index=0,
            device_uuid="",
        )

    loaded = await env.run(node.load_model, load("minilm", good))
    assert loaded.measured_bytes == 1 << 30
    for artifact, sha256, failure in [
        ("../secret.txt", "", "REQUEST_INVALID"),
        ("minilm", "0" * 64, "ARTIFACT_CORRUPT"),
    ]:
        with pytest.raises(ApplicationError) as refused:
            await env.run(node.load_model, load(artifact, sha256))
        assert refused.value.type == failure and refused.value.non_retryable
    # Nothing was allocated for the refused loads: only the good one holds memory.
    [device] = backend.sample()
    assert sum(p.used_bytes for p in device.processes if p.name.startswith("modelforge:")) == 1 << 30
