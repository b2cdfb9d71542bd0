"""Shared bits of workflow code: failures as ApplicationErrors, activity options (and the ids of
modelforge/names.py, re-exported for the workflows)."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError, TimeoutType

with workflow.unsafe.imports_passed_through():
    from modelforge.failures import FailureClass, is_retryable
    from modelforge.names import request_workflow_id, resident_workflow_id, scheduler_id, telemetry_id

ALL_FAILURES = [f.value for f in FailureClass]
# The pool scheduler's workflow task timeout: how long a pool stands still when the worker
# holding one of its tasks dies mid-task (Temporal hands the task to another worker only once it
# times out), and the room a task has. Measured (docs/ARCHITECTURE.md): the longest scheduler
# task in `bench/sustained.py --edge --pools 2` at 1.5x the admitted edge was 3.65 s, and a cold
# replay of a 1,376-event scheduler history took 1.0 s (a full 5,000-event run: about 3.6 s),
# which a worker taking over a pool does within its first task. Past the default 10 s the server
# times out a slow task, the backlog grows and the next task is slower still (seen before the
# scheduler had its own queue). A run started with it keeps it across continue-as-new, and the
# scheduler passes it again when it continues as new, so a run started with another moves to it.
SCHEDULER_TASK_TIMEOUT = timedelta(seconds=30)
# Worker Versioning (modelforge/versioning.py): a versioned worker pins every run to the build
# that started it (its default behavior: a workflow type cannot declare one, which the server
# refuses from unversioned workers); the long-lived ones (the pool scheduler, telemetry) start
# each new run on the deployment's current build when they continue as new.
UPGRADE_ON_CONTINUE = workflow.ContinueAsNewVersioningBehavior.AUTO_UPGRADE
NON_RETRYABLE = [f.value for f in FailureClass if not is_retryable(f)]


def failure(cls: FailureClass | str, message: str) -> ApplicationError:
    value = cls.value if isinstance(cls, FailureClass) else cls
    return ApplicationError(message, type=value, non_retryable=True)


def classify(error: BaseException) -> tuple[str, str]:
    """The failure class and message of an activity's failure."""
    cause = error.cause if isinstance(error, ActivityError) else error
    if isinstance(cause, ApplicationError) and cause.type in ALL_FAILURES:
        return cause.type, cause.message
    if isinstance(cause, TimeoutError):
        return FailureClass.TIMEOUT.value, f"activity timed out ({cause.type.name if cause.type else 'unknown'})"
    if isinstance(cause, ApplicationError):
        return FailureClass.RUNTIME_CRASH.value, f"{cause.type}: {cause.message}"
    return FailureClass.RUNTIME_CRASH.value, str(cause)


def heartbeat_timed_out(error: BaseException) -> bool:
    """An activity whose heartbeat timed out: how it ended was not heard (its completion lost
    while Temporal was away, its task lost in flight, or its worker gone). The node's invoke
    keeps its outcome a while for this (activities/_invoke_outcomes.py)."""
    cause = error.cause if isinstance(error, ActivityError) else None
    return isinstance(cause, TimeoutError) and cause.type == TimeoutType.HEARTBEAT


def never_started(error: BaseException) -> bool:
    """A heartbeat timeout with no heartbeat ever recorded: the task was lost in flight, or every
    heartbeat was (Temporal away from the start), so the node is asked before it is run again.
    Meaningful for activities that heartbeat the moment they start (the node's invoke does)."""
    cause = error.cause if isinstance(error, ActivityError) else None
    return heartbeat_timed_out(error) and isinstance(cause, TimeoutError) and not cause.last_heartbeat_details


# Activities that touch a runtime: a few bounded retries of transient classes only.
RUNTIME_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1), maximum_attempts=2, non_retryable_error_types=NON_RETRYABLE
)
# Writes to Postgres: retried until they land (durable across an outage), backing off to 30 s.
STORE_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=30),
    non_retryable_error_types=["REQUEST_INVALID"],
)


__all__ = [
    "ALL_FAILURES",
    "NON_RETRYABLE",
    "classify",
    "failure",
    "request_workflow_id",
    "resident_workflow_id",
    "scheduler_id",
    "telemetry_id",
]
