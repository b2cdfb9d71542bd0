"""ResidencyWorkflow: one per load of a model on an accelerator,
`resident:<deployment>:<accelerator>:<generation>` (a child of the pool scheduler, which counts
the generations, so a reload never reuses the id of a residency still closing).

Load, one functional health check, then commands from the scheduler (`extend`, `unload`, `sleep`,
`wake`, `lost`, `adopt`) until it ends. A keep_warm model's TTL timer asks the scheduler when it fires
(`resident_idle`): the scheduler knows the last use and the active leases, and answers `extend`
or `unload`. Unloading is the unload, then the reclaim check that proves the bytes came back."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from modelforge.domain import Residency
    from modelforge.failures import FailureClass
    from modelforge.messages import (
        LoadInput,
        LoadResult,
        ReclaimInput,
        ReclaimResult,
        ResidencyInput,
        ResidentCommand,
        ResidentIdle,
        ResidentReport,
        RuntimeOpResult,
        UnloadReport,
    )
    from modelforge.names import RESIDENCY_WORKFLOW_TYPE
    from modelforge.settings import node_task_queue

from workflows._common import RUNTIME_RETRY, classify, scheduler_id


@workflow.defn(name=RESIDENCY_WORKFLOW_TYPE)
class ResidencyWorkflow:
    @workflow.init
    def __init__(self, start: ResidencyInput) -> None:
        self._commands: list[ResidentCommand] = []
        self._phase = "loading"
        self._expires_at: float | None = None
        self._id = workflow.info().workflow_id

    @workflow.signal
    def command(self, command: ResidentCommand) -> None:
        self._commands.append(command)

    @workflow.query
    def phase(self) -> str:
        return self._phase

    @workflow.run
    async def run(self, start: ResidencyInput) -> str:
        scheduler = workflow.get_external_workflow_handle(scheduler_id(start.pool))
        queue = node_task_queue(start.accelerator.node)
        deployment = start.deployment
        load_timeout = timedelta(seconds=deployment.load_timeout_s)
        try:
            loaded = await workflow.execute_activity(
                "load_model",
                LoadInput(
                    key=start.key,
                    deployment=deployment,
                    accelerator_id=start.accelerator.id,
                    device_index=start.device_index,
                    device_uuid=start.accelerator.uuid,
                ),
                result_type=LoadResult,
                task_queue=queue,
                start_to_close_timeout=load_timeout,
                schedule_to_close_timeout=load_timeout * 2,
                heartbeat_timeout=timedelta(seconds=30),
                retry_policy=RUNTIME_RETRY,
                summary=f"load {deployment.deployment_id}",
            )
        except ActivityError as error:
            cls, message = classify(error)
            await scheduler.signal(
                "resident_loaded",
                ResidentReport(key=start.key, ok=False, failure=cls, message=f"load: {message}", workflow_id=self._id),
            )
            return f"load failed: {cls}"
        health_started = workflow.now()
        try:
            await workflow.execute_activity(
                "health_check",
                start.key,
                task_queue=queue,
                start_to_close_timeout=timedelta(seconds=60),
                retry_policy=RUNTIME_RETRY,
                summary=f"health check {deployment.deployment_id}",
            )
        except ActivityError as error:
            _, message = classify(error)
            await self._unload(start, queue)
            await scheduler.signal(
                "resident_loaded",
                ResidentReport(
                    key=start.key,
                    workflow_id=self._id,
                    ok=False,
                    failure=FailureClass.HEALTHCHECK_FAILED.value,
                    message=f"health check: {message}",
                ),
            )
            return "health check failed"
        health_s = (workflow.now() - health_started).total_seconds()
        ready = ResidentReport(
            key=start.key,
            workflow_id=self._id,
            ok=True,
            measured_bytes=loaded.measured_bytes,
            load_s=loaded.load_s,
            health_s=health_s,
            deployment=deployment.deployment_id,
            accelerator=start.accelerator.id,
        )
        await scheduler.signal("resident_loaded", ready)
        self._phase = "ready"
        if deployment.residency == Residency.KEEP_WARM:
            self._expires_at = workflow.now().timestamp() + deployment.ttl_s

        while True:
            timeout = None if self._expires_at is None else max(0.0, self._expires_at - workflow.now().timestamp())
            try:
                await workflow.wait_condition(lambda: bool(self._commands), timeout=timeout)
            except TimeoutError:
                # The TTL timer fired: the scheduler knows the last use and active leases.
                self._expires_at = None
                await scheduler.signal("resident_idle", ResidentIdle(key=start.key, workflow_id=self._id))
                continue
            command = self._commands.pop(0)
            if command.action == "extend":
                self._expires_at = command.until
                continue
            if command.action == "unload":
                break
            if command.action == "sleep":
                await self._sleep(start, queue, scheduler)
                continue
            if command.action == "wake":
                if not await self._wake_up(start, queue, scheduler):
                    return "wake failed"
                continue
            if command.action == "adopt":
                # The scheduler, reset past this run's start, decided this load again and waits
                # for it: loaded, it hears so again (the report before went to the lost part of
                # its history); asleep, it is woken for the request that asked for the load.
                if self._phase != "asleep":
                    await scheduler.signal("resident_loaded", replace(ready, again=True))
                elif not await self._wake_up(start, queue, scheduler, report="resident_loaded"):
                    return "wake failed"
                continue
            if command.action == "lost":
                self._phase = "lost"
                return "lost: " + command.reason
        self._phase = "unloading"
        report = await self._unload(start, queue)
        await scheduler.signal("resident_unloaded", report)
        self._phase = "unloaded" if report.reclaimed else "unreclaimed"
        return self._phase

    async def _sleep(self, start: ResidencyInput, queue: str, scheduler: workflow.ExternalWorkflowHandle[Any]) -> None:
        """Sleep to make room: the runtime keeps its process and a little memory. A runtime that
        cannot stays awake; the scheduler will unload it instead."""
        self._phase = "sleeping"
        try:
            result = await workflow.execute_activity(
                "sleep_model",
                start.key,
                result_type=RuntimeOpResult,
                task_queue=queue,
                start_to_close_timeout=timedelta(seconds=max(60.0, start.deployment.sleep_s * 10)),
                retry_policy=RUNTIME_RETRY,
                summary=f"sleep {start.deployment.deployment_id}",
            )
        except ActivityError as error:
            cls, message = classify(error)
            self._phase = "ready"
            await scheduler.signal(
                "resident_slept",
                ResidentReport(key=start.key, ok=False, failure=cls, message=f"sleep: {message}", workflow_id=self._id),
            )
            return
        self._phase = "asleep"
        await scheduler.signal(
            "resident_slept",
            ResidentReport(key=start.key, ok=True, measured_bytes=result.bytes_after, workflow_id=self._id),
        )

    async def _wake_up(
        self,
        start: ResidencyInput,
        queue: str,
        scheduler: workflow.ExternalWorkflowHandle[Any],
        report: str = "resident_woke",
    ) -> bool:
        """Wake for the requests waiting on it. A failed wake unloads the model: the waiters hear
        the failure as after a failed load, and a later request loads it afresh. `report`: the
        scheduler's signal that hears the outcome (`resident_loaded` for a scheduler that adopted
        this run and waits for its load)."""
        self._phase = "waking"
        try:
            result = await workflow.execute_activity(
                "wake_model",
                start.key,
                result_type=RuntimeOpResult,
                task_queue=queue,
                start_to_close_timeout=timedelta(seconds=start.deployment.wake_timeout_s),
                heartbeat_timeout=timedelta(seconds=30),
                retry_policy=RUNTIME_RETRY,
                summary=f"wake {start.deployment.deployment_id}",
            )
        except ActivityError as error:
            cls, message = classify(error)
            await self._unload(start, queue)
            self._phase = "unloaded"
            await scheduler.signal(
                report,
                ResidentReport(
                    key=start.key,
                    ok=False,
                    failure=cls,
                    message=f"wake: {message}",
                    workflow_id=self._id,
                    deployment=start.deployment.deployment_id,
                    accelerator=start.accelerator.id,
                ),
            )
            return False
        self._phase = "ready"
        await scheduler.signal(
            report,
            ResidentReport(
                key=start.key,
                ok=True,
                measured_bytes=result.bytes_after,
                workflow_id=self._id,
                deployment=start.deployment.deployment_id,
                accelerator=start.accelerator.id,
                again=report == "resident_loaded",
            ),
        )
        return True

    async def _unload(self, start: ResidencyInput, queue: str) -> UnloadReport:
        started = workflow.now()
        try:
            await workflow.execute_activity(
                "unload_model",
                start.key,
                task_queue=queue,
                start_to_close_timeout=timedelta(seconds=120),
                retry_policy=RUNTIME_RETRY,
                summary=f"unload {start.deployment.deployment_id}",
            )
            reclaim = await workflow.execute_activity(
                "verify_reclaim",
                ReclaimInput(key=start.key, accelerator_id=start.accelerator.id),
                result_type=ReclaimResult,
                task_queue=queue,
                start_to_close_timeout=timedelta(seconds=60),
                retry_policy=RUNTIME_RETRY,
                summary="verify reclaim",
            )
        except ActivityError as error:
            _, message = classify(error)
            return UnloadReport(
                key=start.key,
                workflow_id=self._id,
                reclaimed=False,
                message=message,
                unload_s=(workflow.now() - started).total_seconds(),
            )
        return UnloadReport(
            key=start.key,
            workflow_id=self._id,
            reclaimed=reclaim.reclaimed,
            message=reclaim.message,
            unload_s=(workflow.now() - started).total_seconds(),
        )
