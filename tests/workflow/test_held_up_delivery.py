"""A delivery that Temporal holds up does not stop the pool. The scheduler tells each requester
its grant by a signal; after restarts under load the dev server took minutes to deliver some of
them (the chaos round: no grant, no load and no continue-as-new for ten minutes, while the
scheduler's loop waited for every delivery of its last pass to end). Here one grant's signal is
held back 25 s inside the scheduler (an interceptor on its outbound calls, the same await the
server's delay is); meanwhile another model must be loaded and its request served as always,
and the held-up grant still arrives and is used. With continue-as-new due meanwhile (a low
history limit), new deliveries wait for it only until the one under way counts as held up
(HELD_UP_DELIVERY_S), and the run continues as new once it has ended."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from temporalio import workflow
from temporalio.client import Client
from temporalio.client import Interceptor as ClientInterceptor
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Interceptor as WorkerInterceptor
from temporalio.worker import (
    SignalExternalWorkflowInput,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
    WorkflowOutboundInterceptor,
)

from tests.gateway.serving import CATALOG
from workers.stack import Stack, running_stack
from workflows.scheduler import HELD_UP_DELIVERY_S

pytestmark = pytest.mark.workflow

HELD_UP_S = 25.0
HELD_UP_REQUEST = "held-up"


class HoldingTemporal(ClientInterceptor, WorkerInterceptor):
    """Holds back the grant to one request, as a server working through a backlog does."""

    def workflow_interceptor_class(self, input: WorkflowInterceptorClassInput) -> type[WorkflowInboundInterceptor]:
        return _Inbound


class _Inbound(WorkflowInboundInterceptor):
    def init(self, outbound: WorkflowOutboundInterceptor) -> None:
        super().init(_Outbound(outbound))


class _Outbound(WorkflowOutboundInterceptor):
    async def signal_external_workflow(self, input: SignalExternalWorkflowInput) -> None:
        if input.signal == "lease_decision" and input.workflow_id.endswith(f":{HELD_UP_REQUEST}"):
            await workflow.sleep(HELD_UP_S)
        await super().signal_external_workflow(input)


async def _lease_on(stack: Stack, capability: str) -> bool:
    return any(r.capability == capability and r.active_leases > 0 for r in (await stack.status()).residents)


@pytest.mark.parametrize(
    ("history_limit", "served_within_s"),
    [
        (5000, HELD_UP_S / 2),
        # Continue-as-new due all along: the other load waits at most HELD_UP_DELIVERY_S for it.
        (60, HELD_UP_DELIVERY_S + HELD_UP_S / 4),
    ],
    ids=["continue-as-new-not-due", "continue-as-new-due"],
)
async def test_a_held_up_grant_does_not_stop_loads_and_grants_for_others(
    dev_server_env: WorkflowEnvironment, database_url: str, history_limit: int, served_within_s: float
) -> None:
    config = dev_server_env.client.config()
    config["interceptors"] = [HoldingTemporal()]
    # The replay guard replays the scheduler without the interceptor, which cannot match.
    async with running_stack(
        Client(**config), database_url, catalog_path=CATALOG, replay_check_s=0, max_history_events=history_limit
    ) as stack:
        loop = asyncio.get_running_loop()
        # Cold: admitted as queued, granted by the scheduler's loop once loaded, by a signal.
        held = await stack.start_request("slow.job@1", request_id=HELD_UP_REQUEST, input={"simulate_invoke_s": 1})
        for _ in range(200):
            if await _lease_on(stack, "slow.job@1"):
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the held-up request was never granted")
        asked = loop.time()
        run_while_held = (await stack.scheduler.describe()).run_id
        # Another model, cold too: its load and its grant come from the same loop.
        other = await stack.start_request("rag.embedding@1", tenant="rag", input={"text": "meanwhile"})
        answer: Any = await other.result()
        served_in = loop.time() - asked
        assert answer.output["simulated"] is True
        assert served_in < served_within_s, f"served in {served_in:.1f} s: it waited for the held-up delivery"
        assert not (await held.describe()).close_time, "the held-up grant arrived early: nothing was held up"
        # The late grant is still the request's, and it runs.
        done: Any = await held.result()
        assert loop.time() - asked >= HELD_UP_S - 5
        assert done.output["simulated"] is True
        assert (await stack.status()).active_leases == 0
        if history_limit < 100:
            for _ in range(100):  # once the held-up delivery ended, the run continues as new
                if (await stack.scheduler.describe()).run_id != run_while_held:
                    break
                await asyncio.sleep(0.2)
            else:
                pytest.fail("the scheduler never continued as new after the held-up delivery ended")
