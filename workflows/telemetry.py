"""TelemetryWorkflow: one per node, `telemetry:<node>`. An NVML sample every 10 s through the
node's task queue, sent to the scheduler of each pool the node's cards are in as one batched
signal per sample."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from modelforge.failures import FailureClass
    from modelforge.messages import NodeSample, RebaseSignal, TelemetryInput
    from modelforge.names import TELEMETRY_WORKFLOW_TYPE
    from modelforge.settings import node_task_queue

from workflows._common import UPGRADE_ON_CONTINUE, scheduler_id


@workflow.defn(name=TELEMETRY_WORKFLOW_TYPE)
class TelemetryWorkflow:
    def __init__(self) -> None:
        self._rebase: str | None = None

    @workflow.signal
    def rebase(self, signal: RebaseSignal) -> None:
        """Continue as new after the current sample: onto the current build (`modelforge upgrade`)."""
        self._rebase = signal.reason

    @workflow.run
    async def run(self, start: TelemetryInput) -> None:
        schedulers = [
            workflow.get_external_workflow_handle(scheduler_id(pool)) for pool in [start.pool, *start.other_pools]
        ]
        for _ in range(start.samples_before_continue):
            if self._rebase is not None:
                break
            try:
                sample = await workflow.execute_activity(
                    "sample_node",
                    start.node,
                    result_type=NodeSample,
                    task_queue=node_task_queue(start.node),
                    # A sample older than one interval is worth nothing: no retries, no backlog.
                    schedule_to_close_timeout=timedelta(seconds=start.interval_s),
                    retry_policy=RetryPolicy(maximum_attempts=1),
                    summary="NVML sample",
                )
                now = workflow.now().timestamp()
                sample = replace(sample, observations=[replace(o, received_at=now) for o in sample.observations])
                for scheduler in schedulers:
                    await scheduler.signal("observe", sample)
            except ActivityError as error:
                cause = error.cause
                if isinstance(cause, ApplicationError) and cause.type == FailureClass.DRIVER_ERROR.value:
                    for scheduler in schedulers:
                        await scheduler.signal("observe", NodeSample(node=start.node, error=cause.message))
                # A silent node sends nothing: its accelerators go stale at the scheduler.
            try:  # the interval, cut short by a rebase
                await workflow.wait_condition(lambda: self._rebase is not None, timeout=start.interval_s)
            except TimeoutError:
                pass
        # The next run starts on the deployment's current build (Worker Versioning).
        workflow.continue_as_new(start, initial_versioning_behavior=UPGRADE_ON_CONTINUE)
