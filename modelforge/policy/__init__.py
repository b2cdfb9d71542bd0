"""The admission policy: pure, deterministic, and the same in the scheduler workflow and the
simulator. Nothing here reads a clock, the environment or randomness; `now` is an argument."""

from modelforge.policy._admission import (
    AdmissionRejected,
    AdmissionRequest,
    apply_decisions,
    cancel_request,
    enqueue,
    keep_warm_check,
    release_lease,
    resident_crashed,
    resident_failed,
    resident_ready,
    resident_unloaded,
    resolve_priority,
    validate_request,
)
from modelforge.policy._budget import Budget, compute_budget, dynamic_reserve_bytes
from modelforge.policy._decisions import (
    Assign,
    Decisions,
    Grant,
    PolicyEvent,
    Reject,
    StartLoad,
    Unload,
    Wait,
)
from modelforge.policy._observe import apply_observations
from modelforge.policy._order import fair_share_scores, queue_order
from modelforge.policy._placement import FilterResult, decide, filter_accelerators
from modelforge.policy._state import (
    AcceleratorRuntime,
    Lease,
    PolicyConfig,
    PoolState,
    QueuedRequest,
    ResidentPhase,
    ResidentState,
    TenantUsage,
)
from modelforge.policy._views import AcceleratorStatus, PoolStatus, ResidentStatus, pool_status

__all__ = [
    "AcceleratorRuntime",
    "AcceleratorStatus",
    "AdmissionRejected",
    "AdmissionRequest",
    "Assign",
    "Budget",
    "Decisions",
    "FilterResult",
    "Grant",
    "Lease",
    "PolicyConfig",
    "PolicyEvent",
    "PoolState",
    "PoolStatus",
    "QueuedRequest",
    "Reject",
    "ResidentPhase",
    "ResidentState",
    "ResidentStatus",
    "StartLoad",
    "TenantUsage",
    "Unload",
    "Wait",
    "apply_decisions",
    "apply_observations",
    "cancel_request",
    "compute_budget",
    "decide",
    "dynamic_reserve_bytes",
    "enqueue",
    "fair_share_scores",
    "filter_accelerators",
    "keep_warm_check",
    "pool_status",
    "queue_order",
    "release_lease",
    "resident_crashed",
    "resident_failed",
    "resident_ready",
    "resident_unloaded",
    "resolve_priority",
    "validate_request",
]
