"""One decision pass: walk the queue in order and place each request in phases, in the spirit of
the Kubernetes scheduler framework: filter (each accelerator accepted or rejected with a reason),
score (join a ready resident > join a loading one > load), choose (best fit), and make room
(evict the cheapest idle residents) when nothing fits.

`decide` is pure: it reads the state and returns decision objects. It is also the hot path of the
scheduler workflow, so it is built to stay near-linear in the queue and the pool:

- everything the pass needs per accelerator (budget, evictable residents, always_warm bytes) is
  computed once, grouped in one walk over residents and leases;
- the static filter (placement list, production eligibility, measured envelope) is computed once
  per (deployment, class) and pass; health is the only per-pass filter;
- a pass only ever consumes capacity, so once an unplaced request of a deployment has to wait
  (or can never fit), every later request of that deployment and the same filter outcome would
  too: its outcome is reused rather than recomputed;
- wait reasons are summarised per kind of reason, never one line per accelerator;
- the queue is walked through an index kept across passes (`_queue_index.py`): a lane of
  requests that would only be told, again, the reason they already wait for is passed over whole.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator

from modelforge.domain import Deployment, Residency, fair_share_entity, resident_key
from modelforge.failures import FailureClass
from modelforge.policy._decisions import Assign, Decisions, Grant, Preempt, Reject, Sleep, StartLoad, Unload, Wait, Wake
from modelforge.policy._gang import place_gang
from modelforge.policy._order import class_rank, fair_share_scores, is_production, ordered_buckets, production_ranks
from modelforge.policy._pass import (
    IDLE_RUNTIME,
    DecisionPass,
    FilterResult,
    Reasons,
    filter_accelerators,
    filtered_accelerators,
    grant_on,
    is_evictable,
    start_pass,
)
from modelforge.policy._queue_index import Lane, queue_index
from modelforge.policy._room import Preemption, eviction_plan, preemption_plan, room_decisions, slot_preemption
from modelforge.policy._state import PoolState, QueuedRequest, ResidentPhase, ResidentState, operation_seconds

__all__ = ["FilterResult", "decide", "decide_each", "filter_accelerators", "silent_nodes_due"]


def decide(state: PoolState, now: float) -> Decisions:
    return decide_each(state, now, reuse_settled=True)


def decide_each(state: PoolState, now: float, reuse_settled: bool) -> Decisions:
    """`decide`, and with `reuse_settled=False` the reference it must agree with: every request
    placed on its own, no outcome reused (the property tests compare the two)."""
    pass_ = start_pass(state, now)
    decisions = Decisions()
    counter = state.lease_counter
    # Per capability: its deployment and the outcome an unplaced request of it settled on in this
    # pass, one table for production requests and one for the rest (their filters differ).
    deployments: dict[str, Deployment | None] = {}
    settled_production: dict[str, tuple[FailureClass, str] | tuple[None, str]] = {}
    settled_other: dict[str, tuple[FailureClass, str] | tuple[None, str]] = {}
    if reuse_settled:
        counter = _decide_queue(pass_, decisions, settled_production, settled_other, now, counter)
    for bucket in [] if reuse_settled else ordered_buckets(state, now):
        # A bucket holds one class, so one settled table serves all of it.
        settled_by = settled_production if is_production(state.catalog, bucket[0].priority) else settled_other
        for queued in bucket:
            counter = _visit(pass_, decisions, queued, settled_by, deployments, now, counter, reuse_settled=False)

    _keep_always_warm(pass_, decisions, now)

    # An UNHEALTHY accelerator's work is preempted and requeued elsewhere (the filter keeps it
    # off that accelerator), and its idle residents go.
    if pass_.unhealthy:
        for lease in state.leases.values():
            if lease.lease_id in state.preempting:
                continue
            sick = [a for a in lease.accelerators if a in pass_.unhealthy]
            if sick:
                decisions.preemptions.append(
                    Preempt(
                        lease.lease_id,
                        lease.request_id,
                        lease.workflow_id,
                        f"{sick[0]} is UNHEALTHY",
                        state.config.preempt_grace_s,
                    )
                )
        for resident in state.residents.values():
            if (
                resident.accelerator in pass_.unhealthy
                and is_evictable(resident)
                and resident.key not in pass_.evicting
                and resident.key not in pass_.in_use
            ):
                pass_.evicting[resident.key] = True
                decisions.unloads.append(Unload(resident.key, f"{resident.accelerator} is UNHEALTHY"))

    _preempt_on_silent_nodes(pass_, decisions, now)
    if state.config.unload_removed_deployments:
        _unload_removed(pass_, decisions)

    # load_on_demand and batch residents go when their last lease has ended and nobody waits.
    waiting_on = {a.resident_key: True for a in decisions.assigns}
    for queued in queue_index(state).assigned.values():
        waiting_on[queued.assigned_to] = True
    granted_on = {g.lease.resident_key: True for g in decisions.grants}
    for resident in state.residents.values():
        if (
            resident.residency in (Residency.LOAD_ON_DEMAND, Residency.NONE)
            and is_evictable(resident)
            and resident.key not in pass_.evicting
            and resident.key not in waiting_on
            and resident.key not in granted_on
        ):
            decisions.unloads.append(Unload(resident.key, "last lease ended (load_on_demand)"))
    return decisions


def _unload_removed(pass_: DecisionPass, decisions: Decisions) -> None:
    """A resident whose deployment or accelerator is no longer in the catalog goes as soon as it
    is idle, whatever its residency: nothing may be granted on it, so an `always_warm` one would
    otherwise pin its memory, unevictable, forever."""
    catalog = pass_.state.catalog
    for resident in pass_.state.residents.values():
        known = catalog.deployment(resident.deployment) is not None
        if known and catalog.accelerator(resident.accelerator) is not None:
            continue
        if (
            resident.phase in (ResidentPhase.READY, ResidentPhase.ASLEEP)
            and resident.active_leases == 0
            and resident.key not in pass_.evicting
            and resident.key not in pass_.in_use
        ):
            pass_.evicting[resident.key] = True
            decisions.unloads.append(Unload(resident.key, "removed from the catalog"))


Settled = dict[str, tuple[FailureClass, str] | tuple[None, str]]


def _decide_queue(
    pass_: DecisionPass,
    decisions: Decisions,
    settled_production: Settled,
    settled_other: Settled,
    now: float,
    counter: int,
) -> int:
    """The queue in order (class, fair-share score, submission time, request id), walked through
    its index: lanes of one class, tenant and capability, merged by submission time where several
    share a (class, score). Once a capability has settled on waiting in this pass, a lane of it
    whose every request already carries that reason (none expired, none waiting on a load) is
    passed over whole: it would decide nothing. Everything else is decided request by request,
    exactly as `decide_each(..., reuse_settled=False)` orders it; the property tests compare."""
    state = pass_.state
    catalog = state.catalog
    scores = fair_share_scores(state, now)
    production = production_ranks(catalog)
    groups: dict[tuple[int, float], list[Lane]] = {}
    for lane in queue_index(state).lanes.values():
        key = (class_rank(catalog, lane.priority), -scores.get(fair_share_entity(lane.priority, lane.tenant), 0.0))
        group = groups.get(key)
        if group is None:
            groups[key] = [lane]
        else:
            group.append(lane)
    deployments: dict[str, Deployment | None] = {}
    for key in sorted(groups):
        lanes = groups[key]
        settled_by = settled_production if key[0] in production else settled_other
        walk = _single(lanes[0], settled_by, now) if len(lanes) == 1 else _merged(lanes, settled_by, now)
        for queued in walk:
            counter = _visit(pass_, decisions, queued, settled_by, deployments, now, counter, reuse_settled=True)
    return counter


def _visit(
    pass_: DecisionPass,
    decisions: Decisions,
    queued: QueuedRequest,
    settled_by: Settled,
    deployments: dict[str, Deployment | None],
    now: float,
    counter: int,
    reuse_settled: bool,
) -> int:
    """One queued request's outcome in this pass; returns the lease counter after it."""
    if now >= queued.lease_timeout_at or (queued.deadline_at is not None and now >= queued.deadline_at):
        decisions.rejects.append(_expired(queued, now))
        return counter
    capability = queued.capability
    if reuse_settled and not queued.assigned_to:
        settled = settled_by.get(capability)
        if settled is not None:
            # The hot path on a busy pool: most of the queue waits behind its head.
            if settled[0] is None:
                if queued.waiting_reason != settled[1]:
                    decisions.waits.append(Wait(queued.request_id, settled[1]))
            else:
                decisions.rejects.append(Reject(queued.request_id, queued.workflow_id, *settled))
            return counter
    if capability in deployments:
        deployment = deployments[capability]
    else:
        deployment = deployments[capability] = pass_.state.catalog.deployment_for(capability)
    if deployment is None:
        decisions.rejects.append(
            Reject(
                queued.request_id,
                queued.workflow_id,
                FailureClass.CAPABILITY_UNAVAILABLE,
                f"{capability} was removed from the catalog",
            )
        )
        return counter
    return _decide_one(pass_, decisions, queued, deployment, settled_by, now, counter)


