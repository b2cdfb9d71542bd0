"""The state transitions: the deterministic functions the scheduler workflow and the simulator
both run on their state to carry out what happened, `decide`'s decisions (`apply_decisions`) and
every report from outside (a lease released or silent, a resident ready, failed, crashed,
unloaded, asleep or awake, a request cancelled, a keep-warm TTL timer). Admission itself, what
is let into the queue, is policy/_admission.py.
"""

from __future__ import annotations

from dataclasses import replace

from modelforge.domain import Residency, fair_share_entity
from modelforge.failures import FailureClass, parse_failure
from modelforge.policy._admission import asked_for
from modelforge.policy._decisions import (
    Decisions,
    PolicyEvent,
    Reject,
    lease_granted_event,
    lease_released_event,
    resident_event,
)
from modelforge.policy._lease_index import current_lease_index, lease_index
from modelforge.policy._order import decayed_usage
from modelforge.policy._queue_index import current_index, queue_index
from modelforge.policy._state import (
    CapabilityHealth,
    Lease,
    PoolState,
    QueuedRequest,
    ResidentPhase,
    ResidentState,
    TenantUsage,
    free_lent_slots_on,
    holder_of,
    measured,
    note_service,
)


def _eta_error(queued: QueuedRequest | None, now: float) -> dict[str, str | float]:
    """A grant's ETA error (predicted minus actual start, seconds) and the reason it was
    predicted for, when a verdict predicted its start (policy/_verdicts.py)."""
    if queued is None or queued.eta_at is None:
        return {}
    return {"eta_error_s": round(queued.eta_at - now, 3), "eta_reason": queued.eta_reason}


def apply_decisions(
    state: PoolState, decisions: Decisions, now: float, workflow_ids: dict[str, str]
) -> list[PolicyEvent]:
    """Carry out decisions on the state. `workflow_ids` maps a new resident key to the id of the
    residency workflow that will own it."""
    events: list[PolicyEvent] = []
    index = queue_index(state)
    by_id = index.by_id
    leases = current_lease_index(state)
    done: list[str] = []
    for load in decisions.loads:
        deployment = state.catalog.deployment(load.deployment)
        assert deployment is not None
        state.incarnations += 1
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
            incarnation=state.incarnations,
        )
        for request_id in load.for_requests:
            if request_id in by_id:
                index.assign(by_id[request_id], load.resident_key)
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
            index.assign(by_id[assign.request_id], assign.resident_key)
    for grant in decisions.grants:
        lease = grant.lease
        state.leases[lease.lease_id] = lease
        if leases is not None:
            leases.added(lease)
        state.lease_seen[lease.lease_id] = now
        state.lease_counter += 1
        if lease.resident_key:  # a gang job's lease is the whole job: no resident
            resident = state.residents[lease.resident_key]
            if lease.incarnation != resident.incarnation:  # decided on this resident: its life
                lease = replace(lease, incarnation=resident.incarnation)
                state.leases[lease.lease_id] = lease
            resident.active_leases += 1
            resident.last_used = now
            resident.last_priority = lease.priority
        done.append(grant.request_id)
        queued = by_id.get(grant.request_id)
        events.append(
            lease_granted_event(
                state.pool,
                lease,
                now - queued.submitted_at if queued else None,
                **(asked_for(queued) if queued else {}),
                **_eta_error(queued, now),
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
                payload={"pool": state.pool, **asked_for(by_id[reject.request_id])}
                if reject.request_id in by_id
                else {},
            )
        )
    for unload in decisions.unloads:
        unloading = state.residents.get(unload.resident_key)
        if unloading is None:
            continue
        resident = unloading
        resident.phase = ResidentPhase.UNLOADING
        resident.requested_at = now
        events.append(resident_event(resident, "unload_requested", unload.reason))
    for sleep in decisions.sleeps:
        sleeper = state.residents.get(sleep.resident_key)
        if sleeper is None:
            continue
        sleeper.phase = ResidentPhase.SLEEPING
        sleeper.requested_at = now
        events.append(resident_event(sleeper, "sleep_requested", sleep.reason))
    for wake in decisions.wakes:
        waking = state.residents.get(wake.resident_key)
        if waking is None:
            continue
        waking.phase = ResidentPhase.WAKING
        waking.requested_at = now
        # Its awake bytes are promised from now on, before the node has them back.
        waking.bytes = max(waking.bytes, wake.bytes)
        for request_id in wake.for_requests:
            if request_id in by_id:
                index.assign(by_id[request_id], wake.resident_key)
        events.append(resident_event(waking, "wake_requested", payload={"bytes": wake.bytes}))
    for preempt in decisions.preemptions:
        preempted = state.leases.get(preempt.lease_id)
        if preempted is None:
            continue
        state.preempting[preempt.lease_id] = preempt.reason
        events.append(
            PolicyEvent(
                kind="preemption_requested",
                request_id=preempt.request_id,
                lease_id=preempt.lease_id,
                accelerator=preempted.accelerator,
                deployment=preempted.deployment,
                workflow_id=preempt.workflow_id,
                message=preempt.reason,
                payload={"grace_s": preempt.grace_s, "priority": preempted.priority},
            )
        )
    for wait in decisions.waits:
        if wait.request_id in by_id:
            index.set_reason(by_id[wait.request_id], wait.reason, wait.codes)
    if done:
        _drop(state, dict.fromkeys(done, True))
    return events


