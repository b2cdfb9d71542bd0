"""Making room: the idle residents to put to sleep or unload, and the lower work to preempt,
for a request that fits nowhere as things are."""

from __future__ import annotations

from dataclasses import dataclass

from modelforge.domain import Deployment, Residency
from modelforge.policy._decisions import Preempt, Sleep, Unload, Wait, WaitReason
from modelforge.policy._order import is_production, may_preempt
from modelforge.policy._pass import DecisionPass
from modelforge.policy._state import (
    Lease,
    PoolState,
    QueuedRequest,
    ResidentPhase,
    ResidentState,
    holder_of,
    operation_seconds,
)


@dataclass(frozen=True)
class Preemption:
    accelerator: str
    preempts: list[Preempt]
    wait: Wait


def preemptible_for(pass_: DecisionPass, queued: QueuedRequest, accelerator: str) -> list[tuple[Lease, int]]:
    """Leases on `accelerator` the asker's class may preempt (past their minimum runtime), in
    preemption order, each with the bytes its end gives back there (its batch runner's too)."""
    state = pass_.state
    found: list[tuple[Lease, int]] = []
    for lease in pass_.preemptible.get(accelerator, []):
        if lease.lease_id in pass_.preempting:
            continue
        if lease.lease_id not in state.preempting and not may_preempt(state.catalog, queued.priority, lease.priority):
            continue
        freed = lease.bytes
        holder = holder_of(state, lease)
        if holder is not None and holder.residency == Residency.NONE and holder.active_leases <= 1:
            freed += holder.bytes
        found.append((lease, freed))
    return found


def preemption_plan(
    pass_: DecisionPass, queued: QueuedRequest, deployment: Deployment, need: int, accelerators: list[str]
) -> Preemption | None:
    """Strictly lower, preemptible work whose leases (and, once idle, residents) make `need` fit:
    on the accelerator needing the fewest new preemptions, then the fewest in all."""
    state = pass_.state
    best: tuple[int, int, str, list[Lease]] | None = None
    if pass_.indexed and state.preempting:
        # Only a card holding work already being stopped can need no new preemption; the best
        # of those, when it needs none, beats every other card (each needs at least one).
        stopping = _stopping_cards(pass_)
        for accelerator in accelerators:
            if accelerator in stopping:
                plan = _plan_on(pass_, queued, deployment, need, accelerator)
                if plan is not None and (best is None or plan[:3] < best[:3]):
                    best = plan
        if best is not None and best[0] != 0:
            best = None
    if best is None:
        for accelerator in accelerators:
            plan = _plan_on(pass_, queued, deployment, need, accelerator)
            if plan is not None and (best is None or plan[:3] < best[:3]):
                best = plan
    if best is None:
        return None
    _, _, accelerator, chosen = best
    pass_.blocked[accelerator] = True
    reason = f"{queued.priority} {queued.capability} needs room on {accelerator}"
    preempts = []
    for lease in chosen:
        if lease.lease_id in state.preempting:
            continue
        pass_.preempting[lease.lease_id] = True
        preempts.append(
            Preempt(lease.lease_id, lease.request_id, lease.workflow_id, reason, state.config.preempt_grace_s)
        )
    waiting = ", ".join(lease.lease_id for lease in chosen)
    making_room = f"making room: preempting lower-class work ({waiting})"
    return Preemption(accelerator, preempts, Wait(queued.request_id, making_room, (WaitReason.MAKING_ROOM,)))


def _plan_on(
    pass_: DecisionPass, queued: QueuedRequest, deployment: Deployment, need: int, accelerator: str
) -> tuple[int, int, str, list[Lease]] | None:
    """`preemption_plan` on one card: (new preemptions, leases stopped, the card, those leases)
    that make `need` fit there, or None."""
    candidates = pass_.preemptible.get(accelerator)
    if not candidates:
        return None
    state = pass_.state
    catalog = state.catalog
    free = pass_.free(accelerator)
    for resident in pass_.evictable.get(accelerator, []):
        if (
            resident.deployment != deployment.deployment_id
            and resident.key not in pass_.evicting
            and resident.key not in pass_.in_use
        ):
            free += resident.bytes
    remaining: dict[str, int] = {}
    chosen: list[Lease] = []
    fresh = 0
    for lease in candidates:
        if free >= need:
            break
        already = lease.lease_id in state.preempting
        if not already and (
            not may_preempt(catalog, queued.priority, lease.priority) or lease.lease_id in pass_.preempting
        ):
            continue
        chosen.append(lease)
        fresh += 0 if already else 1
        free += lease.bytes
        holder = holder_of(state, lease)
        if holder is not None:
            left = remaining.get(holder.key, holder.active_leases) - 1
            remaining[holder.key] = left
            if (
                left <= 0
                and holder.residency != Residency.ALWAYS_WARM
                and holder.deployment != deployment.deployment_id
            ):
                free += holder.bytes
    if free >= need and chosen:
        return (fresh, len(chosen), accelerator, chosen)
    return None