def _skippable(lane: Lane, settled_by: Settled, now: float) -> bool:
    settled = settled_by.get(lane.capability)
    return settled is not None and settled[0] is None and lane.uniformly_waiting(settled[1], now)


def _single(lane: Lane, settled_by: Settled, now: float) -> Iterator[QueuedRequest]:
    capability = lane.capability
    items = iter(lane.items)
    # Until the capability settles, request by request; once it has (it stays so for the pass),
    # the lane is skipped whole or walked to the end.
    for queued in items:
        settled = settled_by.get(capability)
        if settled is not None:
            if settled[0] is None and lane.uniformly_waiting(settled[1], now):
                return
            yield queued
            yield from items
            return
        yield queued


def _merged(lanes: list[Lane], settled_by: Settled, now: float) -> Iterator[QueuedRequest]:
    """Requests of several lanes in submission order; a lane leaves once it is skippable."""
    heads = [(lane.items[0].submitted_at, lane.items[0].request_id, n, 0) for n, lane in enumerate(lanes)]
    heapq.heapify(heads)
    while heads:
        _, _, n, position = heapq.heappop(heads)
        lane = lanes[n]
        if _skippable(lane, settled_by, now):
            continue
        yield lane.items[position]
        position += 1
        if position < len(lane.items):
            following = lane.items[position]
            heapq.heappush(heads, (following.submitted_at, following.request_id, n, position))