def _drop(state: PoolState, gone: dict[str, bool]) -> None:
    """Take requests off the queue, and out of its index."""
    index = current_index(state)
    state.queue = [q for q in state.queue if q.request_id not in gone]
    if index is not None:
        index.removed(gone, state.queue)


def note_outcome(state: PoolState, capability: str, outcome: str, message: str, now: float) -> None:
    """Count a request's or a load's outcome towards its capability's health: no retry loop hides
    a capability that keeps failing. Outcomes that are not the capability's fault (preempted,
    reclaimed, cancelled) count neither way."""
    if outcome == "ok":
        state.capability_health.pop(capability, None)
        return
    if parse_failure(outcome) is None:
        return
    health = state.capability_health.setdefault(capability, CapabilityHealth())
    health.consecutive_failures += 1
    health.last_failure = outcome
    health.last_message = message
    health.last_failure_at = now


def charge_usage(state: PoolState, priority: str, tenant: str, seconds: float, now: float) -> None:
    """`seconds` of GPU time to the fair-share entity of `priority` and `tenant` (decayed to
    `now` first): what a released lease, or a request served on a lent slot, costs its tenant."""
    usage = state.usage.setdefault(fair_share_entity(priority, tenant), TenantUsage(updated_at=now))
    usage.gpu_seconds = decayed_usage(usage, state.config.fair_share_half_life_s, now) + max(0.0, seconds)
    usage.updated_at = now


def end_on_resident(state: PoolState, lease: Lease, now: float, *, used: bool = True) -> list[PolicyEvent]:
    """A lease (or a lent slot) ended: one slot fewer in use on the resident it was granted on,
    if that incarnation still holds its key. A lease that outlived its resident (lost, then
    loaded again under the same key) changes no count, the new resident's least of all: it is
    recorded as `stale_lease_ended`, and its own end (ledger row, slot event) goes on as usual.
    `used`: the lease's end is the resident's last use (its keep-warm TTL counts from it); a lent
    slot given back is not a use (the requests it served were, at the ends its node reported)."""
    if not lease.resident_key:
        return []
    resident = holder_of(state, lease)
    if resident is not None:
        resident.active_leases = max(0, resident.active_leases - 1)
        if used:
            resident.last_used = now
        return []
    current = state.residents.get(lease.resident_key)
    now_held = f"incarnation {current.incarnation} holds it now" if current is not None else "it is not resident now"
    return [
        PolicyEvent(
            kind="stale_lease_ended",
            request_id=lease.request_id,
            lease_id=lease.lease_id,
            accelerator=lease.accelerator,
            deployment=lease.deployment,
            workflow_id=lease.workflow_id,
            message=(
                f"granted on incarnation {lease.incarnation} of {lease.resident_key}, which is gone ({now_held}):"
                " no resident's count changes"
            ),
            payload={
                "resident": lease.resident_key,
                "incarnation": lease.incarnation,
                "current_incarnation": current.incarnation if current is not None else None,
            },
        )
    ]


