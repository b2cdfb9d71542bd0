"""Preemption end to end: an interactive request that cannot fit next to a running background
job preempts it (after its minimum runtime and grace), runs, and the job is requeued at its
original class, comes back, and finishes."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.policy import PolicyConfig
from workers.stack import running_stack
from workflows import PoolSchedulerWorkflow

pytestmark = pytest.mark.workflow

CATALOG = Path(__file__).parent.parent / "catalogs" / "preemption.toml"


async def test_interactive_preempts_a_background_job_which_then_finishes(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    config = PolicyConfig(preempt_min_runtime_s=1.0, preempt_grace_s=1.0)
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG, config=config) as stack:
        job = await stack.start_request("train.job@1", tenant="lab", input={"simulate_invoke_s": 6})
        while not any(r.active_leases for r in (await stack.status()).residents):
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.5)  # past the job's minimum runtime

        # 24 - 1 reserve - 16 job = 7 GiB < 12 GiB: only preempting the job makes room.
        chat = await (await stack.start_request("chat.llm@1", tenant="app", lease_timeout_s=60)).result()
        assert chat.lease.accelerator == "lab-node/0"

        done = await job.result()
        assert done.output["simulated"] is True
        assert done.timings["preemptions"] == 1
        # It was checkpointed before it was stopped, and the resumed run started from there:
        # at least the 1.5 s it ran plus the 1 s grace were saved, and not redone.
        checkpoint = Path(done.output["resumed_from"])
        assert checkpoint.name == "checkpoint.json" and "checkpoints" in checkpoint.parts
        saved = json.loads(checkpoint.read_text())
        assert 2.0 <= saved["done_s"] < 6.0
        assert done.timings["invoke_s"] < 6.0 - saved["done_s"] + 1.5

        [asked] = await stack.events("preemption_requested", at_least=1)
        assert asked["workflow_id"] == job.id and "interactive chat.llm@1 needs room" in asked["message"]
        [preempted] = await stack.events("preempted", at_least=1)
        assert preempted["request_id"] == done.request_id and preempted["payload"]["retrying"] is True
        assert f"resumes from checkpoint {checkpoint}" in preempted["message"]
        # The job's batch resident was unloaded for the chat model, then loaded again for the job
        # (which evicted the idle chat model in turn).
        assert len(await stack.events("load", at_least=3)) == 3


async def test_a_preempted_request_keeps_its_deadline_from_its_start(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    # The deadline is the caller's: "seconds until the answer is useless" from its request, not
    # from each admission. Preempted and asked again, the job keeps the time it had left.
    config = PolicyConfig(preempt_min_runtime_s=1.0, preempt_grace_s=1.0)
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG, config=config) as stack:
        started = time.time()
        # A job's service is counted as its max_duration: 20 s fits its 60 s deadline, before and
        # after the preemption (the default 600 s would be refused at once as hopeless).
        job = await stack.start_request(
            "train.job@1", tenant="lab", input={"simulate_invoke_s": 8}, deadline_s=60, max_duration_s=20.0
        )
        for _ in range(150):  # bounded: a job refused at once fails here, not by the suite's timeout
            if any(r.active_leases for r in (await stack.status()).residents):
                break
            await asyncio.sleep(0.2)
        else:
            pytest.fail("the job never got its lease")
        await asyncio.sleep(3.0)  # past the job's minimum runtime: 3 s of its 60 are gone
        chat = await stack.start_request("chat.llm@1", tenant="app", lease_timeout_s=60, input={"simulate_invoke_s": 4})

        async def requeued() -> Any:
            state = await stack.scheduler.query(PoolSchedulerWorkflow.state)
            return next((q for q in state.queue if q.request_id == job.id.rsplit(":", 1)[1]), None)

        queued = None
        for _ in range(100):
            queued = await requeued()
            if queued is not None:
                break
            await asyncio.sleep(0.1)
        assert queued is not None and queued.preempted, "the job was never requeued"
        assert queued.deadline_at is not None
        # From the start (about started + 60), not from the new admission (3+ s later).
        assert queued.deadline_at <= started + 60.5, queued.deadline_at - started
        assert (await chat.result()).output
        assert (await job.result()).timings["preemptions"] == 1
