"""Multi-GPU batch jobs (gangs): all-or-nothing placement on the topology, making room for
them, and reservations with backfill while they wait."""

from __future__ import annotations

from modelforge.domain import Accelerator, Deployment
from modelforge.failures import FailureClass
from modelforge.policy._decisions import Grant, Preempt, Reject, Sleep, Unload, Wait
from modelforge.policy._order import is_production
from modelforge.policy._pass import IDLE_RUNTIME, DecisionPass, filtered_accelerators, idle_residents, new_lease
from modelforge.policy._queue_index import queue_index
from modelforge.policy._reservation import Reservation, choose_reserved, free_at, freed_by, release_timeline
from modelforge.policy._room import Preemption, eviction_plan, preemptible_for, room_decisions
from modelforge.policy._state import Lease, QueuedRequest, ResidentPhase, operation_seconds
from modelforge.policy._topology import GangShape, choose_gang


def place_gang(
    pass_: DecisionPass, queued: QueuedRequest, deployment: Deployment, now: float, counter: int
) -> Grant | Reject | Wait | list[Unload | Sleep] | Preemption:
    """A multi-GPU batch job, all or nothing: `gpu_count` accelerators that each have the job's
    bytes schedulable, inside one NVLink group when the job requires it, else on as few nodes as
    possible; best fit (least left over) among the candidates. Nothing stays resident: the lease
    is the whole job. A waiting gang drains nothing: holding back a node for days (the Alibaba
    trace's jobs run that long) timed out 1,577 other jobs in simulation, so a stream of small
    jobs can still delay a gang (reservations with backfill are the next step)."""
    state = pass_.state
    load_s = operation_seconds(state, deployment, "load")  # measured here, else the catalog's
    count = deployment.gpu_count
    need = deployment.envelope_bytes
    production = is_production(pass_.state.catalog, queued.priority)
    passed, refused = filtered_accelerators(pass_, deployment, production)
    catalog = state.catalog
    groups: dict[str, list[str]] = {}
    for accelerator in passed:
        acc = catalog.accelerator(accelerator)
        assert acc is not None
        key = acc.nvlink_group if deployment.nvlink_required else acc.node
        if deployment.nvlink_required and not key:
            continue
        groups.setdefault(key, []).append(accelerator)
    # Could it ever fit, with every ModelForge byte gone? Only the card sizes and reserves count.
    budgets = pass_.budgets
    possible = [
        members
        for members in groups.values()
        if sum(1 for a in members if need <= budgets[a].total_bytes - budgets[a].reserve_bytes) >= count
    ]
    if deployment.nvlink_required and not possible:
        detail = "; ".join(f.reason for f in refused[:3])
        return Reject(
            queued.request_id,
            queued.workflow_id,
            FailureClass.CAPABILITY_UNAVAILABLE if not groups else FailureClass.INSUFFICIENT_SCHEDULABLE_VRAM,
            f"no NVLink group has {count} eligible accelerators with {need} B each"
            + (f" ({detail})" if detail else ""),
        )
    shape = GangShape.of(deployment)
    topology = {a: acc for a in passed if (acc := catalog.accelerator(a)) is not None}
    if not deployment.nvlink_required and sum(len(m) for m in possible) < count:
        ever = sum(1 for a in passed if need <= budgets[a].total_bytes - budgets[a].reserve_bytes)
        if ever < count:
            return Reject(
                queued.request_id,
                queued.workflow_id,
                FailureClass.INSUFFICIENT_SCHEDULABLE_VRAM,
                f"needs {count} accelerators with {need} B each; the pool has {ever}",
            )
    if not deployment.nvlink_required:
        # Could its shape ever be satisfied, with every card empty? Else refuse now, with why.
        empty = [(0, a) for a in passed if need <= budgets[a].total_bytes - budgets[a].reserve_bytes]
        if choose_gang(empty, shape, topology) is None:
            return Reject(
                queued.request_id,
                queued.workflow_id,
                FailureClass.INSUFFICIENT_SCHEDULABLE_VRAM,
                f"no placement in the pool satisfies {shape.describe()} with {need} B each",
            )
    if queued.deadline_at is not None and now + load_s > queued.deadline_at:
        return Reject(
            queued.request_id,
            queued.workflow_id,
            FailureClass.DEADLINE_CANNOT_BE_MET,
            f"starting {deployment.deployment_id} takes {load_s:.1f} s; the deadline is in "
            f"{queued.deadline_at - now:.1f} s",
        )

    def fitting(members: list[str], evicting: bool, preempting: bool = False) -> list[tuple[int, str]]:
        """(bytes left over, accelerator) where the job fits now, or (`evicting`) once the idle
        residents there are unloaded, or (`preempting`) once the work it may preempt has gone too."""
        room = []
        for accelerator in members:
            if accelerator in pass_.blocked or not budgets[accelerator].fresh:
                continue
            if not production and state.accelerators.get(accelerator, IDLE_RUNTIME).pressure:
                continue
            if pass_.reservations and pass_.reserved_refusal(accelerator, queued, need, False, now, load_s):
                continue
            free = pass_.free(accelerator)
            if evicting or preempting:
                free += sum(r.bytes for r in idle_residents(pass_, accelerator, production))
            if preempting:
                # Ranked by the bytes of work newly stopped for it: cards whose work is already
                # being preempted (by an earlier pass) first, so passes do not spread the damage.
                stoppable = preemptible_for(pass_, queued, accelerator)
                free += sum(freed for lease, freed in stoppable if lease.lease_id in state.preempting)
                fresh = 0
                for lease, freed in stoppable:
                    if free >= need:
                        break
                    if lease.lease_id not in state.preempting:
                        free += freed
                        fresh += freed
                if need <= free:
                    room.append((fresh, accelerator))
                continue
            if need <= free:
                room.append((free - need, accelerator))
        room.sort()
        return room

    def select(evicting: bool, preempting: bool = False) -> list[str] | None:
        if not deployment.nvlink_required:
            # One node if it fits there, else one rack, else the pool (as the shape allows).
            return choose_gang(fitting(passed, evicting, preempting), shape, topology)
        best: tuple[int, str, list[str]] | None = None
        for key, members in groups.items():
            room = fitting(members, evicting, preempting)
            if len(room) >= count:
                leftover = sum(left for left, _ in room[:count])
                if best is None or (leftover, key) < best[:2]:
                    best = (leftover, key, [a for _, a in room[:count]])
        return None if best is None else best[2]

    picked = select(evicting=False)
    if picked is None and pass_.evictable:
        # Making room as a single request does: the idle residents in the way go first.
        room_after = select(evicting=True)
        plans = [eviction_plan(pass_, a, deployment.deployment_id, need, production) or [] for a in room_after or []]
        if room_after is not None and any(plans):
            unloads = []
            for accelerator, plan in zip(room_after, plans, strict=True):
                pass_.blocked[accelerator] = True
                for key, _ in plan:
                    pass_.evicting[key] = True
                unloads.extend(room_decisions(plan, f"making room for {queued.capability} ({queued.priority})"))
            return unloads
    if picked is None and pass_.preemptible:
        # Then preemption of work its class may preempt, on the cards needing the least of it.
        room_after = select(evicting=True, preempting=True)
        if room_after is not None:
            preemption = _preempt_for_gang(pass_, queued, room_after, need, production)
            if preemption is not None:
                return preemption
    if picked is None:
        where = "in one NVLink group" if deployment.nvlink_required else f"for {shape.describe()}"
        waiting = f"gang of {count} x {need} B: not enough room {where} yet"
        reserved = (
            _reserve_for_gang(
                pass_, queued, deployment, passed, groups if deployment.nvlink_required else None, shape, topology, now
            )
            if state.config.gang_reservations
            else ""
        )
        return Wait(queued.request_id, f"{waiting}; {reserved}" if reserved else waiting)
    best = (0, "", picked)
    chosen = best[2]
    for accelerator in chosen:
        pass_.commit(accelerator, need)
        pass_.take_reserved(accelerator, queued, need, False, now, load_s)
    first = catalog.accelerator(chosen[0])
    assert first is not None
    lease = new_lease(pass_, queued, deployment, chosen, first.node, "", need, now, counter)
    return Grant(queued.request_id, queued.workflow_id, lease)


