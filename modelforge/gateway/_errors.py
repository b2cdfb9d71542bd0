"""Failure classes as HTTP statuses and OpenAI's error shape: the class itself always travels in
the body (`error.modelforge_class`, and `failure_class` beside `error`)."""

from __future__ import annotations

from modelforge.failures import FailureClass

_STATUS: dict[FailureClass, int] = {
    # OpenAI and vLLM answer an invalid request 400 (the SDK's BadRequestError); some refusals
    # have statuses of their own, chosen where they are raised (401, 404, 408, 409, 413).
    FailureClass.REQUEST_INVALID: 400,
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
# A 429 always says when to come back, whatever made it.
DEFAULT_RETRY_AFTER_S = 5

# OpenAI's `error.type` and a default `error.code` per status; a refusal may name a more precise
# code (`model_not_found`, `unsupported_parameter`...).
_OPENAI: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", "invalid_value"),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    409: ("invalid_request_error", "request_id_conflict"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    502: ("server_error", "upstream_error"),
    503: ("server_error", "service_unavailable"),
    504: ("server_error", "timeout"),
}


def http_status(failure: str, *, unknown_model: bool = False) -> int:
    """The HTTP status of a failure class; an unknown model or capability is 404, not 503."""
    if unknown_model:
        return 404
    try:
        return _STATUS.get(FailureClass(failure), 500)
    except ValueError:
        return 500


def openai_error(status: int) -> tuple[str, str | None]:
    """OpenAI's (`type`, default `code`) for an HTTP status."""
    if status in _OPENAI:
        return _OPENAI[status]
    return ("invalid_request_error", None) if status < 500 else ("server_error", None)


def retry_after_s(failure: str, status: int) -> int | None:
    """The Retry-After (seconds) an answer of `status` for `failure` carries: where waiting helps
    (429 and 503 of a class with a known wait), else None. The Ollama and Anthropic shapes use it."""
    try:
        wait = RETRY_AFTER_S.get(FailureClass(failure))
    except ValueError:
        return None
    return wait if wait is not None and status in (429, 503) else None
