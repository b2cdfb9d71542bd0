"""Warm-path delegation: the scheduler lends a node some of a ready resident's concurrency slots,
and the node admits warm requests into them itself, with no scheduler round trip.

A slot is a lease like any other in the pool's state (so concurrency, eviction and the memory
invariant see it), held by the node (`holder_id`) instead of a request. No bytes change hands:
only deployments whose envelope already covers their concurrency (`lease_extra_bytes == 0`) are
delegated. The node syncs with the scheduler about once a second while it holds slots or has
something to report (up to 4 s apart while it has nothing new to say; `sync_slots`): the sync
reports the requests served, says which slots the node still holds and which are in use (by
whom), and asks for slots for the capabilities it was asked for; its reply is the authoritative
list of slots the node may keep.

The scheduler keeps the invariant and the order of classes:
- a slot is closed (the node takes no new request on it and gives it back once free) whenever a
  request waiting at the scheduler may want it, its card or its model's memory (one for the same
  model, or one not yet placed that may land on the card), the card is under GPU_PRESSURE, stale
  or unhealthy, the resident is leaving or draining, or the slot is preempted
  (`closing_reason`); so such a request is overtaken on a node for at most one sync interval.
  Requests waiting for the same model close one free slot each, not every slot
  (`_closed_for_waiters`): they are served as soon, and the node keeps admitting on the rest
  instead of giving back and being lent all of them;
- a slot goes back to the pool only when the node says it no longer holds it (a sync without it),
  or when the node has been silent for stale_lease_s (the node stops using its slots after half
  of that, `SlotReply.valid_s`), so no slot is ever used by two requests at once;
- a node worker that restarts holds nothing: its first sync gives every slot of its previous
  life back."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from modelforge.domain import Catalog, Residency
from modelforge.identifiers import identifier_problem
from modelforge.policy._budget import is_fresh
from modelforge.policy._decisions import PolicyEvent, lease_granted_event, lease_released_event
from modelforge.policy._order import is_production
from modelforge.policy._pass import static_reason
from modelforge.policy._state import (
    DelegatedSlot,
    Lease,
    PoolState,
    QueuedRequest,
    ResidentPhase,
    ResidentState,
    holder_id,
    holder_of,
    note_service,
)
from modelforge.policy._transitions import charge_usage, end_on_resident, note_outcome

SLOT_PREFIX = "slot-"
# A slot's class: none of the catalog's, so the policy never picks one to preempt (closing it
# is how the scheduler takes it back) and fair share never charges a slot, only its requests.
SLOT_CLASS = "delegated"
# Wanted capabilities looked at per sync: a sync's size is bounded whatever a node sends.
MAX_WANTED = 32
MAX_RUNS = 2000
# A run's end is believed at most this long before the sync that reports it: a bound on what a
# node's report can move in the ledger.
MAX_ENDED_AGO_S = 600.0


def is_slot(lease_id: str) -> bool:
    return lease_id.startswith(SLOT_PREFIX)


@dataclass(frozen=True)
class SlotRun:
    """One request a node served on a delegated slot, reported in its next sync."""

    lease_id: str
    request_id: str
    workflow_id: str
    tenant: str
    priority: str
    capability: str
    outcome: str
    invoke_s: float
    message: str = ""
    # From asking the node for a slot to claiming it (what a scheduler grant's waited_s is).
    waited_s: float = 0.0
    # How long before the sync that reports it the run ended (the node's clock): its ledger row
    # ends then, not when the sync arrives (runs of one slot reported together must not overlap).
    ended_ago_s: float = 0.0
    end_user: str = ""  # who the application says asked (SlotClaim's)


@dataclass(frozen=True)
class SlotSync:
    """What a node tells its scheduler at each sync. `held`: every slot it holds, free or in use
    (anything else it was lent, it has given back); `in_use`: slot -> the workflow of the request
    on it, and `in_use_tenants` its tenant (what `status` counts it under until the run is
    reported); `wanted`: capabilities it was asked for and had no free slot for. `boot`: its
    worker process (slots of another life of the node are gone with it)."""

    node: str
    boot: str
    held: list[str] = field(default_factory=list)
    in_use: dict[str, str] = field(default_factory=dict)
    in_use_tenants: dict[str, str] = field(default_factory=dict)
    runs: list[SlotRun] = field(default_factory=list)
    wanted: list[str] = field(default_factory=list)
    view_epoch: int = -1
    # The longest it may wait before its next sync (its idle back-off's ceiling): its vouch for
    # these slots counts this long, and a moment more, when a client asks where to route.
    within_s: float = 0.0


@dataclass(frozen=True)
class SlotReply:
    """The slots the node may keep: `kept` of those it holds (one it holds and is not named here
    is no longer its own) and the ones lent now (`lent`, whole: only new slots cross, so a sync's
    reply stays small whatever the node holds); which of them are closing (no new request; give
    back when free, with the reason); where production classes may run; and for how long this
    answer holds without another. `view`: the catalog's tenants, queues and delegated
    deployments, for the node's own checks, when its `view_epoch` is behind."""

    kept: list[str] = field(default_factory=list)
    lent: list[Lease] = field(default_factory=list)
    closing: dict[str, str] = field(default_factory=dict)
    production_ok: list[str] = field(default_factory=list)
    valid_s: float = 0.0
    view: Catalog | None = None
    view_epoch: int = 0


