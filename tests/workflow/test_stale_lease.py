"""A lease outlives neither its holder nor its welcome: a request that is terminated while it
holds a lease gives the memory and the slot back after stale_lease_s, while a long invoke that
keeps heart-beating keeps its lease to the end."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.policy import PolicyConfig
from workers.stack import running_stack

pytestmark = pytest.mark.workflow

EMBEDDING = "rag.embedding@1"  # concurrency 1 in the example catalog: one holder at a time
STALE_S = 3.0  # the holder heartbeats every 1 s


async def test_live_holder_keeps_its_lease_and_a_terminated_one_loses_it(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    config = PolicyConfig(stale_lease_s=STALE_S)
    async with running_stack(dev_server_env.client, database_url, config=config) as stack:
        # A live holder invoking for 2x the stale limit keeps its lease: its heartbeats land.
        long = await (await stack.start_request(EMBEDDING, tenant="rag", input={"simulate_invoke_s": 6})).result()
        assert long.lease.heartbeat_s == pytest.approx(STALE_S / 3)
        assert await stack.store.list_events(kind="lease_reclaimed") == []

        # A holder that dies while holding: terminated mid-invoke, it never releases.
        doomed = await stack.start_request(EMBEDDING, tenant="rag", input={"simulate_invoke_s": 30})
        while not any(r.active_leases for r in (await stack.status()).residents):
            await asyncio.sleep(0.2)
        await doomed.terminate("simulating a lost holder")

        # The next request waits behind the dead lease, then gets the slot once it is reclaimed.
        nxt = await (await stack.start_request(EMBEDDING, tenant="rag", lease_timeout_s=60)).result()
        assert nxt.output["simulated"] is True
        [reclaimed] = await stack.events("lease_reclaimed", at_least=1)
        assert reclaimed["workflow_id"] == doomed.id
        assert "holder silent" in reclaimed["message"]
        assert nxt.timings["lease_s"] >= STALE_S - 1.5  # it really waited for the reclaim
