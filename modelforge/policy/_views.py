"""Read-only views of the scheduler state for `status` and `ps`."""

from __future__ import annotations

from dataclasses import dataclass, field

from modelforge.policy._budget import compute_budget
from modelforge.policy._state import AcceleratorRuntime, PoolState


@dataclass(frozen=True)
class AcceleratorStatus:
    id: str
    node: str
    kind: str
    model: str
    production_eligible: bool
    simulated: bool
    total_bytes: int
    observed_used_bytes: int | None
    external_bytes: int
    resident_bytes: int
    leased_bytes: int
    reserve_bytes: int
    schedulable_bytes: int
    pressure: bool
    healthy: bool
    fresh: bool
    observation_age_s: float | None
    observed_at: float | None


@dataclass(frozen=True)
class ResidentStatus:
    deployment: str
    capability: str
    accelerator: str
    bytes: int
    state: str
    residency: str
    active_leases: int
    last_used: float
    ttl_s: float
    expires_at: float | None
    workflow_id: str


@dataclass(frozen=True)
class CapabilityStatus:
    capability: str
    degraded: bool
    consecutive_failures: int
    last_failure: str
    last_message: str
    last_failure_at: float


@dataclass(frozen=True)
class PoolStatus:
    pool: str
    now: float
    accelerators: list[AcceleratorStatus] = field(default_factory=list)
    residents: list[ResidentStatus] = field(default_factory=list)
    queue_depth: dict[str, int] = field(default_factory=dict)
    active_leases: int = 0
    # Capabilities whose recent requests or loads failed; `degraded` past the configured count.
    capabilities: list[CapabilityStatus] = field(default_factory=list)
    # The pool's classes, highest priority first (`queue_depth` may come back sorted by name).
    classes: list[str] = field(default_factory=list)


def pool_status(state: PoolState, now: float) -> PoolStatus:
    accelerators = []
    for acc in state.catalog.accelerators:
        if acc.pool != state.pool:
            continue
        runtime = state.accelerators.get(acc.id, AcceleratorRuntime())
        budget = compute_budget(
            acc, runtime, list(state.residents.values()), list(state.leases.values()), state.config, now
        )
        accelerators.append(
            AcceleratorStatus(
                id=acc.id,
                node=acc.node,
                kind=acc.kind,
                model=acc.model,
                production_eligible=acc.production_eligible,
                simulated=acc.simulated or bool(runtime.observation and runtime.observation.simulated),
                total_bytes=budget.total_bytes,
                observed_used_bytes=budget.observed_used_bytes,
                external_bytes=budget.external_bytes,
                resident_bytes=budget.resident_bytes,
                leased_bytes=budget.leased_bytes,
                reserve_bytes=budget.reserve_bytes,
                schedulable_bytes=budget.schedulable_bytes,
                pressure=runtime.pressure,
                healthy=runtime.healthy,
                fresh=budget.fresh,
                observation_age_s=budget.age_s,
                observed_at=runtime.observation.observed_at if runtime.observation else None,
            )
        )
    residents = [
        ResidentStatus(
            deployment=r.deployment,
            capability=r.capability,
            accelerator=r.accelerator,
            bytes=r.bytes,
            state=r.phase.value,
            residency=r.residency.value,
            active_leases=r.active_leases,
            last_used=r.last_used,
            ttl_s=r.ttl_s,
            expires_at=(r.last_used + r.ttl_s)
            if r.residency.value == "keep_warm" and r.phase.value == "ready" and r.active_leases == 0
            else None,
            workflow_id=r.workflow_id,
        )
        for r in state.residents.values()
    ]
    depth = dict.fromkeys(state.catalog.classes, 0)
    for queued in state.queue:
        depth[queued.priority] = depth.get(queued.priority, 0) + 1
    return PoolStatus(
        pool=state.pool,
        now=now,
        accelerators=accelerators,
        residents=residents,
        queue_depth=depth,
        classes=list(state.catalog.classes),
        active_leases=len(state.leases),
        capabilities=[
            CapabilityStatus(
                capability=capability,
                degraded=health.consecutive_failures >= state.config.degraded_after_failures,
                consecutive_failures=health.consecutive_failures,
                last_failure=health.last_failure,
                last_message=health.last_message,
                last_failure_at=health.last_failure_at,
            )
            for capability, health in state.capability_health.items()
        ],
    )
