"""How the admission call reads a failed update. Temporal's own refusals (an update the
scheduler's run never processed because it continued as new or its worker restarted, seen as
`UnprocessedUpdate` under bursts of 200) are not failures of the request: they come back as the
one retryable admission class, SCHEDULER_STATE_STALE, and the call asks again, where they once
failed the request as a non-retryable RUNTIME_CRASH. The scheduler's own typed refusals pass
through unchanged."""

from __future__ import annotations

from typing import Any

import pytest
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from activities.admission import _as_failure
from workflows._common import classify

# A failed update is read from the error alone: the scheduler's handle is never asked.
NO_HANDLE: Any = None


@pytest.mark.parametrize(
    "cause",
    [
        ApplicationError(
            "Workflow Update is rejected because it wasn't processed by worker. Probably, Workflow "
            "Update is not supported by the worker.",
            type="UnprocessedUpdate",
            non_retryable=True,
        ),
        ApplicationError("something internal", type="AcceptedUpdateCompletedWorkflow", non_retryable=True),
        RuntimeError("no type at all"),
    ],
)
async def test_temporals_own_refusals_are_asked_again(cause: BaseException) -> None:
    failure = await _as_failure(WorkflowUpdateFailedError(cause), "default", NO_HANDLE)
    assert isinstance(failure, ApplicationError)
    assert failure.type == "SCHEDULER_STATE_STALE" and not failure.non_retryable
    assert "asking again" in failure.message
    assert classify(failure)[0] == "SCHEDULER_STATE_STALE"


async def test_the_schedulers_typed_refusals_pass_through() -> None:
    cause = ApplicationError("3 requests already queued", type="QUEUE_FULL", non_retryable=True)
    failure = await _as_failure(WorkflowUpdateFailedError(cause), "default", NO_HANDLE)
    assert isinstance(failure, ApplicationError)
    assert (failure.type, failure.non_retryable, failure.message) == ("QUEUE_FULL", True, "3 requests already queued")
