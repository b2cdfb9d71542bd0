"""Failure classes as HTTP statuses: the class itself always travels in the body."""

from __future__ import annotations

from modelforge.failures import FailureClass

_STATUS: dict[FailureClass, int] = {
    FailureClass.REQUEST_INVALID: 422,
    FailureClass.QUEUE_FULL: 429,
    FailureClass.DEADLINE_CANNOT_BE_MET: 504,
    FailureClass.LEASE_TIMEOUT: 504,
    FailureClass.TIMEOUT: 504,
    # Known capability, no room or no healthy place right now: try again later.
    FailureClass.CAPABILITY_UNAVAILABLE: 503,
    FailureClass.INSUFFICIENT_SCHEDULABLE_VRAM: 503,
    FailureClass.EXTERNAL_GPU_PRESSURE: 503,
    FailureClass.EVICTION_NOT_ALLOWED: 503,
    FailureClass.SCHEDULER_STATE_STALE: 503,
    FailureClass.RESIDENCY_CONFLICT: 503,
    FailureClass.LEASE_CONFLICT: 503,
    FailureClass.GPU_MEMORY_NOT_RECLAIMED: 503,
    FailureClass.DRIVER_ERROR: 503,
    # The model server failed the work.
    FailureClass.MODEL_LOAD_FAILED: 502,
    FailureClass.GPU_OOM: 502,
    FailureClass.RUNTIME_CRASH: 502,
    FailureClass.HEALTHCHECK_FAILED: 502,
    FailureClass.INVALID_OUTPUT: 502,
    FailureClass.ARTIFACT_CORRUPT: 502,
}

# Seconds a client should wait before asking again after these (the Retry-After header).
RETRY_AFTER_S: dict[FailureClass, int] = {
    FailureClass.QUEUE_FULL: 5,
    FailureClass.INSUFFICIENT_SCHEDULABLE_VRAM: 10,
    FailureClass.EXTERNAL_GPU_PRESSURE: 30,
    FailureClass.SCHEDULER_STATE_STALE: 5,
}


def http_status(failure: str, *, unknown_model: bool = False) -> int:
    """The HTTP status of a failure class; an unknown model or capability is 404, not 503."""
    if unknown_model:
        return 404
    try:
        return _STATUS.get(FailureClass(failure), 500)
    except ValueError:
        return 500
