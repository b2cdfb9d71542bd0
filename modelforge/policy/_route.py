"""The route view: what one pool's scheduler answers to the `route` query (`route_info`, one
walk over its residents, leases and queue), how a client picks a pool from the answers
(`choose_pool`, by `route_key`) and which pools the catalog lets a capability be placed in
(`catalog_pools`). Pure, like the rest of the policy: `modelforge/routing.py` does the asking."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from modelforge.domain import Catalog
from modelforge.policy._budget import budget_from_sums, is_fresh
from modelforge.policy._pass import static_filter, static_reason
from modelforge.policy._state import PoolState, ResidentPhase, holder_id, holder_of
from modelforge.policy._views import PoolStatus

# A node holding lent slots says in each sync the longest it may wait before the next (its idle
# back-off's ceiling, 4 s at MODELFORGE_DELEGATION_SYNC_S's default of 1 s); slots not vouched
# for within that and SYNC_LATE_S more (a worker gone quiet) do not make its node the preferred
# one. LENT_SEEN_S: the window for a node that does not say (a release before it did).
LENT_SEEN_S = 5.0
SYNC_LATE_S = 1.0


@dataclass(frozen=True)
class RouteQuery:
    capability: str
    tenant: str = "default"
    # The class asked for (None: the tenant's default): production work needs production cards.
    priority: str | None = None


@dataclass(frozen=True)
class RouteInfo:
    """One pool's answer to `route`: how well it can serve the capability now."""

    pool: str
    # The catalog is loaded (a fresh scheduler reads it first; until then it knows nothing).
    ready: bool = True
    # The pool has an accelerator the deployment may be placed on (whatever the class).
    known: bool = False
    # ...and one the request's class may use (production: production-eligible, measured).
    serves: bool = False
    # Ready instances of the deployment on usable cards, and their free concurrency slots.
    warm: int = 0
    free_slots: int = 0
    # A fresh, healthy card it may use has schedulable bytes for another instance.
    room: bool = False
    # Requests waiting in the pool for this capability, and in all.
    queued: int = 0
    queue_depth: int = 0
    # The node that should take a warm request of the capability ("" when none): one with a
    # ready instance on a fresh card, preferring open slots lent to it (warm-path delegation: its
    # worker admits the request itself), then free concurrency. A client with no route of its
    # own starts the request on that node's task queue. Answers of schedulers before it have none.
    node: str = ""


def _production(catalog: Catalog, tenant: str, priority: str | None) -> bool:
    """Whether the request's class follows the production rules (as far as the route needs to
    know: the scheduler resolves the class for real, and refuses what is wrong with it)."""
    known = catalog.tenant(tenant)
    asked = priority or (known.default_priority if known is not None else "")
    klass = catalog.priority_class(asked)
    if klass is None:
        klass = next((k for k in catalog.classes.values() if k.level == asked), None)
    return klass is not None and klass.production


def route_info(state: PoolState, query: RouteQuery, now: float, *, ready: bool = True) -> RouteInfo:
    """The scheduler's `route` query: one walk over the pool's residents, leases and queue."""
    pool = state.pool
    if not ready:
        return RouteInfo(pool=pool, ready=False)
    deployment = state.catalog.deployment_for(query.capability)
    if deployment is None:
        return RouteInfo(pool=pool)
    if not static_filter(state, deployment, False)[0]:
        return RouteInfo(pool=pool)
    production = _production(state.catalog, query.tenant, query.priority)
    usable = set(static_filter(state, deployment, production)[0])
    queued = sum(1 for q in state.queue if q.capability == query.capability)
    if not usable:
        return RouteInfo(pool=pool, known=True, queued=queued, queue_depth=len(state.queue))

    def fresh(accelerator: str) -> bool:
        runtime = state.accelerators.get(accelerator)
        return runtime is not None and runtime.healthy and is_fresh(runtime, state.config, now)

    warm = free = 0
    resident_sum: dict[str, int] = {}
    # The best node for a warm request so far, by `_node_key`.
    best: tuple[bool, bool, int, str] | None = None
    lent: dict[str, int] | None = None
    for resident in state.residents.values():
        resident_sum[resident.accelerator] = resident_sum.get(resident.accelerator, 0) + resident.bytes
        if (
            resident.deployment == deployment.deployment_id
            and resident.phase == ResidentPhase.READY
            and resident.accelerator in usable
            and fresh(resident.accelerator)
        ):
            warm += 1
            spare = max(0, deployment.concurrency - resident.active_leases)
            free += spare
            if resident.key in state.draining:
                continue  # takes no new lease: no node to send requests to
            if lent is None:
                lent = _open_lent_slots(state, now)
            key = _node_key(resident.node, lent.get(resident.key, 0), spare)
            best = key if best is None or key < best else best
    room = False
    if not free:  # the choice never looks at room when a slot is free
        leased_sum: dict[str, int] = {}
        for lease in state.leases.values():
            for accelerator_id in lease.accelerators:
                leased_sum[accelerator_id] = leased_sum.get(accelerator_id, 0) + lease.bytes
        cards = 0
        for accelerator in state.catalog.accelerators:
            if accelerator.id not in usable or not fresh(accelerator.id):
                continue
            budget = budget_from_sums(
                accelerator,
                state.accelerators[accelerator.id],
                resident_sum.get(accelerator.id, 0),
                leased_sum.get(accelerator.id, 0),
                state.config,
                now,
            )
            if budget.schedulable_bytes >= deployment.envelope_bytes:
                cards += 1
                if cards >= max(1, deployment.gpu_count):
                    room = True
                    break
    return RouteInfo(
        pool=pool,
        known=True,
        serves=True,
        warm=warm,
        free_slots=free,
        room=room,
        queued=queued,
        queue_depth=len(state.queue),
        node=best[-1] if best is not None else "",
    )