def _preempt_on_silent_nodes(pass_: DecisionPass, decisions: Decisions, now: float) -> None:
    """Leases on an accelerator whose node has said nothing for `node_silent_s` are preempted:
    whatever runs there is out of sight, and its holder should stop and requeue rather than keep
    a lease nobody can verify. (Nothing new lands there meanwhile: the accelerator is stale.)"""
    state = pass_.state
    limit = state.config.node_silent_s
    asked = {p.lease_id: True for p in decisions.preemptions}
    for lease in state.leases.values():
        if lease.lease_id in state.preempting or lease.lease_id in asked:
            continue
        for accelerator in lease.accelerators:
            observation = state.accelerators.get(accelerator, IDLE_RUNTIME).observation
            if observation is None or now - observation.received_at < limit:
                continue
            decisions.preemptions.append(
                Preempt(
                    lease.lease_id,
                    lease.request_id,
                    lease.workflow_id,
                    f"{accelerator}: node silent for {now - observation.received_at:.0f} s",
                    state.config.preempt_grace_s,
                )
            )
            break


def silent_nodes_due(state: PoolState) -> float | None:
    """When the next lease's node will have been silent for `node_silent_s` if it says nothing
    more: the scheduler wakes then, so the rule above acts on time, not at the next reconcile."""
    limit = state.config.node_silent_s
    if limit == math.inf:
        return None
    due: float | None = None
    for lease in state.leases.values():
        if lease.lease_id in state.preempting:
            continue
        for accelerator in lease.accelerators:
            observation = state.accelerators.get(accelerator, IDLE_RUNTIME).observation
            if observation is not None:
                at = observation.received_at + limit
                due = at if due is None else min(due, at)
    return due