def _preempt_for_gang(
    pass_: DecisionPass, queued: QueuedRequest, accelerators: list[str], need: int, production: bool
) -> Preemption | None:
    """On each chosen card, as little preemption as makes the gang's bytes fit with the idle
    residents gone too (their unloads follow on the next pass)."""
    state = pass_.state
    preempts: list[Preempt] = []
    stopping: list[str] = []
    reason = f"{queued.priority} {queued.capability} (a gang) needs room on {', '.join(sorted(accelerators))}"
    for accelerator in accelerators:
        free = pass_.free(accelerator) + sum(r.bytes for r in idle_residents(pass_, accelerator, production))
        # A gang lease stopped for an earlier card frees this one too.
        free += sum(
            lease.bytes for lease in state.leases.values() if lease.lease_id in stopping and accelerator in lease.gang
        )
        for lease, freed in preemptible_for(pass_, queued, accelerator):
            if free >= need:
                break
            free += freed
            pass_.preempting[lease.lease_id] = True
            stopping.append(lease.lease_id)
            if lease.lease_id not in state.preempting:
                preempts.append(
                    Preempt(lease.lease_id, lease.request_id, lease.workflow_id, reason, state.config.preempt_grace_s)
                )
        if free < need:
            return None
        pass_.blocked[accelerator] = True
    if not stopping:
        return None
    return Preemption(
        accelerators[0],
        preempts,
        Wait(queued.request_id, f"making room: preempting lower-class work ({', '.join(stopping)})"),
    )


