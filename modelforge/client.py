"""The Python client: the same calls the CLI makes.

client = await ModelForgeClient.connect()
result = await client.request("rag.embedding@1", input={"text": "hi"}, tenant="rag")
result.ok, result.output, result.failure_class, result.message, result.lease, result.timings
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from temporalio.client import Client, WorkflowFailureError, WorkflowHandle, WorkflowQueryFailedError
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import ApplicationError, TerminatedError, TimeoutError
from temporalio.service import RPCError

from modelforge import temporal as sa
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.messages import MAX_INPUT_BYTES, RequestInput, RequestResult
from modelforge.policy import Lease, PoolStatus, ResidentStatus
from modelforge.settings import CONTROL_TASK_QUEUE, DEFAULT_POOL, NODE_TASK_QUEUE_PREFIX, Settings

_CAPABILITY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/+-]*(@[A-Za-z0-9._-]+)?$")
_CLASS_PART = re.compile(r"^[a-z0-9][a-z0-9_-]{0,59}$")
# A level, or queue.level (the scheduler checks it against the catalog's queues).
_CLASS = re.compile(r"^[a-z0-9][a-z0-9_-]{0,59}(\.[a-z0-9][a-z0-9_-]{0,59})?$")


@dataclass(frozen=True)
class Result:
    ok: bool
    request_id: str
    capability: str
    output: dict[str, Any] | None = None
    failure_class: str | None = None
    message: str = ""
    lease: Lease | None = None
    timings: dict[str, float] = field(default_factory=dict)
    workflow_id: str = ""


def _invalid(request_id: str, capability: str, message: str) -> Result:
    return Result(
        ok=False,
        request_id=request_id,
        capability=capability,
        failure_class=FailureClass.REQUEST_INVALID.value,
        message=message,
    )


class ModelForgeClient:
    def __init__(self, client: Client, pool: str = DEFAULT_POOL) -> None:
        self.temporal = client
        self.pool = pool
        # Capability -> the task queue of the node that served its last request. A request
        # started there runs its workflow on that node's worker, which hands itself the invoke
        # (eager dispatch) when the lease lands on that node; anywhere else it runs as from the
        # control queue. Only a hint: admission decides, and a node gone silent has its queue
        # served by the control worker (workers/control.py, NodeQueueAdopter).
        self._routes: dict[str, str] = {}

    @classmethod
    async def connect(cls, settings: Settings | None = None, pool: str = DEFAULT_POOL) -> ModelForgeClient:
        return cls(await sa.connect(settings or Settings.from_env()), pool)

    async def request(
        self,
        capability: str,
        input: dict[str, Any] | None = None,
        *,
        priority: str | None = None,
        queue: str | None = None,
        tenant: str = "default",
        deadline_s: float | None = None,
        lease_timeout_s: float | None = None,
        request_id: str | None = None,
        on_progress: Callable[[str], None] | None = None,
    ) -> Result:
        """One request, start to end. `on_progress` hears, about twice a second, what the request
        waits on: admission, the queue, a model loading (from its load activity's heartbeats),
        the invoke."""
        request_id = request_id or uuid.uuid4().hex[:16]
        payload = {} if input is None else input
        if not isinstance(capability, str) or not _CAPABILITY.match(capability) or len(capability) > 200:
            return _invalid(request_id, str(capability)[:200], f"capability {str(capability)[:80]!r} is not a name")
        if not isinstance(payload, dict):
            return _invalid(request_id, capability, "input must be a JSON object")
        try:
            size = len(json.dumps(payload, allow_nan=False).encode())
        except (TypeError, ValueError) as error:
            return _invalid(request_id, capability, f"input is not JSON: {error}")
        if size > MAX_INPUT_BYTES:
            return _invalid(request_id, capability, f"input is {size} bytes; the limit is {MAX_INPUT_BYTES}")
        if queue is not None:
            if not _CLASS_PART.match(queue):
                return _invalid(request_id, capability, f"queue {queue[:80]!r} is not a queue name")
            if priority is None or "." in priority:
                return _invalid(request_id, capability, "a queue needs a level: --queue merge --priority critical")
            priority = f"{queue}.{priority}"
        if priority is not None and not _CLASS.match(priority):
            return _invalid(
                request_id,
                capability,
                f"priority {priority[:80]!r} is not a class name (a level such as 'interactive', or 'queue.level')",
            )
        for name, value in (("deadline_s", deadline_s), ("lease_timeout_s", lease_timeout_s)):
            if value is not None and not (0 < value <= 7 * 24 * 3600):
                return _invalid(request_id, capability, f"{name} must be between 0 and 604800 seconds")
        request = RequestInput(
            request_id=request_id,
            capability=capability,
            input=payload,
            priority=priority,
            tenant=tenant,
            deadline_s=deadline_s,
            lease_timeout_s=lease_timeout_s,
            pool=self.pool,
        )
        workflow_id = f"request:{capability}:{request_id}"
        attributes = [SearchAttributePair(sa.CAPABILITY, capability), SearchAttributePair(sa.TENANT, tenant)]
        if priority:
            attributes.append(SearchAttributePair(sa.PRIORITY, priority))
        try:
            handle = await self.temporal.start_workflow(
                "CapabilityRequestWorkflow",
                request,
                id=workflow_id,
                task_queue=self._routes.get(capability, CONTROL_TASK_QUEUE),
                search_attributes=TypedSearchAttributes(attributes),
                result_type=RequestResult,
                static_summary=f"{capability} for {tenant}",
                memo={"capability": capability, "tenant": tenant, "input_bytes": size},
            )
            watcher = asyncio.create_task(self._watch(handle, capability, on_progress)) if on_progress else None
            try:
                result: RequestResult = await handle.result()
            finally:
                if watcher is not None:
                    watcher.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await watcher
        except WorkflowFailureError as error:
            self._routes.pop(capability, None)  # the next one starts from the control queue
            cause = error.cause
            if isinstance(cause, ApplicationError) and cause.type:
                return Result(
                    ok=False,
                    request_id=request_id,
                    capability=capability,
                    failure_class=cause.type,
                    message=cause.message,
                    workflow_id=workflow_id,
                )
            if isinstance(cause, TimeoutError | TerminatedError):
                return Result(
                    ok=False,
                    request_id=request_id,
                    capability=capability,
                    failure_class=FailureClass.TIMEOUT.value,
                    message=str(cause),
                    workflow_id=workflow_id,
                )
            raise
        except RPCError as error:
            raise ModelForgeError(
                FailureClass.CAPABILITY_UNAVAILABLE, f"Temporal refused the request: {error}"
            ) from None
        if result.route.startswith(NODE_TASK_QUEUE_PREFIX):
            self._routes[capability] = result.route
        else:
            self._routes.pop(capability, None)
        return Result(
            ok=True,
            request_id=request_id,
            capability=capability,
            output=result.output,
            lease=result.lease,
            timings=result.timings,
            workflow_id=workflow_id,
        )

    async def _watch(self, handle: WorkflowHandle[Any, Any], capability: str, report: Callable[[str], None]) -> None:
        last = ""
        while True:
            try:
                line = await self._progress(handle, capability)
            except (RPCError, WorkflowQueryFailedError, ModelForgeError):
                line = ""  # not started yet, or already done: nothing to say this time
            if line and line != last:
                report(line)
                last = line
            await asyncio.sleep(0.5)

    async def _progress(self, handle: WorkflowHandle[Any, Any], capability: str) -> str:
        phase = str(await handle.query("phase", result_type=str, rpc_timeout=timedelta(seconds=5)))
        if phase in ("admitting", "queued"):
            status = await self.status()
            for resident in status.residents:
                if resident.capability == capability and resident.state == "loading" and resident.workflow_id:
                    detail = await self._heartbeat(
                        self.temporal.get_workflow_handle(resident.workflow_id), "load_model"
                    )
                    return f"{phase}: {detail or f'loading {resident.deployment}'} on {resident.accelerator}"
            return f"{phase}: waiting for a lease"
        if phase in ("invoking", "preempting"):
            detail = await self._heartbeat(handle, "invoke")
            return f"{phase}" + (f": {detail}" if detail else "")
        return phase

    async def _heartbeat(self, handle: WorkflowHandle[Any, Any], activity_type: str) -> str:
        """The latest heartbeat detail of a running activity of the workflow, or ''."""
        described = await handle.describe(rpc_timeout=timedelta(seconds=5))
        for pending in described.raw_description.pending_activities:
            if pending.activity_type.name == activity_type and pending.heartbeat_details.payloads:
                values = await self.temporal.data_converter.decode(pending.heartbeat_details.payloads)
                return str(values[0]) if values else ""
        return ""

    async def status(self) -> PoolStatus:
        try:
            status: PoolStatus = await self.temporal.get_workflow_handle(f"scheduler:{self.pool}").query(
                "status", result_type=PoolStatus, rpc_timeout=timedelta(seconds=10)
            )
        except RPCError as error:
            raise ModelForgeError(
                FailureClass.CAPABILITY_UNAVAILABLE, f"the scheduler of pool {self.pool!r} does not answer: {error}"
            ) from None
        return status

    async def ps(self) -> list[ResidentStatus]:
        return list((await self.status()).residents)


class SyncModelForgeClient:
    """A small blocking wrapper for scripts."""

    def __init__(self, settings: Settings | None = None, pool: str = DEFAULT_POOL) -> None:
        self._loop = asyncio.new_event_loop()
        self._client = self._loop.run_until_complete(ModelForgeClient.connect(settings, pool))

    def request(self, capability: str, input: dict[str, Any] | None = None, **kwargs: Any) -> Result:
        return self._loop.run_until_complete(self._client.request(capability, input, **kwargs))

    def status(self) -> PoolStatus:
        return self._loop.run_until_complete(self._client.status())

    def close(self) -> None:
        self._loop.close()