def _keep_always_warm(pass_: DecisionPass, decisions: Decisions, now: float) -> None:
    """always_warm deployments are loaded when the pool starts and again after a loss, without a
    request asking: on the best-fitting eligible accelerator with room, never by evicting or
    preempting anything, and with backoff after failed loads."""
    state = pass_.state
    starting = {load.deployment: True for load in decisions.loads}
    for deployment in state.catalog.deployments:
        if deployment.residency != Residency.ALWAYS_WARM or deployment.deployment_id in starting:
            continue
        if pass_.residents_of.get(deployment.deployment_id):
            continue
        backoff = state.warm_backoff.get(deployment.deployment_id)
        if backoff is not None and now < backoff[1]:
            continue
        production = deployment.production_eligible and bool(deployment.measured_on)
        passed, _ = filtered_accelerators(pass_, deployment, production)
        need = deployment.resident_bytes
        best: tuple[int, str] | None = None
        for accelerator in passed:
            budget = pass_.budgets[accelerator]
            if not budget.fresh or accelerator in pass_.blocked:
                continue
            reservation = pass_.reservations.get(accelerator)
            if reservation is not None and need > reservation.spare:
                continue  # a model stays: it may only take what a waiting gang will not need
            if not production and state.accelerators.get(accelerator, IDLE_RUNTIME).pressure:
                continue
            free = pass_.free(accelerator)
            if need <= free and (best is None or (free - need, accelerator) < best):
                best = (free - need, accelerator)
        if best is None:
            continue
        accelerator = best[1]
        acc = state.catalog.accelerator(accelerator)
        assert acc is not None
        pass_.commit(accelerator, need)
        if accelerator in pass_.reservations:
            pass_.reservations[accelerator].spare -= need
        key = resident_key(deployment.deployment_id, accelerator)
        pass_.slots[key] = deployment.concurrency
        decisions.loads.append(StartLoad(key, deployment.deployment_id, accelerator, acc.node, need, []))


def _expired(queued: QueuedRequest, now: float) -> Reject:
    if now >= queued.lease_timeout_at:
        reason = f"; last reason: {queued.waiting_reason}" if queued.waiting_reason else ""
        return Reject(
            queued.request_id,
            queued.workflow_id,
            FailureClass.LEASE_TIMEOUT,
            f"waited {now - queued.submitted_at:.1f} s for a lease{reason}",
        )
    reason = f"; {queued.waiting_reason}" if queued.waiting_reason else ""
    message = f"deadline passed while queued{reason}"
    return Reject(queued.request_id, queued.workflow_id, FailureClass.DEADLINE_CANNOT_BE_MET, message)


