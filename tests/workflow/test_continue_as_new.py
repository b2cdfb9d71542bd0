"""The scheduler continues as new when its history grows past max_history_events, carrying its
state: a lease held and a request queued across the boundary both complete, and nothing leaks."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.testing import WorkflowEnvironment

from workers.stack import running_stack
from workflows._common import SCHEDULER_TASK_TIMEOUT

pytestmark = pytest.mark.workflow

EMBEDDING = "rag.embedding@1"  # concurrency 1: the second request queues behind the first


async def test_lease_and_queue_survive_continue_as_new(dev_server_env: WorkflowEnvironment, database_url: str) -> None:
    async with running_stack(dev_server_env.client, database_url, max_history_events=80) as stack:
        first_run = (await stack.scheduler.describe()).run_id
        holder = await stack.start_request(EMBEDDING, tenant="rag", input={"simulate_invoke_s": 3})
        while not any(r.active_leases for r in (await stack.status()).residents):
            await asyncio.sleep(0.2)
        queued = await stack.start_request(EMBEDDING, tenant="rag", lease_timeout_s=120)
        results = [await holder.result(), await queued.result()]
        more = [await (await stack.start_request(EMBEDDING, tenant="rag")).result() for _ in range(3)]

        assert all(r.output["simulated"] for r in results + more)
        latest = await stack.client.get_workflow_handle(stack.scheduler.id).describe()
        assert latest.run_id != first_run, "the scheduler continued as new"
        # ...and kept its task timeout (a dead worker's task stalls it 30 s).
        assert (
            latest.raw_description.execution_config.default_workflow_task_timeout.ToTimedelta()
            == SCHEDULER_TASK_TIMEOUT
        )
        history = await stack.client.get_workflow_handle(stack.scheduler.id).fetch_history()
        assert len(history.events) < 200  # the current run's history stays short
        status = await stack.status()
        assert all(a.leased_bytes == 0 for a in status.accelerators)
        [warm] = [r for r in status.residents if r.capability == EMBEDDING]
        assert warm.active_leases == 0 and warm.state == "ready"
