"""A scheduler that stands still for a whole workflow task timeout: what a pool sees when the
control worker holding one of its scheduler's tasks dies mid-task (Temporal hands the task to
another worker only once its task timeout has passed). A request asked for meanwhile is
admitted once the scheduler moves again; it does not fail with TIMEOUT (its admission budget,
ADMIT_BUDGET, was once equal to the task timeout, and such requests failed a few seconds before
the scheduler came back: tests/faults/test_kill_control_worker.py saw it in full runs)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from modelforge.settings import SCHEDULER_TASK_QUEUE
from workers.control import workflow_runner
from workers.stack import running_stack
from workflows import PoolSchedulerWorkflow
from workflows._common import SCHEDULER_TASK_TIMEOUT
from workflows.request import ADMIT_BUDGET

pytestmark = pytest.mark.workflow

CATALOG = Path(__file__).resolve().parents[1] / "catalogs" / "burst.toml"


async def test_a_request_outlasts_a_scheduler_standing_still_for_a_whole_task_timeout(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    # The scheduler's workflow task timeout: the longest a dead worker's task stalls the pool.
    stall = SCHEDULER_TASK_TIMEOUT
    assert stall < ADMIT_BUDGET
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        assert stack.control is not None
        warm = await stack.start_request("bench.embed@1", tenant="bench")
        assert (await warm.result()).output
        # The scheduler's worker goes (the control worker keeps running the request workflows
        # and their admission calls): no worker takes the scheduler's tasks.
        [schedulers] = [w for w in stack.control.workers if w.task_queue == SCHEDULER_TASK_QUEUE]
        await schedulers.shutdown()
        asked = time.monotonic()
        request = await stack.start_request("bench.embed@1", tenant="bench")
        await asyncio.sleep(stall.total_seconds())
        back = Worker(
            dev_server_env.client,
            task_queue=SCHEDULER_TASK_QUEUE,
            workflows=[PoolSchedulerWorkflow],
            workflow_runner=workflow_runner(),
        )
        stack.control.workers[stack.control.workers.index(schedulers)] = back  # stopped with the stack
        await back.__aenter__()
        result = await asyncio.wait_for(request.result(), timeout=60)
        assert result.output, result
        waited = time.monotonic() - asked
        assert waited >= stall.total_seconds(), waited
        print(f"admitted {waited:.1f} s after it asked, the scheduler stood still for {stall}")
