"""A lease outlives neither its max_duration: an invoke that runs past it ends the request with
TIMEOUT and gives the lease back, while the model stays warm for the next request."""

from __future__ import annotations

import time

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from workers.stack import running_stack

pytestmark = pytest.mark.workflow

EMBEDDING = "rag.embedding@1"


async def test_an_invoke_past_max_duration_ends_with_timeout(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    async with running_stack(dev_server_env.client, database_url) as stack:
        await (await stack.start_request(EMBEDDING, tenant="rag")).result()  # warm
        started = time.monotonic()
        slow = await stack.start_request(EMBEDDING, tenant="rag", input={"simulate_invoke_s": 60}, max_duration_s=2)
        with pytest.raises(WorkflowFailureError) as raised:
            await slow.result()
        cause = raised.value.cause
        assert isinstance(cause, ApplicationError) and cause.type == "TIMEOUT"
        assert time.monotonic() - started < 30, "ended at its max_duration, not when the invoke would have"

        status = await stack.status()
        assert all(a.leased_bytes == 0 for a in status.accelerators)
        [warm] = [r for r in status.residents if r.capability == EMBEDDING]
        assert warm.active_leases == 0
        nxt = await (await stack.start_request(EMBEDDING, tenant="rag")).result()
        assert nxt.output["simulated"] is True
