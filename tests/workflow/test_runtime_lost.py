"""A runtime that is gone when a lease is used (it crashed, or its node worker restarted
before the next NVML sample told the scheduler) costs the request one bounded retry on a fresh
load, never a failure the user sees, and never a conflict with the residency that is closing."""

from __future__ import annotations

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from workers.stack import running_stack

pytestmark = pytest.mark.workflow

EMBEDDING = "rag.embedding@1"


async def test_node_restart_between_requests_reloads_and_succeeds(
    time_skipping_env: WorkflowEnvironment, database_url: str
) -> None:
    async with running_stack(time_skipping_env.client, database_url) as stack:
        first = await (await stack.start_request(EMBEDDING, tenant="rag")).result()
        assert first.lease.accelerator == "gpu-node/0"

        await stack.restart_node("gpu-node")  # the scheduler still believes the model is warm
        again = await (await stack.start_request(EMBEDDING, tenant="rag", input={"text": "after"})).result()
        assert again.output["simulated"] is True

        # Loaded twice, each time by its own residency workflow; none of them conflicted.
        loads = await stack.events("load", at_least=2)
        assert len(loads) == 2
        assert len({e["workflow_id"] for e in loads}) == 2
        assert await stack.store.list_events(kind="resident_failed") == []
        [warm] = [r for r in (await stack.status()).residents if r.capability == EMBEDDING]
        assert warm.state == "ready"


async def test_a_crashing_runtime_is_retried_once_then_fails_with_its_class(
    time_skipping_env: WorkflowEnvironment, database_url: str
) -> None:
    async with running_stack(time_skipping_env.client, database_url) as stack:
        handle = await stack.start_request(EMBEDDING, tenant="rag", input={"simulate_fault": "RUNTIME_CRASH"})
        with pytest.raises(WorkflowFailureError) as raised:
            await handle.result()
        cause = raised.value.cause
        assert isinstance(cause, ApplicationError) and cause.type == "RUNTIME_CRASH"

        # Two attempts, each on a fresh load; the first says it is retrying, the second does not.
        failed = await stack.events("invoke_failed", at_least=2)
        assert [e["payload"]["retrying"] for e in failed] == [True, False]
        assert len(await stack.events("load", at_least=2)) == 2
        lost = await stack.events("resident_lost", at_least=2)
        assert [e["failure_class"] for e in lost] == ["RUNTIME_CRASH", "RUNTIME_CRASH"]
        # Nothing stays resident or leased once the request has failed, and status says why
        # the capability failed (two failures: not yet degraded, which takes three).
        status = await stack.status()
        [health] = [c for c in status.capabilities if c.capability == EMBEDDING]
        assert (health.consecutive_failures, health.last_failure, health.degraded) == (2, "RUNTIME_CRASH", False)
        assert [r for r in status.residents if r.capability == EMBEDDING] == []
        assert all(a.leased_bytes == 0 for a in status.accelerators)
