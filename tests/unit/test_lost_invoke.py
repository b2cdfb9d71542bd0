"""An invoke whose task the node never ran (its poll answer lost in flight, as in a Temporal
restart) is told apart from one that ran and went silent: the node heartbeats the moment an
invoke starts, so a heartbeat timeout with no heartbeat at all means it never started, and the
request workflow runs it once more on a fresh lease instead of failing it."""

from __future__ import annotations

from temporalio.exceptions import ActivityError, ApplicationError, RetryState, TimeoutError, TimeoutType

from workflows._common import never_started


def _activity_failure(cause: BaseException) -> ActivityError:
    error = ActivityError(
        "activity failed",
        scheduled_event_id=5,
        started_event_id=6,
        identity="node",
        activity_type="invoke",
        activity_id="1",
        retry_state=RetryState.TIMEOUT,
    )
    error.__cause__ = cause
    return error


def test_a_heartbeat_timeout_without_any_heartbeat_is_an_invoke_that_never_started() -> None:
    lost = _activity_failure(TimeoutError("timed out", type=TimeoutType.HEARTBEAT, last_heartbeat_details=[]))
    assert never_started(lost)


def test_an_invoke_that_heartbeat_and_then_went_silent_ran_and_is_not_retried_as_lost() -> None:
    ran = _activity_failure(
        TimeoutError("timed out", type=TimeoutType.HEARTBEAT, last_heartbeat_details=["invoking: 3/600 s"])
    )
    assert not never_started(ran)


def test_other_timeouts_and_failures_are_not_lost_invokes() -> None:
    for cause in (
        TimeoutError("timed out", type=TimeoutType.SCHEDULE_TO_CLOSE, last_heartbeat_details=[]),
        TimeoutError("timed out", type=TimeoutType.START_TO_CLOSE, last_heartbeat_details=[]),
        ApplicationError("boom", type="RUNTIME_CRASH"),
    ):
        assert not never_started(_activity_failure(cause))
    assert not never_started(ApplicationError("not an activity failure", type="TIMEOUT"))