def closing_reason(
    state: PoolState,
    resident: ResidentState | None,
    lease_id: str,
    now: float,
    memo: dict[str, str] | None = None,
    *,
    waiting_counts: bool = True,
) -> str:
    """Why a slot of `resident` takes no new request (""): the one rule of what a delegated slot
    may still be used for. `memo`: what waits for each resident, found once per sync.
    `waiting_counts=False`: every reason but a request waiting at the scheduler (which
    `_closed_for_waiters` may apply to some of the slots only)."""
    if lease_id in state.preempting:
        return f"preempted: {state.preempting[lease_id]}"
    if resident is None or resident.phase != ResidentPhase.READY:
        return "its model is no longer ready" if resident is None else f"its model is {resident.phase.value}"
    waiting = _waiting_here(state, resident, memo) if waiting_counts else ""
    if waiting:
        # It may need this slot, this card or this model's memory (a lent slot keeps the model
        # from being evicted): the scheduler takes the slots back and decides in class order.
        return f"{waiting} waits at the scheduler"
    if resident.key in state.draining:
        return "its model is draining"
    deployment = state.catalog.deployment(resident.deployment)
    if deployment is None or deployment.lease_extra_bytes or state.catalog.accelerator(resident.accelerator) is None:
        return "its deployment or card left the catalog (or changed)"
    runtime = state.accelerators.get(resident.accelerator)
    if runtime is None or not is_fresh(runtime, state.config, now):
        return f"{resident.accelerator}: no fresh telemetry"
    if not runtime.healthy:
        return f"{resident.accelerator}: UNHEALTHY"
    if runtime.pressure:
        return f"{resident.accelerator}: GPU_PRESSURE"
    return ""


def _waiting_here(state: PoolState, resident: ResidentState, memo: dict[str, str] | None) -> str:
    """A request waiting at the scheduler that may want this resident's slots, its card or its
    memory ("" when none): one for the same model, or one not yet placed that may land on the
    card. Requests waiting on another model's load, or that may not use this card, do not close
    the slots."""
    if memo is not None and resident.key in memo:
        return memo[resident.key]
    first = next(_wanting(state, resident), None)
    found = f"{first[0].capability} ({first[0].priority})" if first is not None else ""
    if memo is not None:
        memo[resident.key] = found
    return found


