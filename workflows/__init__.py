"""Deterministic Temporal workflows. Thin: decisions come from `modelforge.policy`."""

from workflows.records import RecordEventsWorkflow
from workflows.request import CapabilityRequestWorkflow
from workflows.residency import ResidencyWorkflow
from workflows.scheduler import PoolSchedulerWorkflow
from workflows.telemetry import TelemetryWorkflow

ALL_WORKFLOWS = [
    CapabilityRequestWorkflow,
    PoolSchedulerWorkflow,
    RecordEventsWorkflow,
    ResidencyWorkflow,
    TelemetryWorkflow,
]

__all__ = [
    "ALL_WORKFLOWS",
    "CapabilityRequestWorkflow",
    "PoolSchedulerWorkflow",
    "RecordEventsWorkflow",
    "ResidencyWorkflow",
    "TelemetryWorkflow",
]
