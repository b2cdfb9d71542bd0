"""Deterministic Temporal workflows. Thin: decisions come from `modelforge.policy`."""

from workflows.request import CapabilityRequestWorkflow
from workflows.residency import ResidencyWorkflow
from workflows.scheduler import PoolSchedulerWorkflow
from workflows.telemetry import TelemetryWorkflow

ALL_WORKFLOWS = [CapabilityRequestWorkflow, PoolSchedulerWorkflow, ResidencyWorkflow, TelemetryWorkflow]

__all__ = [
    "ALL_WORKFLOWS",
    "CapabilityRequestWorkflow",
    "PoolSchedulerWorkflow",
    "ResidencyWorkflow",
    "TelemetryWorkflow",
]