def _reserve_for_gang(
    pass_: DecisionPass,
    queued: QueuedRequest,
    deployment: Deployment,
    passed: list[str],
    nvlink_groups: dict[str, list[str]] | None,
    shape: GangShape,
    topology: dict[str, Accelerator],
    now: float,
) -> str:
    """Reserve the accelerators where this waiting gang can start soonest, when the work there
    has known end times and it would start before its own lease timeout and deadline; returns
    what was reserved, or "" (nothing can be promised)."""
    state = pass_.state
    # Whether a reservation is made depends on this request's own lease timeout and deadline:
    # its wait is never reused for the rest of its capability.
    pass_.duration_sensitive = True
    need = deployment.envelope_bytes
    production = is_production(state.catalog, queued.priority)
    on: dict[str, list[Lease]] = {}
    for lease in state.leases.values():
        for accelerator in lease.accelerators:
            on.setdefault(accelerator, []).append(lease)
    # Lease bytes promised to requests waiting on a load: back when their work ends. Residents
    # being unloaded: back once the unload is done.
    promised: dict[str, list[tuple[float, int]]] = {}
    for resident in state.residents.values():
        if resident.phase == ResidentPhase.UNLOADING:
            unloading = state.catalog.deployment(resident.deployment)
            done = now + (operation_seconds(state, unloading, "unload") if unloading is not None else 0.0)
            promised.setdefault(resident.accelerator, []).append((done, resident.bytes))
    if pass_.reserved:
        by_id = queue_index(state).by_id
        for request_id, held in pass_.reserved.items():
            waiting = by_id.get(request_id)
            holder = state.residents.get(waiting.assigned_to) if waiting is not None else None
            if waiting is None or holder is None or waiting.max_duration_s is None:
                continue
            loading = state.catalog.deployment(holder.deployment)
            start = now + (
                operation_seconds(state, loading, "load")
                if loading is not None and holder.phase == ResidentPhase.LOADING
                else 0.0
            )
            promised.setdefault(holder.accelerator, []).append((start + waiting.max_duration_s, held))
    timelines: dict[str, list[tuple[float, int]]] = {}
    ready_at: dict[str, float] = {}
    for accelerator in passed:
        if accelerator in pass_.blocked or accelerator in pass_.reservations or not pass_.budgets[accelerator].fresh:
            continue
        if not production and state.accelerators.get(accelerator, IDLE_RUNTIME).pressure:
            continue
        coming = promised.get(accelerator, [])
        for idle in idle_residents(pass_, accelerator, production):
            # Unloaded to make room when the gang's time comes (as it does when it fits now).
            unloading = state.catalog.deployment(idle.deployment)
            coming = [
                *coming,
                (now + (operation_seconds(state, unloading, "unload") if unloading is not None else 0.0), idle.bytes),
            ]
        timeline = release_timeline(on.get(accelerator, []), state.residents, now, coming)
        timelines[accelerator] = timeline
        ready_at[accelerator] = free_at(pass_.free(accelerator), timeline, need, now)
    chosen = choose_reserved(ready_at, deployment.gpu_count, shape, topology, nvlink_groups)
    if chosen is None:
        return ""
    starts_at, accelerators = chosen
    latest = queued.lease_timeout_at if queued.deadline_at is None else min(queued.lease_timeout_at, queued.deadline_at)
    if starts_at + operation_seconds(state, deployment, "load") >= latest:
        return ""
    for accelerator in accelerators:
        spare = pass_.free(accelerator) + freed_by(timelines[accelerator], starts_at) - need
        pass_.reservations[accelerator] = Reservation(queued.request_id, starts_at, max(0, spare))
    return (
        f"reserved {', '.join(sorted(accelerators))} from {starts_at - now:.0f} s on (backfill: work that ends by then)"
    )
