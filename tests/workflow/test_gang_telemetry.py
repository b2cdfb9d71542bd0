"""A running simulated gang job's bytes, seen by the nodes' telemetry, are ModelForge's, not
external use: the cards' external bytes stay 0 and a higher class still preempts the gang (before
the simulated runtime marked its job processes managed, the sample made them external and the
preempting request was refused, INSUFFICIENT_SCHEDULABLE_VRAM)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.domain import GiB
from modelforge.policy import PolicyConfig
from workers.stack import running_stack

pytestmark = pytest.mark.workflow

CATALOG = Path(__file__).parent.parent / "catalogs" / "gang.toml"
CARDS = ["g1/0", "g1/1", "g2/0", "g2/1"]


async def test_a_sampled_gang_job_is_not_external_use_and_is_still_preempted(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    config = PolicyConfig(preempt_min_runtime_s=1.0, preempt_grace_s=0.5)
    async with running_stack(
        dev_server_env.client, database_url, catalog_path=CATALOG, config=config, telemetry_interval_s=1.0
    ) as stack:
        job = await stack.start_request("train.wide@1", tenant="lab", input={"simulate_invoke_s": 8})
        while not (await stack.status()).active_leases:
            await asyncio.sleep(0.2)
        for _ in range(100):  # until a sample of every card shows the job's bytes
            cards = {a.id: a for a in (await stack.status()).accelerators if a.id in CARDS}
            if all((a.observed_used_bytes or 0) >= 10 * GiB for a in cards.values()):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"no sample showed the job's bytes: {cards}")
        assert {card: a.external_bytes for card, a in cards.items()} == dict.fromkeys(CARDS, 0)
        # chat.big@1 needs 20 GiB: 24 - 1 - 10 = 13 on every card, so the gang must go.
        chat = await (await stack.start_request("chat.big@1", tenant="app", lease_timeout_s=60)).result()
        assert chat.lease.accelerator in CARDS
        done = await job.result()
        assert done.timings["preemptions"] == 1