def _decide_one(
    pass_: DecisionPass,
    decisions: Decisions,
    queued: QueuedRequest,
    deployment: Deployment,
    settled_by: dict[str, tuple[FailureClass, str] | tuple[None, str]],
    now: float,
    counter: int,
) -> int:
    """Place one request and record the outcome; returns the lease counter after it."""
    pass_.duration_sensitive = False
    outcome = _place(pass_, queued, deployment, now, counter)
    if isinstance(outcome, Grant):
        decisions.grants.append(outcome)
        return counter + 1
    if isinstance(outcome, Reject):
        decisions.rejects.append(outcome)
        if not queued.assigned_to and outcome.failure != FailureClass.DEADLINE_CANNOT_BE_MET:
            settled_by[queued.capability] = (outcome.failure, outcome.message)
    elif isinstance(outcome, StartLoad):
        decisions.loads.append(outcome)
    elif isinstance(outcome, Assign):
        decisions.assigns.append(outcome)
    elif isinstance(outcome, Preemption):
        decisions.preemptions.extend(outcome.preempts)
        decisions.waits.append(outcome.wait)
    elif isinstance(outcome, Wake):
        decisions.wakes.append(outcome)
    elif isinstance(outcome, list):
        unloads = [u for u in outcome if isinstance(u, Unload)]
        sleeps = [u for u in outcome if isinstance(u, Sleep)]
        decisions.unloads.extend(unloads)
        decisions.sleeps.extend(sleeps)
        doing = []
        if sleeps:
            doing.append("putting to sleep " + ", ".join(u.resident_key for u in sleeps))
        if unloads:
            doing.append("unloading " + ", ".join(u.resident_key for u in unloads))
        decisions.waits.append(Wait(queued.request_id, "making room: " + "; ".join(doing)))
    else:
        decisions.waits.append(outcome)
        if not queued.assigned_to and not pass_.duration_sensitive:
            settled_by[queued.capability] = (None, outcome.reason)
    return counter


