"""A node whose telemetry falls silent: its card goes stale (nothing new lands
there), the lease of the job running on it is preempted once the silence passes node_silent_s,
the job is checkpointed and requeued, and when the node samples again its residents are
reconciled against what it reports and the job resumes from its checkpoint and finishes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.policy import PolicyConfig
from tests.polling import until
from workers.node import ensure_telemetry
from workers.stack import Stack, running_stack
from workflows._common import telemetry_id

pytestmark = pytest.mark.workflow

CATALOG = Path(__file__).resolve().parents[1] / "catalogs" / "preemption.toml"
GPU = "lab-node/0"


async def _card(stack: Stack) -> object:
    return next(a for a in (await stack.status()).accelerators if a.id == GPU)


async def test_a_silent_node_loses_its_leases_and_its_job_resumes_when_it_returns(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    # Lease heartbeats every 2 s (stale_lease_s / 3) keep waking the scheduler while the node is silent.
    config = PolicyConfig(
        freshness_s=3.0, node_silent_s=6.0, preempt_grace_s=1.0, preempt_min_runtime_s=1.0, stale_lease_s=6.0
    )
    async with running_stack(
        dev_server_env.client, database_url, catalog_path=CATALOG, config=config, telemetry_interval_s=1.0
    ) as stack:
        job = await stack.start_request("train.job@1", tenant="lab", input={"simulate_invoke_s": 30})
        assert await until(lambda: _leased(stack), 30)

        # The node's telemetry stops (the node itself, and the job's invoke, carry on).
        await dev_server_env.client.get_workflow_handle(telemetry_id("lab-node")).terminate("test: silent node")
        assert await until(lambda: _stale(stack), 15)
        [asked] = await stack.events("preemption_requested", at_least=1, within_s=30)
        assert asked["workflow_id"] == job.id and "node silent for" in asked["message"]
        [preempted] = await stack.events("preempted", at_least=1, within_s=30)
        assert preempted["payload"]["retrying"] is True and "resumes from checkpoint" in preempted["message"]
        # Requeued, and nothing is granted on the stale card meanwhile.
        await asyncio.sleep(2)
        status = await stack.status()
        assert not any(r.active_leases for r in status.residents)
        assert sum(status.queue_depth.values()) == 1

        # The node samples again: the card is fresh, its residents reconciled, the job resumes.
        await ensure_telemetry(dev_server_env.client, "lab-node", interval_s=1.0)
        assert await until(lambda: _fresh(stack), 15)
        done = await job.result()
        assert done.timings["preemptions"] == 1
        saved = json.loads(Path(done.output["resumed_from"]).read_text())
        assert saved["done_s"] >= 5.0  # the seconds it ran before the silence were not redone
        status = await stack.status()
        assert not any(r.active_leases for r in status.residents) and sum(status.queue_depth.values()) == 0


async def _leased(stack: Stack) -> bool:
    return any(r.active_leases for r in (await stack.status()).residents)


async def _stale(stack: Stack) -> bool:
    return not (await _card(stack)).fresh  # type: ignore[attr-defined]


async def _fresh(stack: Stack) -> bool:
    return bool((await _card(stack)).fresh)  # type: ignore[attr-defined]