def release_lease(
    state: PoolState, lease_id: str, now: float, outcome: str, message: str = "", ended_at: float | None = None
) -> list[PolicyEvent]:
    """`ended_at`: when its holder let go, if it says (`ReleaseSignal.ended_at`): the ledger's end
    and the service time, within the lease's grant and `now`; the pool's state changes now."""
    index = current_lease_index(state)
    lease = state.leases.pop(lease_id, None)
    if lease is not None and index is not None:
        index.removed(lease)
    state.lease_seen.pop(lease_id, None)
    state.lease_heard.pop(lease_id, None)
    state.preempting.pop(lease_id, None)
    lent = state.slots.pop(lease_id, None) is not None  # a node's slot (reclaimed): its requests were charged
    if lease is None:
        return []
    ended = now if ended_at is None else max(lease.granted_at, min(now, ended_at))
    if not lent:
        note_outcome(state, lease.capability, outcome, message, now)
        if outcome == "ok":
            note_service(state, lease.deployment, ended - lease.granted_at)
    events = end_on_resident(state, lease, now, used=not lent)
    if lent:
        return [
            *events,
            PolicyEvent(
                kind="slot_returned",
                lease_id=lease_id,
                accelerator=lease.accelerator,
                deployment=lease.deployment,
                workflow_id=lease.workflow_id,
                message=outcome,
                payload={"node": lease.node, "resident": lease.resident_key},
            ),
        ]
    charge_usage(state, lease.priority, lease.tenant, now - lease.granted_at, now)
    return [*events, lease_released_event(state.pool, lease, outcome, ended)]


def lease_heartbeat(state: PoolState, lease_id: str, now: float) -> bool:
    """The holder of a lease is alive. False when the lease is no longer held (reclaimed or
    released): the holder must stop using it."""
    if lease_id not in state.leases:
        return False
    state.lease_seen[lease_id] = now
    state.lease_heard[lease_id] = True
    return True


def _silence_limit(state: PoolState, lease_id: str) -> float:
    """How long this lease's holder may stay silent: stale_lease_s once it has been heard from,
    unheard_lease_s before (it may not have heard of its grant yet)."""
    config = state.config
    if config.unheard_lease_s is None or state.lease_heard.get(lease_id):
        return config.stale_lease_s
    return max(config.stale_lease_s, config.unheard_lease_s)


def stale_leases_due(state: PoolState) -> float | None:
    """When the next lease goes stale if its holder stays silent, for the scheduler's timer."""
    if not state.lease_seen:
        return None
    return min(seen + _silence_limit(state, lease_id) for lease_id, seen in state.lease_seen.items())


def reclaim_stale_leases(state: PoolState, now: float) -> list[PolicyEvent]:
    """Leases whose holder has been silent for `stale_lease_s` go back to the pool: a holder
    that was terminated or lost must not pin memory forever. A lease never heard from is held for
    unheard_lease_s: its holder may not have heard of it. Runs on every pass, so one walk over
    the leases finds the stale ones and, with fencing, when the next one is due."""
    limit = state.config.stale_lease_s
    fenced = state.config.unheard_lease_s is not None
    if fenced:
        # The scheduler's timer wakes it when the next lease goes stale: looking much later than
        # that (half a period) means it was not running, so holders could not be heard either.
        away = state.stale_due_at is not None and now > state.stale_due_at + 0.5 * limit
    else:
        away = state.stale_checked_at > 0 and now - state.stale_checked_at > 1.5 * limit
    state.stale_checked_at = now
    if away:
        # The scheduler was not running (its worker restarted): holders' heartbeats could not
        # land either, so silence proves nothing yet. Give every holder a full period.
        for lease_id in state.lease_seen:
            state.lease_seen[lease_id] = now
        if fenced:
            state.stale_due_at = stale_leases_due(state)
        return (
            [
                PolicyEvent(
                    kind="stale_lease_grace",
                    message=f"scheduler was away; {len(state.lease_seen)} leases get {limit:.0f} s to heartbeat",
                )
            ]
            if state.lease_seen
            else []
        )
    stale: list[tuple[str, float]] = []
    due: float | None = None
    for lease_id, seen in state.lease_seen.items():
        allowed = _silence_limit(state, lease_id)
        if now - seen >= allowed:
            stale.append((lease_id, allowed))
        elif fenced and (due is None or seen + allowed < due):
            due = seen + allowed
    events: list[PolicyEvent] = []
    for lease_id, allowed in stale:
        lease = state.leases.get(lease_id)
        silent = now - state.lease_seen[lease_id]
        if lease is None:
            state.lease_seen.pop(lease_id, None)
            continue
        events.append(
            PolicyEvent(
                kind="lease_reclaimed",
                request_id=lease.request_id,
                lease_id=lease_id,
                accelerator=lease.accelerator,
                deployment=lease.deployment,
                workflow_id=lease.workflow_id,
                message=f"holder silent for {silent:.0f} s (limit {allowed:.0f} s)",
                payload={"bytes": lease.bytes},
            )
        )
        events.extend(release_lease(state, lease_id, now, f"reclaimed: holder silent for {silent:.0f} s"))
    if fenced:
        state.stale_due_at = due
    return events


