"""Admission: validate, order the queue, place each request in phases (filter, score, choose),
make room by evicting idle residents, and the state transitions that carry decisions out.

`decide` is pure: it reads the state and returns new decision objects. The `apply_*`,
`release_lease` and `resident_*` functions are the deterministic transitions that the scheduler
workflow and the simulator both run on their state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modelforge.domain import (
    RESERVED_RESIDENCIES,
    Accelerator,
    Deployment,
    Priority,
    Residency,
    resident_key,
)
from modelforge.failures import FailureClass
from modelforge.policy._budget import Budget, compute_budget
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
from modelforge.policy._state import (
    AcceleratorRuntime,
    Lease,
    PoolState,
    QueuedRequest,
    ResidentPhase,
    ResidentState,
    TenantUsage,
)

MAX_CAPABILITY_LENGTH = 200
MAX_TENANT_LENGTH = 100


class AdmissionRejected(Exception):
    """Raised by `validate_request`; carries the typed class for the update validator."""

    def __init__(self, failure: FailureClass, message: str) -> None:
        super().__init__(message)
        self.failure = failure
        self.message = message


@dataclass(frozen=True)
class AdmissionRequest:
    request_id: str
    workflow_id: str
    capability: str
    tenant: str
    priority: Priority | None = None
    deadline_s: float | None = None
    lease_timeout_s: float | None = None


def resolve_priority(state: PoolState, request: AdmissionRequest) -> Priority:
    """The class stamped from identity: the tenant's default, never above its ceiling."""
    tenant = state.catalog.tenant(request.tenant)
    if tenant is None:
        raise AdmissionRejected(FailureClass.REQUEST_INVALID, f"unknown tenant {request.tenant!r}")
    priority = request.priority or tenant.default_priority
    if priority.rank < tenant.max_priority.rank:
        raise AdmissionRejected(
            FailureClass.REQUEST_INVALID,
            f"tenant {tenant.name!r} may ask for at most {tenant.max_priority.value!r}, not {priority.value!r}",
        )
    return priority


def validate_request(state: PoolState, request: AdmissionRequest) -> tuple[Deployment, Priority]:
    """Everything that can be refused without touching the queue: a refused admission update
    writes no history."""
    if not request.request_id or not request.capability:
        raise AdmissionRejected(FailureClass.REQUEST_INVALID, "request_id and capability are required")
    if len(request.capability) > MAX_CAPABILITY_LENGTH or len(request.tenant) > MAX_TENANT_LENGTH:
        raise AdmissionRejected(FailureClass.REQUEST_INVALID, "capability or tenant name too long")
    for name, value in (("deadline_s", request.deadline_s), ("lease_timeout_s", request.lease_timeout_s)):
        if value is not None and not (0 < value <= 7 * 24 * 3600):
            raise AdmissionRejected(
                FailureClass.REQUEST_INVALID, f"{name} must be between 0 and 604800 seconds, got {value!r}"
            )
    deployment = state.catalog.deployment_for(request.capability)
    if deployment is None:
        raise AdmissionRejected(FailureClass.CAPABILITY_UNAVAILABLE, f"no deployment serves {request.capability!r}")
    if deployment.residency in RESERVED_RESIDENCIES:
        raise AdmissionRejected(
            FailureClass.RESIDENCY_CONFLICT,
            f"residency {deployment.residency.value!r} is reserved for later and not served",
        )
    priority = resolve_priority(state, request)
    if any(q.request_id == request.request_id for q in state.queue) or any(
        lease.request_id == request.request_id for lease in state.leases.values()
    ):
        raise AdmissionRejected(FailureClass.LEASE_CONFLICT, f"request {request.request_id} is already admitted")
    queued = sum(1 for q in state.queue if q.capability == request.capability)
    if queued >= deployment.queue_limit:
        raise AdmissionRejected(
            FailureClass.QUEUE_FULL,
            f"{queued} requests already queued for {request.capability} (queue_limit {deployment.queue_limit})",
        )
    return deployment, priority


def enqueue(state: PoolState, request: AdmissionRequest, priority: Priority, now: float) -> QueuedRequest:
    timeout = request.lease_timeout_s or state.config.default_lease_timeout_s
    queued = QueuedRequest(
        request_id=request.request_id,
        workflow_id=request.workflow_id,
        capability=request.capability,
        priority=priority,
        tenant=request.tenant,
        submitted_at=now,
        lease_timeout_at=now + timeout,
        deadline_at=None if request.deadline_s is None else now + request.deadline_s,
    )
    state.queue.append(queued)
    return queued


