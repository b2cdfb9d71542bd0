"""Structured events: what the scheduler and its workflows record in the Postgres event log."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EventRecord:
    event_id: str
    at: float
    kind: str
    failure_class: str | None = None
    request_id: str = ""
    lease_id: str = ""
    accelerator: str = ""
    deployment: str = ""
    workflow_id: str = ""
    message: str = ""
    payload: dict[str, Any] = field(default_factory=dict)
    alert: str | None = None
