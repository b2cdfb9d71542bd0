"""The subprocess_job runtime through the node's activities, with real child processes: the SLERP
merge example preempted mid-run and resumed to a byte-identical output, a job that ignores
SIGTERM, and each failure class a job shows (crash, CUDA OOM, OOM kill, usage, max_duration, a
resume location that is not its own)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.node import NodeActivities
from modelforge.catalog import CatalogError, parse_catalog
from modelforge.domain import GiB
from modelforge.failures import FailureClass
from modelforge.gpu import HostMemoryDevice, NodeDevices, SimulatedDevice, SimulatedGpuBackend
from modelforge.messages import CheckpointInput
from modelforge.runtimes import SubprocessJobRuntime, job_log_dirs
from modelforge.runtimes import _subprocess_job as job_module
from modelforge.runtimes._process import alive
from tests.runtimes.jobs import CPU_KEY, MERGE, MERGE_ARGS, ROOT, RUN, UUID, Node, job, python

pytest.importorskip("numpy")  # the merge example's only dependency


def attempts(node: Node, request_id: str) -> list[dict[str, Any]]:
    [directory] = job_log_dirs(node.home, request_id)
    status: dict[str, Any] = json.loads((directory / "status.json").read_text())
    found: list[dict[str, Any]] = status["attempts"]
    return found


async def until_checkpointed(node: Node, request_id: str, layers: int, within_s: float = 30.0) -> None:
    state = node.store / request_id / "job" / RUN / "state.json"
    deadline = time.monotonic() + within_s
    while not (state.exists() and json.loads(state.read_text())["layers_done"] >= layers):
        assert time.monotonic() < deadline, f"no checkpoint of {layers} layers within {within_s} s"
        await asyncio.sleep(0.05)


def output_bytes(output: dict[str, Any]) -> dict[str, bytes]:
    directory = Path(output["output_dir"])
    return {entry["path"]: (directory / entry["path"]).read_bytes() for entry in output["outputs"]}


async def test_a_merge_preempted_mid_run_resumes_from_its_checkpoint_to_a_byte_identical_output(node: Node) -> None:
    await node.load(job([sys.executable, str(MERGE)]))
    reference = await node.invoke("reference", {"args": MERGE_ARGS})
    assert reference["exit_code"] == 0 and reference["progress"] == 1.0
    assert reference["result"] == {"layers": 6, "t": 0.3}
    assert len(reference["outputs"]) == 8  # six layers, the manifest and the stacked model
    assert node.beats[-1] == "job 100%: merged 6 layers"  # its last progress line, as the heartbeat

    # The same merge, slowed down, preempted after its second layer.
    slow = {"args": [*MERGE_ARGS, "--layer-delay-s", "0.5"]}
    running_env = node.env()
    running = asyncio.create_task(node.invoke("merge", slow, env=running_env))
    await until_checkpointed(node, "merge", 2)
    assert any(beat.startswith("job ") and ": merged layer" in beat for beat in node.beats), node.beats
    started = time.monotonic()
    saved = await node.env().run(
        node.activities.checkpoint_invocation, CheckpointInput(CPU_KEY, "lease-merge", "merge", 0)
    )
    assert time.monotonic() - started < 3, "SIGTERM ends the layer's wait at once: no grace needed"
    location = Path(saved.location)
    assert location == node.store / "merge" / "job" / RUN / "state.json"
    layers_done = json.loads(location.read_text())["layers_done"]
    assert 2 <= layers_done < 6
    running_env.cancel()  # as the request workflow cancels the preempted invoke
    with pytest.raises(asyncio.CancelledError):
        await running
    [first] = attempts(node, "merge")
    assert first["outcome"] == "checkpointed" and first["exit_code"] == 75 and first["checkpoint"] == str(location)
    assert not alive(first["pid"])

    # The requeued run is told where to resume; it merges only the layers left.
    resumed = await node.invoke("merge", slow, resume_from=str(location))
    assert resumed["resumed_from"] == str(location)
    assert output_bytes(resumed) == output_bytes(reference)  # byte-identical to the uninterrupted run
    assert [a["outcome"] for a in resumed["attempts"]] == ["checkpointed", "succeeded"]
    assert resumed["attempts"][1]["restart"] == f"resumed from checkpoint {location}"
    log = (Path(resumed["log"])).read_text()
    assert f"resumed after layer {layers_done}/6" in log
    assert log.count('"message": "merged layer000"') == 1  # the first layers were not merged again


async def test_a_job_that_ignores_sigterm_is_killed_after_the_grace_and_restarts_from_its_last_checkpoint(
    node: Node,
) -> None:
    await node.load(job([sys.executable, str(MERGE)], preempt_grace_s="0.5"))
    args = {"args": [*MERGE_ARGS, "--layer-delay-s", "0.5", "--ignore-sigterm"]}
    running_env = node.env()
    running = asyncio.create_task(node.invoke("stubborn", args, env=running_env))
    await until_checkpointed(node, "stubborn", 1)
    started = time.monotonic()
    saved = await node.env().run(
        node.activities.checkpoint_invocation, CheckpointInput(CPU_KEY, "lease-stubborn", "stubborn", 0)
    )
    assert 0.5 <= time.monotonic() - started < 3  # the grace, then SIGKILL to its session
    running_env.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    [first] = attempts(node, "stubborn")
    assert first["outcome"] == "killed_after_grace" and first["checkpoint"] == saved.location
    assert "ignored SIGTERM for 0.5 s: killed; restarts from its last checkpoint" in first["detail"]
    assert not alive(first["pid"])
    resumed = await node.invoke("stubborn", args, resume_from=saved.location)
    assert resumed["attempts"][1]["restart"] == f"resumed from checkpoint {saved.location}"


async def test_a_job_killed_before_any_checkpoint_restarts_from_scratch_and_says_so(node: Node) -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    await node.load(job(python(code), preempt_grace_s="0.3"))
    running_env = node.env()
    running = asyncio.create_task(node.invoke("scratch", {}, env=running_env))
    while "up" not in "".join(p.read_text() for p in node.home.glob("jobs/n/scratch/*/job.log")):
        await asyncio.sleep(0.05)  # its handler is set
    with pytest.raises(ApplicationError, match="restarts from scratch") as refused:
        await node.env().run(
            node.activities.checkpoint_invocation, CheckpointInput(CPU_KEY, "lease-scratch", "scratch", 0)
        )
    assert refused.value.type == FailureClass.CAPABILITY_UNAVAILABLE.value  # the workflow then starts it over
    running_env.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    await node.env().run(node.activities.unload_model, CPU_KEY)
    await node.load(job(python("print('done')")))  # the same request's next run, here a quick one
    done = await node.invoke("scratch", {})
    assert [a["outcome"] for a in done["attempts"]] == ["killed_after_grace", "succeeded"]
    assert done["attempts"][1]["restart"] == "started over from scratch (no checkpoint)"


@pytest.mark.parametrize(
    ("code", "failure", "says"),
    [
        ("import sys; print('boom', file=sys.stderr); sys.exit(3)", FailureClass.RUNTIME_CRASH, "exited with code 3"),
        (
            "raise RuntimeError('CUDA out of memory. Tried to allocate 2.00 GiB')",
            FailureClass.GPU_OOM,
            "ran out of GPU memory",
        ),
        ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", FailureClass.RUNTIME_CRASH, "killed by SIGSEGV"),
        ("import sys; sys.exit(2)", FailureClass.REQUEST_INVALID, "refused its arguments"),
        ("import sys; sys.exit(75)", FailureClass.RUNTIME_CRASH, "no preemption asked"),
    ],
)
async def test_each_way_a_job_fails_has_its_class(node: Node, code: str, failure: FailureClass, says: str) -> None:
    await node.load(job(python(code)))
    with pytest.raises(ApplicationError, match=says) as failed:
        await node.invoke("failing", {})
    assert failed.value.type == failure.value
    [attempt] = attempts(node, "failing")
    assert attempt["outcome"] == f"failed: {failure.value}"


async def test_an_oom_kill_is_gpu_oom(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel's OOM killer cannot be called safely in a test: its counter is read as it would
    # be after one, and the job dies of the same SIGKILL.
    counts = iter([3, 4])
    monkeypatch.setattr(job_module, "_oom_kills", lambda: next(counts))
    await node.load(job(python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")))
    with pytest.raises(ApplicationError, match="OOM killer") as failed:
        await node.invoke("oom", {})
    assert failed.value.type == FailureClass.GPU_OOM.value


async def test_a_job_past_its_max_duration_is_stopped_with_timeout(node: Node) -> None:
    await node.load(job(python("import time; time.sleep(60)"), stop_grace_s="0.5"))
    started = time.monotonic()
    with pytest.raises(ApplicationError, match="max_duration") as failed:
        await node.invoke("slow", {}, env=node.env(max_duration_s=2.5))
    assert failed.value.type == FailureClass.TIMEOUT.value
    assert time.monotonic() - started < 5
    [attempt] = attempts(node, "slow")
    assert attempt["outcome"] == "timeout" and not alive(attempt["pid"])


async def test_a_resume_location_outside_the_jobs_own_directory_is_refused(node: Node, tmp_path: Path) -> None:
    await node.load(job(python("print('never runs')")))
    other = node.store / "someone-else" / "job" / RUN / "state.json"
    other.parent.mkdir(parents=True)
    other.write_text('{"layers_done": 1}')
    elsewhere = tmp_path / "state.json"
    elsewhere.write_text("{}")
    for location in (str(other), str(elsewhere), "/etc/passwd", f"file://{other}"):
        with pytest.raises(ApplicationError) as refused:
            await node.invoke("mine", {}, resume_from=location)
        assert refused.value.type == FailureClass.REQUEST_INVALID.value, location
    assert job_log_dirs(node.home, "mine") == []  # nothing ran


async def test_a_job_sees_its_cards_directories_and_none_of_the_workers_secrets(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MODELFORGE_DATABASE_URL", "postgresql://secret")
    code = (
        "import json, os, pathlib;"
        "print(json.dumps({'progress': 0.5, 'message': 'half'}), flush=True);"
        "env = {k: v for k, v in os.environ.items() if k.startswith(('MODELFORGE_', 'CUDA_'))};"
        "inp = json.loads(pathlib.Path(os.environ['MODELFORGE_JOB_INPUT']).read_text());"
        "print(json.dumps({'result': {'env': env, 'input': inp}}))"
    )
    for key, cards in (("merge.job@1@n/0", UUID), (CPU_KEY, "")):
        await node.load(job(python(code)), key=key)
        output = await node.invoke(f"env-{cards or 'cpu'}", {"t": 0.5}, key=key)
        seen = output["result"]["env"]
        assert seen["CUDA_VISIBLE_DEVICES"] == cards
        request_id = f"env-{cards or 'cpu'}"
        assert seen["MODELFORGE_JOB_ID"] == request_id
        assert seen["MODELFORGE_CHECKPOINT_DIR"] == str(node.store / request_id / "job" / RUN)
        assert seen["MODELFORGE_OUTPUT_DIR"] == output["output_dir"]
        assert "MODELFORGE_RESUME_FROM" not in seen and "MODELFORGE_DATABASE_URL" not in seen
        assert output["result"]["input"] == {"t": 0.5}  # the request's input, nothing of the node's
        assert "job 50%: half" in node.beats


def test_the_catalog_checks_a_jobs_command_and_configuration() -> None:
    base = {"capability": "j@1", "envelope_bytes": 1 << 30, "runtime": "subprocess_job"}
    for extra, says in (
        ({}, "needs `command`"),
        ({"command": ["x", "{port}"]}, "unknown placeholder {port}"),
        ({"command": ["x"], "runtime_config": {"sleep_path": "/s"}}, "unknown for subprocess_job"),
        ({"command": ["x"], "runtime_config": {"preempt_signal": "SIGKILL"}}, "preempt_signal"),
        ({"command": ["x"], "runtime_config": {"preempt_grace_s": "300"}}, "preempt_grace_s"),
        ({"command": ["x"], "runtime_config": {"env.MODELFORGE_HOME": "/"}}, "env.MODELFORGE_HOME"),
    ):
        with pytest.raises(CatalogError, match=says):
            parse_catalog({"deployments": [{**base, **extra}]})
    catalog, _ = parse_catalog(
        {"deployments": [{**base, "command": ["{python}", "merge.py", "--out", "{output_dir}"]}]}
    )
    assert catalog.deployments[0].runtime == "subprocess_job"


def test_the_example_catalog_is_valid() -> None:
    import tomllib

    data = tomllib.loads((ROOT / "examples" / "jobs" / "merge.toml").read_text())
    catalog, _ = parse_catalog(data)
    jobs = [d for d in catalog.deployments if d.runtime == "subprocess_job"]
    assert [d.capability for d in jobs] == ["merge.slerp@1", "merge.slerp.cpu@1", "evaluate.merge.cpu@1"]
    for deployment in jobs:
        assert deployment.command[0] == "{python}" and os.path.exists(ROOT / deployment.command[1])


async def test_modelforge_logs_prints_and_follows_a_jobs_log_and_jobs_lists_it(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from modelforge import cli
    from modelforge.cli_jobs import follow_log

    monkeypatch.setenv("MODELFORGE_HOME", str(node.home))
    await node.load(job([sys.executable, str(MERGE)]))
    running = asyncio.create_task(node.invoke("logged", {"args": [*MERGE_ARGS, "--layer-delay-s", "0.2"]}))
    chunks: list[bytes] = []
    # Followed from before the job starts until it ends: every line it printed, nothing twice.
    state = await asyncio.to_thread(follow_log, node.home, "logged", chunks.append, True, 0.05, 30.0)
    await running
    followed = b"".join(chunks).decode()
    assert state == "succeeded"
    assert followed.count('"message": "merged layer005"') == 1 and "attempt 1 ended: succeeded" in followed

    printed = CliRunner().invoke(cli.app, ["logs", "logged"])
    assert printed.exit_code == 0 and printed.stdout == followed
    missing = CliRunner().invoke(cli.app, ["logs", "nobody"])
    assert missing.exit_code == 1 and "REQUEST_INVALID" in missing.output and "no job log" in missing.output

    listed = CliRunner().invoke(cli.app, ["jobs", "--json"])
    [row] = json.loads(listed.stdout)
    assert (row["request_id"], row["node"], row["state"], row["progress"], row["attempts"]) == (
        "logged",
        "n",
        "succeeded",
        1.0,
        1,
    )
    table = CliRunner().invoke(cli.app, ["jobs"], env={"COLUMNS": "120"})
    assert table.exit_code == 0 and "logged" in table.stdout and "100%" in table.stdout and "succeeded" in table.stdout


def test_a_node_worker_that_comes_back_kills_the_orphaned_jobs_its_killed_predecessor_left(tmp_path: Path) -> None:
    import subprocess

    devices = NodeDevices(SimulatedGpuBackend([]), HostMemoryDevice("n", 8 * GiB))
    runtime = SubprocessJobRuntime(devices, tmp_path, "n")
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    # What a killed worker leaves: the job (a session of its own) and its pid file.
    orphan = subprocess.Popen(argv, start_new_session=True)
    bystander = subprocess.Popen(argv, start_new_session=True)  # a pid file that names another command
    try:
        running = runtime.jobs_dir / "running"
        running.mkdir(parents=True)
        (running / "lease-1.pid").write_text(json.dumps({"pid": orphan.pid, "argv": argv}))
        (running / "lease-2.pid").write_text(json.dumps({"pid": bystander.pid, "argv": ["something", "else"]}))
        assert SubprocessJobRuntime(devices, tmp_path, "n").reap_orphans() == [orphan.pid]
        assert orphan.wait(timeout=10) == -9
        assert bystander.poll() is None  # never a process it cannot prove is its own
        assert list(running.iterdir()) == []
    finally:
        for process in (orphan, bystander):
            process.kill()
            process.wait()


def test_job_submit_refuses_what_it_cannot_run_before_connecting() -> None:
    from typer.testing import CliRunner

    from modelforge import cli

    runner = CliRunner()
    for arguments, says in (
        (["--gpu-count", "0"], "--gpu-count is from 1 to 1024"),
        (["--max-duration", "4x"], "a duration is a positive number"),
        (["--tenant", "a b"], "REQUEST_INVALID"),
    ):
        refused = runner.invoke(cli.app, ["job", "submit", "merge.slerp@1", *arguments, "--", "--layers", "3"])
        assert refused.exit_code == 1 and says in refused.output, refused.output
        assert "cannot reach Temporal" not in refused.output


async def test_progress_written_to_the_progress_file_counts_and_an_earlier_attempts_lines_do_not(node: Node) -> None:
    code = (
        "import json, os, sys;"
        "f = open(os.environ['MODELFORGE_PROGRESS_FILE'], 'a');"
        "n = os.environ['MODELFORGE_ATTEMPT'];"
        "n == '1' and f.write(json.dumps({'progress': 0.5, 'message': 'attempt ' + n}) + '\\n'); f.flush();"
        "sys.exit(3 if n == '1' else 0)"
    )
    await node.load(job(python(code)))
    with pytest.raises(ApplicationError):
        await node.invoke("twice", {})  # attempt 1 reports, then crashes
    assert "job 50%: attempt 1" in node.beats
    again = await node.invoke("twice", {})  # the retry (the same request and run) reports nothing
    assert (again["progress"], again["message"]) == (None, "")
    assert [a["outcome"] for a in again["attempts"]] == ["failed: RUNTIME_CRASH", "succeeded"]


ALLREDUCE = ROOT / "examples" / "jobs" / "allreduce.py"


def expected_total(steps: int, world: int = 2) -> list[float]:
    return [float(sum(r + 1 for r in range(world)) * steps * (steps + 1) // 2)] * 4


async def test_a_two_rank_gang_on_two_nodes_all_reduces_checkpoints_every_rank_and_resumes(tmp_path: Path) -> None:
    """Two node workers (one card each), one gang job: both ranks run with the torchrun
    variables and a rendezvous in the shared store; preempted, both checkpoint after the same
    step; resumed, the sum is what an uninterrupted run's is."""
    pytest.importorskip("torch")
    from modelforge.messages import GangCheckpointInput, GangJobInput

    store = tmp_path / "store"
    nodes = []
    for index, name in enumerate(("g1", "g2")):
        devices = NodeDevices(SimulatedGpuBackend([SimulatedDevice(0, f"GPU-{index}", "Simulated", 24 * GiB)]))
        runtime = SubprocessJobRuntime(devices, tmp_path / "home", name)
        nodes.append((NodeActivities(name, devices, {"subprocess_job": runtime}, checkpoint_root=store), runtime))
    deployment = job([sys.executable, str(ALLREDUCE)], preempt_grace_s="20")
    beats: list[str] = []

    def env() -> ActivityEnvironment:
        return Node(nodes[0][0], nodes[0][1], store, tmp_path / "home", beats).env()

    def part(rank: int, lease: str, args: list[str], resume: str = "") -> GangJobInput:
        return GangJobInput(lease, "gang", deployment, [f"g{rank + 1}/0"], {"args": args}, rank, 2, resume)

    try:
        envs = [env(), env()]
        args = ["--steps", "40", "--step-delay-s", "0.2"]
        runs = [asyncio.create_task(envs[r].run(nodes[r][0].run_gang_job, part(r, "gang.1", args))) for r in (0, 1)]
        state = store / "gang" / "job-rank1" / RUN / "state.json"
        deadline = time.monotonic() + 60
        while not (state.exists() and json.loads(state.read_text())["step"] >= 3):
            assert time.monotonic() < deadline and not any(r.done() for r in runs), [r for r in runs if r.done()]
            await asyncio.sleep(0.05)
        # Rank 0's request lands first; rank 1 stops with it (the ranks agree on the step) and
        # exits 75 before its own request arrives, which still finds its checkpoint.
        first = await env().run(nodes[0][0].checkpoint_gang_job, GangCheckpointInput("gang.1", "gang", 0, 0))
        await asyncio.sleep(1.0)
        assert nodes[1][1]._jobs["gang.1#rank1"].process.returncode == 75  # rank 1 has exited already
        second = await env().run(nodes[1][0].checkpoint_gang_job, GangCheckpointInput("gang.1", "gang", 1, 0))
        saved = [first, second]
        steps = [json.loads(Path(s.location).read_text())["step"] for s in saved]
        assert steps[0] == steps[1] and 3 <= steps[0] < 40, steps  # every rank stopped after the same step
        assert [Path(s.location).parent.parent.name for s in saved] == ["job-rank0", "job-rank1"]
        for run, environment in zip(runs, envs, strict=True):
            environment.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run
        # The gang's next lease: each rank from its own checkpoint.
        resumed = await asyncio.gather(
            *(env().run(nodes[r][0].run_gang_job, part(r, "gang.2", args, saved[r].location)) for r in (0, 1))
        )
        for rank, result in enumerate(resumed):
            output = result.output
            assert output["rank"] == rank and output["world_size"] == 2
            assert output["result"] == {"total": expected_total(40), "rank": rank, "world": 2}
            assert output["resumed_from"] == saved[rank].location
            assert [a["outcome"] for a in output["attempts"]] == ["checkpointed", "succeeded"]
        total = Path(resumed[0].output["output_dir"]) / "total.json"
        assert json.loads(total.read_text())["total"] == expected_total(40)
    finally:
        for _, runtime in nodes:
            await runtime.close()


