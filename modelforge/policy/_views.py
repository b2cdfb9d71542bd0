"""Read-only views of the scheduler state for `status` and `ps`, and what one tenant sees of
them (`tenant_view`).

An active lease is one that serves a request (or a gang job, or the scheduler's own load): a
slot lent to a node for warm requests that is free by the node's last sync serves nobody and is
counted apart (`lent_slots`), never as an active lease."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from modelforge.policy._budget import compute_budget
from modelforge.policy._state import AcceleratorRuntime, PoolState, holder_of, serves_nobody


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
    # Leases serving a request on it now (a delegated slot counts while a request is on it).
    active_leases: int
    last_used: float
    ttl_s: float
    expires_at: float | None
    workflow_id: str
    # Slots lent to a node and free by its last sync: they serve nobody (not active leases).
    lent_slots: int = 0
    # The active leases by tenant (a request on a delegated slot counts under its tenant from the
    # node's next sync after its claim, "" before).
    tenant_leases: dict[str, int] = field(default_factory=dict)


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
    # Free lent slots (not in `active_leases`), the active leases by tenant, and the queue by
    # tenant and class: what `tenant_view` keeps of each tenant's own.
    lent_slots: int = 0
    tenant_leases: dict[str, int] = field(default_factory=dict)
    tenant_queue_depth: dict[str, dict[str, int]] = field(default_factory=dict)
    # The scheduler is loading its catalog (at its start, or after `catalog apply`): until it has,
    # admissions and controls answer SCHEDULER_STATE_STALE (retryable), and the cards above are
    # those of the catalog it had. Set by the scheduler's query, not by `pool_status`.
    catalog_loading: bool = False


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
    serving: dict[str, dict[str, int]] = {}  # resident key -> tenant -> active leases
    lent: dict[str, int] = {}  # resident key -> free lent slots
    tenant_leases: dict[str, int] = {}
    for lease in state.leases.values():
        resident = holder_of(state, lease)
        if serves_nobody(state, lease):
            if resident is not None:
                lent[resident.key] = lent.get(resident.key, 0) + 1
            continue
        tenant_leases[lease.tenant] = tenant_leases.get(lease.tenant, 0) + 1
        if resident is not None:
            by_tenant = serving.setdefault(resident.key, {})
            by_tenant[lease.tenant] = by_tenant.get(lease.tenant, 0) + 1
    residents = []
    for r in state.residents.values():
        # Its count less the free lent slots (a lease of an earlier life counts on no resident).
        active = max(0, r.active_leases - lent.get(r.key, 0))
        residents.append(
            ResidentStatus(
                deployment=r.deployment,
                capability=r.capability,
                accelerator=r.accelerator,
                bytes=r.bytes,
                state=r.phase.value,
                residency=r.residency.value,
                active_leases=active,
                last_used=r.last_used,
                ttl_s=r.ttl_s,
                expires_at=r.idle_expires_at
                if r.residency.value == "keep_warm" and r.phase.value == "ready" and active == 0
                else None,
                workflow_id=r.workflow_id,
                lent_slots=lent.get(r.key, 0),
                tenant_leases=serving.get(r.key, {}),
            )
        )
    depth = dict.fromkeys(state.catalog.classes, 0)
    tenant_depth: dict[str, dict[str, int]] = {}
    for queued in state.queue:
        depth[queued.priority] = depth.get(queued.priority, 0) + 1
        mine = tenant_depth.setdefault(queued.tenant, {})
        mine[queued.priority] = mine.get(queued.priority, 0) + 1
    return PoolStatus(
        pool=state.pool,
        now=now,
        accelerators=accelerators,
        residents=residents,
        queue_depth=depth,
        classes=list(state.catalog.classes),
        active_leases=sum(tenant_leases.values()),
        lent_slots=sum(1 for lease in state.leases.values() if serves_nobody(state, lease)),
        tenant_leases=tenant_leases,
        tenant_queue_depth=tenant_depth,
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


def tenant_view(status: PoolStatus, tenant: str) -> PoolStatus:
    """What one tenant's API key is shown of a pool (the gateway's `/v1/status` and `/api/ps`
    when keys are configured; an operator's key sees `status` whole). Every resident is listed:
    any tenant may use any deployment of the catalog (`/v1/models` and `/api/tags` list them all)
    and needs to know whether its model is loaded, where and until when. Of the traffic it sees
    only its own: its active leases (on each resident and in the pool) and its queued requests by
    class; no other tenant's counts, no lent slots, and no failure message (another tenant's
    request may have caused it: the class and counts stay). The cards' memory figures stay, as
    the sums admission answers refer to, never split by tenant."""
    own = status.tenant_leases.get(tenant, 0)
    queued = status.tenant_queue_depth.get(tenant, {})
    return replace(
        status,
        residents=[
            replace(
                r,
                active_leases=r.tenant_leases.get(tenant, 0),
                lent_slots=0,
                tenant_leases={tenant: r.tenant_leases[tenant]} if r.tenant_leases.get(tenant) else {},
            )
            for r in status.residents
        ],
        queue_depth={name: queued.get(name, 0) for name in status.queue_depth},
        active_leases=own,
        lent_slots=0,
        tenant_leases={tenant: own} if own else {},
        tenant_queue_depth={tenant: dict(queued)} if queued else {},
        capabilities=[replace(c, last_message="") for c in status.capabilities],
    )