def resident_crashed(
    state: PoolState, key: str, granted_at: float, message: str, now: float, incarnation: int | None = None
) -> list[PolicyEvent]:
    """An invoke found the runtime gone (crashed, or its node worker restarted): the model is no
    longer resident, whatever the last sample said, so no further lease may be granted on it.
    A report about a lease of another incarnation (`incarnation`, the lease's), or older than
    the resident's current load, is about a previous life of the same key and changes nothing.
    The other leases on that life end with it (`lease_reclaimed`, then released): nothing can
    run under them any more, and their ledger rows must not stay open beside the leases of the
    model loaded again under the same key (a holder that goes on is stopped at its next
    heartbeat; its own release later changes nothing). Slots lent to the node are its own to
    give back at its next sync."""
    resident = state.residents.get(key)
    if resident is None or resident.phase != ResidentPhase.READY:
        return []
    if incarnation is not None and incarnation != resident.incarnation:
        return []
    if resident.loaded_at is not None and resident.loaded_at > granted_at:
        return []
    del state.residents[key]
    state.draining.pop(key, None)  # the drain was of this life: a reload under the key is not draining
    events = [
        PolicyEvent(
            kind="resident_lost",
            failure=FailureClass.RUNTIME_CRASH,
            accelerator=resident.accelerator,
            deployment=resident.deployment,
            workflow_id=resident.workflow_id,
            message=f"invoke found the runtime gone: {message}",
        )
    ]
    dead = [
        lease
        for lease in state.leases.values()
        if lease.resident_key == key and lease.incarnation == resident.incarnation and lease.lease_id not in state.slots
    ]
    for lease in dead:
        events.append(
            PolicyEvent(
                kind="lease_reclaimed",
                request_id=lease.request_id,
                lease_id=lease.lease_id,
                accelerator=lease.accelerator,
                deployment=lease.deployment,
                workflow_id=lease.workflow_id,
                message=f"its resident {key} was lost: {message}",
                payload={"bytes": lease.bytes},
            )
        )
        events.extend(release_lease(state, lease.lease_id, now, "reclaimed: its resident was lost"))
    return events


def cancel_request(
    state: PoolState, request_id: str, now: float, reason: str, ended_at: float | None = None
) -> list[PolicyEvent]:
    """The requester gave up (timeout, cancel): drop it from the queue and release any lease
    (its ledger row ending at `ended_at`, when the requester gave up, if it says)."""
    events: list[PolicyEvent] = []
    before = len(state.queue)
    _drop(state, {request_id: True})
    if len(state.queue) != before:
        events.append(PolicyEvent(kind="request_cancelled", request_id=request_id, message=reason))
    for lease_id, _ in lease_index(state).held_for(request_id):
        events.extend(release_lease(state, lease_id, now, f"reclaimed: {reason}", ended_at=ended_at))
    return events


