"""Jobs from files and across nodes: a job TOML and `--nvlink` for `modelforge job submit`
(checked before anything connects, and honoured or refused by the node), a job's output
directory as one artifact, the artifact store's own location and its retention, the
evaluation dataset shipped with the examples, and `modelforge logs`/`jobs --cluster` reading
another node's jobs through Temporal (the end of a job's log in its answer)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from temporalio.exceptions import ApplicationError
from typer.testing import CliRunner

from modelforge import cli
from modelforge.domain import GiB
from modelforge.failures import FailureClass
from modelforge.runtimes import _subprocess_job as job_module
from modelforge.runtimes import job_log_dirs
from tests.runtimes.jobs import CPU_KEY, MERGE, MERGE_ARGS, ROOT, Node, job, python

JOB_FILE = ROOT / "examples" / "jobs" / "merge-job.toml"
EVALUATE = ROOT / "examples" / "jobs" / "evaluate.py"


class Recorded:
    """ModelForgeClient's request and submit_job, recording what `job submit` sends."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from modelforge import client, temporal

        self.calls: list[dict[str, Any]] = []

        async def connect(*args: Any, **kwargs: Any) -> object:
            return object()

        async def submit_job(self_: Any, capability: str, args: list[str], **kwargs: Any) -> Any:
            self.calls.append({"via": "submit_job", "capability": capability, "args": args, **kwargs})
            return client.Result(ok=True, request_id=kwargs["request_id"], capability=capability, output={})

        async def request(self_: Any, capability: str, payload: dict[str, Any], **kwargs: Any) -> Any:
            self.calls.append({"via": "request", "capability": capability, "payload": payload, **kwargs})
            return client.Result(ok=True, request_id=kwargs["request_id"], capability=capability, output={})

        monkeypatch.setattr(temporal, "connect", connect)
        monkeypatch.setattr(client.ModelForgeClient, "submit_job", submit_job)
        monkeypatch.setattr(client.ModelForgeClient, "request", request)


def submit(*arguments: str) -> Any:
    return CliRunner().invoke(cli.app, ["job", "submit", *arguments])


def test_job_submit_takes_a_job_toml_and_the_command_line_wins_over_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MODELFORGE_HOME", str(tmp_path / "home"))
    sent = Recorded(monkeypatch)
    done = submit("--file", str(JOB_FILE), "--request-id", "from-file")
    assert done.exit_code == 0, done.output
    [call] = sent.calls
    assert (call["capability"], call["args"], call["max_duration_s"], call["tenant"], call["priority"]) == (
        "merge.slerp.cpu@1",
        ["--layers", "8", "--t", "0.5"],
        4 * 3600.0,
        "lab",
        "background",
    )
    assert call["queue"] is None and call["gpu_count"] is None

    # Arguments after -- replace the file's; an option replaces its value; a name@version its capability.
    sent.calls.clear()
    done = submit("--file", str(JOB_FILE), "--max-duration", "90s", "--request-id", "r2", "--", "--layers", "3")
    assert done.exit_code == 0, done.output
    [call] = sent.calls
    assert (call["capability"], call["args"], call["max_duration_s"]) == ("merge.slerp.cpu@1", ["--layers", "3"], 90.0)
    sent.calls.clear()
    done = submit("other.job@2", "--file", str(JOB_FILE), "--request-id", "r3", "--", "x")
    assert done.exit_code == 0, done.output
    assert (sent.calls[0]["capability"], sent.calls[0]["args"]) == ("other.job@2", ["x"])


