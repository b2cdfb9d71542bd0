"""The typed failure classes of ModelForge (docs/ARCHITECTURE.md, "Typed failures") and how they travel.

Every failure is exactly one :class:`FailureClass`. Inside Temporal it is raised as an
``ApplicationError`` whose ``type`` is the class name; retryability is decided per class here,
in one place, so workflows and activities never guess.
"""

from __future__ import annotations

from enum import StrEnum


class FailureClass(StrEnum):
    MODEL_LOAD_FAILED = "MODEL_LOAD_FAILED"
    GPU_OOM = "GPU_OOM"
    RUNTIME_CRASH = "RUNTIME_CRASH"
    TIMEOUT = "TIMEOUT"
    HEALTHCHECK_FAILED = "HEALTHCHECK_FAILED"
    INVALID_OUTPUT = "INVALID_OUTPUT"
    ARTIFACT_CORRUPT = "ARTIFACT_CORRUPT"
    CAPABILITY_UNAVAILABLE = "CAPABILITY_UNAVAILABLE"
    DRIVER_ERROR = "DRIVER_ERROR"
    SCHEDULER_STATE_STALE = "SCHEDULER_STATE_STALE"
    INSUFFICIENT_SCHEDULABLE_VRAM = "INSUFFICIENT_SCHEDULABLE_VRAM"
    EXTERNAL_GPU_PRESSURE = "EXTERNAL_GPU_PRESSURE"
    RESIDENCY_CONFLICT = "RESIDENCY_CONFLICT"
    EVICTION_NOT_ALLOWED = "EVICTION_NOT_ALLOWED"
    DEADLINE_CANNOT_BE_MET = "DEADLINE_CANNOT_BE_MET"
    LEASE_CONFLICT = "LEASE_CONFLICT"
    GPU_MEMORY_NOT_RECLAIMED = "GPU_MEMORY_NOT_RECLAIMED"
    QUEUE_FULL = "QUEUE_FULL"
    LEASE_TIMEOUT = "LEASE_TIMEOUT"
    REQUEST_INVALID = "REQUEST_INVALID"


class Alert(StrEnum):
    """Operator alerts: recorded as events, shown and filtered; never a control of any process."""

    GPU_PRESSURE = "GPU_PRESSURE"
    CAPABILITY_CAPACITY = "CAPABILITY_CAPACITY"


# Transient classes: the same work may succeed if tried again (a crashed runtime restarts, a
# driver hiccup passes). Everything else is a decision or a defect that retrying cannot change.
RETRYABLE: frozenset[FailureClass] = frozenset(
    {
        FailureClass.RUNTIME_CRASH,
        FailureClass.DRIVER_ERROR,
        FailureClass.TIMEOUT,
        FailureClass.GPU_OOM,
    }
)


def is_retryable(failure: FailureClass) -> bool:
    return failure in RETRYABLE


class ModelForgeError(Exception):
    """A typed failure raised outside Temporal (adapters, store, CLI)."""

    def __init__(self, failure: FailureClass, message: str) -> None:
        super().__init__(f"{failure.value}: {message}")
        self.failure = failure
        self.message = message


def parse_failure(type_name: str | None) -> FailureClass | None:
    if type_name is None:
        return None
    try:
        return FailureClass(type_name)
    except ValueError:
        return None
