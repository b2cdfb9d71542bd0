"""RecordEventsWorkflow: a durable write of events that no other workflow carries, such as an
admission the scheduler never saw (it was not running, or kept refusing as still starting).
Started and left to run, so the requester answers at once and the write retries until
Postgres takes it."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from modelforge.events import EventRecord
    from modelforge.settings import CONTROL_TASK_QUEUE

from workflows._common import STORE_RETRY


@workflow.defn(name="RecordEventsWorkflow")
class RecordEventsWorkflow:
    @workflow.run
    async def run(self, events: list[EventRecord]) -> int:
        written: int = await workflow.execute_activity(
            "record_events",
            events,
            task_queue=CONTROL_TASK_QUEUE,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=STORE_RETRY,
            summary=f"record {len(events)} events",
        )
        return written
