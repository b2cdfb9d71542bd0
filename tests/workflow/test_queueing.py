"""Waiting for a lease on the real dev server: a request that does not
fit waits in the scheduler's queue and is granted when room appears; one that cannot get a
lease within its lease timeout or its deadline ends with that class, typed; a holder that may
not be preempted is drained (the higher request waits for it to finish, and the room it frees
goes to that request, not to later, lower work)."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from modelforge.client import ModelForgeClient
from modelforge.messages import RequestInput
from modelforge.policy import PolicyConfig
from modelforge.settings import CONTROL_TASK_QUEUE
from workers.stack import Stack, running_stack
from workflows import CapabilityRequestWorkflow
from workflows._common import request_workflow_id

pytestmark = pytest.mark.workflow

CATALOG = Path(__file__).resolve().parents[1] / "catalogs" / "queueing.toml"
JOB = "train.pinned@1"


async def _leased(stack: Stack) -> None:
    while not (await stack.status()).active_leases:
        await asyncio.sleep(0.1)


async def _phase(handle: WorkflowHandle[object, object]) -> str:
    for _ in range(50):
        phase = await handle.query("phase", result_type=str)
        if phase != "admitting":
            return phase
        await asyncio.sleep(0.1)
    return phase


async def _failure(handle: WorkflowHandle[object, object]) -> ApplicationError:
    with pytest.raises(WorkflowFailureError) as failed:
        await handle.result()
    assert isinstance(failed.value.cause, ApplicationError)
    return failed.value.cause


async def test_a_request_waits_in_the_queue_and_is_granted_or_times_out_typed(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        holder = await stack.start_request(JOB, tenant="lab", input={"simulate_invoke_s": 5})
        await _leased(stack)
        # 24 - 1 reserve - 16 held = 7 GiB: a second 16 GiB job waits.
        waiting = await stack.start_request(JOB, tenant="lab", lease_timeout_s=60)
        no_lease = await stack.start_request(JOB, tenant="lab", lease_timeout_s=2)
        no_time = await stack.start_request(JOB, tenant="lab", deadline_s=2)
        assert await _phase(waiting) == "queued"
        # A job is served for up to its max_duration (600 s here) and waits behind one running
        # 5 s more: with a 2 s deadline it is hopeless from the start, refused at once, never queued.
        deadline = await _failure(no_time)
        assert deadline.type == "DEADLINE_CANNOT_BE_MET"
        assert (await stack.status()).queue_depth["background"] == 2

        lease_timeout = await _failure(no_lease)
        assert lease_timeout.type == "LEASE_TIMEOUT"

        first = await holder.result()
        granted = await waiting.result()
        # Granted only once the holder gave its room back: it waited most of the holder's 5 s.
        assert granted.lease is not None and granted.lease.accelerator == "q-node/0"
        assert granted.timings["lease_s"] >= 3.0
        assert first.lease is not None and granted.lease.lease_id != first.lease.lease_id
        status = await stack.status()
        assert status.active_leases == 0 and sum(status.queue_depth.values()) == 0


async def test_a_holder_that_may_not_be_preempted_is_drained(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    config = PolicyConfig(preempt_min_runtime_s=0.5, preempt_grace_s=0.5)
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG, config=config) as stack:
        holder = await stack.start_request(JOB, tenant="lab", input={"simulate_invoke_s": 4})
        await _leased(stack)
        await asyncio.sleep(1.0)  # past the minimum runtime: only `preemptible = false` protects it
        # 7 GiB free, the chat model needs 12: an interactive request that may preempt background
        # work, but not this job. Then a later background job that would fit once the holder ends.
        chat = await stack.start_request("chat.llm@1", tenant="app", lease_timeout_s=60)
        assert await _phase(chat) == "queued"
        later = await stack.start_request(JOB, tenant="lab", lease_timeout_s=60, input={"simulate_invoke_s": 0.5})
        assert await _phase(later) == "queued"

        held = await holder.result()
        answered = await chat.result()
        after = await later.result()
        assert held.timings["preemptions"] == 0  # drained: it ran to its end
        assert not await stack.store.list_events(kind="preemption_requested")
        # The room went to the interactive request first; the later job came after it.
        assert answered.lease is not None and after.lease is not None
        grants = {e["request_id"]: int(e["seq"]) for e in await stack.events("lease_granted", at_least=3)}
        assert grants[answered.request_id] < grants[after.request_id]


async def test_a_deadline_counts_from_the_requests_start_not_from_its_admission(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    # The client waits from the moment it started the request. Its admission reaches the
    # scheduler 2.5 s later here (no worker yet, as on a host under load): those seconds are
    # gone from the deadline the scheduler holds it to, or a refusal would reach the client
    # after the client stopped listening.
    request_id = uuid.uuid4().hex[:12]
    request = RequestInput(request_id=request_id, capability="chat.llm@1", tenant="app", deadline_s=30)
    handle = await dev_server_env.client.start_workflow(
        CapabilityRequestWorkflow.run,
        request,
        id=request_workflow_id("chat.llm@1", request_id),
        task_queue=CONTROL_TASK_QUEUE,
    )
    await asyncio.sleep(2.5)
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        assert (await handle.result()).lease is not None
        granted = [e for e in await stack.events("lease_granted", at_least=1) if e["request_id"] == request_id]
        assert granted and granted[0]["payload"]["deadline_s"] <= 27.5, granted


# Alone (./scripts/test): the refusal must come within 0.8 s of its deadline.
@pytest.mark.serial
async def test_a_waiting_requests_refusal_reaches_its_caller_at_the_deadline_not_a_timer_later(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    # Temporal's timers fire up to a second late on a busy server. The client's own clock nudges
    # the scheduler (`deadline_due`) when the deadline passes, so the refusal comes then.
    # slow.job@1 serves one request at a time (a resident at concurrency 1).
    catalog = Path(__file__).resolve().parents[1] / "catalogs" / "gateway.toml"
    async with running_stack(dev_server_env.client, database_url, catalog_path=catalog) as stack:
        holder = await stack.start_request("slow.job@1", input={"simulate_invoke_s": 8})
        await _leased(stack)
        client = ModelForgeClient(stack.client)
        began = time.monotonic()
        # It waits behind one whose length nothing measured says: not hopeless at once.
        refused = await client.request("slow.job@1", input={"simulate_invoke_s": 8}, deadline_s=3)
        took = time.monotonic() - began
        assert refused.failure_class == "DEADLINE_CANNOT_BE_MET", refused
        assert 3.0 <= took < 3.8, took
        nudges = [
            event
            async for event in stack.scheduler.fetch_history_events()
            if event.HasField("workflow_execution_signaled_event_attributes")
            and event.workflow_execution_signaled_event_attributes.signal_name == "deadline_due"
        ]
        assert len(nudges) == 1
        await holder.result()