def resident_ready(
    state: PoolState, key: str, measured_bytes: int, now: float, measure: bool = True
) -> list[PolicyEvent]:
    """Loaded (or an adopted residency heard from: `measure` False, its time from adoption to
    its answer is no load time)."""
    resident = state.residents.get(key)
    if resident is None:
        return []
    state.warm_backoff.pop(resident.deployment, None)
    if resident.phase == ResidentPhase.LOADING and measure:
        measured(state, resident.deployment, "load", now - resident.requested_at)
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


def adopt_resident(
    state: PoolState,
    key: str,
    deployment_id: str,
    accelerator_id: str,
    workflow_id: str,
    measured_bytes: int,
    now: float,
) -> list[PolicyEvent] | None:
    """A residency heard loaded that the state does not hold: started by a part of the
    scheduler's history a reset discarded (the reset run hears its reports again), or loaded
    after its resident was dropped. Its card holds the model, so the state does too: a life of
    its own (a new incarnation), loading until the residency answers the scheduler's `adopt`
    with what it is now (loaded, or woken from a sleep the discarded history put it to; an
    unload under way ends it), then served from and unloaded like any resident, and never loaded
    a second time beside itself. None where it cannot be (its deployment or card no longer in
    the pool's catalog, or its key held by another life): the caller unloads it or lets it go."""
    deployment = state.catalog.deployment(deployment_id)
    accelerator = state.catalog.accelerator(accelerator_id)
    if deployment is None or accelerator is None or accelerator.pool != state.pool or key in state.residents:
        return None
    state.incarnations += 1
    resident = ResidentState(
        key=key,
        deployment=deployment_id,
        capability=deployment.capability,
        accelerator=accelerator_id,
        node=accelerator.node,
        bytes=max(deployment.resident_bytes, measured_bytes),
        phase=ResidentPhase.LOADING,
        residency=deployment.residency,
        ttl_s=deployment.ttl_s,
        workflow_id=workflow_id,
        requested_at=now,
        last_used=now,
        incarnation=state.incarnations,
    )
    state.residents[key] = resident
    return [
        resident_event(
            resident,
            "residency_adopted",
            "heard loaded, not held by this run (started by history a reset discarded, or after it was dropped)",
            payload={"bytes": resident.bytes, "measured_bytes": measured_bytes},
        )
    ]


def overdue_loads(
    state: PoolState, now: float, heard_since: dict[str, float] | None = None
) -> tuple[list[str], float | None]:
    """The loading residents whose residency has said nothing within its deployment's
    `load_report_limit_s` since its load was asked (or since `heard_since[key]`, when it was last
    known to be there), to be asked whether they are still there; and when the next is due."""
    overdue: list[str] = []
    due: float | None = None
    heard_since = heard_since or {}
    for resident in state.residents.values():
        if resident.phase != ResidentPhase.LOADING:
            continue
        deployment = state.catalog.deployment(resident.deployment)
        # A deployment the catalog no longer has: the shortest limit any deployment gets.
        limit = deployment.load_report_limit_s if deployment is not None else 300.0
        limit_at = max(resident.requested_at, heard_since.get(resident.key, 0.0)) + limit
        if limit_at <= now:
            overdue.append(resident.key)
        elif due is None or limit_at < due:
            due = limit_at
    return overdue, due


def resident_failed(
    state: PoolState, key: str, failure: FailureClass, message: str, now: float
) -> tuple[list[Reject], list[PolicyEvent]]:
    """A load or its health check failed: the resident goes and whoever waited on it is told why."""
    resident = state.residents.pop(key, None)
    if resident is not None:
        note_outcome(state, resident.capability, failure.value, message, now)
    if resident is not None and resident.residency == Residency.ALWAYS_WARM:
        failures = state.warm_backoff.get(resident.deployment, [0.0, 0.0])[0] + 1
        state.warm_backoff[resident.deployment] = [failures, now + min(600.0, 10.0 * 2 ** (failures - 1))]
    rejects = [Reject(q.request_id, q.workflow_id, failure, message) for q in state.queue if q.assigned_to == key]
    asked = {q.request_id: asked_for(q) for q in state.queue if q.assigned_to == key}
    if rejects:
        _drop(state, {r.request_id: True for r in rejects})
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
            payload={"pool": state.pool, **asked[r.request_id]},
        )
        for r in rejects
    )
    return rejects, events


