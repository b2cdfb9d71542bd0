"""A real job through the whole stack: the SLERP merge example (examples/jobs/merge.toml) runs as
a process on its lease, an interactive request preempts it, it checkpoints on SIGTERM and exits
75, is requeued, resumes from its checkpoint, and its merged model is byte-identical to an
uninterrupted run's."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.policy import PolicyConfig
from modelforge.runtimes import job_log_dirs
from tests.workflow.job_catalogs import MERGE, ROOT, catalog_for_test
from workers.stack import running_stack

pytestmark = pytest.mark.workflow
pytest.importorskip("numpy")  # the merge example's only dependency

ARGS = ["--layers", "12", "--dim", "64", "--t", "0.5"]


def uninterrupted_run(tmp_path: Path) -> dict[str, bytes]:
    output = tmp_path / "reference" / "output"
    environment = {
        **os.environ,
        "MODELFORGE_OUTPUT_DIR": str(output),
        "MODELFORGE_CHECKPOINT_DIR": str(tmp_path / "reference" / "checkpoints"),
    }
    subprocess.run([sys.executable, str(MERGE), *ARGS], env=environment, check=True, capture_output=True, timeout=60)
    return {path.name: path.read_bytes() for path in sorted(output.iterdir())}


@pytest.mark.parametrize("ignores_sigterm", [False, True], ids=["checkpoints-on-sigterm", "ignores-sigterm"])
async def test_a_preempted_merge_job_resumes_from_its_checkpoint_to_the_same_bytes(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path, ignores_sigterm: bool
) -> None:
    reference = uninterrupted_run(tmp_path)
    config = PolicyConfig(preempt_min_runtime_s=1.0, preempt_grace_s=0.5)
    home = tmp_path / "node-home"  # the stack's node workers' home
    request_id = f"merge-{os.urandom(4).hex()}"
    misbehaving = ["--ignore-sigterm"] if ignores_sigterm else []
    try:
        async with running_stack(
            dev_server_env.client, database_url, catalog_path=catalog_for_test(tmp_path), config=config, home=home
        ) as stack:
            submitted = time.time()
            job = await stack.start_request(
                "merge.slerp@1",
                tenant="lab",
                request_id=request_id,
                input={"args": [*ARGS, "--layer-delay-s", "0.6", *misbehaving]},
            )
            state = home / "checkpoints" / request_id / "job"
            for _ in range(600):  # past its minimum runtime, a few of its 12 layers merged
                if any(json.loads(p.read_text())["layers_done"] >= 3 for p in state.glob("*/state.json")):
                    break
                await asyncio.sleep(0.1)

            # 24 - 1 reserve - 16 job = 7 GiB < 12 GiB: only preempting the job makes room.
            preempting = time.time()
            chat = await (await stack.start_request("chat.llm@1", tenant="app", lease_timeout_s=120)).result()
            assert chat.lease.accelerator == "lab-node/0"

            done = await job.result()
            assert done.timings["preemptions"] == 1
            output = done.output
            assert output["exit_code"] == 0 and output["progress"] == 1.0
            checkpoint = Path(output["resumed_from"])
            assert checkpoint.name == "state.json" and checkpoint.parent.parent.name == "job"
            first, second = output["attempts"]
            assert second["outcome"] == "succeeded"
            assert second["restart"] == f"resumed from checkpoint {checkpoint}"
            merged = Path(output["output_dir"])
            assert {p.name: p.read_bytes() for p in sorted(merged.iterdir())} == reference

            [preempted] = await stack.events("preempted", at_least=1)
            assert preempted["request_id"] == request_id and preempted["payload"]["retrying"] is True
            assert f"resumes from checkpoint {checkpoint}" in preempted["message"]
            # How it stopped, and what it restarts from, is an event of its own.
            [stopped] = await stack.events("job_preempted", at_least=1)
            assert stopped["request_id"] == request_id and stopped["payload"]["checkpoint"] == str(checkpoint)
            log = Path(output["log"]).read_text()
            assert "resumed after layer" in log
            if ignores_sigterm:
                assert first["outcome"] == "killed_after_grace" and first["exit_code"] == -9
                assert stopped["message"] == "ignored SIGTERM for 1 s: killed; restarts from its last checkpoint"
                assert "attempt 1 ended: killed_after_grace" in log
            else:
                assert first["outcome"] == "checkpointed" and first["exit_code"] == 75
                assert stopped["message"] == f"checkpointed on SIGTERM (exit 75) to {checkpoint}; resumes from it"
                assert "attempt 1 ended: checkpointed" in log
                print(  # the numbers docs/RUNTIMES.md quotes (pytest -s)
                    f"submission to process start {first['started_at'] - submitted:.2f} s; "
                    f"interactive request to the job's checkpointed exit {first['ended_at'] - preempting:.2f} s; "
                    f"to its resumed start {second['started_at'] - preempting:.2f} s"
                )
    finally:
        for directory in job_log_dirs(home, request_id):
            print(f"--- {directory}/job.log:\n{(directory / 'job.log').read_text()}")  # shown when it fails
            shutil.rmtree(directory.parent, ignore_errors=True)
        shutil.rmtree(home / "checkpoints" / request_id, ignore_errors=True)


async def test_a_job_past_its_max_duration_ends_the_request_with_timeout(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    from temporalio.client import WorkflowFailureError
    from temporalio.exceptions import ApplicationError

    home = tmp_path / "node-home"
    request_id = f"slow-{os.urandom(4).hex()}"
    try:
        async with running_stack(
            dev_server_env.client, database_url, catalog_path=catalog_for_test(tmp_path), home=home
        ) as stack:
            started = time.monotonic()
            slow = await stack.start_request(
                "merge.slerp.cpu@1",
                tenant="lab",
                request_id=request_id,
                input={"args": [*ARGS, "--layer-delay-s", "30"]},
                max_duration_s=4,
            )
            with pytest.raises(WorkflowFailureError) as raised:
                await slow.result()
            cause = raised.value.cause
            assert isinstance(cause, ApplicationError) and cause.type == "TIMEOUT"
            assert "max_duration" in cause.message and "merged layer000" in cause.message  # the log's tail
            assert time.monotonic() - started < 30
            [directory] = job_log_dirs(home, request_id)
            status = json.loads((directory / "status.json").read_text())
            [attempt] = status["attempts"]
            assert attempt["outcome"] == "timeout"
            assert (
                not Path(f"/proc/{attempt['pid']}").exists() or "Z" in Path(f"/proc/{attempt['pid']}/stat").read_text()
            )
            assert all(a.leased_bytes == 0 for a in (await stack.status()).accelerators)
    finally:
        for directory in job_log_dirs(home, request_id):
            shutil.rmtree(directory.parent, ignore_errors=True)
        shutil.rmtree(home / "checkpoints" / request_id, ignore_errors=True)


async def test_job_submit_runs_the_deployments_command_with_its_args_under_its_max_duration(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    from modelforge.cli_jobs import JobClient

    home = tmp_path / "node-home"
    ids = [f"submit-{os.urandom(4).hex()}" for _ in range(2)]
    try:
        async with running_stack(
            dev_server_env.client, database_url, catalog_path=catalog_for_test(tmp_path), home=home
        ) as stack:
            jobs = JobClient(stack.client)
            done = await jobs.submit_job(
                "merge.slerp.cpu@1",
                ["--layers", "3", "--t", "0.25"],
                max_duration_s=120,
                tenant="lab",
                request_id=ids[0],
            )
            assert done.ok and done.output["result"] == {"layers": 3, "t": 0.25}
            # The lease lasts --max-duration, not the 600 s default: a slower job is stopped at it.
            started = time.monotonic()
            slow = await jobs.submit_job(
                "merge.slerp.cpu@1", [*ARGS, "--layer-delay-s", "30"], max_duration_s=3, tenant="lab", request_id=ids[1]
            )
            assert not slow.ok and slow.failure_class == "TIMEOUT" and "max_duration" in slow.message
            assert time.monotonic() - started < 30
            refused = await jobs.submit_job("merge.slerp.cpu@1", [], max_duration_s=60, gpu_count=2, tenant="lab")
            assert refused.failure_class == "REQUEST_INVALID"
            assert "the job asks for 2 cards; merge.slerp.cpu@1 runs on 1" in refused.message
    finally:
        for request_id in ids:
            for directory in job_log_dirs(home, request_id):
                shutil.rmtree(directory.parent, ignore_errors=True)
            shutil.rmtree(home / "checkpoints" / request_id, ignore_errors=True)


GANG_CATALOG = """
[[accelerators]]
id = "g1/0"
node = "g1"
model = "Simulated 24GB"
total_bytes = 25769803776
production_eligible = true
rack_id = "r1"
simulated = true