async def test_outputs_become_verified_artifacts_a_later_job_takes_and_a_tampered_one_is_refused(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from modelforge import cli

    await node.load(job([sys.executable, str(MERGE)]))
    merged = await node.invoke("merge-a", {"args": MERGE_ARGS})
    manifest = next(entry for entry in merged["outputs"] if entry["path"] == "manifest.json")
    stored = node.home / "artifacts" / "store" / "sha256" / manifest["sha256"]
    assert manifest["artifact"] == f"artifact:sha256:{manifest['sha256']}"
    assert stored.read_bytes() == (Path(merged["output_dir"]) / "manifest.json").read_bytes()
    # A later job names it by digest and is handed the verified file.
    reader = (
        "import hashlib, json, sys;"
        "print(json.dumps({'result': hashlib.sha256(open(sys.argv[1], 'rb').read()).hexdigest()}))"
    )
    await node.env().run(node.activities.unload_model, CPU_KEY)
    await node.load(job(python(reader)))
    read = await node.invoke("reader", {"args": [manifest["artifact"]]})
    assert read["result"] == manifest["sha256"]
    monkeypatch.setenv("MODELFORGE_HOME", str(node.home))
    listed = json.loads(CliRunner().invoke(cli.app, ["artifacts", "--json"]).stdout)
    [row] = [r for r in listed if r["artifact"] == manifest["artifact"]]
    assert row["requests"] == ["merge-a"] and row["paths"] == ["manifest.json"] and row["present"] is True
    # Changed on disk: refused before the job starts. Unknown: the request is wrong.
    stored.chmod(0o644)
    stored.write_bytes(b'{"t": 0.9}')
    with pytest.raises(ApplicationError) as corrupt:
        await node.invoke("reader-2", {"args": [manifest["artifact"]]})
    assert corrupt.value.type == FailureClass.ARTIFACT_CORRUPT.value
    with pytest.raises(ApplicationError) as unknown:
        await node.invoke("reader-3", {"args": ["artifact:sha256:" + "0" * 64]})
    assert unknown.value.type == FailureClass.REQUEST_INVALID.value


async def test_merge_then_evaluate_the_merged_artifact(node: Node) -> None:
    """The chain: the merge's stacked model is an artifact, and the evaluation job takes it by
    digest (verified) and scores it against its parents: t = 0.3 stays closer to the first."""
    await node.load(job([sys.executable, str(MERGE)]))
    merged = await node.invoke("chain-merge", {"args": MERGE_ARGS})
    [model] = [entry for entry in merged["outputs"] if entry["path"] == "merged.npy"]
    await node.env().run(node.activities.unload_model, CPU_KEY)
    await node.load(job([sys.executable, str(ROOT / "examples" / "jobs" / "evaluate.py")]))
    scored = await node.invoke("chain-evaluate", {"args": ["--model", model["artifact"]]})
    score = scored["result"]
    assert score["layers"] == 6 and score["similarity_to_a"] > score["similarity_to_b"] > 0
    assert json.loads((Path(scored["output_dir"]) / "score.json").read_text()) == score


async def test_a_checkpoint_named_outside_the_jobs_directory_is_ignored_and_the_log_says_so(node: Node) -> None:
    code = "import json; print(json.dumps({'checkpoint': '/etc/passwd'}))"
    await node.load(job(python(code)))
    done = await node.invoke("stray", {})
    assert "[modelforge] ignored checkpoint '/etc/passwd': not in" in Path(done["log"]).read_text()