def test_nvlink_from_the_file_or_the_command_line_reaches_the_node_in_the_jobs_input(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MODELFORGE_HOME", str(tmp_path / "home"))
    sent = Recorded(monkeypatch)
    spec = tmp_path / "gang.toml"
    spec.write_text('capability = "merge.gang@1"\nargs = ["--t", "0.5"]\ngpu_count = 2\nnvlink = true\n')
    assert submit("--file", str(spec), "--request-id", "g1").exit_code == 0
    assert (
        submit("merge.gang@1", "--nvlink", "--gpu-count", "2", "--request-id", "g2", "--", "--t", "0.5").exit_code == 0
    )
    assert len(sent.calls) == 2
    for call in sent.calls:  # ModelForgeClient.submit_job(nvlink=True) puts it in the job's input
        assert call["via"] == "submit_job" and (call["args"], call["gpu_count"], call["nvlink"]) == (
            ["--t", "0.5"], 2, True
        )  # fmt: skip
    # --no-nvlink overrides the file's nvlink = true: a plain job.
    sent.calls.clear()
    assert submit("--file", str(spec), "--no-nvlink", "--request-id", "g3").exit_code == 0
    assert sent.calls[0]["via"] == "submit_job" and sent.calls[0]["gpu_count"] == 2
    assert sent.calls[0]["nvlink"] is False


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('capability = "m@1"\ngpu = 2\n', "unknown key 'gpu'"),
        ('capability = "m@1"\nargs = "--layers 3"\n', "args must be a list of strings"),
        ('capability = "m@1"\nnvlink = "yes"\n', "nvlink must be true or false"),
        ('capability = "m@1"\ngpu_count = 0\n', "gpu_count must be an integer from 1 to 1024"),
        ('capability = "m@1"\nmax_duration = "4 fortnights"\n', "max_duration: a duration is"),
        ('capability = "m@1"\nargs = [\n', "not valid TOML"),
        ('args = ["--t", "1"]\n', "name the job's capability"),
        ('capability = "not a capability"\n', "capability"),
    ],
)
def test_a_bad_job_toml_is_request_invalid_naming_the_file_and_key_before_connecting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: str, says: str
) -> None:
    monkeypatch.setenv("MODELFORGE_HOME", str(tmp_path / "home"))
    sent = Recorded(monkeypatch)
    spec = tmp_path / "bad-job.toml"
    spec.write_text(text)
    refused = submit("--file", str(spec))
    assert refused.exit_code == 1, refused.output
    assert "REQUEST_INVALID" in refused.output and says in refused.output, refused.output
    if "name the job's" not in says and "not a capability" not in text:
        assert "bad-job.toml" in refused.output
    assert sent.calls == []  # refused before anything was sent
    missing = submit("--file", str(tmp_path / "nowhere.toml"))
    assert missing.exit_code == 1 and "nowhere.toml" in missing.output and "cannot read it" in missing.output


async def test_the_node_refuses_nvlink_for_a_deployment_that_does_not_require_an_nvlink_group(node: Node) -> None:
    await node.load(job(python("print('ran')")))
    with pytest.raises(ApplicationError, match="does not require an NVLink group") as refused:
        await node.invoke("no-nvlink", {"nvlink": True})
    assert refused.value.type == FailureClass.REQUEST_INVALID.value
    assert "merge.job@1" in str(refused.value)
    assert job_log_dirs(node.home, "no-nvlink") == []  # nothing ran
    with pytest.raises(ApplicationError) as malformed:
        await node.invoke("bad-nvlink", {"nvlink": "yes"})
    assert malformed.value.type == FailureClass.REQUEST_INVALID.value

    # A deployment whose placement requires an NVLink group runs it; nvlink = false runs anywhere.
    await node.env().run(node.activities.unload_model, "merge.job@1@n/cpu")
    await node.load(dataclasses.replace(job(python("print('ran')")), nvlink_required=True))
    assert (await node.invoke("with-nvlink", {"nvlink": True}))["exit_code"] == 0
    assert (await node.invoke("without", {"nvlink": False}))["exit_code"] == 0
    assert json.loads((job_log_dirs(node.home, "with-nvlink")[0] / "input.json").read_text()) == {"nvlink": True}


