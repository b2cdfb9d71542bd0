"""An invoke whose end never reached Temporal: the SDK gives up reporting an activity's
completion (and heartbeats) after about 10 s of Temporal being away, seen at a restart under
load. The request hears only its invoke's heartbeat timeout, asks the node, and answers with
what the node kept: nothing is run twice, nothing is lost, a failure keeps its class."""

from __future__ import annotations

from typing import Any

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle
from temporalio.client import Interceptor as ClientInterceptor
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import ActivityInboundInterceptor, ActivityOutboundInterceptor, ExecuteActivityInput
from temporalio.worker import Interceptor as WorkerInterceptor

from workers.stack import running_stack

pytestmark = pytest.mark.workflow

EMBEDDING = "rag.embedding@1"
# By the invoke's input text: its completion is lost; or its heartbeats too, the first one
# included (Temporal away from the moment it started), so it reads as never started.
LOSE_COMPLETION = ("lost", "failing")
LOSE_EVERYTHING = ("silent",)


class LosingTemporal(ClientInterceptor, WorkerInterceptor):
    """The node runs each invoke to its end; what it reports of the marked ones never arrives."""

    def __init__(self) -> None:
        self.ran: list[str] = []  # each invoke run on the node, by request workflow id

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _Inbound(next, self)


class _Outbound(ActivityOutboundInterceptor):
    silent = False

    def heartbeat(self, *details: Any) -> None:
        if not self.silent:
            super().heartbeat(*details)


class _Inbound(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, losing: LosingTemporal) -> None:
        super().__init__(next)
        self._losing = losing
        self._outbound: _Outbound | None = None

    def init(self, outbound: ActivityOutboundInterceptor) -> None:
        self._outbound = _Outbound(outbound)
        super().init(self._outbound)

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        info = activity.info()
        if info.activity_type != "invoke":
            return await super().execute_activity(input)
        self._losing.ran.append(info.workflow_id or "")
        text = input.args[0].payload.get("text")
        if text in LOSE_EVERYTHING and self._outbound is not None:
            self._outbound.silent = True
        try:
            return await super().execute_activity(input)
        finally:
            if text in LOSE_COMPLETION + LOSE_EVERYTHING:
                activity.raise_complete_async()  # nothing is reported: the completion is lost


def _activities(history: Any) -> list[str]:
    return [
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history.events
        if e.HasField("activity_task_scheduled_event_attributes")
    ]


async def test_an_invoke_whose_end_was_lost_is_answered_from_its_node(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    """Three requests at once (the embedder serves one at a time, the failing one last: its lease
    is released only once its request hears): an answer whose completion was lost, one whose
    heartbeats were lost too (it reads as never started: run again before, it would have run
    twice), and a failure (the class the node kept, not TIMEOUT). One 60 s heartbeat timeout
    for all, waited on the real dev server (the time-skipping test server cannot skip it while
    an invoke is in flight, and refused a completion here once: "invalid history builder state")."""
    losing = LosingTemporal()
    config = dev_server_env.client.config()
    config["interceptors"] = [losing]
    async with running_stack(Client(**config), database_url) as stack:
        lost = await stack.start_request(EMBEDDING, tenant="rag", input={"text": "lost"})
        silent = await stack.start_request(EMBEDDING, tenant="rag", input={"text": "silent"})
        # The simulated runtime fails the call with the class asked for (GPU_OOM: not retried).
        failing = await stack.start_request(
            EMBEDDING, tenant="rag", input={"text": "failing", "simulate_fault": "GPU_OOM"}
        )
        for answered in (lost, silent):
            assert (await answered.result()).output["simulated"] is True
        with pytest.raises(WorkflowFailureError) as failed:
            await failing.result()
        assert getattr(failed.value.cause, "type", None) == "GPU_OOM", failed.value.cause
        assert sorted(losing.ran) == sorted([lost.id, silent.id, failing.id])  # none ran twice
        handles: list[WorkflowHandle[Any, Any]] = [lost, silent, failing]
        for handle in handles:
            assert _activities(await handle.fetch_history()) == ["invoke", "collect_invoke"]
        assert (await stack.status()).active_leases == 0
        # The next request on the same resident is served as always.
        again = await stack.start_request(EMBEDDING, tenant="rag", input={"text": "again"})
        assert (await again.result()).output["simulated"] is True
        assert losing.ran[-1] == again.id