# --- fair share -----------------------------------------------------------------------------


def decayed_usage(usage: TenantUsage, half_life_s: float, now: float) -> float:
    if half_life_s <= 0:
        return usage.gpu_seconds
    decay: float = 0.5 ** (max(0.0, now - usage.updated_at) / half_life_s)
    return usage.gpu_seconds * decay


def fair_share_scores(state: PoolState, now: float) -> dict[str, float]:
    """Seed 003: score = priority * (1 + (target - consumed) / target), clamped at zero, where
    `priority` is the tenant's weight and target its weighted share of all decayed usage."""
    tenants = state.catalog.tenants
    total_weight = sum(t.weight for t in tenants) or 1.0
    consumed = {
        t.name: decayed_usage(state.usage.get(t.name, TenantUsage()), state.config.fair_share_half_life_s, now)
        for t in tenants
    }
    total = sum(consumed.values())
    scores: dict[str, float] = {}
    for tenant in tenants:
        if total <= 0:
            scores[tenant.name] = tenant.weight
            continue
        target = total * tenant.weight / total_weight
        scores[tenant.name] = max(0.0, tenant.weight * (1 + (target - consumed[tenant.name]) / target))
    return scores


def queue_order(state: PoolState, now: float) -> list[QueuedRequest]:
    """Class, then fair-share score (higher first), then submission time, then request id."""
    scores = fair_share_scores(state, now)
    return sorted(
        state.queue, key=lambda q: (q.priority.rank, -scores.get(q.tenant, 0.0), q.submitted_at, q.request_id)
    )


# --- placement ------------------------------------------------------------------------------


@dataclass
class _Pass:
    """Commitments made earlier in this decision pass, so one pass never double-books."""

    budgets: dict[str, Budget]
    committed: dict[str, int] = field(default_factory=dict)
    slots: dict[str, int] = field(default_factory=dict)
    evicting: list[str] = field(default_factory=list)
    # Accelerators on which a higher-ordered request is waiting for memory: later requests may
    # join ready residents there but must not take new bytes ahead of it.
    blocked: list[str] = field(default_factory=list)

    def free(self, accelerator: str) -> int:
        return self.budgets[accelerator].schedulable_bytes - self.committed.get(accelerator, 0)

    def commit(self, accelerator: str, nbytes: int) -> None:
        self.committed[accelerator] = self.committed.get(accelerator, 0) + nbytes


@dataclass(frozen=True)
class FilterResult:
    accelerator: str
    passed: bool
    reason: str = ""
    permanent: bool = True


def filter_accelerators(state: PoolState, deployment: Deployment, priority: Priority, now: float) -> list[FilterResult]:
    """Phase 1: each accelerator of the pool, accepted or rejected with its reason."""
    results: list[FilterResult] = []
    for accelerator in state.catalog.accelerators:
        if accelerator.pool != state.pool:
            continue
        reason, permanent = _filter_one(state, accelerator, deployment, priority, now)
        results.append(FilterResult(accelerator.id, reason == "", reason, permanent))
    return results


def _filter_one(
    state: PoolState, accelerator: Accelerator, deployment: Deployment, priority: Priority, now: float
) -> tuple[str, bool]:
    if deployment.accelerators and accelerator.id not in deployment.accelerators:
        return f"{accelerator.id}: not in the deployment's placement list", True
    if priority == Priority.PRODUCTION:
        if not accelerator.production_eligible:
            return f"{accelerator.id}: production_eligible=false", True
        if not deployment.production_eligible:
            return f"{accelerator.id}: deployment {deployment.deployment_id} is not production eligible", True
        if accelerator.model not in deployment.measured_on:
            return (
                f"{accelerator.id}: envelope of {deployment.deployment_id} not measured on "
                f"{accelerator.model or 'this accelerator model'}"
            ), True
    runtime = state.accelerators.get(accelerator.id)
    if runtime is not None and not runtime.healthy:
        return f"{accelerator.id}: UNHEALTHY", False
    return "", True