[[accelerators]]
id = "g2/0"
node = "g2"
model = "Simulated 24GB"
total_bytes = 25769803776
production_eligible = true
rack_id = "r1"
simulated = true

[[deployments]]
capability = "train.allreduce@1"   # one card on each of two nodes
envelope_bytes = 10737418240
residency = "none"
node_count = 2
gpu_per_node = 1
preemptible = true
runtime = "subprocess_job"
command = ["{python}", "ALLREDUCE"]
runtime_config = { input_args = "true", preempt_grace_s = "20" }

[[deployments]]
capability = "chat.big@1"          # 20 GiB: needs a card to itself
envelope_bytes = 21474836480
residency = "keep_warm"
ttl_s = 600
load_s = 0.5
runtime = "simulated"

[[tenants]]
name = "lab"
default_priority = "background"
max_priority = "background"

[[tenants]]
name = "app"
default_priority = "interactive"
max_priority = "interactive"
"""


async def test_a_two_rank_gang_job_on_two_nodes_is_preempted_checkpoints_both_ranks_and_sums_right(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    catalog = tmp_path / "gang.toml"
    catalog.write_text(GANG_CATALOG.replace("ALLREDUCE", str(ROOT / "examples" / "jobs" / "allreduce.py")))
    config = PolicyConfig(preempt_min_runtime_s=1.0, preempt_grace_s=0.5)
    home = tmp_path / "node-home"
    request_id = f"gang-{os.urandom(4).hex()}"
    steps = 40
    try:
        # Samples every second: the gang's processes are the job's (managed), never external.
        async with running_stack(
            dev_server_env.client,
            database_url,
            catalog_path=catalog,
            config=config,
            telemetry_interval_s=1.0,
            home=home,
        ) as stack:
            job = await stack.start_request(
                "train.allreduce@1",
                tenant="lab",
                request_id=request_id,
                input={"args": ["--steps", str(steps), "--step-delay-s", "0.25"]},
            )
            state = home / "checkpoints" / request_id / "job-rank1"
            for _ in range(900):  # both ranks up (torch imported, rendezvous done), a few steps summed
                if any(json.loads(p.read_text())["step"] >= 3 for p in state.glob("*/state.json")):
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(2.5)  # a few samples taken while it runs
            assert all(a.external_bytes == 0 for a in (await stack.status()).accelerators)
            # chat.big@1 needs 20 GiB: 24 - 10 = 14 on each card, so the gang must go.
            chat = await (await stack.start_request("chat.big@1", tenant="app", lease_timeout_s=120)).result()
            assert chat.lease.accelerator in ("g1/0", "g2/0")
            done = await job.result()
            assert done.timings["preemptions"] == 1
            output = done.output
            assert output["rank"] == 0 and output["world_size"] == 2 and output["nodes"] == ["g1", "g2"]
            total = float(3 * steps * (steps + 1) // 2)  # ranks add 1 and 2 times the step, summed
            assert output["result"] == {"total": [total] * 4, "rank": 0, "world": 2}
            assert [a["outcome"] for a in output["attempts"]] == ["checkpointed", "succeeded"]
            [preempted] = await stack.events("preempted", at_least=1)
            assert "resumes from the checkpoints of its 2 ranks" in preempted["message"]
            stopped = await stack.events("job_preempted", at_least=2)
            assert sorted(e["payload"]["rank"] for e in stopped) == [0, 1]
            assert all(e["payload"]["outcome"] == "checkpointed" for e in stopped)
    finally:
        for directory in job_log_dirs(home, request_id):
            shutil.rmtree(directory.parent, ignore_errors=True)
        shutil.rmtree(home / "checkpoints" / request_id, ignore_errors=True)
