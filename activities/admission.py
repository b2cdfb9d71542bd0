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
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from modelforge.failures import FailureClass
from modelforge.messages import AdmitBatch, AdmitBatchReply, AdmitCall, AdmitReply, LeaseConfirmCall, SlotClaim
from modelforge.names import scheduler_id
from modelforge.policy import AdmissionRequest, Lease

if TYPE_CHECKING:
    from activities._delegation import NodeSlots, PoolSlots

T = TypeVar("T")
_FAILURE_CLASSES = frozenset(f.value for f in FailureClass)
# One admission attempt waits this long for the scheduler: under the local activity's
# start-to-close timeout (10 s), so Temporal never times an attempt out itself.
ATTEMPT_WAIT_S = 8.0
# Without an admit_by (requests from before lease fencing): give up this long before the local
# activity's schedule-to-close timeout.
ADMIT_MARGIN_S = 3.0
MAX_IN_FLIGHT = 4  # per worker process and pool: well under Temporal's 10 per workflow
MAX_BATCH = 200


class _PoolBatcher:
    def __init__(self, client: Client, pool: str) -> None:
        self._handle = client.get_workflow_handle(scheduler_id(pool))
        self._pool = pool
        self._pending: list[tuple[AdmissionRequest, asyncio.Future[AdmitReply]]] = []
        self._slots = asyncio.Semaphore(MAX_IN_FLIGHT)
        self._pump: asyncio.Task[None] | None = None
        self._sending: list[asyncio.Task[None]] = []  # held so they are not collected mid-flight

    async def admit(self, request: AdmissionRequest) -> AdmitReply:
        future: asyncio.Future[AdmitReply] = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._run())
        return await future

    async def _run(self) -> None:
        """Sends until nothing is pending, then ends (the next call starts another): no task is
        left waiting when the worker's loop closes."""
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
            failure = await _as_failure(error, self._pool, self._handle)
            for _, future in batch:
                if not future.done():
                    future.set_exception(failure)
        else:
            for (_, future), answer in zip(batch, reply.replies, strict=True):
                if not future.done():
                    future.set_result(answer)
        finally:
            self._slots.release()


def _admission_deadline(call: AdmitCall) -> float:
    if call.request.admit_by is not None:
        return call.request.admit_by
    return _call_deadline()


def _call_deadline() -> float:
    """ADMIT_MARGIN_S before the local activity's schedule-to-close timeout."""
    info = activity.info()
    budget = info.schedule_to_close_timeout
    if budget is None:
        return time.time() + 3600.0
    return info.scheduled_time.timestamp() + budget.total_seconds() - ADMIT_MARGIN_S


async def _within(call: Callable[[], Awaitable[T]], deadline: float, pool: str, what: str) -> T:
    """One attempt of a call to the scheduler, ended by this activity itself: at most
    ATTEMPT_WAIT_S (then SCHEDULER_STATE_STALE, asked again by the retry policy; the calls are
    idempotent), and TIMEOUT once `deadline` is reached."""
    left = deadline - time.time()
    too_late = ApplicationError(
        f"the scheduler of pool {pool!r} did not {what} in time", type=FailureClass.TIMEOUT.value, non_retryable=True
    )
    if left <= 0:
        raise too_late
    try:
        return await asyncio.wait_for(call(), timeout=min(left, ATTEMPT_WAIT_S))
    except TimeoutError:
        if left <= ATTEMPT_WAIT_S:
            raise too_late from None
        raise ApplicationError(
            f"the scheduler of pool {pool!r} did not answer within {ATTEMPT_WAIT_S:.0f} s; asking again",
            type=FailureClass.SCHEDULER_STATE_STALE.value,
            non_retryable=False,
        ) from None