def _place(
    pass_: DecisionPass, queued: QueuedRequest, deployment: Deployment, now: float, counter: int
) -> Grant | Reject | StartLoad | Assign | Wake | Wait | list[Unload | Sleep] | Preemption:
    state = pass_.state
    load_s = operation_seconds(state, deployment, "load")  # measured here, else the catalog's
    if deployment.gpu_count > 1:
        return place_gang(pass_, queued, deployment, now, counter)
    extra = deployment.lease_extra_bytes
    # A request already waiting on a load is granted when that resident is ready.
    if queued.assigned_to:
        resident = state.residents.get(queued.assigned_to)
        if resident is not None and resident.phase in (ResidentPhase.LOADING, ResidentPhase.WAKING):
            verb = "load" if resident.phase == ResidentPhase.LOADING else "wake"
            return Wait(queued.request_id, f"waiting for {resident.key} to {verb}")
        held = pass_.reserved.pop(queued.request_id, 0)
        if held and resident is not None:
            pass_.commit(resident.accelerator, -held)  # the grant below takes them for real
        if (
            resident is not None
            and resident.phase == ResidentPhase.READY
            and pass_.slots.get(resident.key, 0) > 0
            and resident.key not in pass_.evicting
        ):
            if extra <= pass_.free(resident.accelerator) or extra == 0:
                return grant_on(queued, deployment, resident, now, pass_, counter)

    production = is_production(pass_.state.catalog, queued.priority)
    passed, refused = filtered_accelerators(pass_, deployment, production)
    if not passed:
        if all(f.permanent for f in refused):
            detail = "; ".join(f.reason for f in refused) or "the pool has no accelerators"
            return Reject(
                queued.request_id,
                queued.workflow_id,
                FailureClass.CAPABILITY_UNAVAILABLE,
                f"no {queued.priority} placement for {queued.capability}: {detail}",
            )
        reasons = Reasons()
        for f in refused:
            if not f.passed:
                reasons.add("unhealthy" if not f.permanent else "filtered", f.reason)
        return Wait(queued.request_id, str(reasons))

    # Phase 2, score: join a ready resident (no new load) > join a loading one > load with best fit.
    reasons = Reasons()
    holding: dict[str, bool] = {}
    # Ready residents of this deployment with every slot taken: their slots are where a request
    # of a class that preempts the holders' gets in (seed 003: merge Critical stops merge Low).
    full: list[ResidentState] = []
    # Asleep residents of this deployment too big to wake now: making room may wake them later.
    asleep: list[tuple[ResidentState, int]] = []
    residents = pass_.residents_of.get(deployment.deployment_id, [])
    if residents:
        eligible = pass_.eligible[(deployment.deployment_id, production)]
        if len(residents) > 1:
            # In the order of the pool's accelerators, as the filter phase returns them.
            position = pass_.position
            residents = sorted(residents, key=lambda r: position.get(r.accelerator, 0))
        for resident in residents:
            accelerator = resident.accelerator
            if accelerator not in eligible:
                continue
            holding[accelerator] = True
            if not pass_.budgets[accelerator].fresh and not state.config.join_stale_residents:
                # Its node has not reported within freshness_s: it may be gone, and work sent
                # there would wait on a worker nobody can see (nothing new lands on a stale card).
                reasons.add("stale", _stale(accelerator, pass_.budgets[accelerator].age_s))
                continue
            if resident.key in pass_.evicting:
                # A higher request of this pass is unloading it to make room: joining it now
                # would run work on a model that is going away.
                reasons.add("evicting", f"{accelerator}: {resident.key} is being unloaded to make room")
                continue
            if pass_.slots.get(resident.key, 0) <= 0:
                reasons.add(
                    "concurrency", f"{accelerator}: {deployment.deployment_id} at concurrency {deployment.concurrency}"
                )
                if resident.phase == ResidentPhase.READY:
                    full.append(resident)
                continue
            # Joining an idle resident keeps it from being unloaded until this lease ends: on a
            # reserved accelerator that counts as taking its bytes too.
            joined = extra
            if (
                resident.phase == ResidentPhase.READY
                and resident.active_leases == 0
                and resident.key not in pass_.in_use
            ):
                joined += resident.bytes
            refusal = pass_.reserved_refusal(accelerator, queued, joined, False, now) if pass_.reservations else ""
            if refusal:
                reasons.add("reserved", refusal)
                continue
            if resident.phase == ResidentPhase.READY:
                if extra == 0 or extra <= pass_.free(accelerator):
                    pass_.take_reserved(accelerator, queued, joined, False, now)
                    return grant_on(queued, deployment, resident, now, pass_, counter)
                reasons.add(
                    "lease_bytes", f"{accelerator}: lease needs {extra} B, {pass_.free(accelerator)} B schedulable"
                )
            elif resident.phase in (ResidentPhase.LOADING, ResidentPhase.WAKING) or resident.key in pass_.waking:
                if extra and extra > pass_.free(accelerator):
                    reasons.add(
                        "lease_bytes", f"{accelerator}: lease needs {extra} B, {pass_.free(accelerator)} B schedulable"
                    )
                    continue
                pass_.take_reserved(accelerator, queued, extra, False, now, load_s)
                pass_.slots[resident.key] -= 1
                pass_.in_use[resident.key] = True
                pass_.commit(accelerator, extra)
                return Assign(queued.request_id, resident.key)
            elif resident.phase == ResidentPhase.ASLEEP and resident.key not in pass_.evicting:
                # Waking takes back what it gave up, plus this lease's bytes: far cheaper than a load.
                awake = resident.awake_bytes if resident.awake_bytes is not None else deployment.resident_bytes
                wake_need = max(0, awake - resident.bytes) + extra
                free = pass_.free(accelerator)
                if accelerator in pass_.blocked:
                    reasons.add("blocked", f"{accelerator}: a higher request waits for memory here")
                    continue
                refusal = (
                    pass_.reserved_refusal(accelerator, queued, wake_need, True, now) if pass_.reservations else ""
                )
                if refusal:
                    reasons.add("reserved", refusal)
                    continue
                if wake_need <= free:
                    pass_.commit(accelerator, wake_need)
                    pass_.take_reserved(accelerator, queued, wake_need, True, now)
                    pass_.slots[resident.key] -= 1
                    pass_.in_use[resident.key] = True
                    pass_.waking[resident.key] = True
                    return Wake(resident.key, awake, [queued.request_id])
                asleep.append((resident, wake_need))
                reasons.add("asleep", f"{accelerator}: waking {resident.key} needs {wake_need} B, {free} B schedulable")
            else:
                reasons.add("phase", f"{accelerator}: {deployment.deployment_id} is {resident.phase.value}")

    need = deployment.resident_bytes + extra
    # A batch resident (residency none) goes with its lease; any other stays after it.
    persists = deployment.residency != Residency.NONE
    best: tuple[int, str] | None = None
    eviction_options: list[tuple[int, str, list[tuple[str, bool]]]] = []
    blocked = pass_.blocked
    # Accelerators where a higher request already waits for memory are out for new bytes; on a
    # busy pool that is most of them, so they are set aside in one sweep.
    if not blocked:
        open_accelerators = passed
    elif len(blocked) == len(pass_.pool_accelerators):
        open_accelerators = []
    else:
        open_accelerators = [a for a in passed if a not in blocked and a not in holding]
    shut = len(passed) - len(open_accelerators) - len(holding) if blocked else 0
    if shut > 0:
        first = next(a for a in passed if a in blocked and a not in holding)
        reasons.add("blocked", f"{first}: a higher request waits for memory here", shut)
    budgets = pass_.budgets
    # Fresh, unblocked, not under pressure: where preemption could make room if nothing else can.
    room_candidates: list[str] = []
    backfill_only: dict[str, bool] = {}
    for accelerator in open_accelerators:
        if accelerator in holding:
            continue
        budget = budgets[accelerator]
        if not budget.fresh:
            reasons.add("stale", _stale(accelerator, budget.age_s))
            continue
        if not production and state.accelerators.get(accelerator, IDLE_RUNTIME).pressure:
            reasons.add("pressure", f"{accelerator}: GPU_PRESSURE, only production work may load")
            continue
        if pass_.reservations:
            refusal = pass_.reserved_refusal(accelerator, queued, need, persists, now, load_s)
            if refusal:
                # Held for a gang, not for this request: later work that ends in time may still
                # backfill it, so this wait blocks nothing there.
                reasons.add("reserved", refusal)
                backfill_only[accelerator] = True
                continue
        room_candidates.append(accelerator)
        free = budget.schedulable_bytes - pass_.committed.get(accelerator, 0)
        if need <= free:
            if best is None or (free - need, accelerator) < best:
                best = (free - need, accelerator)
            continue
        if accelerator in pass_.evictable:
            plan = eviction_plan(pass_, accelerator, deployment.deployment_id, need, production)
            if plan is not None:
                evicted = sum(state.residents[k].bytes for k, _ in plan)
                eviction_options.append((evicted, accelerator, plan))
        reasons.add("no_room", f"{accelerator}: needs {need} B, {free} B schedulable")
    # An asleep copy of this model whose wake does not fit yet: making room for the wake is an
    # option as good as making room for a load elsewhere.
    for sleeper, wake_need in asleep:
        accelerator = sleeper.accelerator
        if accelerator in pass_.evictable and accelerator not in pass_.reservations:
            plan = eviction_plan(pass_, accelerator, deployment.deployment_id, wake_need, production)
            if plan is not None:
                evicted = sum(state.residents[k].bytes for k, _ in plan)
                eviction_options.append((evicted, accelerator, plan))

    if best is not None and queued.deadline_at is not None and now + load_s > queued.deadline_at:
        return Reject(
            queued.request_id,
            queued.workflow_id,
            FailureClass.DEADLINE_CANNOT_BE_MET,
            f"loading {deployment.deployment_id} takes {load_s:.1f} s; the deadline is in "
            f"{queued.deadline_at - now:.1f} s",
        )
    if best is not None:
        # Phase 3, choose: best fit (least schedulable left over), ties by accelerator id.
        _, accelerator = best
        acc = state.catalog.accelerator(accelerator)
        assert acc is not None
        # The model's bytes and this request's lease bytes: both are promised from now on.
        pass_.commit(accelerator, need)
        pass_.take_reserved(accelerator, queued, need, persists, now, load_s)
        key = resident_key(deployment.deployment_id, accelerator)
        pass_.slots[key] = deployment.concurrency - 1
        # Later requests of this pass join the load (up to its concurrency) instead of starting
        # a second one under the same key on the same card.
        pass_.residents_of.setdefault(deployment.deployment_id, []).append(
            ResidentState(
                key=key,
                deployment=deployment.deployment_id,
                capability=deployment.capability,
                accelerator=accelerator,
                node=acc.node,
                bytes=deployment.resident_bytes,
                phase=ResidentPhase.LOADING,
                residency=deployment.residency,
                ttl_s=deployment.ttl_s,
                workflow_id="",
                requested_at=now,
            )
        )
        return StartLoad(
            key, deployment.deployment_id, accelerator, acc.node, deployment.resident_bytes, [queued.request_id]
        )
    if eviction_options:
        _, accelerator, plan = min(eviction_options)
        for key, _ in plan:
            pass_.evicting[key] = True
        pass_.blocked[accelerator] = True
        return room_decisions(plan, f"making room for {queued.capability} ({queued.priority})")
    if pass_.preemptible:
        preemption = slot_preemption(pass_, queued, full) if full else None
        if preemption is None:
            preemption = preemption_plan(pass_, queued, deployment, need, room_candidates)
        if preemption is not None:
            return preemption

    # Nothing fits now. Refuse at once when no release of ModelForge's own work could ever help.
    never = _never_fits(pass_, passed, need)
    if never is not None:
        return Reject(queued.request_id, queued.workflow_id, never[0], never[1])
    for accelerator in open_accelerators:
        if budgets[accelerator].fresh and accelerator not in backfill_only:
            blocked[accelerator] = True
    return Wait(queued.request_id, str(reasons) or "waiting for capacity")