def _open_lent_slots(state: PoolState, now: float) -> dict[str, int]:
    """Resident key -> slots lent to its node that are open and free (held by the node, not by a
    request), of nodes that vouched for them within the time they said (LENT_SEEN_S if unsaid)."""
    counts: dict[str, int] = {}
    for lease_id, slot in state.slots.items():
        lease = state.leases.get(lease_id)
        if (
            lease is not None
            and slot.open
            and lease.workflow_id == holder_id(slot.node)
            and now - state.lease_seen.get(lease_id, -math.inf) <= _vouch_window(slot.within_s)
            and holder_of(state, lease) is not None  # a slot of a resident's earlier life serves none
        ):
            counts[lease.resident_key] = counts.get(lease.resident_key, 0) + 1
    return counts


def _vouch_window(within_s: float) -> float:
    return within_s + SYNC_LATE_S if within_s > 0 else LENT_SEEN_S


def _node_key(node: str, lent: int, spare: int) -> tuple[bool, bool, int, str]:
    """Smaller is better: open lent slots, then free concurrency, then the most of both, by name."""
    return (not lent, not spare, -(lent + spare), node)


def route_key(info: RouteInfo) -> tuple[bool, bool, bool, int, int, str]:
    """Smaller is better: warm with a free slot, warm, room to load, fewest queued, by name."""
    return (
        not (info.warm and info.free_slots > 0),
        not info.warm,
        not info.room,
        info.queued,
        info.queue_depth,
        info.pool,
    )


def choose_pool(infos: Sequence[RouteInfo]) -> str | None:
    """The pool for the request, or None when no pool serves the capability. Pools that serve it
    for the request's class first; else one that knows it (its scheduler then says why the class
    cannot have it, card by card); else a pool still loading its catalog (the admission retries
    until it has it)."""
    for eligible in (
        [i for i in infos if i.serves],
        [i for i in infos if i.known],
    ):
        if eligible:
            return min(eligible, key=route_key).pool
    loading = sorted(i.pool for i in infos if not i.ready)
    return loading[0] if loading else None


def catalog_pools(catalog: Catalog, capability: str) -> set[str]:
    """The pools the catalog lets the capability's deployment be placed in (whatever the class:
    its scheduler says card by card why a class cannot have it; a CPU device only when the
    deployment's placement list names it, as the policy's static filter has it)."""
    deployment = catalog.deployment_for(capability)
    if deployment is None:
        return set()
    return {card.pool for card in catalog.accelerators if not static_reason(card, deployment, False)}


def merge_statuses(statuses: Sequence[PoolStatus]) -> PoolStatus:
    """Several pools' status as one: every accelerator and resident, queues and leases summed.
    `pool` lists the pools, comma-separated."""
    if len(statuses) == 1:
        return statuses[0]
    depth: dict[str, int] = {}
    classes: list[str] = []
    for status in statuses:
        for name, count in status.queue_depth.items():
            depth[name] = depth.get(name, 0) + count
        classes += [c for c in status.classes if c not in classes]
    return PoolStatus(
        pool=",".join(s.pool for s in statuses),
        now=max((s.now for s in statuses), default=0.0),
        accelerators=[a for s in statuses for a in s.accelerators],
        residents=[r for s in statuses for r in s.residents],
        queue_depth=depth,
        active_leases=sum(s.active_leases for s in statuses),
        capabilities=[c for s in statuses for c in s.capabilities],
        classes=classes,
        lent_slots=sum(s.lent_slots for s in statuses),
        tenant_leases=_summed([s.tenant_leases for s in statuses]),
        tenant_queue_depth={
            tenant: _summed([s.tenant_queue_depth.get(tenant, {}) for s in statuses])
            for tenant in dict.fromkeys(t for s in statuses for t in s.tenant_queue_depth)
        },
        catalog_loading=any(s.catalog_loading for s in statuses),
    )


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for one in counts:
        for name, count in one.items():
            total[name] = total.get(name, 0) + count
    return total
