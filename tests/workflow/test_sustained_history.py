"""Under a steady stream of requests the scheduler's history stays bounded: it
continues as new at max_history_events, every run's history stays under the bound plus one
workflow task, and no request is lost across the boundaries. (bench/sustained.py runs the same
for minutes at the production bound; this is its CI-sized version.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from workers.stack import running_stack

pytestmark = pytest.mark.workflow

CATALOG = Path(__file__).resolve().parents[1] / "catalogs" / "burst.toml"
BOUND = 300
RATE_PER_S = 4
SECONDS = 30


async def test_the_scheduler_history_stays_bounded_under_a_steady_stream(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    client = dev_server_env.client
    async with running_stack(client, database_url, catalog_path=CATALOG, max_history_events=BOUND) as stack:
        handles = []
        for _ in range(RATE_PER_S * SECONDS):
            handles.append(await stack.start_request("bench.embed@1", tenant="bench", input={"simulate_invoke_s": 0.5}))
            await asyncio.sleep(1 / RATE_PER_S)
        results = await asyncio.gather(*(h.result() for h in handles))
        assert len(results) == RATE_PER_S * SECONDS and all(r.output["simulated"] for r in results)

        runs = [execution.run_id async for execution in client.list_workflows(f"WorkflowId = '{stack.scheduler.id}'")]
        lengths = []
        for run_id in runs:
            history = await client.get_workflow_handle(stack.scheduler.id, run_id=run_id).fetch_history()
            lengths.append(len(history.events))
        print(f"scheduler runs: {len(runs)}, history lengths: {lengths}")
        # 120 requests write well over 300 events: it must have continued as new, more than once.
        assert len(runs) >= 3, lengths
        # The bound is checked between workflow tasks: a run ends within one task of it.
        assert max(lengths) <= BOUND + 60, lengths
        status = await stack.status()
        assert all(a.leased_bytes == 0 for a in status.accelerators)
        assert sum(status.queue_depth.values()) == 0