def _evictable(resident: ResidentState) -> bool:
    return (
        resident.phase == ResidentPhase.READY
        and resident.active_leases == 0
        and resident.residency != Residency.ALWAYS_WARM
    )


def _eviction_plan(state: PoolState, accelerator: str, deployment_id: str, need: int, pass_: _Pass) -> list[str] | None:
    """The cheapest idle residents whose bytes make `need` fit: fastest to unload first, then the
    largest, so the fewest models go."""
    free = pass_.free(accelerator)
    candidates = [
        r
        for r in state.residents.values()
        if r.accelerator == accelerator
        and r.deployment != deployment_id
        and _evictable(r)
        and r.key not in pass_.evicting
    ]
    costs = {d.deployment_id: d.unload_s for d in state.catalog.deployments}
    candidates.sort(key=lambda r: (costs.get(r.deployment, 0.0), -r.bytes, r.key))
    chosen: list[str] = []
    for resident in candidates:
        if free >= need:
            break
        chosen.append(resident.key)
        free += resident.bytes
    return chosen if free >= need and chosen else None


def decide(state: PoolState, now: float) -> Decisions:
    budgets = {
        acc_id: compute_budget(
            acc,
            state.accelerators.get(acc_id, AcceleratorRuntime()),
            list(state.residents.values()),
            list(state.leases.values()),
            state.config,
            now,
        )
        for acc_id, acc in ((a.id, a) for a in state.catalog.accelerators if a.pool == state.pool)
    }
    pass_ = _Pass(budgets=budgets)
    for resident in state.residents.values():
        deployment = _deployment_by_id(state, resident.deployment)
        concurrency = deployment.concurrency if deployment else 1
        pass_.slots[resident.key] = concurrency - resident.active_leases
    grants: list[Grant] = []
    rejects: list[Reject] = []
    loads: list[StartLoad] = []
    assigns: list[Assign] = []
    unloads: list[Unload] = []
    waits: list[Wait] = []
    counter = state.lease_counter

    for queued in queue_order(state, now):
        if now >= queued.lease_timeout_at:
            reason = f"; last reason: {queued.waiting_reason}" if queued.waiting_reason else ""
            rejects.append(
                Reject(
                    queued.request_id,
                    queued.workflow_id,
                    FailureClass.LEASE_TIMEOUT,
                    f"waited {now - queued.submitted_at:.1f} s for a lease{reason}",
                )
            )
            continue
        if queued.deadline_at is not None and now >= queued.deadline_at:
            rejects.append(
                Reject(
                    queued.request_id,
                    queued.workflow_id,
                    FailureClass.DEADLINE_CANNOT_BE_MET,
                    f"deadline passed while queued{'; ' + queued.waiting_reason if queued.waiting_reason else ''}",
                )
            )
            continue
        deployment = state.catalog.deployment_for(queued.capability)
        if deployment is None:
            rejects.append(
                Reject(
                    queued.request_id,
                    queued.workflow_id,
                    FailureClass.CAPABILITY_UNAVAILABLE,
                    f"{queued.capability} was removed from the catalog",
                )
            )
            continue
        outcome = _place(state, queued, deployment, now, pass_, counter)
        if isinstance(outcome, Grant):
            counter += 1
            grants.append(outcome)
        elif isinstance(outcome, Reject):
            rejects.append(outcome)
        elif isinstance(outcome, StartLoad):
            loads.append(outcome)
        elif isinstance(outcome, Assign):
            assigns.append(outcome)
        elif isinstance(outcome, list):
            unloads.extend(outcome)
            waits.append(
                Wait(queued.request_id, "making room: unloading " + ", ".join(u.resident_key for u in outcome))
            )
        else:
            waits.append(outcome)

    # load_on_demand and batch residents go when their last lease has ended and nobody waits.
    waiting_on = {a.resident_key for a in assigns} | {q.assigned_to for q in state.queue if q.assigned_to}
    for resident in state.residents.values():
        if (
            resident.residency in (Residency.LOAD_ON_DEMAND, Residency.NONE)
            and _evictable(resident)
            and resident.key not in pass_.evicting
            and resident.key not in waiting_on
            and not any(g.lease.resident_key == resident.key for g in grants)
        ):
            unloads.append(Unload(resident.key, "last lease ended (load_on_demand)"))
    return Decisions(grants=grants, rejects=rejects, loads=loads, assigns=assigns, unloads=unloads, waits=waits)


