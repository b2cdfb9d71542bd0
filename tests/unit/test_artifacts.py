"""Artifacts are read only from the configured roots and only when they are the bytes the
catalog names: traversal, absolute paths elsewhere and symlinks out are refused; a changed file
is ARTIFACT_CORRUPT, before any runtime opens it. The runtime is handed the real path that was
checked (never a relative one), and a file swapped between the check and the load is
ARTIFACT_CORRUPT too."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.node import NodeActivities
from modelforge.catalog import example_catalog_path, load_catalog_file
from modelforge.domain import Deployment
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.messages import LoadInput
from modelforge.runtimes import (
    Heartbeat,
    LoadedModel,
    SimulatedRuntime,
    artifact_digest,
    check_artifact,
    resolve_artifact,
    verify_artifact,
)
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


class _Recording(SimulatedRuntime):
    """The simulated runtime, noting the artifact path it was handed; `during_load` runs as the
    runtime would open its files (to swap one under it)."""

    def __init__(self, *args: Any, during_load: Callable[[], None] | None = None) -> None:
        super().__init__(*args)
        self.handed: list[str] = []
        self.unloaded: list[str] = []
        self._during_load = during_load

    async def load(
        self, key: str, deployment: Deployment, device_index: int, device_uuid: str, heartbeat: Heartbeat
    ) -> LoadedModel:
        self.handed.append(deployment.artifact)
        if self._during_load is not None:
            self._during_load()
        return await super().load(key, deployment, device_index, device_uuid, heartbeat)

    async def unload(self, model: LoadedModel) -> None:
        self.unloaded.append(model.resident_key)
        await super().unload(model)


def _node(roots: list[Path], runtime_factory: Callable[[Any], SimulatedRuntime]) -> tuple[NodeActivities, Any]:
    catalog, external = load_catalog_file(example_catalog_path())
    backend = simulated_backend("gpu-node", catalog, external)
    runtime = runtime_factory(backend)
    return NodeActivities("gpu-node", backend, {"simulated": runtime}, artifact_roots=roots), backend


def _load(artifact: str, sha256: str, key: str = "emb@1@gpu-node/0") -> LoadInput:
    deployment = Deployment(capability="emb@1", envelope_bytes=1 << 30, artifact=artifact, artifact_sha256=sha256)
    return LoadInput(key=key, deployment=deployment, accelerator_id="gpu-node/0", device_index=0, device_uuid="")


async def test_the_runtime_is_handed_the_real_path_that_was_checked(
    roots: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A relative artifact is checked under the root: the runtime must not open it against its
    # own working directory, where another "minilm" waits.
    elsewhere = tmp_path / "cwd"
    (elsewhere / "minilm").mkdir(parents=True)
    (elsewhere / "minilm" / "model.safetensors").write_bytes(b"something else")
    monkeypatch.chdir(elsewhere)
    recording: list[_Recording] = []

    def factory(backend: Any) -> SimulatedRuntime:
        recording.append(_Recording(backend))
        return recording[0]

    node, _ = _node(roots, factory)
    await ActivityEnvironment().run(node.load_model, _load("minilm", artifact_digest(roots[0] / "minilm")))
    handed = recording[0].handed[0]
    assert Path(handed).is_absolute()
    assert handed == os.path.realpath(roots[0] / "minilm")


@pytest.mark.parametrize("target", ["model.safetensors", "config.json"])
async def test_a_file_swapped_between_the_check_and_the_load_is_corrupt(roots: list[Path], target: str) -> None:
    weights = roots[0] / "minilm" / target
    good = artifact_digest(roots[0] / "minilm")

    def swap() -> None:
        # Same bytes, another file: what the runtime opens is not what was hashed.
        replacement = weights.with_name(target + ".new")
        replacement.write_bytes(weights.read_bytes())
        os.replace(replacement, weights)

    recording: list[_Recording] = []

    def factory(backend: Any) -> SimulatedRuntime:
        recording.append(_Recording(backend, during_load=swap))
        return recording[0]

    node, backend = _node(roots, factory)
    with pytest.raises(ApplicationError) as refused:
        await ActivityEnvironment().run(node.load_model, _load("minilm", good))
    assert refused.value.type == "ARTIFACT_CORRUPT" and "after it was checked" in refused.value.message
    # The model the runtime loaded from it was stopped again; nothing is held or recorded loaded.
    assert recording[0].unloaded == ["emb@1@gpu-node/0"]
    [device] = backend.sample()
    assert sum(p.used_bytes for p in device.processes if p.name.startswith("modelforge:")) == 0


def test_a_file_in_a_model_directory_linking_out_of_the_roots_is_refused(roots: list[Path], tmp_path: Path) -> None:
    (roots[0] / "minilm" / "tokenizer.json").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(ModelForgeError) as refused:
        check_artifact("minilm", roots, artifact_digest(roots[0] / "minilm"))
    assert refused.value.failure == FailureClass.REQUEST_INVALID and "links outside" in refused.value.message


def test_checked_artifacts_hash_what_they_opened(roots: list[Path]) -> None:
    good = artifact_digest(roots[0] / "minilm")
    checked = check_artifact(str(roots[0] / "minilm"), roots, good)
    assert checked.digest == good and set(checked.identities) == {"config.json", "model.safetensors"}
    checked.verify_unchanged()
    (roots[0] / "minilm" / "extra.bin").write_bytes(b"new shard")
    with pytest.raises(ModelForgeError) as changed:
        checked.verify_unchanged()  # a file came: not the directory that was checked
    assert changed.value.failure == FailureClass.ARTIFACT_CORRUPT
    single = check_artifact("minilm/model.safetensors", roots, hashlib.sha256(b"weights" * 100).hexdigest())
    assert single.path == (roots[0] / "minilm" / "model.safetensors").resolve() and list(single.identities) == [""]