async def test_a_jobs_output_directory_is_one_artifact_a_later_job_and_artifacts_get_read_back(
    node: Node, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The merge's whole output (its layers and manifest) is one directory artifact, whose digest
    is the one a deployment's `artifact_sha256` checks for a model directory; the evaluation job
    takes it by digest (verified) and scores it as it scores the stacked file; `artifacts get`
    copies it back; a changed file in it is ARTIFACT_CORRUPT for both."""
    from modelforge.runtimes._artifacts import artifact_digest, check_artifact

    await node.load(job([sys.executable, str(MERGE)]))
    merged = await node.invoke("dir-merge", {"args": MERGE_ARGS})
    directory = merged["output_artifact"]
    digest = directory.removeprefix("artifact:sha256:")
    stored = node.home / "artifacts" / "store" / "sha256" / digest
    assert sorted(p.relative_to(stored).as_posix() for p in stored.rglob("*")) == sorted(
        e["path"] for e in merged["outputs"]
    )
    assert digest == artifact_digest(Path(merged["output_dir"]))  # the output directory's own digest
    # Servable as a deployment's artifact, checked as any model directory.
    checked = check_artifact(f"store/sha256/{digest}", [node.home / "artifacts"], digest)
    assert checked.path == stored

    await node.env().run(node.activities.unload_model, CPU_KEY)
    await node.load(job([sys.executable, str(EVALUATE)]))
    [stacked] = [e for e in merged["outputs"] if e["path"] == "merged.npy"]
    by_dir = (await node.invoke("eval-dir", {"args": ["--model", directory]}))["result"]
    by_file = (await node.invoke("eval-file", {"args": ["--model", stacked["artifact"]]}))["result"]
    assert by_dir == by_file and by_dir["layers"] == 6

    monkeypatch.setenv("MODELFORGE_HOME", str(node.home))
    runner = CliRunner()
    [row] = [
        r for r in json.loads(runner.invoke(cli.app, ["artifacts", "--json"]).stdout) if r["artifact"] == directory
    ]
    assert (row["kind"], row["files"], row["requests"], row["present"]) == ("directory", 8, ["dir-merge"], True)
    printed = runner.invoke(cli.app, ["artifacts", "get", directory])
    assert printed.exit_code == 0 and printed.stdout.strip() == str(stored)
    copy = tmp_path / "candidate"
    got = runner.invoke(cli.app, ["artifacts", "get", digest, str(copy)])
    assert got.exit_code == 0, got.output
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == {
        p.name: p.read_bytes() for p in Path(merged["output_dir"]).iterdir()
    }
    again = runner.invoke(cli.app, ["artifacts", "get", digest, str(copy)])
    assert again.exit_code == 1 and "exists" in again.output

    layer = stored / "layer002.npy"
    layer.chmod(0o644)
    layer.write_bytes(layer.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(ApplicationError) as corrupt:
        await node.invoke("eval-corrupt", {"args": ["--model", directory]})
    assert corrupt.value.type == FailureClass.ARTIFACT_CORRUPT.value
    refused = runner.invoke(cli.app, ["artifacts", "get", directory, str(tmp_path / "other")])
    assert refused.exit_code == 1 and "ARTIFACT_CORRUPT" in refused.output
    assert not (tmp_path / "other").exists()


def test_the_artifact_store_is_a_setting_of_its_own_and_node_workers_use_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from modelforge.gpu import HostMemoryDevice, NodeDevices, SimulatedGpuBackend
    from modelforge.runtimes import build_runtimes
    from modelforge.settings import Settings

    assert Settings(home=tmp_path).resolved_artifact_store() == tmp_path / "artifacts" / "store"  # unchanged
    monkeypatch.setenv("MODELFORGE_ARTIFACT_STORE", str(tmp_path / "shared" / "artifacts"))
    assert Settings.from_env().resolved_artifact_store() == tmp_path / "shared" / "artifacts"
    devices = NodeDevices(SimulatedGpuBackend([]), HostMemoryDevice("n", 8 * GiB))
    runtimes = build_runtimes(devices, tmp_path / "home", "n")  # starts nothing
    assert getattr(runtimes["subprocess_job"], "store", None) == tmp_path / "shared" / "artifacts"


async def test_two_nodes_with_their_own_homes_share_artifacts_through_the_configured_store(tmp_path: Path) -> None:
    """Node a's merge output is node b's input: both write to and read from one store (a shared
    filesystem on a cluster), while their jobs, logs and homes stay their own."""
    from activities.node import NodeActivities
    from modelforge.gpu import HostMemoryDevice, NodeDevices, SimulatedGpuBackend
    from modelforge.runtimes import SubprocessJobRuntime

    shared = tmp_path / "shared-store"
    nodes = []
    for name in ("a", "b"):
        devices = NodeDevices(SimulatedGpuBackend([]), HostMemoryDevice(name, 8 * GiB))
        runtime = SubprocessJobRuntime(devices, tmp_path / f"home-{name}", name, shared)
        activities = NodeActivities(name, devices, {"subprocess_job": runtime}, checkpoint_root=tmp_path / "ckpt")
        nodes.append(Node(activities, runtime, tmp_path / "ckpt", tmp_path / f"home-{name}", []))
    try:
        await nodes[0].load(job([sys.executable, str(MERGE)]))
        merged = await nodes[0].invoke("shared-merge", {"args": MERGE_ARGS})
        assert (shared / "sha256" / merged["output_artifact"].removeprefix("artifact:sha256:")).is_dir()
        assert not (tmp_path / "home-a" / "artifacts").exists()  # nothing in the node's own home
        await nodes[1].load(job([sys.executable, str(EVALUATE)]))
        scored = await nodes[1].invoke("shared-eval", {"args": ["--model", merged["output_artifact"]]})
        assert scored["result"]["layers"] == 6
    finally:
        for each in nodes:
            await each.runtime.close()


READER = (
    "import pathlib, sys, time\n"
    "mode, model = sys.argv[1], pathlib.Path(sys.argv[2])\n"
    "assert model.exists()\n"
    "if mode == 'crash': sys.exit(3)\n"
    "if mode == 'usage': sys.exit(2)\n"
    "while mode == 'wait' and not (model.parent.parent / 'go').exists(): time.sleep(0.05)\n"
)


async def test_artifacts_gc_deletes_old_artifacts_but_never_a_running_or_requeued_jobs_input(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modelforge.runtimes._subprocess_job import artifact_rows, artifacts_in_use, collect_garbage

    store = node.home / "artifacts" / "store"
    await node.load(job([sys.executable, str(MERGE)]))
    merged = await node.invoke("gc-merge", {"args": MERGE_ARGS})
    by_path = {entry["path"]: entry["artifact"] for entry in merged["outputs"]}
    await node.env().run(node.activities.unload_model, CPU_KEY)
    await node.load(job(python(READER)))
    # Crashed (RUNTIME_CRASH, which is retried): its input stays in use. Refused its arguments
    # (REQUEST_INVALID, final): not any more.
    with pytest.raises(ApplicationError):
        await node.invoke("gc-crash", {"args": ["crash", by_path["layer000.npy"]]})
    with pytest.raises(ApplicationError):
        await node.invoke("gc-usage", {"args": ["usage", by_path["layer001.npy"]]})
    running = asyncio.create_task(node.invoke("gc-running", {"args": ["wait", by_path["manifest.json"]]}))
    while "gc-running" not in str(artifacts_in_use(store)):
        await asyncio.sleep(0.05)

    later = time.time() + 7200  # two hours on: every artifact is older than an hour
    preview = collect_garbage(store, 3600, dry_run=True, now=later)
    assert len(preview["deleted"]) == 7 and len(artifact_rows(store)) == 9  # a dry run deletes nothing
    report = collect_garbage(store, 3600, now=later)
    kept = {row["artifact"]: row["in_use_by"] for row in report["kept_in_use"]}
    assert kept == {by_path["layer000.npy"]: ["gc-crash"], by_path["manifest.json"]: ["gc-running"]}
    assert {row["artifact"] for row in report["deleted"]} == {
        *(a for p, a in by_path.items() if p not in ("layer000.npy", "manifest.json")),
        merged["output_artifact"],
    }
    assert report["bytes_freed"] > 0
    assert {row["artifact"] for row in artifact_rows(store)} == set(kept)  # the index says what is left
    assert sorted(p.name for p in (store / "sha256").iterdir()) == sorted(a[16:] for a in kept)
    with pytest.raises(ApplicationError) as gone:
        await node.invoke("gc-late", {"args": ["usage", by_path["layer001.npy"]]})
    assert gone.value.type == FailureClass.REQUEST_INVALID.value

    # The running job ends: its input is no longer in use, and goes on the next collection
    # (here from the command line, with a real age of a second).
    (store / "go").touch()
    assert (await running)["exit_code"] == 0
    monkeypatch.setenv("MODELFORGE_HOME", str(node.home))
    await asyncio.sleep(1.1)
    printed = CliRunner().invoke(cli.app, ["artifacts", "gc", "--older-than", "1s", "--json"])
    assert printed.exit_code == 0, printed.output
    report = json.loads(printed.stdout)
    assert [row["artifact"] for row in report["deleted"]] == [by_path["manifest.json"]]
    assert [row["artifact"] for row in report["kept_in_use"]] == [by_path["layer000.npy"]]
    refused = CliRunner().invoke(cli.app, ["artifacts", "gc", "--older-than", "soon"])
    assert refused.exit_code == 1 and "REQUEST_INVALID" in refused.output


DATASET = ROOT / "examples" / "jobs" / "data" / "eval-triples.jsonl"


def test_the_evaluation_dataset_ships_with_the_project() -> None:
    """A few dozen triples of the project's own text, in the repository (a fresh clone has it)."""
    import subprocess

    triples = [json.loads(line) for line in DATASET.read_text(encoding="utf-8").splitlines()]
    assert 24 <= len(triples) <= 100
    assert all(set(t) == {"anchor", "positive", "negative"} and all(t.values()) for t in triples)
    if (ROOT / ".git").exists():
        tracked = subprocess.run(
            ["git", "ls-files", "--error-unmatch", str(DATASET.relative_to(ROOT))],
            cwd=ROOT,
            capture_output=True,
            check=False,
        )
        assert tracked.returncode == 0, "examples/jobs/data/eval-triples.jsonl is not committed"


async def test_merge_then_evaluate_scores_on_the_shipped_dataset_by_default(node: Node, tmp_path: Path) -> None:
    """The chain as a fresh clone runs it: no dataset named, the shipped one is used (the job
    runs in its own directory, not the checkout); the same merge scores the same, and a merge
    nearer its first parent is more similar to it on the dataset's sentences."""
    await node.load(job([sys.executable, str(MERGE)]))
    merged = await node.invoke("ds-merge", {"args": MERGE_ARGS})
    await node.env().run(node.activities.unload_model, CPU_KEY)
    await node.load(job([sys.executable, str(EVALUATE)]))
    score = (await node.invoke("ds-eval", {"args": ["--model", merged["output_artifact"]]}))["result"]
    assert (score["dataset"], score["triples"], score["probes"], score["layers"]) == ("eval-triples.jsonl", 36, 108, 6)
    assert score["similarity_to_a"] > score["similarity_to_b"] > 0
    accuracy = score["ranking_accuracy"]
    assert set(accuracy) == {"merged", "a", "b"} and all(0.5 < value <= 1.0 for value in accuracy.values())
    again = (await node.invoke("ds-eval-2", {"args": ["--model", merged["output_artifact"]]}))["result"]
    assert again == score  # deterministic: the same model and dataset score the same

    # Another dataset by argument, as an artifact (a host path is refused:
    # tests/runtimes/test_job_confinement.py); a broken one is the request's arguments being wrong.
    own = tmp_path / "mine" / "mine.jsonl"
    own.parent.mkdir()
    own.write_text(json.dumps({"anchor": "a cat sat", "positive": "the cat sat", "negative": "stock prices"}) + "\n")
    mine = await node.invoke("ds-own", {"args": ["--model", merged["output_artifact"], "--dataset", stored(node, own)]})
    assert mine["result"]["triples"] == 1
    own.write_text('{"anchor": "only"}\n')
    with pytest.raises(ApplicationError, match="refused its arguments") as refused:
        await node.invoke("ds-bad", {"args": ["--model", merged["output_artifact"], "--dataset", stored(node, own)]})
    assert refused.value.type == FailureClass.REQUEST_INVALID.value


def stored(node: Node, path: Path) -> str:
    """`path`'s file kept in the node's artifact store as a job's output is: its artifact reference."""
    outputs = job_module._list_outputs(path.parent)
    job_module.register_outputs(node.runtime.store, path.parent, outputs, "test", "n")
    [entry] = [entry for entry in outputs if entry["path"] == path.name]
    return str(entry["artifact"])


async def test_a_jobs_answer_carries_the_end_of_its_log_from_a_lines_start(node: Node) -> None:
    await node.load(job(python("for i in range(2000): print(f'line {i:04d}')")))
    done = await node.invoke("tail", {})
    tail = done["log_tail"]
    assert 3000 < len(tail.encode()) <= 4096 and tail.startswith("line ")  # whole lines, at most 4 KiB
    assert "line 1999\n" in tail and "line 0000" not in tail
    assert Path(done["log"]).read_text().endswith(tail)


class _Handle:
    def __init__(self, described: Any, result: Any) -> None:
        self.described, self.outcome = described, result

    async def describe(self) -> Any:
        return self.described

    async def result(self) -> Any:
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


class _Temporal:
    """Stands in for a Temporal client on a host that ran none of the jobs: request workflows,
    their invoke's heartbeat and their results."""

    def __init__(self) -> None:
        from temporalio.converter import DataConverter

        self.data_converter = DataConverter.default
        self.workflows: dict[str, _Handle] = {}

    def add(self, request_id: str, status: Any, heartbeat: str = "", result: Any = None) -> None:
        from types import SimpleNamespace

        from temporalio.api.common.v1 import ActivityType, Payloads
        from temporalio.api.workflow.v1 import PendingActivityInfo

        pending = []
        if heartbeat:
            details = Payloads(payloads=self.data_converter.payload_converter.to_payloads([heartbeat]))
            pending.append(
                PendingActivityInfo(
                    activity_type=ActivityType(name="invoke"),
                    heartbeat_details=details,
                    last_worker_identity="7@node-b",
                )
            )
        described = SimpleNamespace(status=status, raw_description=SimpleNamespace(pending_activities=pending))
        self.workflows[f"request:merge.slerp.cpu@1:{request_id}"] = _Handle(described, result)

    async def list_workflows(self, query: str) -> Any:
        from types import SimpleNamespace

        from temporalio.client import WorkflowExecutionStatus

        for workflow_id in reversed(self.workflows):
            running = self.workflows[workflow_id].described.status == WorkflowExecutionStatus.RUNNING
            if "Running" in query and not running:
                continue
            yield SimpleNamespace(id=workflow_id, start_time=None)

    def get_workflow_handle(self, workflow_id: str, *, result_type: Any = None) -> _Handle:
        return self.workflows[workflow_id]


def _temporal_with_three_jobs() -> _Temporal:
    from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError

    from modelforge.messages import RequestResult

    temporal = _Temporal()
    answer = {"exit_code": 0, "log": "/node-b/jobs/done/job.log", "log_tail": "merged 8 layers\n", "progress": 1.0}
    temporal.add(
        "done", WorkflowExecutionStatus.COMPLETED, result=RequestResult("done", "merge.slerp.cpu@1", answer, None)
    )
    temporal.add("busy", WorkflowExecutionStatus.RUNNING, heartbeat="job 40%: merged layer 3")
    temporal.add("chat", WorkflowExecutionStatus.RUNNING, heartbeat="leased")  # not a job
    crash = ApplicationError("the job exited 1; job log ends: Traceback...", type="RUNTIME_CRASH")
    temporal.add("broken", WorkflowExecutionStatus.FAILED, result=WorkflowFailureError(cause=crash))
    return temporal


async def test_jobs_and_logs_of_another_nodes_jobs_are_read_through_temporal(tmp_path: Path) -> None:
    from modelforge.cli_jobs import follow_remote, remote_job, running_jobs

    temporal = _temporal_with_three_jobs()
    assert await running_jobs(temporal) == [
        {
            "request_id": "busy",
            "workflow_id": "request:merge.slerp.cpu@1:busy",
            "state": "running",
            "line": "job 40%: merged layer 3",
            "worker": "7@node-b",
            "started_at": None,
        }
    ]
    assert await remote_job(temporal, "nowhere") is None
    done = await remote_job(temporal, "done")
    assert done is not None and (done["ok"], done["log"], done["log_tail"]) == (
        True, "/node-b/jobs/done/job.log", "merged 8 layers\n"
    )  # fmt: skip

    written: list[bytes] = []
    assert await follow_remote(temporal, "done", written.append, False, tmp_path) == "succeeded"
    text = b"".join(written).decode()
    assert text.startswith("merged 8 layers\n") and "the whole log is on its node: /node-b/jobs/done/job.log" in text
    written.clear()
    assert await follow_remote(temporal, "busy", written.append, False, tmp_path) == "running"
    assert b"on 7@node-b: job 40%: merged layer 3" in b"".join(written)
    written.clear()
    assert await follow_remote(temporal, "broken", written.append, False, tmp_path) == "failed"
    assert b"RUNTIME_CRASH: the job exited 1; job log ends: Traceback..." in b"".join(written)
    assert await follow_remote(temporal, "nowhere", written.append, False, tmp_path) is None


def test_the_command_line_reads_another_hosts_jobs_through_temporal(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from modelforge import temporal as temporal_module

    monkeypatch.setenv("MODELFORGE_HOME", str(tmp_path / "home"))  # this host ran nothing
    fake = _temporal_with_three_jobs()

    async def connect(*args: Any, **kwargs: Any) -> _Temporal:
        return fake

    monkeypatch.setattr(temporal_module, "connect", connect)
    runner = CliRunner()
    done = runner.invoke(cli.app, ["logs", "done"])
    assert done.exit_code == 0 and done.stdout.startswith("merged 8 layers\n"), done.output
    broken = runner.invoke(cli.app, ["logs", "broken"])
    assert broken.exit_code == 1 and "RUNTIME_CRASH" in broken.stdout
    unknown = runner.invoke(cli.app, ["logs", "nowhere"])  # neither here nor in Temporal: as before
    assert unknown.exit_code == 1 and "no job log of request 'nowhere'" in unknown.output
    listed = runner.invoke(cli.app, ["jobs", "--cluster", "--json"])
    assert listed.exit_code == 0, listed.output
    assert [(r["request_id"], r["line"]) for r in json.loads(listed.stdout)] == [("busy", "job 40%: merged layer 3")]