def _deployment_by_id(state: PoolState, deployment_id: str) -> Deployment | None:
    for deployment in state.catalog.deployments:
        if deployment.deployment_id == deployment_id:
            return deployment
    return None


def _grant(
    state: PoolState,
    queued: QueuedRequest,
    deployment: Deployment,
    resident: ResidentState,
    now: float,
    pass_: _Pass,
    counter: int,
) -> Grant:
    extra = deployment.lease_extra_bytes
    pass_.commit(resident.accelerator, extra)
    pass_.slots[resident.key] = pass_.slots.get(resident.key, 0) - 1
    lease = Lease(
        lease_id=f"{queued.request_id}.{counter + 1}",
        request_id=queued.request_id,
        workflow_id=queued.workflow_id,
        capability=queued.capability,
        deployment=deployment.deployment_id,
        accelerator=resident.accelerator,
        node=resident.node,
        resident_key=resident.key,
        bytes=extra,
        granted_at=now,
        priority=queued.priority,
        tenant=queued.tenant,
    )
    return Grant(queued.request_id, queued.workflow_id, lease)


def _place(
    state: PoolState, queued: QueuedRequest, deployment: Deployment, now: float, pass_: _Pass, counter: int
) -> Grant | Reject | StartLoad | Assign | Wait | list[Unload]:
    extra = deployment.lease_extra_bytes
    # A request already waiting on a load is granted when that resident is ready.
    if queued.assigned_to:
        resident = state.residents.get(queued.assigned_to)
        if resident is not None and resident.phase == ResidentPhase.LOADING:
            return Wait(queued.request_id, f"waiting for {resident.key} to load")
        if resident is not None and resident.phase == ResidentPhase.READY and pass_.slots.get(resident.key, 0) > 0:
            if extra <= pass_.free(resident.accelerator) or extra == 0:
                return _grant(state, queued, deployment, resident, now, pass_, counter)

    filtered = filter_accelerators(state, deployment, queued.priority, now)
    passed = [f.accelerator for f in filtered if f.passed]
    if not passed:
        if all(f.permanent for f in filtered):
            detail = "; ".join(f.reason for f in filtered) or "the pool has no accelerators"
            return Reject(
                queued.request_id,
                queued.workflow_id,
                FailureClass.CAPABILITY_UNAVAILABLE,
                f"no {queued.priority.value} placement for {queued.capability}: {detail}",
            )
        return Wait(queued.request_id, "; ".join(f.reason for f in filtered if not f.passed))

    # Phase 2, score: join a ready resident (no new load) > join a loading one > load with best fit.
    reasons: list[str] = []
    for accelerator in passed:
        resident = state.residents.get(resident_key(deployment.deployment_id, accelerator))
        if resident is None:
            continue
        if pass_.slots.get(resident.key, 0) <= 0:
            reasons.append(f"{accelerator}: {deployment.deployment_id} at concurrency {deployment.concurrency}")
            continue
        if resident.phase == ResidentPhase.READY:
            if extra == 0 or extra <= pass_.free(accelerator):
                return _grant(state, queued, deployment, resident, now, pass_, counter)
            reasons.append(f"{accelerator}: lease needs {extra} B, {pass_.free(accelerator)} B schedulable")
        elif resident.phase == ResidentPhase.LOADING:
            pass_.slots[resident.key] -= 1
            return Assign(queued.request_id, resident.key)
        else:
            reasons.append(f"{accelerator}: {deployment.deployment_id} is {resident.phase.value}")

    need = deployment.resident_bytes + extra
    candidates: list[tuple[int, str]] = []
    eviction_options: list[tuple[int, str, list[str]]] = []
    for accelerator in passed:
        key = resident_key(deployment.deployment_id, accelerator)
        if key in state.residents:
            continue
        budget = pass_.budgets[accelerator]
        if not budget.fresh:
            age = "never observed" if budget.age_s is None else f"observation {budget.age_s:.0f} s old"
            reasons.append(f"{accelerator}: {FailureClass.SCHEDULER_STATE_STALE.value} ({age})")
            continue
        runtime = state.accelerators.get(accelerator, AcceleratorRuntime())
        if runtime.pressure and queued.priority != Priority.PRODUCTION:
            reasons.append(f"{accelerator}: GPU_PRESSURE, only production work may load")
            continue
        if accelerator in pass_.blocked:
            reasons.append(f"{accelerator}: a higher request waits for memory here")
            continue
        free = pass_.free(accelerator)
        if need <= free:
            candidates.append((free - need, accelerator))
            continue
        plan = _eviction_plan(state, accelerator, deployment.deployment_id, need, pass_)
        if plan is not None:
            evicted = sum(state.residents[k].bytes for k in plan)
            eviction_options.append((evicted, accelerator, plan))
        reasons.append(f"{accelerator}: needs {need} B, {free} B schedulable")

    if candidates and queued.deadline_at is not None and now + deployment.load_s > queued.deadline_at:
        return Reject(
            queued.request_id,
            queued.workflow_id,
            FailureClass.DEADLINE_CANNOT_BE_MET,
            f"loading {deployment.deployment_id} takes {deployment.load_s:.1f} s; the deadline is in "
            f"{queued.deadline_at - now:.1f} s",
        )
    if candidates:
        # Phase 3, choose: best fit (least schedulable left over), ties by accelerator id.
        _, accelerator = min(candidates)
        acc = state.catalog.accelerator(accelerator)
        assert acc is not None
        pass_.commit(accelerator, need - extra)
        key = resident_key(deployment.deployment_id, accelerator)
        pass_.slots[key] = deployment.concurrency - 1
        return StartLoad(
            key, deployment.deployment_id, accelerator, acc.node, deployment.resident_bytes, [queued.request_id]
        )
    if eviction_options:
        _, accelerator, plan = min(eviction_options)
        pass_.evicting.extend(plan)
        pass_.blocked.append(accelerator)
        return [Unload(key, f"making room for {queued.capability} ({queued.priority.value})") for key in plan]

    # Nothing fits now. Refuse at once when no release of ModelForge's own work could ever help.
    never = _never_fits(state, passed, need, pass_)
    if never is not None:
        return Reject(queued.request_id, queued.workflow_id, never[0], never[1])
    for accelerator in passed:
        if accelerator not in pass_.blocked and pass_.budgets[accelerator].fresh:
            pass_.blocked.append(accelerator)
    return Wait(queued.request_id, "; ".join(reasons) or "waiting for capacity")