def sync_slots(state: PoolState, sync: SlotSync, now: float, *, spare: int = 1) -> tuple[SlotReply, list[PolicyEvent]]:
    """One node's sync (module docstring). `spare`: slots of each resident kept back for the
    scheduler's own admissions (requests that did not reach this node's worker). Requests
    waiting at the scheduler for the same model close one free slot each, not every slot of the
    resident (`_closed_for_waiters`)."""
    events = record_runs(state, sync.node, sync.runs[:MAX_RUNS], now)
    held = set(sync.held)
    # Not held any more, or lent to another life of this node's worker (gone with it).
    given_back = [
        lease_id
        for lease_id, slot in state.slots.items()
        if slot.node == sync.node and (lease_id not in held or slot.boot != sync.boot)
    ]
    returned: dict[str, int] = {}  # resident key -> slots given back now (room for what waits)
    for lease_id in given_back:
        given = state.leases.get(lease_id)
        if given is not None and holder_of(state, given) is not None:  # room on its own resident only
            returned[given.resident_key] = returned.get(given.resident_key, 0) + 1
        events.extend(return_slot(state, lease_id, now, "given back by its node"))
    holder = holder_id(sync.node)
    within_s = _said_within(state, sync)
    mine: list[Lease] = []
    for lease_id in sync.held:
        slot = state.slots.get(lease_id)
        lease = state.leases.get(lease_id)
        if slot is None or lease is None or slot.node != sync.node or slot.boot != sync.boot:
            continue  # reclaimed, or another life's: the node drops it
        # The node that holds the slot is alive: it vouches for it (stale_lease_s applies).
        state.lease_seen[lease_id] = now
        state.lease_heard[lease_id] = True
        slot.within_s = within_s
        workflow_id = sync.in_use.get(lease_id, holder)[:300]
        # The request's tenant, if the catalog knows it: `status` counts the slot under it (a
        # tenant sees its own request) until the run is reported; a free slot has none.
        tenant = sync.in_use_tenants.get(lease_id, "") if lease_id in sync.in_use else ""
        tenant = tenant if isinstance(tenant, str) and state.catalog.tenant(tenant) is not None else ""
        if lease.workflow_id != workflow_id or lease.tenant != tenant:  # a preemption reaches the request on it
            lease = replace(lease, workflow_id=workflow_id, tenant=tenant)
            state.leases[lease_id] = lease
        mine.append(lease)
    closing: dict[str, str] = {}
    memo: dict[str, str] = {}
    only = _closed_for_waiters(state, mine, sync, returned)
    for lease in mine:
        slot = state.slots[lease.lease_id]
        if slot.open:
            # None for a slot of a resident's earlier life (lost, loaded again): it closes.
            resident = holder_of(state, lease)
            if resident is not None and lease.resident_key in only:
                # Requests for this same model wait: as many free slots close as they are; the
                # node keeps using the others (any other reason still closes the slot).
                reason = closing_reason(state, resident, lease.lease_id, now, memo, waiting_counts=False)
                if not reason and lease.lease_id in only[lease.resident_key]:
                    reason = f"{_waiting_here(state, resident, memo)} waits at the scheduler" if resident else ""
            else:
                reason = closing_reason(state, resident, lease.lease_id, now, memo)
            if reason:
                slot.open, slot.closed_reason = False, reason
                events.append(_slot_event("slot_closed", lease, reason))
        if not slot.open:
            closing[lease.lease_id] = slot.closed_reason
    lent: list[Lease] = []
    for capability in list(dict.fromkeys(sync.wanted))[:MAX_WANTED]:
        granted = _lend(state, sync.node, sync.boot, capability, now, spare, memo)
        for lease in granted:
            state.slots[lease.lease_id].within_s = within_s
        lent.extend(granted)
        events.extend(_slot_event("slot_lent", lease, "") for lease in granted)
    keys = {lease.resident_key for lease in [*mine, *lent]}
    reply = SlotReply(
        kept=[lease.lease_id for lease in mine],
        lent=lent,
        closing=closing,
        production_ok=sorted(key for key in keys if _production_ok(state, key)),
        valid_s=state.config.stale_lease_s / 2,
        view=admission_view(state, keys) if sync.view_epoch != state.view_epoch else None,
        view_epoch=state.view_epoch,
    )
    return reply, events


def _wanting(state: PoolState, resident: ResidentState) -> Iterator[tuple[QueuedRequest, bool]]:
    """The requests waiting at the scheduler that may want `resident`, in queue order, each with
    whether it is for the resident's own deployment (else it is for another model that may land
    on its card, and so may need its memory). The one home of that rule, for `_waiting_here`
    and `_waiters`."""
    card = state.catalog.accelerator(resident.accelerator)
    for queued in state.queue:
        if queued.assigned_to and queued.assigned_to != resident.key:
            continue
        deployment = state.catalog.deployment_for(queued.capability)
        if deployment is None:
            continue
        if deployment.deployment_id == resident.deployment:
            yield queued, True
        elif card is not None and not static_reason(card, deployment, is_production(state.catalog, queued.priority)):
            yield queued, False


def _waiters(state: PoolState, resident: ResidentState) -> tuple[int, bool]:
    """How many requests wait for `resident`'s own deployment, and whether any waits for another
    model that may need its card's memory (then every slot closes: the model may have to go)."""
    same, other = 0, False
    for _, own in _wanting(state, resident):
        if own:
            same += 1
        else:
            other = True
    return same, other