def _stopping_cards(pass_: DecisionPass) -> dict[str, bool]:
    """The cards holding a lease already being preempted (by an earlier pass), once per pass."""
    cached = pass_.memo.get(("stopping",))
    if cached is not None:
        return cached  # type: ignore[return-value]
    leases = pass_.state.leases
    stopping: dict[str, bool] = {}
    for lease_id in pass_.state.preempting:
        lease = leases.get(lease_id)
        if lease is not None:
            stopping.update(dict.fromkeys(lease.accelerators, True))
    pass_.memo[("stopping",)] = stopping
    return stopping


def slot_preemption(pass_: DecisionPass, queued: QueuedRequest, full: list[ResidentState]) -> Preemption | None:
    """A slot on a ready resident of the asked deployment, freed by stopping one lease on it that
    the asker's class may preempt: no load, no bytes to find. A slot already being freed (its
    holder was told to stop in an earlier pass) is waited for rather than freeing another."""
    state = pass_.state
    catalog = state.catalog
    for resident in full:
        for lease in pass_.preemptible.get(resident.accelerator, []):
            if (
                lease.resident_key != resident.key
                or lease.incarnation != resident.incarnation  # a slot of an earlier life frees none here
                or lease.lease_id in pass_.preempting
            ):
                continue
            already = lease.lease_id in state.preempting
            if not already and not may_preempt(catalog, queued.priority, lease.priority):
                continue
            pass_.preempting[lease.lease_id] = True
            reason = f"{queued.priority} {queued.capability} needs a slot of {resident.key}"
            preempts = (
                []
                if already
                else [
                    Preempt(lease.lease_id, lease.request_id, lease.workflow_id, reason, state.config.preempt_grace_s)
                ]
            )
            return Preemption(
                resident.accelerator,
                preempts,
                Wait(
                    queued.request_id,
                    f"making room: preempting {lease.priority} work ({lease.lease_id})",
                    (WaitReason.MAKING_ROOM,),
                ),
            )
    return None


def eviction_plan(
    pass_: DecisionPass, accelerator: str, deployment_id: str, need: int, production: bool
) -> list[tuple[str, bool]] | None:
    """The idle residents whose memory makes `need` fit, as (key, put to sleep rather than
    unloaded). Sleepers first, the cheapest sleep (sleep + wake seconds) first: a model whose
    runtime can sleep gives back all but `sleep_bytes` far more cheaply than an unload and a
    reload (it sleeps only where that is so, by the times measured in this pool, else the
    catalog's). Then unloads, fastest first, then the
    largest, so the fewest models go; if sleeping frees too little, sleepers are unloaded
    instead. A model that last served production is evicted only for production: no other work
    unloads a warm production model (it waits until that model's TTL lets it go). Below
    production, any class may evict an idle model (the README's making-room order, "How it works")."""
    candidates = pass_.evictable.get(accelerator)
    if not candidates:
        return None
    catalog = pass_.state.catalog
    free = pass_.free(accelerator)
    sleepers: list[tuple[float, int, str, int]] = []  # (sleep + wake s, -freed, key, kept bytes)
    others: list[ResidentState] = []
    for resident in candidates:
        if resident.deployment == deployment_id or resident.key in pass_.evicting or resident.key in pass_.in_use:
            continue
        if not production and resident.last_priority is not None and is_production(catalog, resident.last_priority):
            continue
        deployment = catalog.deployment(resident.deployment)
        sleeping = _sleep_cost(pass_.state, deployment) if resident.phase == ResidentPhase.READY else None
        if deployment is not None and deployment.sleep_bytes is not None and sleeping is not None:
            kept = min(resident.bytes, deployment.sleep_bytes)
            sleepers.append((sleeping, kept - resident.bytes, resident.key, kept))
        else:
            others.append(resident)
    sleepers.sort()
    keys: list[str] = []
    asleep_keeps: list[int] = []  # per chosen key: bytes it keeps asleep; -1 if unloaded
    for _, negative_freed, key, kept in sleepers:
        if free >= need:
            break
        keys.append(key)
        asleep_keeps.append(kept)
        free -= negative_freed
    for resident in others:
        if free >= need:
            break
        keys.append(resident.key)
        asleep_keeps.append(-1)
        free += resident.bytes
    for position, kept in enumerate(asleep_keeps):
        if free >= need:
            break
        if kept >= 0:
            asleep_keeps[position] = -1  # unloaded after all: its kept bytes come back too
            free += kept
    if free < need or not keys:
        return None
    return [(key, kept >= 0) for key, kept in zip(keys, asleep_keeps, strict=True)]


def _sleep_cost(state: PoolState, deployment: Deployment | None) -> float | None:
    """Seconds to sleep and wake again, when the model can sleep and that is cheaper than an
    unload and a reload (measured times where seen); else None."""
    if deployment is None or deployment.sleep_bytes is None:
        return None
    sleeping = operation_seconds(state, deployment, "sleep") + operation_seconds(state, deployment, "wake")
    reloading = operation_seconds(state, deployment, "unload") + operation_seconds(state, deployment, "load")
    return sleeping if sleeping < reloading else None


def room_decisions(plan: list[tuple[str, bool]], reason: str) -> list[Unload | Sleep]:
    return [Sleep(key, reason) if sleep else Unload(key, reason) for key, sleep in plan]
