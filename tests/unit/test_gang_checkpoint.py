"""A gang job's part on one node is checkpointed and resumed (for gang
holders): the simulated runtime saves the seconds a rank has run, a resumed rank starts there;
the node refuses a checkpoint of a job it does not run, or outside a checkpoint store; runtimes
that cannot run gang jobs cannot checkpoint them either, and say so."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.node import NodeActivities
from modelforge.domain import Deployment, GiB
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gpu import NodeDevices, SimulatedDevice, SimulatedGpuBackend
from modelforge.messages import RESUME_KEY, GangCheckpointInput, GangJobInput, LeaseHeartbeat
from modelforge.runtimes import SentenceTransformersRuntime, SimulatedRuntime, SubprocessHttpRuntime

JOB = Deployment(capability="train.wide@1", envelope_bytes=2 * GiB, runtime="simulated")


def _devices() -> NodeDevices:
    return NodeDevices(SimulatedGpuBackend([SimulatedDevice(i, f"GPU-{i}", "Simulated", 24 * GiB) for i in (0, 1)]))


async def test_a_running_rank_is_checkpointed_and_a_resumed_rank_skips_what_it_ran(tmp_path: Path) -> None:
    runtime = SimulatedRuntime(_devices())
    payload = {"simulate_invoke_s": 3, "modelforge_lease_id": "job.1", "modelforge_rank": 1}
    running = asyncio.ensure_future(runtime.run_job(JOB, [0, 1], payload, lambda _: None))
    await asyncio.sleep(1.3)  # one 1 s step done
    location = await runtime.checkpoint_job("job.1", 1, str(tmp_path / "0-rank1"))
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert json.loads(Path(location).read_text())["done_s"] == 1.0
    # Resumed: 3 s to run, 1 s already done, so 2 s left (not 3).
    loop = asyncio.get_running_loop()
    started = loop.time()
    output = await runtime.run_job(JOB, [0, 1], {**payload, RESUME_KEY: location}, lambda _: None)
    assert 1.9 <= loop.time() - started < 2.9
    assert output["resumed_from"] == location and output["rank"] == 1


async def test_no_checkpoint_of_a_job_that_is_not_running() -> None:
    with pytest.raises(ModelForgeError) as refused:
        await SimulatedRuntime(_devices()).checkpoint_job("job.1", 0, "/tmp/x")
    assert refused.value.failure == FailureClass.REQUEST_INVALID


@pytest.mark.parametrize("kind", ["subprocess_http", "sentence_transformers"])
async def test_model_servers_cannot_checkpoint_gang_jobs(kind: str, tmp_path: Path) -> None:
    devices = _devices()
    runtime = (
        SubprocessHttpRuntime(devices, tmp_path) if kind == "subprocess_http" else SentenceTransformersRuntime(devices)
    )
    with pytest.raises(ModelForgeError) as refused:
        await runtime.checkpoint_job("job.1", 0, str(tmp_path))
    assert refused.value.failure == FailureClass.CAPABILITY_UNAVAILABLE
    assert "cannot checkpoint a multi-GPU job" in refused.value.message


async def test_the_node_checkpoints_only_its_running_ranks_and_only_into_its_store(tmp_path: Path) -> None:
    devices = _devices()
    node = NodeActivities("g1", devices, {"simulated": SimulatedRuntime(devices)}, checkpoint_root=tmp_path)
    env = ActivityEnvironment()
    ask = GangCheckpointInput(lease_id="job.1", request_id="job", rank=0, preemption=0)
    with pytest.raises(ApplicationError) as refused:
        await env.run(node.checkpoint_gang_job, ask)
    assert (
        refused.value.type == FailureClass.REQUEST_INVALID.value and "no gang job job.1 rank 0" in refused.value.message
    )

    job = GangJobInput(
        lease_id="job.1", request_id="job", deployment=JOB, accelerators=["g1/0"], payload={"simulate_invoke_s": 3}
    )
    running = asyncio.ensure_future(env.run(node.run_gang_job, job))
    await asyncio.sleep(1.3)
    saved = await env.run(node.checkpoint_gang_job, ask)
    assert Path(saved.location).is_relative_to(tmp_path / "job" / "0-rank0")
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running

    # A resume location outside the store is refused before anything runs.
    outside = GangJobInput(
        lease_id="job.2",
        request_id="job",
        deployment=JOB,
        accelerators=["g1/0"],
        payload={"simulate_invoke_s": 1, RESUME_KEY: "/etc/passwd"},
    )
    with pytest.raises(ApplicationError) as escaped:
        await env.run(node.run_gang_job, outside)
    assert escaped.value.type == FailureClass.REQUEST_INVALID.value


class _Scheduler:
    """Stands for the scheduler's handle: records the lease heartbeats the node sends."""

    def __init__(self) -> None:
        self.beats: list[tuple[str, str]] = []

    async def signal(self, name: str, heartbeat: LeaseHeartbeat) -> None:
        self.beats.append((name, heartbeat.lease_id))


class _Client:
    def __init__(self) -> None:
        self.scheduler = _Scheduler()
        self.asked: list[str] = []

    def get_workflow_handle(self, workflow_id: str) -> _Scheduler:
        self.asked.append(workflow_id)
        return self.scheduler


async def test_a_node_running_its_part_of_a_gang_vouches_for_the_lease() -> None:
    # Whoever uses the memory vouches for it: a gang's node heartbeats the lease while its part
    # runs, so a holder whose own worker is away does not lose a lease its job still uses.
    devices = _devices()
    client = _Client()
    node = NodeActivities("g1", devices, {"simulated": SimulatedRuntime(devices)}, client=client)  # type: ignore[arg-type]
    job = GangJobInput(
        lease_id="job.9",
        request_id="job",
        deployment=JOB,
        accelerators=["g1/0"],
        payload={"simulate_invoke_s": 2},
        release_to="scheduler:default",
        heartbeat_s=0.4,
    )
    await ActivityEnvironment().run(node.run_gang_job, job)
    assert client.asked == ["scheduler:default"]
    assert len(client.scheduler.beats) >= 3 and set(client.scheduler.beats) == {("lease_heartbeat", "job.9")}


@pytest.mark.parametrize(("release_to", "heartbeat_s"), [("", 0.4), ("scheduler:default", 0.0)])
async def test_a_node_refuses_work_that_names_no_scheduler_to_vouch_to(release_to: str, heartbeat_s: float) -> None:
    # Every request workflow names its lease's scheduler and heartbeat: work without them would
    # run with nobody vouching for its memory, so the node refuses it before anything runs.
    devices = _devices()
    client = _Client()
    node = NodeActivities("g1", devices, {"simulated": SimulatedRuntime(devices)}, client=client)  # type: ignore[arg-type]
    job = GangJobInput(
        lease_id="job.9",
        request_id="job",
        deployment=JOB,
        accelerators=["g1/0"],
        payload={"simulate_invoke_s": 30},
        release_to=release_to,
        heartbeat_s=heartbeat_s,
    )
    with pytest.raises(ApplicationError) as refused:
        await ActivityEnvironment().run(node.run_gang_job, job)
    assert refused.value.type == FailureClass.REQUEST_INVALID.value and refused.value.non_retryable
    assert "release_to" in refused.value.message and client.asked == []
