"""The admission call: a local activity of the request workflow sends the scheduler's `admit`
update, whose validator refuses bad requests without writing history."""

from __future__ import annotations

from temporalio import activity
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from modelforge.failures import FailureClass
from modelforge.messages import AdmitCall, AdmitReply


class SchedulerGatewayActivities:
    def __init__(self, client: Client) -> None:
        self._client = client

    @activity.defn(name="admit")
    async def admit(self, call: AdmitCall) -> AdmitReply:
        handle = self._client.get_workflow_handle(f"scheduler:{call.pool}")
        try:
            reply: AdmitReply = await handle.execute_update("admit", call.request, result_type=AdmitReply)
            return reply
        except WorkflowUpdateFailedError as error:
            cause = error.cause
            if isinstance(cause, ApplicationError) and cause.type:
                raise ApplicationError(cause.message, type=cause.type, non_retryable=cause.non_retryable) from None
            raise
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND:
                raise ApplicationError(
                    f"the scheduler of pool {call.pool!r} is not running",
                    type=FailureClass.CAPABILITY_UNAVAILABLE.value,
                    non_retryable=True,
                ) from None
            raise