def _closed_for_waiters(
    state: PoolState, mine: list[Lease], sync: SlotSync, returned: dict[str, int]
) -> dict[str, set[str]]:
    """Resident key -> the slots to close for the requests waiting for that same model, where
    closing only some is enough: one slot per waiting request, counting the closed slots not in
    use (the node gives them back at once) and the slots it gave back in this sync (room the
    scheduler grants next), chosen among the free ones, so a waiting request is
    served after this sync, as when every slot closed (a closed slot the node took meanwhile
    does not count at the next sync: one more free slot closes). A resident absent
    here closes all its slots as before: no request waits for it, one for another model may
    need its card, or fewer slots are free than requests wait (the first slot to end then goes
    back, as before). Taking back every slot for one waiting request made a burst churn: a few
    requests missing the node closed all of its slots, the node gave them back and was lent
    them again at its next sync, hundreds of slot events a second."""
    by_resident: dict[str, list[Lease]] = {}
    for lease in mine:
        if holder_of(state, lease) is not None:  # a slot of an earlier life closes anyway
            by_resident.setdefault(lease.resident_key, []).append(lease)
    chosen: dict[str, set[str]] = {}
    for key, leases in by_resident.items():
        resident = state.residents.get(key)
        if resident is None:
            continue
        same, other = _waiters(state, resident)
        if other or same == 0:
            continue
        closed = sum(
            1 for lease in leases if not state.slots[lease.lease_id].open and lease.lease_id not in sync.in_use
        )
        free = [
            lease.lease_id for lease in leases if state.slots[lease.lease_id].open and lease.lease_id not in sync.in_use
        ]
        need = max(0, same - closed - returned.get(key, 0))
        if len(free) >= need:
            # The last free ones: the node claims the first free slot it holds, so these are the
            # least likely to be taken before this reply arrives.
            chosen[key] = set(free[len(free) - need :])
    return chosen


def _said_within(state: PoolState, sync: SlotSync) -> float:
    """The node's `within_s`, as a number the routing may use: 0 (not said) unless positive
    and finite, and never past the reply's `valid_s` (the slots are not valid longer)."""
    said = sync.within_s
    if not isinstance(said, int | float) or not math.isfinite(said) or said <= 0:
        return 0.0
    return float(min(said, state.config.stale_lease_s / 2))


def _lend(
    state: PoolState, node: str, boot: str, capability: str, now: float, spare: int, memo: dict[str, str]
) -> list[Lease]:
    deployment = state.catalog.deployment_for(capability)
    if deployment is None or deployment.lease_extra_bytes or deployment.gpu_count > 1:
        return []
    if deployment.residency == Residency.NONE:
        return []  # loaded for its requests and gone after: nothing warm to lend
    lent: list[Lease] = []
    for resident in list(state.residents.values()):
        if resident.node != node or resident.deployment != deployment.deployment_id:
            continue
        if closing_reason(state, resident, "", now, memo):
            continue
        free = deployment.concurrency - resident.active_leases - (spare if deployment.concurrency > 1 else 0)
        for _ in range(max(0, free)):
            state.lease_counter += 1
            lease = Lease(
                lease_id=f"{SLOT_PREFIX}{state.lease_counter}",
                request_id=f"{SLOT_PREFIX}{state.lease_counter}",
                workflow_id=holder_id(node),
                capability=capability,
                deployment=deployment.deployment_id,
                accelerator=resident.accelerator,
                node=node,
                resident_key=resident.key,
                bytes=0,
                granted_at=now,
                priority=SLOT_CLASS,
                tenant="",
                heartbeat_s=state.config.stale_lease_s / 3,
                incarnation=resident.incarnation,
            )
            state.leases[lease.lease_id] = lease
            state.lease_seen[lease.lease_id] = now
            state.lease_heard[lease.lease_id] = True
            state.slots[lease.lease_id] = DelegatedSlot(node=node, boot=boot)
            resident.active_leases += 1  # lending is not a use: the requests served on it are
            lent.append(lease)
    return lent


def return_slot(state: PoolState, lease_id: str, now: float, why: str) -> list[PolicyEvent]:
    """A slot back in the pool (its node gave it back, or it was reclaimed): no usage is charged,
    its requests were charged as they ran."""
    state.slots.pop(lease_id, None)
    lease = state.leases.pop(lease_id, None)
    state.lease_seen.pop(lease_id, None)
    state.lease_heard.pop(lease_id, None)
    state.preempting.pop(lease_id, None)
    if lease is None:
        return []
    return [*end_on_resident(state, lease, now, used=False), _slot_event("slot_returned", lease, why)]