def _stale(accelerator: str, age_s: float | None) -> str:
    age = "never observed" if age_s is None else f"observation {age_s:.0f} s old"
    return f"{accelerator}: {FailureClass.SCHEDULER_STATE_STALE.value} ({age})"


def _never_fits(pass_: DecisionPass, passed: list[str], need: int) -> tuple[FailureClass, str] | None:
    external_blocked = []
    for accelerator in passed:
        budget = pass_.budgets[accelerator]
        if not budget.fresh:
            return None
        ceiling = budget.total_bytes - budget.reserve_bytes
        pinned = pass_.pinned.get(accelerator, 0)
        if need <= ceiling - budget.external_bytes - pinned:
            return None  # releases or evictions of ModelForge work would make it fit: wait
        if need <= ceiling - pinned:
            external_blocked.append(
                f"{accelerator}: external {budget.external_bytes} B leaves "
                f"{ceiling - pinned - budget.external_bytes} B, needs {need} B"
            )
    if len(external_blocked) == len(passed):
        return FailureClass.EXTERNAL_GPU_PRESSURE, "; ".join(external_blocked[:8]) + (
            f"; and {len(external_blocked) - 8} more" if len(external_blocked) > 8 else ""
        )
    budgets = pass_.budgets
    if any(need <= budgets[a].total_bytes - budgets[a].reserve_bytes - budgets[a].external_bytes for a in passed):
        return FailureClass.EVICTION_NOT_ALLOWED, "only always_warm residents could make room"
    return FailureClass.INSUFFICIENT_SCHEDULABLE_VRAM, (
        f"needs {need} B; largest possible on any eligible accelerator is "
        f"{max(budgets[a].total_bytes - budgets[a].reserve_bytes for a in passed)} B"
    )
