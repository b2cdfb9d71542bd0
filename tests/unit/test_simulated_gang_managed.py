"""A simulated gang job's bytes are ModelForge's: the node's sample marks the job's processes on
its cards managed, so the scheduler never counts them as external use (which would leave no room
for a request preempting the job: INSUFFICIENT_SCHEDULABLE_VRAM), as subprocess_job's are."""

from __future__ import annotations

import asyncio

from temporalio.testing import ActivityEnvironment

from activities.node import NodeActivities
from modelforge.domain import Deployment, GiB
from modelforge.gpu import NodeDevices, SimulatedDevice, SimulatedGpuBackend
from modelforge.messages import GangJobInput
from modelforge.runtimes import SimulatedRuntime

JOB = Deployment(capability="train.wide@1", envelope_bytes=16 * GiB, runtime="simulated")


async def test_a_running_gang_jobs_bytes_are_managed_in_the_nodes_sample_and_gone_after() -> None:
    devices = NodeDevices(SimulatedGpuBackend([SimulatedDevice(i, f"GPU-{i}", "Simulated", 24 * GiB) for i in (0, 1)]))
    runtime = SimulatedRuntime(devices)
    node = NodeActivities("g1", devices, {"simulated": runtime})
    env = ActivityEnvironment()
    job = GangJobInput(
        lease_id="job.1",
        request_id="job",
        deployment=JOB,
        accelerators=["g1/0", "g1/1"],
        payload={"simulate_invoke_s": 2},
    )
    running = asyncio.ensure_future(env.run(node.run_gang_job, job))
    try:
        for _ in range(100):  # until its bytes are on both cards
            sample = await env.run(node.sample_node, "g1")
            if all(o.used_bytes >= 16 * GiB for o in sample.observations):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the job's bytes never reached the cards")
        for observation in sample.observations:
            jobs = [p for p in observation.processes if p.name == "modelforge:job:job.1"]
            assert jobs and all(p.managed for p in jobs), observation.processes
            assert observation.managed_bytes == 16 * GiB
            assert observation.external_bytes == 0  # not external use: a preempting request fits
    finally:
        await running
    assert runtime.running_pids() == set()
    after = await env.run(node.sample_node, "g1")
    assert all(o.used_bytes == 0 and not o.processes for o in after.observations)
