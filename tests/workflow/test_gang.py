"""Multi-GPU gang leases run by the workflows: one job member per node on that node's cards, all
or nothing, its bytes held on every card while it runs; a failing member stops the job; a higher
class preempts it, every rank is checkpointed, and it resumes from there when its lease comes
back."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from modelforge.domain import GiB
from modelforge.policy import PolicyConfig
from workers.stack import Stack, running_stack

pytestmark = pytest.mark.workflow

CATALOG = Path(__file__).parent.parent / "catalogs" / "gang.toml"
CARDS = ["g1/0", "g1/1", "g2/0", "g2/1"]


async def leased_bytes(stack: Stack) -> dict[str, int]:
    return {a.id: a.leased_bytes for a in (await stack.status()).accelerators}


async def test_a_two_node_gang_runs_on_all_its_cards_and_gives_them_back(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        job = await stack.start_request("train.wide@1", tenant="lab", input={"simulate_invoke_s": 3})
        while not (await stack.status()).active_leases:
            await asyncio.sleep(0.2)
        # While it runs: 10 GiB leased on each of the four cards, and the simulated NVML of both
        # nodes shows the job's process holding them.
        assert await leased_bytes(stack) == dict.fromkeys(CARDS, 10 * GiB)

        def held() -> list[int]:
            return [
                sum(p.used_bytes for p in device.processes if p.name.startswith("modelforge:job:"))
                for backend in stack.backends.values()
                for device in backend.sample()
            ]

        for _ in range(20):  # each node's member starts when its worker picks it up
            if held() == [10 * GiB] * 4:
                break
            await asyncio.sleep(0.1)
        assert held() == [10 * GiB] * 4
        done = await job.result()
        assert sorted(done.lease.accelerators) == CARDS
        assert done.output["nodes"] == ["g1", "g2"] and done.output["simulated"] is True
        assert done.timings["invoke_s"] >= 3.0
        for _ in range(50):
            if not (await stack.status()).active_leases:
                break
            await asyncio.sleep(0.1)
        assert await leased_bytes(stack) == dict.fromkeys(CARDS, 0)

        # An NVLink pair lands inside one node's group.
        pair = await (await stack.start_request("train.pair@1", tenant="lab")).result()
        assert {a.split("/")[0] for a in pair.lease.accelerators} in ({"g1"}, {"g2"})


async def test_a_failing_member_fails_the_whole_gang_with_its_class(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        job = await stack.start_request(
            "train.wide@1", tenant="lab", input={"simulate_invoke_s": 1, "simulate_fault": "INVALID_OUTPUT"}
        )
        with pytest.raises(WorkflowFailureError) as caught:
            await job.result()
        assert isinstance(caught.value.cause, ApplicationError)
        assert caught.value.cause.type == "INVALID_OUTPUT"
        for _ in range(50):
            if not (await stack.status()).active_leases:
                break
            await asyncio.sleep(0.1)
        assert await leased_bytes(stack) == dict.fromkeys(CARDS, 0)
        # Nothing left running on any card.
        assert all(
            not any(p.name.startswith("modelforge:job:") for p in device.processes)
            for backend in stack.backends.values()
            for device in backend.sample()
        )


async def test_a_higher_class_preempts_the_gang_which_resumes_from_its_checkpoints_and_finishes(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    config = PolicyConfig(preempt_min_runtime_s=1.0, preempt_grace_s=0.5)
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG, config=config) as stack:
        job = await stack.start_request("train.wide@1", tenant="lab", input={"simulate_invoke_s": 4})
        while not (await stack.status()).active_leases:
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.5)
        # chat.big@1 needs 20 GiB: 24 - 1 - 10 = 13 on every card, so the gang must go.
        chat = await (await stack.start_request("chat.big@1", tenant="app", lease_timeout_s=60)).result()
        assert chat.lease.accelerator in CARDS
        done = await job.result()
        assert done.timings["preemptions"] == 1
        [asked] = await stack.events("preemption_requested", at_least=1)
        assert asked["workflow_id"] == job.id
        [preempted] = await stack.events("preempted", at_least=1)
        assert "resumes from the checkpoints of its 2 ranks" in preempted["message"]
        # Rank 0's checkpoint: the seconds it ran before the preemption were not run again.
        saved = json.loads(Path(done.output["resumed_from"]).read_text())
        assert saved["done_s"] >= 1.0 and done.output["rank"] == 0