def resident_unloaded(
    state: PoolState, key: str, reclaimed: bool, message: str, now: float | None = None
) -> list[PolicyEvent]:
    """The node unloaded a resident and checked NVML; `now` (when known) times the unload."""
    resident = state.residents.get(key)
    if resident is None:
        return []
    if now is not None and resident.phase == ResidentPhase.UNLOADING:
        measured(state, resident.deployment, "unload", now - resident.requested_at)
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


def resident_slept(
    state: PoolState, key: str, ok: bool, bytes_after: int, message: str, now: float
) -> list[PolicyEvent]:
    """The node put a resident to sleep (its bytes now what it still holds), or could not (it
    stays awake and ready; making room will unload it instead)."""
    resident = state.residents.get(key)
    if resident is None or resident.phase != ResidentPhase.SLEEPING:
        return []
    if not ok:
        resident.phase = ResidentPhase.READY
        return [resident_event(resident, "sleep_failed", message)]
    measured(state, resident.deployment, "sleep", now - resident.requested_at)
    freed = max(0, resident.bytes - bytes_after)
    resident.awake_bytes = resident.bytes
    resident.bytes = min(resident.bytes, bytes_after)
    resident.phase = ResidentPhase.ASLEEP
    return [resident_event(resident, "resident_asleep", payload={"bytes": resident.bytes, "freed_bytes": freed})]


def resident_woke(state: PoolState, key: str, measured_bytes: int, now: float) -> list[PolicyEvent]:
    """Awake again: ready, its waiters granted on the next pass. (A failed wake is a failed
    load: `resident_failed`.)"""
    resident = state.residents.get(key)
    if resident is None or resident.phase != ResidentPhase.WAKING:
        return []
    measured(state, resident.deployment, "wake", now - resident.requested_at)
    resident.phase = ResidentPhase.READY
    resident.bytes = max(resident.bytes, measured_bytes)
    resident.awake_bytes = None
    resident.last_used = now
    payload: dict[str, str | int | float | bool | None] = {
        "bytes": resident.bytes,
        "wake_s": round(now - resident.requested_at, 3),
    }
    return [resident_event(resident, "resident_awake", payload=payload)]


# How soon a TTL timer looks again at a resident that only free slots lent to its node hold: the
# node gives a free slot back within its idle give-back and next sync (about 10-14 s).
SLOTS_ONLY_RECHECK_S = 5.0


def keep_warm_check(state: PoolState, key: str, now: float) -> float | None:
    """Called when a resident's TTL timer fires. Returns the time to check again (the TTL was
    reset by a later use, or leases are active), or None: unload it now."""
    resident = state.residents.get(key)
    if resident is not None and resident.phase in (ResidentPhase.LOADING, ResidentPhase.SLEEPING, ResidentPhase.WAKING):
        # Asked again once the transition is over (loading: a residency adopted, whose timer
        # fired before it answered, would otherwise be unloaded under the leases granted then).
        return now + resident.ttl_s
    if resident is not None and resident.key in state.draining:
        return now + resident.ttl_s  # an operator's drain unloads it when its last lease ends
    if resident is None or resident.phase not in (ResidentPhase.READY, ResidentPhase.ASLEEP):
        return None
    if resident.residency == Residency.ALWAYS_WARM:
        return now + 3600.0
    if resident.active_leases > 0:
        if resident.active_leases <= free_lent_slots_on(state, resident):
            # Only slots lent to its node hold it: a free one goes back within the node's idle
            # give-back (seconds), and its TTL counts from the last request served on it, so
            # look again soon, not a whole TTL later (the unload would slip by up to that).
            return now + min(resident.ttl_s, SLOTS_ONLY_RECHECK_S)
        return now + resident.ttl_s
    expires = resident.idle_expires_at
    if expires > now:
        return expires
    resident.phase = ResidentPhase.UNLOADING
    resident.requested_at = now
    return None