def _never_fits(state: PoolState, passed: list[str], need: int, pass_: _Pass) -> tuple[FailureClass, str] | None:
    external_blocked = []
    for accelerator in passed:
        budget = pass_.budgets[accelerator]
        if not budget.fresh:
            return None
        ceiling = budget.total_bytes - budget.reserve_bytes
        pinned = sum(
            r.bytes
            for r in state.residents.values()
            if r.accelerator == accelerator and r.residency == Residency.ALWAYS_WARM
        )
        if need <= ceiling - budget.external_bytes - pinned:
            return None  # releases or evictions of ModelForge work would make it fit: wait
        if need <= ceiling - pinned:
            external_blocked.append(
                f"{accelerator}: external {budget.external_bytes} B leaves "
                f"{ceiling - pinned - budget.external_bytes} B, needs {need} B"
            )
    if len(external_blocked) == len(passed):
        return FailureClass.EXTERNAL_GPU_PRESSURE, "; ".join(external_blocked)
    pinned_only = [
        a
        for a in passed
        if need <= pass_.budgets[a].total_bytes - pass_.budgets[a].reserve_bytes - pass_.budgets[a].external_bytes
    ]
    if pinned_only:
        return FailureClass.EVICTION_NOT_ALLOWED, "only always_warm residents could make room"
    return FailureClass.INSUFFICIENT_SCHEDULABLE_VRAM, (
        f"needs {need} B; largest possible on any eligible accelerator is "
        f"{max(pass_.budgets[a].total_bytes - pass_.budgets[a].reserve_bytes for a in passed)} B"
    )


# --- transitions ----------------------------------------------------------------------------


