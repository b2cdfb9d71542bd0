"""The admission call: a local activity of the request workflow asks the pool scheduler for a
lease through a Workflow Update.

Temporal allows 10 updates in flight per workflow, and a burst of requests must not queue up
behind that limit (nor cost one scheduler workflow task each). So the calls of one worker
process are coalesced: while up to `MAX_IN_FLIGHT` batches are with the scheduler, new calls
gather into the next batch, and each batch is one `admit_batch` update answered with one reply
per request. A lone request goes out at once, alone.
"""

from __future__ import annotations

import asyncio

from temporalio import activity
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from modelforge.failures import FailureClass
from modelforge.messages import AdmitBatch, AdmitBatchReply, AdmitCall, AdmitReply
from modelforge.policy import AdmissionRequest

MAX_IN_FLIGHT = 4  # per worker process and pool: well under Temporal's 10 per workflow
MAX_BATCH = 200


class _PoolBatcher:
    def __init__(self, client: Client, pool: str) -> None:
        self._handle = client.get_workflow_handle(f"scheduler:{pool}")
        self._pool = pool
        self._pending: list[tuple[AdmissionRequest, asyncio.Future[AdmitReply]]] = []
        self._slots = asyncio.Semaphore(MAX_IN_FLIGHT)
        self._pump: asyncio.Task[None] | None = None
        self._sending: list[asyncio.Task[None]] = []  # held so they are not collected mid-flight
        self._wake = asyncio.Event()

    async def admit(self, request: AdmissionRequest) -> AdmitReply:
        future: asyncio.Future[AdmitReply] = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._run())
        self._wake.set()
        return await future

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                await self._slots.acquire()
                # Whatever gathered while waiting for a slot goes out together.
                batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
                live = [(request, future) for request, future in batch if not future.done()]
                if not live:
                    self._slots.release()
                    continue
                self._sending = [task for task in self._sending if not task.done()]
                self._sending.append(asyncio.create_task(self._send(live)))

    async def _send(self, batch: list[tuple[AdmissionRequest, asyncio.Future[AdmitReply]]]) -> None:
        try:
            reply: AdmitBatchReply = await self._handle.execute_update(
                "admit_batch", AdmitBatch(requests=[request for request, _ in batch]), result_type=AdmitBatchReply
            )
        except Exception as error:  # every caller hears it; its local activity decides to retry
            failure = _as_failure(error, self._pool)
            for _, future in batch:
                if not future.done():
                    future.set_exception(failure)
        else:
            for (_, future), answer in zip(batch, reply.replies, strict=True):
                if not future.done():
                    future.set_result(answer)
        finally:
            self._slots.release()


def _as_failure(error: Exception, pool: str) -> Exception:
    if isinstance(error, WorkflowUpdateFailedError):
        cause = error.cause
        if isinstance(cause, ApplicationError) and cause.type:
            return ApplicationError(cause.message, type=cause.type, non_retryable=cause.non_retryable)
    if isinstance(error, RPCError) and error.status == RPCStatusCode.NOT_FOUND:
        return ApplicationError(
            f"the scheduler of pool {pool!r} is not running",
            type=FailureClass.CAPABILITY_UNAVAILABLE.value,
            non_retryable=True,
        )
    return error


class SchedulerGatewayActivities:
    def __init__(self, client: Client) -> None:
        self._client = client
        self._batchers: dict[str, _PoolBatcher] = {}

    @activity.defn(name="admit")
    async def admit(self, call: AdmitCall) -> AdmitReply:
        batcher = self._batchers.get(call.pool)
        if batcher is None:
            batcher = self._batchers[call.pool] = _PoolBatcher(self._client, call.pool)
        return await batcher.admit(call.request)