async def _as_failure(error: Exception, pool: str, handle: WorkflowHandle[Any, Any]) -> Exception:
    if isinstance(error, WorkflowUpdateFailedError):
        cause = error.cause
        if isinstance(cause, ApplicationError) and cause.type in _FAILURE_CLASSES:
            return ApplicationError(cause.message, type=cause.type, non_retryable=cause.non_retryable)
        # Temporal's own refusals (an update the scheduler's run never processed because it
        # continued as new or its worker restarted: `UnprocessedUpdate`, ...) are not failures of
        # the request: the admission is asked again, and the scheduler answers idempotently.
        message = cause.message if isinstance(cause, ApplicationError) else str(cause or error)
        kind = cause.type if isinstance(cause, ApplicationError) else type(cause or error).__name__
        return ApplicationError(
            f"the scheduler of pool {pool!r} did not process the admission ({kind}: {message}); asking again",
            type=FailureClass.SCHEDULER_STATE_STALE.value,
            non_retryable=False,
        )
    if isinstance(error, RPCError) and error.status == RPCStatusCode.NOT_FOUND:
        if await _running(handle):
            # The run the call was addressed to is gone but the scheduler is there: a reset (the
            # replay guard's) or a continue-as-new between the two. Not a failure of the request.
            return ApplicationError(
                f"the scheduler of pool {pool!r} was between runs (a reset or continue-as-new); asking again",
                type=FailureClass.SCHEDULER_STATE_STALE.value,
                non_retryable=False,
            )
        return ApplicationError(
            f"the scheduler of pool {pool!r} is not running",
            type=FailureClass.CAPABILITY_UNAVAILABLE.value,
            non_retryable=True,
        )
    return error


async def _running(handle: WorkflowHandle[Any, Any]) -> bool:
    """Whether the scheduler workflow (its latest run) is running."""
    try:
        description = await handle.describe(rpc_timeout=timedelta(seconds=5))
    except Exception:  # not there, or the server does not answer: not running, as far as we know
        return False
    return description.status == WorkflowExecutionStatus.RUNNING


class AdmissionActivities:
    def __init__(self, client: Client, slots: NodeSlots | PoolSlots | None = None) -> None:
        """`slots`: on a node's worker, the slots its scheduler lent it (warm-path delegation)."""
        self._client = client
        self._batchers: dict[str, _PoolBatcher] = {}
        self._slots = slots

    def activities(self) -> list[Callable[..., Awaitable[Any]]]:
        """What a worker that runs request workflows registers (as local activities)."""
        return [self.admit, self.confirm_lease, self.claim_slot]

    @activity.defn(name="claim_slot")
    async def claim_slot(self, claim: SlotClaim) -> Lease | None:
        """A free slot of this node for the request (activities/_delegation.py), or None: no
        slots here (the control worker has none), and the scheduler admits it as always."""
        return None if self._slots is None else await self._slots.claim_or_ask(claim)

    @activity.defn(name="admit")
    async def admit(self, call: AdmitCall) -> AdmitReply:
        """One attempt waits at most ATTEMPT_WAIT_S for the scheduler, and the call gives up with
        TIMEOUT at the request's `admit_by`, before Temporal's own timeouts would end it: a local
        activity ended by its schedule-to-close timeout leaves a request history that the SDK
        (1.35) cannot replay ("patch marker ... no corresponding change command"), so every
        admission failure must be one this activity raises itself."""
        batcher = self._batchers.get(call.pool)
        if batcher is None:
            batcher = self._batchers[call.pool] = _PoolBatcher(self._client, call.pool)
        return await _within(
            lambda: batcher.admit(call.request), _admission_deadline(call), call.pool, "admit the request"
        )

    @activity.defn(name="confirm_lease")
    async def confirm_lease(self, call: LeaseConfirmCall) -> bool:
        """Whether the scheduler still holds the lease for its holder (and, if so, that the
        holder has now been heard from): asked before a grant that arrived late is used. Like
        `admit`, it ends every attempt itself, never by Temporal's timeouts."""
        handle = self._client.get_workflow_handle(scheduler_id(call.pool))
        try:
            held: bool = await _within(
                lambda: handle.execute_update("confirm_lease", call, result_type=bool, id=f"confirm:{call.lease_id}"),
                _call_deadline(),
                call.pool,
                f"confirm lease {call.lease_id}",
            )
        except ApplicationError:
            raise
        except Exception as error:
            raise await _as_failure(error, call.pool, handle) from None
        return held
