"""A burst of concurrent requests is admitted in a few coalesced updates, never against
Temporal's limit of 10 in-flight updates per workflow, and every request completes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.testing import WorkflowEnvironment

from modelforge.messages import AdmitBatch
from workers.stack import running_stack

pytestmark = pytest.mark.workflow

CATALOG = Path(__file__).parent.parent / "catalogs" / "burst.toml"
BURST = 60


# Alone (./scripts/test): how many admissions one update carries depends on the CPU the
# burst gets (other tests beside it made it 57 updates of at most 2 for 60 requests).
@pytest.mark.serial
async def test_a_burst_is_admitted_in_coalesced_updates(dev_server_env: WorkflowEnvironment, database_url: str) -> None:
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        await (await stack.start_request("bench.embed@1", tenant="bench")).result()  # loads the model
        handles = await asyncio.gather(
            *(stack.start_request("bench.embed@1", tenant="bench", lease_timeout_s=120) for _ in range(BURST))
        )
        outcomes = await asyncio.gather(*(handle.result() for handle in handles), return_exceptions=True)
        failures = [getattr(o, "cause", o) for o in outcomes if isinstance(o, BaseException)]
        assert failures == [], failures[:3]
        results = [o for o in outcomes if not isinstance(o, BaseException)]
        assert all(result.output["simulated"] for result in results)
        assert len({result.lease.lease_id for result in results}) == BURST

        history = await stack.scheduler.fetch_history()
        batches = []
        for event in history.events:
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED:
                accepted = event.workflow_execution_update_accepted_event_attributes.accepted_request
                [batch] = await stack.client.data_converter.decode(accepted.input.args.payloads, [AdmitBatch])
                batches.append(len(batch.requests))
        # Every admission went in an update; concurrent ones shared them. How many share depends on
        # how fast the scheduler answers (its own task queue keeps that fast, and since the request
        # workflows left the sandbox they reach it sooner and share less: 47 updates for 61 in one
        # run; 52 updates with at most 3 in one on a loaded machine): fewer updates than requests,
        # so some carried several at once. How many at most is the machine's timing, not asserted.
        assert sum(batches) == BURST + 1, batches
        assert len(batches) < BURST + 1 and max(batches) >= 2, batches


async def test_a_burst_of_200_through_continue_as_new_loses_none(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    # A low history bound puts several continue-as-new moments inside the burst: an admission
    # update the closing run never processed (`UnprocessedUpdate`) is asked again, never failed.
    async with running_stack(
        dev_server_env.client, database_url, catalog_path=CATALOG, max_history_events=300
    ) as stack:
        await (await stack.start_request("bench.embed@1", tenant="bench")).result()
        first_run = (await stack.scheduler.describe()).run_id
        handles = await asyncio.gather(
            *(stack.start_request("bench.embed@1", tenant="bench", lease_timeout_s=300) for _ in range(200))
        )
        outcomes = await asyncio.gather(*(handle.result() for handle in handles), return_exceptions=True)
        failures = [getattr(o, "cause", o) for o in outcomes if isinstance(o, BaseException)]
        assert failures == [], f"{len(failures)} failed: {failures[:3]}"
        assert (await stack.scheduler.describe()).run_id != first_run, "no continue-as-new inside the burst"
        assert (await stack.status()).active_leases == 0
