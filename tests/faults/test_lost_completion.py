"""An invoke that ran on its node but whose completion never reached Temporal (the SDK gives up
reporting it after about 10 s of Temporal being away: seen at a restart under load). The
request hears its invoke's heartbeat timeout, asks the node, and answers with what the node
kept: nothing is run twice, nothing is lost. With time skipped over the heartbeat timeout."""

from __future__ import annotations

from typing import Any

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowFailureError
from temporalio.client import Interceptor as ClientInterceptor
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
)
from temporalio.worker import (
    Interceptor as WorkerInterceptor,
)

from workers.stack import running_stack

pytestmark = pytest.mark.workflow

EMBEDDING = "rag.embedding@1"


class LoseInvokeCompletions(ClientInterceptor, WorkerInterceptor):
    """The node runs each invoke to its end; the first `lose` of them never report it, as when
    Temporal is away while they end (a completion the worker has given up on)."""

    def __init__(self, lose: int) -> None:
        self.left = lose
        self.ran: list[str] = []  # each invoke run on the node, by request workflow id
        self.lost: list[str] = []

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _Inbound(next, self)


class _Inbound(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, losing: LoseInvokeCompletions) -> None:
        super().__init__(next)
        self._losing = losing

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        info = activity.info()
        if info.activity_type != "invoke":
            return await super().execute_activity(input)
        self._losing.ran.append(info.workflow_id or "")
        lose = self._losing.left > 0
        self._losing.left -= 1
        try:
            result = await super().execute_activity(input)
        finally:
            if lose:
                self._losing.lost.append(info.workflow_id or "")
                activity.raise_complete_async()  # nothing is reported: the completion is lost
        return result


async def test_an_outcome_whose_completion_was_lost_is_collected_from_its_node(
    time_skipping_env: WorkflowEnvironment, database_url: str
) -> None:
    """Two requests at once, each invoke's completion lost: the answer comes back, and so does
    the failure (the class the node kept, not TIMEOUT). One 60 s heartbeat timeout for both:
    an invoke in flight holds the test server's clock, so it is waited, not skipped."""
    losing = LoseInvokeCompletions(lose=2)
    config = time_skipping_env.client.config()
    config["interceptors"] = [losing]
    async with running_stack(Client(**config), database_url) as stack:
        answered = await stack.start_request(EMBEDDING, tenant="rag", input={"text": "hello"})
        # The simulated runtime fails the call with the class asked for (GPU_OOM: not retried).
        failing = await stack.start_request(EMBEDDING, tenant="rag", input={"text": "x", "simulate_fault": "GPU_OOM"})
        result = await answered.result()
        assert result.output["simulated"] is True
        with pytest.raises(WorkflowFailureError) as failed:
            await failing.result()
        assert getattr(failed.value.cause, "type", None) == "GPU_OOM", failed.value.cause
        assert sorted(losing.lost) == sorted(losing.ran) == sorted([answered.id, failing.id])  # none ran twice
        for handle in (answered, failing):
            history = await handle.fetch_history()
            activities = [
                e.activity_task_scheduled_event_attributes.activity_type.name
                for e in history.events
                if e.HasField("activity_task_scheduled_event_attributes")
            ]
            assert activities == ["invoke", "collect_invoke"]
        assert (await stack.status()).active_leases == 0
        # The next request on the same resident is served as always.
        again = await stack.start_request(EMBEDDING, tenant="rag", input={"text": "again"})
        assert (await again.result()).output["simulated"] is True
        assert losing.ran[-1] == again.id
