"""Configured queues end to end, on the shipped example catalog (two simulated 80 GiB cards):
a merge Critical job preempts a merge Low job; an eval High job preempts nothing and waits; the
preempted job comes back at its original level and finishes; usage is counted per queue."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.policy import PolicyConfig
from workers.stack import running_stack

SEED_003 = Path(__file__).parents[2] / "modelforge" / "examples" / "queues-seed003.toml"

pytestmark = pytest.mark.workflow


async def test_merge_critical_preempts_merge_low_while_eval_high_waits(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    config = PolicyConfig(preempt_min_runtime_s=1.0, preempt_grace_s=1.0)
    async with running_stack(dev_server_env.client, database_url, catalog_path=SEED_003, config=config) as stack:
        # Two merge Low jobs of 48 GiB, one per 80 GiB card: 80 - 1 reserve - 48 = 31 GiB left on
        # each, too little for an eval job (32 GiB) or another merge job (48 GiB).
        lows = [
            await stack.start_request(
                "merge.job@1", tenant="merge-team", priority="low", input={"simulate_invoke_s": 6}
            )
            for _ in range(2)
        ]
        while sum(r.active_leases for r in (await stack.status()).residents) < 2:
            await asyncio.sleep(0.2)
        # Eval High (priority 30) is above merge Low (10), but eval preempts nothing.
        evaluation = await stack.start_request(
            "eval.job@1", tenant="eval-team", priority="high", input={"simulate_invoke_s": 0.5}, lease_timeout_s=120
        )
        await asyncio.sleep(1.5)  # past the jobs' minimum runtime
        status = await stack.status()
        assert status.queue_depth["eval.high"] == 1
        assert set(status.queue_depth) >= {"merge.critical", "eval.high", "inference.realtime"}
        assert status.classes[:4] == ["inference.realtime", "merge.critical", "merge.high", "eval.high"]
        assert await stack.events("preemption_requested", at_least=1, within_s=1.0) == []

        # Merge Critical preempts Normal and Low of its own queue.
        critical = await stack.start_request(
            "merge.job@1",
            tenant="merge-team",
            priority="critical",
            input={"simulate_invoke_s": 0.5},
            lease_timeout_s=120,
        )
        done = await critical.result()
        assert done.lease.priority == "merge.critical"

        [asked] = await stack.events("preemption_requested", at_least=1)
        assert "merge.critical merge.job@1 needs a slot of merge.job@1@emep-node" in asked["message"]
        assert asked["workflow_id"] in {low.id for low in lows}

        finished_eval = await evaluation.result()
        assert finished_eval.lease.priority == "eval.high"
        results = [await low.result() for low in lows]
        assert sorted(r.timings["preemptions"] for r in results) == [0, 1]
        assert {r.lease.priority for r in results} == {"merge.low"}  # requeued at its original level

        # Exactly one preemption: eval High never displaced merge Low.
        assert len(await stack.events("preemption_requested", at_least=2, within_s=1.0)) == 1

        # GPU time is counted per queue: what a fresh scheduler seeds its fair share from.
        usage: dict[str, float] = {}
        for _ in range(50):
            usage = await stack.store.decayed_usage(pool="default", half_life_s=3600, as_of=time.time())
            if {"merge/merge-team", "eval/eval-team"} <= set(usage):
                break
            await asyncio.sleep(0.2)
        assert {"merge/merge-team", "eval/eval-team"} <= set(usage)
