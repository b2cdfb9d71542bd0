"""What the admission call (a request workflow's local activity) makes of the scheduler's errors:
a scheduler between two runs (the replay guard's reset, a continue-as-new) is asked again; one
that is not there at all refuses the request, typed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from temporalio.client import WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities.admission import _as_failure
from modelforge.failures import FailureClass


class _Scheduler:
    """A scheduler workflow's handle: `describe` answers with its latest run's status, or fails."""

    def __init__(self, status: WorkflowExecutionStatus | None) -> None:
        self.status = status

    async def describe(self, rpc_timeout: object = None) -> object:
        if self.status is None:
            raise RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b"")
        return SimpleNamespace(status=self.status)


def _failure(status: WorkflowExecutionStatus | None) -> ApplicationError:
    gone = RPCError("workflow execution not found", RPCStatusCode.NOT_FOUND, b"")
    failure = asyncio.run(_as_failure(gone, "default", _Scheduler(status)))  # type: ignore[arg-type]
    assert isinstance(failure, ApplicationError)
    return failure


def test_a_scheduler_between_runs_is_asked_again() -> None:
    failure = _failure(WorkflowExecutionStatus.RUNNING)
    assert failure.type == FailureClass.SCHEDULER_STATE_STALE.value and not failure.non_retryable
    assert "between runs" in failure.message


def test_a_scheduler_that_is_not_there_refuses_the_request() -> None:
    for status in (None, WorkflowExecutionStatus.TERMINATED):
        failure = _failure(status)
        assert failure.type == FailureClass.CAPABILITY_UNAVAILABLE.value and failure.non_retryable
        assert "is not running" in failure.message
