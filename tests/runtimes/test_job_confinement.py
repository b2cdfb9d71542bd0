"""What a job may read and who may read what it writes: a job's
directories are its owner's only (0700, files 0600, as the payload store keeps the same inputs),
and the shipped example jobs take a path argument only as an artifact of the job or inside its
own directories, never any host path a submitter names."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import numpy as np
import pytest
from temporalio.exceptions import ApplicationError

from modelforge.failures import FailureClass
from modelforge.runtimes import _subprocess_job as job_module
from modelforge.runtimes import job_log_dirs
from tests.runtimes.jobs import MERGE, ROOT, Node, job, python

EVALUATE = ROOT / "examples" / "jobs" / "evaluate.py"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_a_jobs_directories_and_files_are_its_owners_only(node: Node) -> None:
    code = (
        "import os, pathlib;"
        "pathlib.Path(os.environ['MODELFORGE_OUTPUT_DIR'], 'weights.bin').write_bytes(b'w');"
        "pathlib.Path(os.environ['MODELFORGE_CHECKPOINT_DIR'], 'step.json').write_text('{}');"
        "print('done')"
    )
    await node.load(job(python(code)))
    output = await node.invoke("private", {"t": 1})
    [run] = job_log_dirs(node.home, "private")
    checkpoints = node.store / "private" / "job" / "run-1"
    folders = [node.runtime.jobs_dir, run.parent, run, run / "output", checkpoints, checkpoints.parent]
    assert {str(folder): mode(folder) for folder in folders} == {str(folder): 0o700 for folder in folders}
    files = [run / "input.json", run / "status.json", run / "job.log", run / "output" / "weights.bin"]
    files.append(checkpoints / "step.json")  # what the job writes itself: umask 077
    assert {str(file): mode(file) for file in files} == {str(file): 0o600 for file in files}
    assert output["exit_code"] == 0


def _stored(node: Node, path: Path) -> str:
    outputs = job_module._list_outputs(path.parent)
    job_module.register_outputs(node.runtime.store, path.parent, outputs, "test", "n")
    [entry] = [entry for entry in outputs if entry["path"] == path.name]
    return str(entry["artifact"])


async def test_the_example_merge_takes_artifacts_and_refuses_a_host_path(node: Node, tmp_path: Path) -> None:
    # Two models on the host, outside anything of the job's: a submitter naming them by path
    # had the job read them (any file the node's user can read, /etc/... included).
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        np.savez(tmp_path / name / f"{name}.npz", layer000=np.eye(4), layer001=2 * np.eye(4))
    host_a, host_b = tmp_path / "a" / "a.npz", tmp_path / "b" / "b.npz"
    await node.load(job([sys.executable, str(MERGE)]))
    with pytest.raises(ApplicationError, match="refused its arguments") as refused:
        await node.invoke("by-path", {"args": ["--model-a", str(host_a), "--model-b", str(host_b)]})
    assert refused.value.type == FailureClass.REQUEST_INVALID.value
    assert "not an artifact of this job" in refused.value.message
    merged = await node.invoke(
        "by-artifact", {"args": ["--model-a", _stored(node, host_a), "--model-b", _stored(node, host_b)]}
    )
    assert merged["exit_code"] == 0 and {o["path"] for o in merged["outputs"]} >= {"layer000.npy", "layer001.npy"}


async def test_the_example_evaluation_refuses_a_host_path_for_its_model_and_dataset(node: Node, tmp_path: Path) -> None:
    await node.load(job([sys.executable, str(MERGE)]))
    merged = await node.invoke("eval-src", {"args": ["--layers", "2", "--dim", "8"]})
    stacked = next(o for o in merged["outputs"] if o["path"] == "merged.npy")
    await node.env().run(node.activities.unload_model, "merge.job@1@n/cpu")
    await node.load(job([sys.executable, str(EVALUATE)]))
    host_model = node.runtime.store / "sha256" / stacked["sha256"]  # the same bytes, named by a host path
    triples = tmp_path / "triples.jsonl"  # a valid dataset, on the host
    triples.write_text('{"anchor": "a cat sat", "positive": "the cat sat", "negative": "stock prices"}\n')
    for n, args in enumerate(
        (
            ["--model", str(host_model)],
            ["--model", stacked["artifact"], "--dataset", str(triples)],
            ["--model", stacked["artifact"], "--dataset", "/etc/passwd"],
        )
    ):
        with pytest.raises(ApplicationError, match="refused its arguments") as refused:
            await node.invoke(f"eval-host-{n}", {"args": args})
        assert refused.value.type == FailureClass.REQUEST_INVALID.value, args
        assert "not an artifact of this job" in refused.value.message, args
    score = await node.invoke("eval-ok", {"args": ["--model", stacked["artifact"], "--probes", "4"]})
    assert score["result"]["layers"] == 2