def close_slot(state: PoolState, lease_id: str, reason: str) -> list[PolicyEvent]:
    """No new request on this slot (a preemption, or its request failed in a way that ends the
    model): the node hears at its next sync and gives it back once free."""
    slot = state.slots.get(lease_id)
    lease = state.leases.get(lease_id)
    if slot is None or lease is None or not slot.open:
        return []
    slot.open, slot.closed_reason = False, reason
    return [_slot_event("slot_closed", lease, reason)]


def record_runs(state: PoolState, node: str, runs: list[SlotRun], now: float) -> list[PolicyEvent]:
    """Requests served on slots: each charged to its tenant's fair share and counted towards its
    capability's health, with the events (and lease ledger rows) a scheduler-granted request has."""
    events: list[PolicyEvent] = []
    for run in runs:
        slot = state.leases.get(run.lease_id)
        resident = holder_of(state, slot) if slot is not None else None
        note_outcome(state, run.capability, run.outcome, run.message, now)
        if run.outcome == "ok" and slot is not None:
            note_service(state, slot.deployment, run.invoke_s)
        held_s = max(0.0, run.invoke_s)
        charge_usage(state, run.priority, run.tenant, held_s, now)
        ended_at = now - min(max(0.0, run.ended_ago_s), MAX_ENDED_AGO_S)
        if resident is not None:
            # Its keep-warm TTL counts from when this request ended on the node, not the sync.
            resident.last_used = max(resident.last_used, ended_at)
            resident.last_priority = run.priority
        # The run's own lease: the slot's memory, from its claim to its end (a slot gone since
        # leaves what the run said of itself), at the times the node measured.
        granted_at = ended_at - held_s
        lease = Lease(
            lease_id=f"{run.lease_id}/{run.request_id}"[:300],
            request_id=run.request_id,
            workflow_id=run.workflow_id,
            capability=run.capability,
            deployment=slot.deployment if slot is not None else "",
            accelerator=slot.accelerator if slot is not None else "",
            node=node,
            resident_key=slot.resident_key if slot is not None else "",
            bytes=slot.bytes if slot is not None else 0,
            granted_at=granted_at,
            priority=run.priority,
            tenant=run.tenant,
            end_user=run.end_user if identifier_problem("end_user", run.end_user) is None else "",
        )
        events.append(lease_granted_event(state.pool, lease, run.waited_s, delegated=True))
        events.append(
            PolicyEvent(
                kind="invoke" if run.outcome == "ok" else "invoke_failed",
                request_id=run.request_id,
                lease_id=lease.lease_id,
                accelerator=lease.accelerator,
                deployment=lease.deployment,
                workflow_id=run.workflow_id,
                message=run.message or f"on a slot delegated to {node}",
                payload={"invoke_s": round(run.invoke_s, 4), "delegated": True},
            )
        )
        events.append(lease_released_event(state.pool, lease, run.outcome, ended_at, delegated=True))
    return events


def admission_view(state: PoolState, resident_keys: set[str]) -> Catalog:
    """What a node needs to check a request by the scheduler's own rules (identifiers, tenant,
    class, ceiling, queues): the tenants, the queues and the delegated deployments."""
    deployments = {state.residents[key].deployment for key in resident_keys if key in state.residents}
    return Catalog(
        deployments=[d for d in state.catalog.deployments if d.deployment_id in deployments],
        tenants=list(state.catalog.tenants),
        queues=list(state.catalog.queues),
    )


def _production_ok(state: PoolState, resident_key: str) -> bool:
    """Production classes may run on this resident's slots (its card and deployment pass the
    production rules of placement)."""
    resident = state.residents.get(resident_key)
    if resident is None:
        return False
    accelerator = state.catalog.accelerator(resident.accelerator)
    deployment = state.catalog.deployment(resident.deployment)
    return accelerator is not None and deployment is not None and not static_reason(accelerator, deployment, True)


def _slot_event(kind: str, lease: Lease, message: str) -> PolicyEvent:
    return PolicyEvent(
        kind=kind,
        lease_id=lease.lease_id,
        accelerator=lease.accelerator,
        deployment=lease.deployment,
        workflow_id=lease.workflow_id,
        message=message,
        payload={"node": lease.node, "resident": lease.resident_key},
    )