def apply_decisions(
    state: PoolState, decisions: Decisions, now: float, workflow_ids: dict[str, str]
) -> list[PolicyEvent]:
    """Carry out decisions on the state. `workflow_ids` maps a new resident key to the id of the
    residency workflow that will own it."""
    events: list[PolicyEvent] = []
    by_id = {q.request_id: q for q in state.queue}
    done: list[str] = []
    for load in decisions.loads:
        deployment = _deployment_by_id(state, load.deployment)
        assert deployment is not None
        state.residents[load.resident_key] = ResidentState(
            key=load.resident_key,
            deployment=load.deployment,
            capability=deployment.capability,
            accelerator=load.accelerator,
            node=load.node,
            bytes=load.bytes,
            phase=ResidentPhase.LOADING,
            residency=deployment.residency,
            ttl_s=deployment.ttl_s,
            workflow_id=workflow_ids.get(load.resident_key, ""),
            requested_at=now,
        )
        for request_id in load.for_requests:
            if request_id in by_id:
                by_id[request_id].assigned_to = load.resident_key
        events.append(
            PolicyEvent(
                kind="load_requested",
                accelerator=load.accelerator,
                deployment=load.deployment,
                payload={"bytes": load.bytes},
            )
        )
    for assign in decisions.assigns:
        if assign.request_id in by_id:
            by_id[assign.request_id].assigned_to = assign.resident_key
    for grant in decisions.grants:
        lease = grant.lease
        state.leases[lease.lease_id] = lease
        state.lease_counter += 1
        resident = state.residents[lease.resident_key]
        resident.active_leases += 1
        resident.last_used = now
        done.append(grant.request_id)
        queued = by_id.get(grant.request_id)
        events.append(
            PolicyEvent(
                kind="lease_granted",
                request_id=grant.request_id,
                lease_id=lease.lease_id,
                accelerator=lease.accelerator,
                deployment=lease.deployment,
                workflow_id=grant.workflow_id,
                payload={
                    "bytes": lease.bytes,
                    "priority": lease.priority.value,
                    "tenant": lease.tenant,
                    "waited_s": round(now - queued.submitted_at, 3) if queued else None,
                },
            )
        )
    for reject in decisions.rejects:
        done.append(reject.request_id)
        events.append(
            PolicyEvent(
                kind="request_rejected",
                failure=reject.failure,
                request_id=reject.request_id,
                workflow_id=reject.workflow_id,
                message=reject.message,
            )
        )
    for unload in decisions.unloads:
        unloading = state.residents.get(unload.resident_key)
        if unloading is None:
            continue
        resident = unloading
        resident.phase = ResidentPhase.UNLOADING
        events.append(
            PolicyEvent(
                kind="unload_requested",
                accelerator=resident.accelerator,
                deployment=resident.deployment,
                workflow_id=resident.workflow_id,
                message=unload.reason,
            )
        )
    for wait in decisions.waits:
        if wait.request_id in by_id:
            by_id[wait.request_id].waiting_reason = wait.reason
    if done:
        finished = set(done)
        state.queue = [q for q in state.queue if q.request_id not in finished]
    return events


def release_lease(state: PoolState, lease_id: str, now: float, outcome: str) -> list[PolicyEvent]:
    lease = state.leases.pop(lease_id, None)
    if lease is None:
        return []
    resident = state.residents.get(lease.resident_key)
    if resident is not None:
        resident.active_leases = max(0, resident.active_leases - 1)
        resident.last_used = now
    usage = state.usage.setdefault(lease.tenant, TenantUsage(updated_at=now))
    usage.gpu_seconds = decayed_usage(usage, state.config.fair_share_half_life_s, now) + max(
        0.0, now - lease.granted_at
    )
    usage.updated_at = now
    return [
        PolicyEvent(
            kind="lease_released",
            request_id=lease.request_id,
            lease_id=lease_id,
            accelerator=lease.accelerator,
            deployment=lease.deployment,
            workflow_id=lease.workflow_id,
            message=outcome,
            payload={"held_s": round(now - lease.granted_at, 3), "bytes": lease.bytes},
        )
    ]


def resident_crashed(state: PoolState, key: str, granted_at: float, message: str) -> list[PolicyEvent]:
    """An invoke found the runtime gone (crashed, or its node worker restarted): the model is no
    longer resident, whatever the last sample said, so no further lease may be granted on it.
    A report about a lease older than the resident's current load is about a previous life of
    the same key and changes nothing."""
    resident = state.residents.get(key)
    if resident is None or resident.phase != ResidentPhase.READY:
        return []
    if resident.loaded_at is not None and resident.loaded_at > granted_at:
        return []
    del state.residents[key]
    return [
        PolicyEvent(
            kind="resident_lost",
            failure=FailureClass.RUNTIME_CRASH,
            accelerator=resident.accelerator,
            deployment=resident.deployment,
            workflow_id=resident.workflow_id,
            message=f"invoke found the runtime gone: {message}",
        )
    ]


def cancel_request(state: PoolState, request_id: str, now: float, reason: str) -> list[PolicyEvent]:
    """The requester gave up (timeout, cancel): drop it from the queue and release any lease."""
    events: list[PolicyEvent] = []
    before = len(state.queue)
    state.queue = [q for q in state.queue if q.request_id != request_id]
    if len(state.queue) != before:
        events.append(PolicyEvent(kind="request_cancelled", request_id=request_id, message=reason))
    for lease_id in [lid for lid, lease in state.leases.items() if lease.request_id == request_id]:
        events.extend(release_lease(state, lease_id, now, f"reclaimed: {reason}"))
    return events


def resident_ready(state: PoolState, key: str, measured_bytes: int, now: float) -> list[PolicyEvent]:
    resident = state.residents.get(key)
    if resident is None:
        return []
    resident.phase = ResidentPhase.READY
    resident.loaded_at = now
    resident.last_used = now
    # Trust the measurement when it exceeds the catalog's envelope: the card holds what it holds.
    resident.bytes = max(resident.bytes, measured_bytes)
    return [
        PolicyEvent(
            kind="resident_ready",
            accelerator=resident.accelerator,
            deployment=resident.deployment,
            workflow_id=resident.workflow_id,
            payload={
                "bytes": resident.bytes,
                "measured_bytes": measured_bytes,
                "load_s": round(now - resident.requested_at, 3),
            },
        )
    ]


def resident_failed(
    state: PoolState, key: str, failure: FailureClass, message: str, now: float
) -> tuple[list[Reject], list[PolicyEvent]]:
    """A load or its health check failed: the resident goes and whoever waited on it is told why."""
    resident = state.residents.pop(key, None)
    rejects = [Reject(q.request_id, q.workflow_id, failure, message) for q in state.queue if q.assigned_to == key]
    if rejects:
        gone = {r.request_id for r in rejects}
        state.queue = [q for q in state.queue if q.request_id not in gone]
    events = [
        PolicyEvent(
            kind="load_failed",
            failure=failure,
            message=message,
            accelerator=resident.accelerator if resident else "",
            deployment=resident.deployment if resident else "",
            workflow_id=resident.workflow_id if resident else "",
        )
    ]
    events.extend(
        PolicyEvent(
            kind="request_rejected",
            failure=r.failure,
            request_id=r.request_id,
            workflow_id=r.workflow_id,
            message=r.message,
        )
        for r in rejects
    )
    return rejects, events


def resident_unloaded(state: PoolState, key: str, reclaimed: bool, message: str) -> list[PolicyEvent]:
    resident = state.residents.get(key)
    if resident is None:
        return []
    if reclaimed:
        del state.residents[key]
        return [
            PolicyEvent(
                kind="reclaim_confirmed",
                accelerator=resident.accelerator,
                deployment=resident.deployment,
                workflow_id=resident.workflow_id,
                payload={"bytes": resident.bytes},
            )
        ]
    resident.phase = ResidentPhase.UNRECLAIMED
    return [
        PolicyEvent(
            kind="reclaim_failed",
            failure=FailureClass.GPU_MEMORY_NOT_RECLAIMED,
            accelerator=resident.accelerator,
            deployment=resident.deployment,
            workflow_id=resident.workflow_id,
            message=message,
            payload={"bytes": resident.bytes},
        )
    ]


def keep_warm_check(state: PoolState, key: str, now: float) -> float | None:
    """Called when a resident's TTL timer fires. Returns the time to check again (the TTL was
    reset by a later use, or leases are active), or None: unload it now."""
    resident = state.residents.get(key)
    if resident is None or resident.phase != ResidentPhase.READY:
        return None
    if resident.residency == Residency.ALWAYS_WARM:
        return now + 3600.0
    if resident.active_leases > 0:
        return now + resident.ttl_s
    expires = resident.last_used + resident.ttl_s
    if expires > now:
        return expires
    resident.phase = ResidentPhase.UNLOADING
    return None
