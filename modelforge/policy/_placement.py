"""One decision pass: walk the queue in order and place each request in phases, in the spirit of
the Kubernetes scheduler framework (and Kueue's numbered scheduling cycle), each phase a function
that returns its decision or why it has none (`_place_one`; gangs: `_gang.place_gang`):
filter (each accelerator accepted or rejected with a reason), score (join a ready resident >
join a loading one > wake an asleep one > load), choose (best fit), make room (evict the
cheapest idle residents, else preempt) when nothing fits, and wait. The rules the phases check
(may new bytes land on a card now, a gang's reservation, the deadline, expiry) are written once,
in `_rules`.

`decide` is pure: it reads the state and returns decision objects. It is also the hot path of the
scheduler workflow, so it is built to stay near-linear in the queue and the pool:

- everything the pass needs per accelerator (budget, evictable residents, always_warm bytes) is
  computed once, grouped in one walk over residents and leases;
- the static filter (placement list, production eligibility, measured envelope) is computed once
  per (deployment, class) and pass; health is the only per-pass filter;
- a pass only ever consumes capacity, so once an unplaced request of a deployment has to wait
  (or can never fit), every later request of that deployment and the same filter outcome would
  too: its outcome is reused rather than recomputed, unless the outcome says otherwise
  (`Outcome.reusable`);
- wait reasons are summarised per kind of reason, never one line per accelerator;
- the queue is walked through an index kept across passes (`_queue_index.py`): a lane of
  requests that would only be told, again, the reason they already wait for is passed over whole.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from modelforge.domain import Catalog, Deployment, Residency, fair_share_entity, resident_key
from modelforge.failures import FailureClass
from modelforge.policy._decisions import (
    Assign,
    Decisions,
    Grant,
    Preempt,
    Reject,
    Sleep,
    StartLoad,
    Unload,
    Wait,
    WaitReason,
    Wake,
)
from modelforge.policy._gang import leases_on, place_gang
from modelforge.policy._order import (
    class_rank,
    fair_share_scores,
    is_production,
    ordered_buckets,
    production_ranks,
    starvation_bound,
    starving,
    submission_key,
)
from modelforge.policy._pass import (
    IDLE_RUNTIME,
    DecisionPass,
    FilterResult,
    Reasons,
    filter_accelerators,
    filtered_accelerators,
    grant_on,
    start_pass,
)
from modelforge.policy._queue_index import Lane, queue_index
from modelforge.policy._reservation import Reservation, free_at, freed_by, release_timeline
from modelforge.policy._room import Preemption, eviction_plan, preemption_plan, room_decisions, slot_preemption
from modelforge.policy._rules import (
    BLOCKED,
    RESERVED,
    STALE,
    STARVED,
    Attempt,
    Landing,
    deadline_refusal,
    expiry_refusal,
    hopeless_refusal,
    joining_keeps,
    landing_refusals,
    may_land,
    predicted_refusal,
    refusal_reason,
    reservation_refuses,
    service_estimate,
    service_of,
    shut_cards,
    take_reservation,
)
from modelforge.policy._standing import GO_WITH_LAST_LEASE, is_evictable, kept_groups
from modelforge.policy._state import PoolState, QueuedRequest, ResidentPhase, ResidentState, operation_seconds

__all__ = ["FilterResult", "decide", "decide_each", "filter_accelerators", "silent_nodes_due"]

# Per capability: the outcome an unplaced request of it settled on in this pass (a failure class
# and message, or None and the reason it waits).
Settled = dict[str, Reject | Wait]


def decide(state: PoolState, now: float) -> Decisions:
    return decide_each(state, now, reuse_settled=True)


def decide_each(state: PoolState, now: float, reuse_settled: bool) -> Decisions:
    """`decide`, and with `reuse_settled=False` the reference it must agree with: every request
    placed on its own, no outcome reused, every gang looking at every card (the property tests
    compare the two)."""
    pass_ = start_pass(state, now, indexed=reuse_settled)
    decisions = Decisions()
    counter = state.lease_counter
    # Per capability: its deployment and the outcome an unplaced request of it settled on in this
    # pass, one table for production requests and one for the rest (their filters differ).
    deployments: dict[str, Deployment | None] = {}
    settled_production: Settled = {}
    settled_other: Settled = {}
    if reuse_settled:
        counter = _decide_queue(pass_, decisions, settled_production, settled_other, now, counter)
    for bucket in [] if reuse_settled else ordered_buckets(state, now):
        # A bucket holds one class, so one settled table serves all of it.
        settled_by = settled_production if is_production(state.catalog, bucket[0].priority) else settled_other
        for queued in bucket:
            counter = _visit(pass_, decisions, queued, settled_by, deployments, now, counter, reuse_settled=False)

    _keep_always_warm(pass_, decisions, now)

    _leave_unhealthy(pass_, decisions)
    _preempt_on_silent_nodes(pass_, decisions, now)
    _unload_removed(pass_, decisions)
    _unload_unused(pass_, decisions)
    return decisions


def _leave_unhealthy(pass_: DecisionPass, decisions: Decisions) -> None:
    """An UNHEALTHY accelerator's work is preempted and requeued elsewhere (the filter keeps it
    off that accelerator), and its idle residents go."""
    if not pass_.unhealthy:
        return
    state = pass_.state
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


def _unload_unused(pass_: DecisionPass, decisions: Decisions) -> None:
    """load_on_demand and batch residents go when their last lease has ended and nobody waits."""
    state = pass_.state
    waiting_on = {a.resident_key: True for a in decisions.assigns}
    for queued in queue_index(state).assigned.values():
        waiting_on[queued.assigned_to] = True
    granted_on = {g.lease.resident_key: True for g in decisions.grants}
    # The fast pass reads them from the groupings it started from (a pass changes no resident);
    # the reference pass walks every resident.
    kept = kept_groups(state) if pass_.indexed else None
    candidates = kept[0].unused if kept is not None else state.residents.values()
    for resident in candidates:
        if (
            resident.residency in GO_WITH_LAST_LEASE
            and is_evictable(resident)
            and resident.key not in pass_.evicting
            and resident.key not in waiting_on
            and resident.key not in granted_on
        ):
            decisions.unloads.append(Unload(resident.key, "last lease ended (load_on_demand)"))


def _unload_removed(pass_: DecisionPass, decisions: Decisions) -> None:
    """A resident whose deployment or accelerator is no longer in the catalog goes as soon as it
    is idle, whatever its residency: nothing may be granted on it, so an `always_warm` one would
    otherwise pin its memory, unevictable, forever."""
    catalog = pass_.state.catalog
    # The fast pass reads them from the groupings it started from (kept with the catalog); the
    # reference pass walks every resident.
    kept = kept_groups(pass_.state) if pass_.indexed else None
    for resident in kept[0].removed if kept is not None else pass_.state.residents.values():
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
    production = production_ranks(catalog)
    lanes_now = queue_index(state).lanes.values()
    ranks = [class_rank(catalog, lane.priority) for lane in lanes_now]
    # The fair-share scores order lanes of one class only: a pass whose lanes are each of a
    # class of their own (an idle or quiet pool, most passes) does without them.
    scores = fair_share_scores(state, now) if len(set(ranks)) < len(ranks) else {}
    groups: dict[tuple[int, float], list[Lane]] = {}
    for rank, lane in zip(ranks, lanes_now, strict=True):
        key = (rank, -scores.get(fair_share_entity(lane.priority, lane.tenant), 0.0))
        group = groups.get(key)
        if group is None:
            groups[key] = [lane]
        else:
            group.append(lane)
    deployments: dict[str, Deployment | None] = {}
    for key in sorted(groups):
        lanes = groups[key]
        settled_by = settled_production if key[0] in production else settled_other
        skip = _Skip(pass_, settled_by, deployments, now)
        walk = _single(lanes[0], skip) if len(lanes) == 1 else _merged(lanes, skip)
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
    expired = expiry_refusal(queued, now)
    if expired is not None:
        decisions.rejects.append(expired)
        return counter
    capability = queued.capability
    if capability in deployments:
        deployment = deployments[capability]
    else:
        deployment = deployments[capability] = pass_.state.catalog.deployment_for(capability)
    if deployment is not None and queued.deadline_at is not None:
        margin = _margin(pass_, deployment)
        if queued.deadline_at - margin <= now or deployment.residency == Residency.NONE:
            hopeless = hopeless_refusal(
                pass_, queued, deployment, now, operation_seconds(pass_.state, deployment, "load")
            )
            if hopeless is not None:
                decisions.rejects.append(hopeless)
                return counter
    if reuse_settled and not queued.assigned_to:
        settled = settled_by.get(capability)
        # A request past its class's starvation bound is placed on its own: it may reserve a card.
        if settled is not None and not starving(pass_.state.catalog, queued, now):
            # The hot path on a busy pool: most of the queue waits behind its head.
            if isinstance(settled, Wait):
                predicted = None if deployment is None else predicted_refusal(pass_, queued, deployment, now)
                if predicted is not None:
                    decisions.rejects.append(predicted)
                    return counter
                if deployment is not None:
                    pass_.ahead[deployment.deployment_id] = pass_.ahead.get(deployment.deployment_id, 0) + 1
                if queued.waiting_reason != settled.reason:
                    decisions.waits.append(Wait(queued.request_id, settled.reason, settled.codes))
            else:
                reject = Reject(queued.request_id, queued.workflow_id, settled.failure, settled.message)
                decisions.rejects.append(reject)
            return counter
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


def _margin(pass_: DecisionPass, deployment: Deployment) -> float:
    """The most a request of `deployment` could need before its deadline, once per pass: its
    load and its service's high percentile (a batch job's own max_duration comes on top)."""
    margin = pass_.margin.get(deployment.deployment_id)
    if margin is None:
        margin = operation_seconds(pass_.state, deployment, "load") + service_of(pass_, deployment.deployment_id)[1]
        pass_.margin[deployment.deployment_id] = margin
    return margin


class _Skip:
    """How much of a lane may be passed over in this pass, and the count of what it passes over
    (the requests left waiting ahead of later ones, `DecisionPass.ahead`)."""

    __slots__ = ("deployments", "floors", "now", "pass_", "settled_by", "untold")

    def __init__(
        self, pass_: DecisionPass, settled_by: Settled, deployments: dict[str, Deployment | None], now: float
    ) -> None:
        self.pass_, self.settled_by, self.deployments, self.now = pass_, settled_by, deployments, now
        # Per lane (by identity): the suffix minima of when its requests stop merely waiting
        # for their deadlines and expiries, and its class's starvation bound (None: none).
        self.floors: dict[int, tuple[list[float], float | None]] = {}
        # Per lane (by identity), the positions of the requests not yet told the settled reason.
        self.untold: dict[int, list[int]] = {}

    def deployment(self, capability: str) -> Deployment | None:
        deployments = self.deployments
        if capability in deployments:
            return deployments[capability]
        deployment = deployments[capability] = self.pass_.state.catalog.deployment_for(capability)
        return deployment

    def passable(self, lane: Lane, position: int) -> int:
        """How many requests of the lane from `position` on would only be told, again, the
        reason they wait for: none waits on a load, none expired, none hopeless for its deadline
        (`hopeless_refusal`: its load and its service counted), each already carries the reason
        its capability settled on. The run ends before the next request not told that reason
        yet (one just submitted, mostly): that one is visited. 0: visit the one at `position`.
        Worked out once per lane and pass, once its capability has settled on waiting."""
        key = id(lane)
        floors = self.floors.get(key)
        if floors is None:
            settled = self.settled_by.get(lane.capability)
            if settled is None:
                return 0  # not settled yet: asked again after the next request
            waiting = self._waiting_floors(lane, settled)
            floors = self.floors[key] = (waiting, starvation_bound(self.pass_.state.catalog, lane.priority))
            if waiting[0] != -math.inf:
                assert isinstance(settled, Wait)
                self.untold[key] = lane.not_carrying(settled.reason)
        if not self._floor(lane, floors, position) > self.now:
            return 0
        untold = self.untold[key]
        following = bisect_left(untold, position)
        return (untold[following] if following < len(untold) else len(lane.items)) - position

    @staticmethod
    def _floor(lane: Lane, floors: tuple[list[float], float | None], position: int) -> float:
        """The earliest moment a request of the lane from `position` on stops merely waiting:
        its expiry, the last moment it could start and finish by its deadline, or when it passes
        its class's starvation bound and may reserve a card; -inf when the lane does not wait as
        a whole (its capability settled on a refusal, or a request of it waits on a load). A
        lane is in submission order, so the earliest to pass the bound from `position` on is
        the request at `position`: no walk over the lane for it."""
        waiting, bound = floors
        floor = waiting[min(position, len(waiting) - 1)]
        items = lane.items
        if bound is None or floor == -math.inf or position >= len(items):
            return floor
        return min(floor, items[position].submitted_at + bound)

    def _waiting_floors(self, lane: Lane, settled: Reject | Wait) -> list[float]:
        """From each position of the lane on, the least of its requests' expiries and last
        moments to start by their deadlines (one value: the same from every position); only
        whether it is past now is ever asked, so [inf] where none is."""
        pass_, now = self.pass_, self.now
        never = [-math.inf]
        if not isinstance(settled, Wait) or lane.assigned or not lane.none_expires_by(now):
            return never
        deployment = self.deployment(lane.capability)
        if deployment is None:
            return [math.inf]
        job = deployment.residency == Residency.NONE
        if job and not lane.deadlines:
            # Each request's floor is its expiry, and none expires by now: only whether a floor
            # is past now is ever asked, so no walk over the lane tells more than this.
            return [math.inf]
        margin = _margin(pass_, deployment)
        if not job and lane.none_expires_by(now + margin):
            return [math.inf]  # the lane's earliest expiry is later than any of its requests could need
        load_s = operation_seconds(pass_.state, deployment, "load")
        items = lane.items
        floors = [math.inf] * (len(items) + 1)
        least = math.inf
        for n in range(len(items) - 1, -1, -1):
            queued = items[n]
            limit = queued.expires_at
            if queued.deadline_at is not None:
                need = load_s + service_estimate(pass_, queued, deployment) if job else margin
                limit = min(limit, queued.deadline_at - need)
            least = min(least, limit)
            floors[n] = least
        return floors

    def passed_over(self, lane: Lane, count: int) -> None:
        deployment = self.deployment(lane.capability)
        if deployment is not None and count:
            ahead = self.pass_.ahead
            ahead[deployment.deployment_id] = ahead.get(deployment.deployment_id, 0) + count


def _single(lane: Lane, skip: _Skip) -> Iterator[QueuedRequest]:
    capability = lane.capability
    settled_by = skip.settled_by
    items = lane.items
    # Until the capability settles, request by request; once it has (it stays so for the pass),
    # runs of the lane are passed over as long as nothing in them would change.
    position = 0
    while position < len(items):
        if capability in settled_by:
            run = skip.passable(lane, position)
            if run:
                skip.passed_over(lane, run)
                position += run
                continue
        yield items[position]
        position += 1


def _merged(lanes: list[Lane], skip: _Skip) -> Iterator[QueuedRequest]:
    """Requests of several lanes in submission order; a run of a lane that would only be told
    its reason again is passed over where it starts. What it passes over counts as ahead of the
    requests of its deployment visited after it (`predicted_refusal`), so where another lane
    has the same capability (another tenant's), the run ends at that lane's next request."""
    heads = [(lane.items[0].submitted_at, lane.items[0].request_id, n, 0) for n, lane in enumerate(lanes)]
    heapq.heapify(heads)
    capabilities = [lane.capability for lane in lanes]
    # Where lanes share a capability: per capability, its lanes' heads as `heads` holds them,
    # in a heap of its own (an entry is stale once its lane has moved on or is being walked),
    # so the next request of another lane of the same capability is its top, not a scan of
    # every head (a pool of many tenants asks it for every run it passes over).
    shared: dict[str, list[tuple[float, str, int, int]]] | None = None
    at: list[int] = []
    if len(set(capabilities)) < len(capabilities):
        shared = {}
        for head in heads:
            shared.setdefault(capabilities[head[2]], []).append(head)
        for same in shared.values():
            heapq.heapify(same)
        at = [0] * len(lanes)
    while heads:
        _, _, n, position = heapq.heappop(heads)
        lane = lanes[n]
        run = skip.passable(lane, position)
        if run:
            if shared is not None:
                at[n] = -1  # being walked: not another lane's head
                same = shared[lane.capability]
                while same and at[same[0][2]] != same[0][3]:
                    heapq.heappop(same)
                if same:
                    end = bisect_left(lane.items, same[0][:2], position + 1, position + run, key=submission_key)
                    run = end - position
            skip.passed_over(lane, run)
            position += run
        else:
            yield lane.items[position]
            position += 1
        if position < len(lane.items):
            following = lane.items[position]
            head = (following.submitted_at, following.request_id, n, position)
            heapq.heappush(heads, head)
            if shared is not None:
                at[n] = position
                heapq.heappush(shared[lane.capability], head)
        elif shared is not None:
            at[n] = -1


def _preempt_on_silent_nodes(pass_: DecisionPass, decisions: Decisions, now: float) -> None:
    """Leases on an accelerator whose node has said nothing for `node_silent_s` are preempted:
    whatever runs there is out of sight, and its holder should stop and requeue rather than keep
    a lease nobody can verify. (Nothing new lands there meanwhile: the accelerator is stale.)"""
    state = pass_.state
    limit = state.config.node_silent_s
    if limit == math.inf and math.isfinite(now):
        return  # the rule is off: no node is ever silent for that long
    runtimes = state.accelerators
    silent = False
    # First the cards holding leases, once each (many leases share one): most passes find none silent.
    for accelerator in pass_.leased_sum:
        observation = runtimes.get(accelerator, IDLE_RUNTIME).observation
        if observation is not None and not now - observation.received_at < limit:
            silent = True
            break
    if not silent:
        return
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
    always_warm = _always_warm(state.catalog)
    if not always_warm:
        return
    starting = {load.deployment: True for load in decisions.loads}
    for deployment in always_warm:
        if deployment.deployment_id in starting:
            continue
        if pass_.residents_of.get(deployment.deployment_id):
            continue
        backoff = state.warm_backoff.get(deployment.deployment_id)
        if backoff is not None and now < backoff[1]:
            continue
        production = deployment.production_eligible and bool(deployment.measured_on)
        # A model stays: on a reserved card it may only take what the waiting gang will not need.
        landing = Landing(deployment.resident_bytes, persists=True)
        accelerator = _warm_card(pass_, deployment, production, landing)
        if accelerator is None:
            continue
        acc = state.catalog.accelerator(accelerator)
        assert acc is not None
        pass_.commit(accelerator, landing.nbytes)
        take_reservation(pass_, accelerator, landing)
        key = resident_key(deployment.deployment_id, accelerator)
        pass_.slots[key] = deployment.concurrency
        decisions.loads.append(StartLoad(key, deployment.deployment_id, accelerator, acc.node, landing.nbytes, []))


def _always_warm(catalog: Catalog) -> list[Deployment]:
    """The catalog's always_warm deployments, in its order: kept with it (immutable by contract),
    as every pass asks."""
    kept: list[Deployment] | None = catalog.__dict__.get("_policy_always_warm")
    if kept is None:
        kept = [d for d in catalog.deployments if d.residency == Residency.ALWAYS_WARM]
        catalog.__dict__["_policy_always_warm"] = kept
    return kept


def _warm_card(pass_: DecisionPass, deployment: Deployment, production: bool, landing: Landing) -> str | None:
    """The best-fitting eligible accelerator where an always_warm model may land now, if any."""
    passed, _ = filtered_accelerators(pass_, deployment, production)
    need = landing.nbytes
    best: tuple[int, str] | None = None
    for accelerator in may_land(pass_, passed, production, landing):
        free = pass_.free(accelerator)
        if need <= free and (best is None or (free - need, accelerator) < best):
            best = (free - need, accelerator)
    return None if best is None else best[1]


Decision = Grant | Reject | StartLoad | Assign | Wake | Wait | list[Unload | Sleep] | Preemption


class Outcome(NamedTuple):
    """What placing one request decided, and whether that stands for the rest of its capability
    in this pass. A pass only consumes capacity, so once an unplaced request of a capability
    waits, or is refused for good, every later one of the same kind of class (production or
    not: their filters differ) would be told the same: the fast pass reuses it. Not so for a
    request waiting on a load (it was not placed), a deadline refusal (its own deadline), or an
    attempt whose outcome depended on its own durations (`Attempt.reusable`)."""

    decision: Decision
    reusable: bool


def _decide_one(
    pass_: DecisionPass,
    decisions: Decisions,
    queued: QueuedRequest,
    deployment: Deployment,
    settled_by: Settled,
    now: float,
    counter: int,
) -> int:
    """Place one request and record the outcome; returns the lease counter after it."""
    outcome = _place(pass_, queued, deployment, now, counter)
    decision = outcome.decision
    if outcome.reusable:
        if isinstance(decision, Reject | Wait):
            settled_by[queued.capability] = decision
    deployment_id = deployment.deployment_id
    if isinstance(decision, Wait):
        # It waits: refused now if it would start too late behind the work ahead of it.
        predicted = predicted_refusal(pass_, queued, deployment, now)
        if predicted is not None:
            decision = predicted
    if isinstance(decision, Grant):
        pass_.granted[deployment_id] = pass_.granted.get(deployment_id, 0) + 1
    elif not isinstance(decision, Reject):
        pass_.ahead[deployment_id] = pass_.ahead.get(deployment_id, 0) + 1
    return _record(decisions, queued, decision, counter)


def _record(decisions: Decisions, queued: QueuedRequest, decision: Decision, counter: int) -> int:
    """Adds one placement's decision to the pass's; returns the lease counter after it."""
    if isinstance(decision, Grant):
        decisions.grants.append(decision)
        return counter + 1
    if isinstance(decision, Reject):
        decisions.rejects.append(decision)
    elif isinstance(decision, StartLoad):
        decisions.loads.append(decision)
    elif isinstance(decision, Assign):
        decisions.assigns.append(decision)
    elif isinstance(decision, Preemption):
        decisions.preemptions.extend(decision.preempts)
        decisions.waits.append(decision.wait)
    elif isinstance(decision, Wake):
        decisions.wakes.append(decision)
    elif isinstance(decision, list):
        unloads = [u for u in decision if isinstance(u, Unload)]
        sleeps = [u for u in decision if isinstance(u, Sleep)]
        decisions.unloads.extend(unloads)
        decisions.sleeps.extend(sleeps)
        doing = []
        if sleeps:
            doing.append("putting to sleep " + ", ".join(u.resident_key for u in sleeps))
        if unloads:
            doing.append("unloading " + ", ".join(u.resident_key for u in unloads))
        decisions.waits.append(Wait(queued.request_id, "making room: " + "; ".join(doing), (WaitReason.MAKING_ROOM,)))
    else:
        decisions.waits.append(decision)
    return counter


def _place(pass_: DecisionPass, queued: QueuedRequest, deployment: Deployment, now: float, counter: int) -> Outcome:
    if queued.assigned_to and deployment.gpu_count <= 1:
        # Phase 0's wait, before an attempt is worked out: most passes find a request that
        # waits on a load still waiting for it (a load spans many passes).
        loading = _waits_on_its_load(pass_, queued)
        if loading is not None:
            return Outcome(loading, False)
    attempt = Attempt(
        pass_,
        queued,
        deployment,
        production=is_production(pass_.state.catalog, queued.priority),
        now=now,
        load_s=operation_seconds(pass_.state, deployment, "load"),  # measured here, else the catalog's
        counter=counter,
    )
    decision = place_gang(attempt) if deployment.gpu_count > 1 else _place_one(attempt)
    if queued.assigned_to:
        reusable = False
    elif isinstance(decision, Reject):
        reusable = decision.failure != FailureClass.DEADLINE_CANNOT_BE_MET
    else:
        reusable = isinstance(decision, Wait) and attempt.reusable
    return Outcome(decision, reusable)


def _place_one(attempt: Attempt) -> Decision:
    """A single-card request, in phases, each returning its decision or why it has none:
    0. a request waiting on a load is granted once the model is ready;
    1. filter: the accelerators it may use (placement list, class, health);
    2. score, join: a ready resident (no new load) > a loading one > waking an asleep one;
    3. score and choose a load: best fit (least schedulable left over), ties by accelerator id;
    4. make room: evict idle residents, else preempt work its class may preempt;
    5. wait (blocking the accelerators it waits for), or refuse if nothing could ever help."""
    if attempt.queued.assigned_to:
        on_load = _on_its_load(attempt)
        if on_load is not None:
            return on_load
    passed, refused = filtered_accelerators(attempt.pass_, attempt.deployment, attempt.production)
    if not passed:
        return _filtered_out(attempt.queued, refused)
    joined = _join(attempt)
    if joined.decision is not None:
        return joined.decision
    room_tried = False
    if _nothing_fits(attempt, joined.holding):
        # Phase 4 first, on the cards where making room could help: on a full pool most
        # requests that find no room make some, and the walk over every card (phase 3) only
        # gathers why a request waits.
        room = _make_room(attempt, _room_candidates(attempt, passed, joined.holding), joined)
        if room is not None:
            return room
        room_tried = True
    cards = _score_loads(attempt, passed, joined.holding)
    reasons = joined.reasons
    reasons.extend(cards.reasons)
    if cards.best is not None:
        return deadline_refusal(attempt, "loading") or _start_load(attempt, cards)
    room = None if room_tried else _make_room(attempt, cards, joined)
    if room is not None:
        return room
    return _wait(attempt, passed, cards, reasons, joined)


def _waits_on_its_load(pass_: DecisionPass, queued: QueuedRequest) -> Wait | None:
    """Phase 0's wait: the resident a request waits on is still loading or waking."""
    resident = pass_.state.residents.get(queued.assigned_to)
    if resident is not None and resident.phase in (ResidentPhase.LOADING, ResidentPhase.WAKING):
        verb = "load" if resident.phase == ResidentPhase.LOADING else "wake"
        return Wait(queued.request_id, f"waiting for {resident.key} to {verb}", (WaitReason.LOAD_IN_FLIGHT,))
    return None


def _on_its_load(attempt: Attempt) -> Grant | None:
    """Phase 0: a request already waiting on a load is granted when that resident is ready (one
    still loading or waking was told so by `_place`, before the attempt); the lease bytes held
    for it since the load was decided are given back to be taken for real."""
    pass_, queued, extra = attempt.pass_, attempt.queued, attempt.deployment.lease_extra_bytes
    resident = pass_.state.residents.get(queued.assigned_to)
    held = pass_.reserved.pop(queued.request_id, 0)
    if held and resident is not None:
        pass_.commit(resident.accelerator, -held)  # the grant below takes them for real
    if (
        resident is not None
        and resident.phase == ResidentPhase.READY
        and pass_.slots.get(resident.key, 0) > 0
        and resident.key not in pass_.evicting
        and (extra <= pass_.free(resident.accelerator) or extra == 0)
    ):
        return grant_on(queued, attempt.deployment, resident, attempt.now, pass_, attempt.counter)
    return None


def _filtered_out(queued: QueuedRequest, refused: list[FilterResult]) -> Reject | Wait:
    """Phase 1 found no accelerator: refused if none ever could be, else it waits for health."""
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
            if f.permanent:  # said, but no health change opens it: not why the request waits
                reasons.add("filtered", None, f.reason)
            else:
                reasons.add("unhealthy", WaitReason.UNHEALTHY, f.reason)
    return Wait(queued.request_id, str(reasons), reasons.codes())


class _Joined:
    """Phase 2's result: the decision if a resident of the deployment could be joined, else
    what the later phases need and why none could. (A plain class: one is made per placement.)"""

    __slots__ = ("asleep", "decision", "full", "holding", "reasons", "short")

    def __init__(self) -> None:
        self.decision: Grant | Assign | Wake | None = None
        self.reasons = Reasons()
        # Eligible accelerators holding a resident of it: no second load of it goes there.
        self.holding: dict[str, bool] = {}
        # Ready residents with every slot taken: their slots are where a request of a class that
        # preempts the holders' gets in.
        self.full: list[ResidentState] = []
        # Asleep residents too big to wake now, with what a wake needs: making room may wake them.
        self.asleep: list[tuple[ResidentState, int]] = []
        # Accelerators holding one where joining or waking it wanted more bytes than are free.
        self.short: dict[str, bool] = {}

    def lacks_lease_bytes(self, accelerator: str, extra: int, free: int) -> None:
        """Joining the resident on `accelerator` wants `extra` lease bytes and `free` are left."""
        self.short[accelerator] = True
        if not self.reasons.again("lease_bytes"):
            self.reasons.add(
                "lease_bytes", WaitReason.MEMORY_HELD, f"{accelerator}: lease needs {extra} B, {free} B schedulable"
            )


def _join(attempt: Attempt) -> _Joined:
    """Phase 2: join a resident of the deployment, in the order of the pool's accelerators."""
    pass_, deployment = attempt.pass_, attempt.deployment
    joined = _Joined()
    residents = pass_.residents_of.get(deployment.deployment_id, [])
    if not residents:
        return joined
    eligible = pass_.eligible[(deployment.deployment_id, attempt.production)]
    if len(residents) > 1:
        residents = _in_card_order(pass_, deployment.deployment_id, residents)
    extra, holding = deployment.lease_extra_bytes, joined.holding
    if pass_.fit is not None and extra and len(residents) > _SHUT_FROM:
        # Many residents each needing lease bytes (batch runners, one per running job, most on
        # full cards): a ready one on a fresh card with a free slot and no reservation, whose
        # card the fit index says lacks the bytes, is short, as `_join_one` would find it,
        # without a call per resident. (Bytes committed in the pass only take some away.)
        stale, slots, evicting = shut_cards(pass_, True), pass_.slots, pass_.evicting
        kept, committed, reservations = pass_.fit.schedulable, pass_.committed, pass_.reservations
        ready = ResidentPhase.READY
        for resident in residents:
            accelerator = resident.accelerator
            if accelerator not in eligible:
                continue
            holding[accelerator] = True
            free = kept.get(accelerator)
            if (
                free is not None
                and resident.phase == ready
                and accelerator not in stale
                and slots.get(resident.key, 0) > 0
                and resident.key not in evicting
                and accelerator not in reservations
            ):
                free -= committed.get(accelerator, 0)
                if free < extra:
                    joined.lacks_lease_bytes(accelerator, extra, free)
                    continue
            joined.decision = _join_one(attempt, resident, joined)
            if joined.decision is not None:
                break
        return joined
    for resident in residents:
        if resident.accelerator not in eligible:
            continue
        holding[resident.accelerator] = True
        joined.decision = _join_one(attempt, resident, joined)
        if joined.decision is not None:
            break
    return joined


def _in_card_order(pass_: DecisionPass, deployment_id: str, residents: list[ResidentState]) -> list[ResidentState]:
    """A deployment's residents in the order of the pool's cards, once per pass while its list
    stays the same (a load started in the pass makes a new one)."""
    kept = pass_.join_order.get(deployment_id)
    if kept is not None and kept[0] is residents:
        return kept[1]
    position = pass_.position
    ordered = sorted(residents, key=lambda r: position.get(r.accelerator, 0))
    pass_.join_order[deployment_id] = (residents, ordered)
    return ordered


def _join_one(attempt: Attempt, resident: ResidentState, joined: _Joined) -> Grant | Assign | Wake | None:
    pass_, reasons, accelerator = attempt.pass_, joined.reasons, resident.accelerator
    if not pass_.budgets.fresh(accelerator):
        # Its node has not reported within freshness_s: it may be gone, and work sent there
        # would wait on a worker nobody can see.
        if not reasons.again(STALE):
            reasons.add(STALE, *refusal_reason(pass_, STALE, accelerator, attempt.now))
        return None
    if resident.key in pass_.evicting:
        # A higher request of this pass is unloading it to make room: joining it now would run
        # work on a model that is going away.
        reasons.add("evicting", WaitReason.MAKING_ROOM, f"{accelerator}: {resident.key} is being unloaded to make room")
        return None
    deployment = attempt.deployment
    if pass_.slots.get(resident.key, 0) <= 0:
        if not reasons.again("concurrency"):
            reasons.add(
                "concurrency",
                WaitReason.CONCURRENCY_FULL,
                f"{accelerator}: {deployment.deployment_id} at concurrency {deployment.concurrency}",
            )
        if resident.phase == ResidentPhase.READY:
            joined.full.append(resident)
        return None
    # Joining an idle resident keeps it from being unloaded until this lease ends: on a reserved
    # accelerator that counts as taking its bytes too.
    # So does joining one a request past its starvation bound needs unloaded (`joining_keeps`).
    nbytes = deployment.lease_extra_bytes
    if resident.phase == ResidentPhase.READY and (
        (resident.active_leases == 0 and resident.key not in pass_.in_use)
        or (pass_.reservations and joining_keeps(pass_, resident))
    ):
        nbytes += resident.bytes
    landing = Landing(nbytes, persists=False, attempt=attempt)
    if reservation_refuses(pass_, accelerator, landing):
        reasons.add(RESERVED, *refusal_reason(pass_, RESERVED, accelerator, attempt.now))
        return None
    if resident.phase == ResidentPhase.READY:
        return _join_ready(attempt, resident, landing, joined)
    if resident.phase in (ResidentPhase.LOADING, ResidentPhase.WAKING) or resident.key in pass_.waking:
        return _join_loading(attempt, resident, joined)
    if resident.phase == ResidentPhase.ASLEEP:
        return _wake(attempt, resident, joined)
    reasons.add("phase", WaitReason.MODEL_PHASE, f"{accelerator}: {deployment.deployment_id} is {resident.phase.value}")
    return None


def _join_ready(attempt: Attempt, resident: ResidentState, landing: Landing, joined: _Joined) -> Grant | None:
    pass_, accelerator, extra = attempt.pass_, resident.accelerator, attempt.deployment.lease_extra_bytes
    free = 0
    if extra:
        # The fast pass reads the card's schedulable bytes from the fit index (a deployment of
        # batch runners has one per running job, most full), a card it joins checked against
        # its budget, as the walk of phase 3 does.
        kept = pass_.fit.schedulable.get(accelerator) if pass_.fit is not None else None
        free = pass_.free(accelerator) if kept is None else kept - pass_.committed.get(accelerator, 0)
        if extra <= free and kept is not None and not pass_.fit_agrees((accelerator,)):
            free = pass_.free(accelerator)  # the index missed a change: it is gone for the pass
    if extra == 0 or extra <= free:
        take_reservation(pass_, accelerator, landing)
        return grant_on(attempt.queued, attempt.deployment, resident, attempt.now, pass_, attempt.counter)
    joined.lacks_lease_bytes(accelerator, extra, free)
    return None


def _join_loading(attempt: Attempt, resident: ResidentState, joined: _Joined) -> Assign | None:
    """A loading (or waking) resident: the request waits on it, its lease bytes held from now."""
    pass_, accelerator, extra = attempt.pass_, resident.accelerator, attempt.deployment.lease_extra_bytes
    if extra and extra > pass_.free(accelerator):
        joined.lacks_lease_bytes(accelerator, extra, pass_.free(accelerator))
        return None
    take_reservation(pass_, accelerator, Landing(extra, persists=False, attempt=attempt, lead_s=attempt.load_s))
    pass_.slots[resident.key] -= 1
    pass_.in_use[resident.key] = True
    pass_.commit(accelerator, extra)
    return Assign(attempt.queued.request_id, resident.key)


def _wake(attempt: Attempt, resident: ResidentState, joined: _Joined) -> Wake | None:
    """An asleep resident: waking takes back what it gave up, plus this lease's bytes, far
    cheaper than a load."""
    pass_, reasons, accelerator, deployment = attempt.pass_, joined.reasons, resident.accelerator, attempt.deployment
    awake = resident.awake_bytes if resident.awake_bytes is not None else deployment.resident_bytes
    wake_need = max(0, awake - resident.bytes) + deployment.lease_extra_bytes
    free = pass_.free(accelerator)
    if accelerator in pass_.blocked:
        reasons.add(BLOCKED, *refusal_reason(pass_, BLOCKED, accelerator, attempt.now))
        return None
    landing = Landing(wake_need, persists=True, attempt=attempt)
    if reservation_refuses(pass_, accelerator, landing):
        reasons.add(RESERVED, *refusal_reason(pass_, RESERVED, accelerator, attempt.now))
        return None
    if wake_need <= free:
        pass_.commit(accelerator, wake_need)
        take_reservation(pass_, accelerator, landing)
        pass_.slots[resident.key] -= 1
        pass_.in_use[resident.key] = True
        pass_.waking[resident.key] = True
        return Wake(resident.key, awake, [attempt.queued.request_id])
    joined.asleep.append((resident, wake_need))
    joined.short[accelerator] = True
    waking = f"{accelerator}: waking {resident.key} needs {wake_need} B, {free} B schedulable"
    reasons.add("asleep", WaitReason.MEMORY_HELD, waking)
    return None


class _Loads:
    """Phase 3's result: where a load of the model (and this lease) may go."""

    __slots__ = ("backfill_only", "best", "need", "open", "persists", "reasons", "room_candidates", "short")

    def __init__(self, need: int, persists: bool) -> None:
        self.need = need  # the model's bytes and this lease's
        self.persists = persists  # a batch resident (residency none) goes with its lease; others stay
        # The accelerators it looked at (those where no higher request waits for memory): the
        # ones it blocks if it has to wait.
        self.open: list[str] = []
        self.reasons = Reasons()
        self.best: tuple[int, str] | None = None  # (bytes left over, accelerator)
        # Where it may land but does not fit yet (making room may help), and every card where it
        # may land (where preemption may make room).
        self.short: list[str] = []
        self.room_candidates: list[str] = []
        # Held for a gang, not for this request: later work that ends in time may still
        # backfill them, so this wait blocks nothing there.
        self.backfill_only: dict[str, bool] = {}


def _score_loads(attempt: Attempt, passed: list[str], holding: dict[str, bool]) -> _Loads:
    """Phase 3: every accelerator where the model may land now (`landing_refusals`) and whether
    it fits there, best fit first."""
    pass_, deployment = attempt.pass_, attempt.deployment
    need = deployment.resident_bytes + deployment.lease_extra_bytes
    loads = _Loads(need, deployment.residency != Residency.NONE)
    landing = Landing(need, loads.persists, attempt, attempt.load_s)
    if pass_.fit is not None and pass_.fit_misses < _INDEXED_MISSES:
        loads.best = _best_fit_indexed(attempt, landing, holding)
        if loads.best is not None:
            return loads  # what else a walk gathers serves only a request that cannot load
    loads.open = _open_accelerators(attempt, passed, holding, loads.reasons)
    candidates = [a for a in loads.open if a not in holding] if holding else loads.open
    # A walk of the fast pass over many cards goes by what refuses them (`_walk_by_kind`),
    # reading their staleness and pressure from one walk of the pass and their schedulable
    # bytes from the fit index (the chosen card's checked against its budget below); the
    # reference pass asks each card itself. The property tests compare the two.
    fast = pass_.indexed and len(candidates) > _SHUT_FROM
    if fast and pass_.fit is not None:
        _walk_by_kind(attempt, candidates, landing, loads)
        if loads.best is not None and not pass_.fit_agrees((loads.best[1],)):
            return _score_loads(attempt, passed, holding)  # walked again without the index
        return loads
    _walk_each(attempt, candidates, landing, loads, shut_cards(pass_, attempt.production) if fast else None)
    return loads


def _walk_each(
    attempt: Attempt, candidates: list[str], landing: Landing, loads: _Loads, shut: dict[str, str] | None
) -> None:
    """`_score_loads`'s walk card by card: whether the load may land on each (`landing_refusals`,
    staleness and pressure read from `shut` where given) and whether it fits there."""
    pass_, need = attempt.pass_, loads.need
    budgets, committed, reasons = pass_.budgets, pass_.committed, loads.reasons
    for accelerator, refusal in landing_refusals(pass_, candidates, attempt.production, landing, shut):
        if refusal:
            if not reasons.again(refusal):
                reasons.add(refusal, *refusal_reason(pass_, refusal, accelerator, attempt.now))
            if refusal == RESERVED:
                loads.backfill_only[accelerator] = True
            continue
        loads.room_candidates.append(accelerator)
        free = budgets[accelerator].schedulable_bytes - committed.get(accelerator, 0)  # `pass_.free`
        if need <= free:
            if loads.best is None or (free - need, accelerator) < loads.best:
                loads.best = (free - need, accelerator)
            continue
        loads.short.append(accelerator)
        if not reasons.again("no_room"):
            reasons.add("no_room", WaitReason.MEMORY_HELD, f"{accelerator}: needs {need} B, {free} B schedulable")


def _walk_by_kind(attempt: Attempt, candidates: list[str], landing: Landing, loads: _Loads) -> None:
    """`_score_loads`'s walk over many cards, by what refuses them rather than card by card:
    on a busy pool a request that finds no room walks thousands of cards only to learn why it
    waits. The cards stale or under pressure (`shut_cards`) and those a reservation keeps the
    load off are looked up among the candidates; the cards with its bytes free can only be the
    fit index's tail from the bytes needed and the cards this pass promised bytes on (or gave
    some back); every other card lacks room. The same best fit, cards to make room on (in the
    pool's order) and reasons (each kind with its first card and count, in the order a walk
    meets them) as the walk card by card (`_walk_each`; the property tests compare the two)."""
    pass_, now = attempt.pass_, attempt.now
    fit = pass_.fit
    assert fit is not None
    need, position = loads.need, pass_.position
    among = dict.fromkeys(candidates, True)
    refused: dict[str, list[str]] = {}
    for card, kind in shut_cards(pass_, attempt.production).items():
        if card in among:
            refused.setdefault(kind, []).append(card)
    out: dict[str, bool] = {}
    for cards in refused.values():
        out.update(dict.fromkeys(cards, True))
    if pass_.reservations:
        held = sorted((c for c in pass_.reservations if c in among and c not in out), key=position.__getitem__)
        kept_off = [card for card in held if reservation_refuses(pass_, card, landing)]
        if kept_off:
            refused[RESERVED] = kept_off
            loads.backfill_only.update(dict.fromkeys(kept_off, True))
            out.update(loads.backfill_only)
    room = [card for card in candidates if card not in out] if out else list(candidates)
    loads.room_candidates = room
    in_room = dict.fromkeys(room, True) if out else among
    committed, schedulable = pass_.committed, fit.schedulable
    order = fit.order
    maybe = dict.fromkeys(order[i][1] for i in range(fit.from_bytes(need), len(order)))
    maybe.update((card, True) for card, promised in committed.items() if promised)
    fitting: dict[str, bool] = {}
    for card in maybe:
        if card in in_room:
            free = schedulable[card] - committed.get(card, 0)
            if need <= free:
                fitting[card] = True
                if loads.best is None or (free - need, card) < loads.best:
                    loads.best = (free - need, card)
    loads.short = [card for card in room if card not in fitting] if fitting else room
    kinds = [(min(position[c] for c in cards), kind, cards) for kind, cards in refused.items()]
    if loads.short:
        kinds.append((position[loads.short[0]], "no_room", loads.short))
    for _, kind, cards in sorted(kinds):
        first = min(cards, key=position.__getitem__)
        if kind == "no_room":
            free = schedulable[first] - committed.get(first, 0)
            text = f"{first}: needs {need} B, {free} B schedulable"
            loads.reasons.add(kind, WaitReason.MEMORY_HELD, text, len(cards))
        else:
            loads.reasons.add(kind, *refusal_reason(pass_, kind, first, now), len(cards))


# A walk over more cards than this reads their staleness and pressure from one walk of the pass
# (`shut_cards`); a shorter one asks each card itself.
_SHUT_FROM = 64
# How many cards with room the indexed search looks at before it leaves the choice to the walk
# over every card (they refused the load: stale, under pressure, reserved for a gang, blocked by
# a request ahead), and how many searches a pass lets end that way before it walks for the rest:
# on a pool whose cards with room all refuse, the search only adds to the walk.
_INDEXED_LOOKS = 64
_INDEXED_MISSES = 3


def _best_fit_indexed(attempt: Attempt, landing: Landing, holding: dict[str, bool]) -> tuple[int, str] | None:
    """Phase 3's best fit from the fit index (`_fit_index`): the card that `_score_loads`'s walk
    would choose, the least schedulable bytes left over then the id, found by searching from the
    bytes needed. Cards this pass already promised bytes on are compared by what they have left.
    None when no card with room takes it within `_INDEXED_LOOKS` looks: the walk decides then,
    and gathers what waiting or making room needs."""
    pass_ = attempt.pass_
    fit = pass_.fit
    assert fit is not None
    need = landing.nbytes
    eligible = pass_.eligible[(attempt.deployment.deployment_id, attempt.production)]
    blocked, committed, budgets = pass_.blocked, pass_.committed, pass_.budgets
    best: tuple[int, str] | None = None

    def lands(card: str) -> bool:
        if card not in eligible or card in blocked or card in holding:
            return False
        return next(iter(landing_refusals(pass_, (card,), attempt.production, landing)))[1] == ""

    for card, promised in committed.items():
        if promised:
            free = budgets[card].schedulable_bytes - promised
            if need <= free and (best is None or (free - need, card) < best) and lands(card):
                best = (free - need, card)
    order, looks = fit.order, 0
    for i in range(fit.from_bytes(need), len(order)):
        schedulable, card = order[i]
        if best is not None and (schedulable - need, card) >= best:
            break
        if committed.get(card):
            continue  # compared above, by what it has left
        if lands(card):
            if not pass_.fit_agrees((card,)):
                return None  # placed by the walk
            return (schedulable - need, card)
        looks += 1
        if looks >= _INDEXED_LOOKS:
            pass_.fit_misses += 1
            return None
    return best


def _nothing_fits(attempt: Attempt, holding: dict[str, bool]) -> bool:
    """Whether phase 3 would find no card for a load, from the fit index (the fast pass): no
    card the load may use has its bytes free. Looks only at the cards with that much
    schedulable that are neither stale nor under pressure for it (`_open_order`'s tail from the
    bytes needed), each as `_score_loads`'s walk reads it. False when unsure (no index), and
    when few cards are left open (their walk costs less)."""
    pass_, deployment = attempt.pass_, attempt.deployment
    fit = pass_.fit
    if fit is None or not pass_.indexed or len(pass_.pool_accelerators) - len(pass_.blocked) <= _SHUT_FROM:
        return False  # (a walk over the few cards left open costs less than this)
    need = deployment.resident_bytes + deployment.lease_extra_bytes
    eligible = pass_.eligible[(deployment.deployment_id, attempt.production)]
    blocked, committed, reservations = pass_.blocked, pass_.committed, pass_.reservations
    landing = Landing(need, deployment.residency != Residency.NONE, attempt, attempt.load_s)
    order = _open_order(pass_, attempt.production)
    start = bisect_left(order, (need, ""))
    # The open cards it may use with its bytes schedulable, in the index's order: from the
    # deployment's own cards where they are fewer than the order's tail (a deployment pinned to a
    # few cards of a large pool), else from that tail. The same cards in the same order either way.
    if len(eligible) < len(order) - start:
        shut, held = shut_cards(pass_, attempt.production), fit.schedulable
        candidates: Iterable[tuple[int, str]] = sorted(
            (held[card], card) for card in eligible if card in held and held[card] >= need and card not in shut
        )
    else:
        candidates = (order[i] for i in range(start, len(order)) if order[i][1] in eligible)
    for schedulable, card in candidates:
        if card in holding or card in blocked:
            continue
        if schedulable - committed.get(card, 0) < need:
            continue
        if not reservations or not reservation_refuses(pass_, card, landing):
            return False
    return True


def _room_candidates(attempt: Attempt, passed: list[str], holding: dict[str, bool]) -> _Loads:
    """Phase 3's result where `_nothing_fits`, as phase 4 reads it, without the walk: the cards
    the load may use (`landing_refusals`) that hold idle residents or preemptible work, each
    short of the bytes (nothing fits), in the pool's order. Reasons, and the cards a wait
    blocks, are left to the walk: only a request that waits needs them."""
    pass_, deployment = attempt.pass_, attempt.deployment
    loads = _Loads(deployment.resident_bytes + deployment.lease_extra_bytes, deployment.residency != Residency.NONE)
    eligible = pass_.eligible[(deployment.deployment_id, attempt.production)]
    cards = [a for a in _room_cards(pass_) if a in eligible and a not in holding]
    landing = Landing(loads.need, loads.persists, attempt, attempt.load_s)
    shut = shut_cards(pass_, attempt.production)
    refusals = landing_refusals(pass_, cards, attempt.production, landing, shut)
    loads.room_candidates = [a for a, refusal in refusals if not refusal]
    loads.short = loads.room_candidates
    return loads


def _open_order(pass_: DecisionPass, production: bool) -> list[tuple[int, str]]:
    """The fit index's order less the cards stale or under pressure for this kind of work
    (`shut_cards`), once per pass: on a pool under pressure most cards with room are those."""
    key = ("open_order", production)
    cached = pass_.memo.get(key)
    if cached is None:
        assert pass_.fit is not None
        shut = shut_cards(pass_, production)
        cached = [entry for entry in pass_.fit.order if entry[1] not in shut] if shut else pass_.fit.order
        pass_.memo[key] = cached
    return cached  # type: ignore[return-value]


def _room_cards(pass_: DecisionPass) -> list[str]:
    """The cards holding idle residents or preemptible work, in the pool's order, once per pass."""
    cached = pass_.memo.get(("room_cards",))
    if cached is None:
        position = pass_.position
        cached = sorted({**pass_.evictable, **pass_.preemptible}, key=lambda a: position.get(a, 0))
        pass_.memo[("room_cards",)] = cached
    return cached  # type: ignore[return-value]


def _open_accelerators(attempt: Attempt, passed: list[str], holding: dict[str, bool], reasons: Reasons) -> list[str]:
    """`passed` less the accelerators where a higher request already waits for memory (the first
    part of `landing_refusals`, in one sweep: on a busy pool that is most of them)."""
    pass_ = attempt.pass_
    blocked = pass_.blocked
    if not blocked:
        return passed
    if len(blocked) == len(pass_.pool_accelerators):
        open_accelerators = []
    else:
        open_accelerators = [a for a in passed if a not in blocked and a not in holding]
    shut = len(passed) - len(open_accelerators) - len(holding)
    if shut > 0:
        first = next(a for a in passed if a in blocked and a not in holding)
        code, text = refusal_reason(pass_, BLOCKED, first, attempt.now)
        reasons.add(BLOCKED, code, text, shut)
    return open_accelerators


def _start_load(attempt: Attempt, loads: _Loads) -> StartLoad:
    """Phase 3, chosen: load on the best fit. The model's bytes and this request's lease bytes
    are both promised from now on."""
    pass_, deployment = attempt.pass_, attempt.deployment
    assert loads.best is not None
    _, accelerator = loads.best
    acc = pass_.state.catalog.accelerator(accelerator)
    assert acc is not None
    pass_.commit(accelerator, loads.need)
    take_reservation(pass_, accelerator, Landing(loads.need, loads.persists, attempt, attempt.load_s))
    key = resident_key(deployment.deployment_id, accelerator)
    pass_.slots[key] = deployment.concurrency - 1
    # Later requests of this pass join the load (up to its concurrency) instead of starting a
    # second one under the same key on the same card.
    # A new list, not an append: the lists a pass starts from are kept across passes (`_standing`).
    pass_.residents_of[deployment.deployment_id] = [
        *pass_.residents_of.get(deployment.deployment_id, []),
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
            requested_at=attempt.now,
        ),
    ]
    return StartLoad(
        key, deployment.deployment_id, accelerator, acc.node, deployment.resident_bytes, [attempt.queued.request_id]
    )


def _make_room(attempt: Attempt, loads: _Loads, joined: _Joined) -> list[Unload | Sleep] | Preemption | None:
    """Phase 4: the cheapest idle residents to evict (where it falls short, or for the wake of
    an asleep copy), else a slot or the bytes of work its class may preempt."""
    pass_, queued = attempt.pass_, attempt.queued
    options = _eviction_options(attempt, loads, joined.asleep)
    if options:
        _, accelerator, plan = min(options)
        for key, _ in plan:
            pass_.evicting[key] = True
        pass_.blocked[accelerator] = True
        return room_decisions(plan, f"making room for {queued.capability} ({queued.priority})")
    if not pass_.preemptible:
        return None
    preemption = slot_preemption(pass_, queued, joined.full) if joined.full else None
    if preemption is None:
        preemption = preemption_plan(pass_, queued, attempt.deployment, loads.need, loads.room_candidates)
    return preemption


def _eviction_options(
    attempt: Attempt, loads: _Loads, asleep: list[tuple[ResidentState, int]]
) -> list[tuple[int, str, list[tuple[str, bool]]]]:
    """(bytes evicted, accelerator, plan) for each place making room would help: a load where it
    falls short, and an asleep copy of this model whose wake does not fit yet (as good an
    option as making room for a load elsewhere)."""
    pass_, deployment_id = attempt.pass_, attempt.deployment.deployment_id
    residents = pass_.state.residents
    wanted = [(a, loads.need) for a in loads.short if a in pass_.evictable]
    wanted += [
        (s.accelerator, need)
        for s, need in asleep
        if s.accelerator in pass_.evictable and s.accelerator not in pass_.reservations
    ]
    options = []
    for accelerator, need in wanted:
        plan = eviction_plan(pass_, accelerator, deployment_id, need, attempt.production)
        if plan is not None:
            options.append((sum(residents[k].bytes for k, _ in plan), accelerator, plan))
    return options


def _wait(attempt: Attempt, passed: list[str], loads: _Loads, reasons: Reasons, joined: _Joined) -> Reject | Wait:
    """Phase 5, nothing fits now: refused at once when no release of ModelForge's own work could
    ever help; else it waits, and later requests may not take new bytes where it waits. Where
    it only waits for a slot of its own resident (no second copy goes there, and joining wants
    no more bytes than are free), it waits for no memory: lower work may use what is free there."""
    pass_, queued = attempt.pass_, attempt.queued
    never = _never_fits(pass_, passed, loads.need)
    if never is not None:
        return Reject(queued.request_id, queued.workflow_id, never[0], never[1])
    budgets = pass_.budgets
    slot_only = joined.holding
    starved = _reserve_starved(attempt, loads, joined) if starving(pass_.state.catalog, queued, attempt.now) else ""
    # Staleness as the walk read it, when it read it from the pass's (`shut_cards`).
    shut = pass_.shut.get(attempt.production) if pass_.indexed else None
    backfill_only, short = loads.backfill_only, joined.short
    # In one sweep: on a busy pool a request that waits blocks thousands of cards.
    blocking = [
        accelerator
        for accelerator in loads.open
        if (accelerator not in slot_only or accelerator in short)
        and (shut.get(accelerator) != STALE if shut is not None else budgets.fresh(accelerator))
        and accelerator not in backfill_only
    ]
    pass_.blocked.update(dict.fromkeys(blocking, True))
    reason, codes = str(reasons) or "waiting for capacity", reasons.codes() or (WaitReason.MEMORY_HELD,)
    if starved:
        codes = tuple(dict.fromkeys((*codes, WaitReason.STARVATION_RESERVATION)))
        return Wait(queued.request_id, f"{reason}; {starved}", codes)
    return Wait(queued.request_id, reason, codes)


def _reserve_starved(attempt: Attempt, loads: _Loads, joined: _Joined) -> str:
    """A request waiting past its class's starvation bound (its level's `starvation_bound_s`)
    reserves the card where it falls short least, among those where it could fit with
    ModelForge's evictable work gone (capacity exists) and no other reservation holds: a load's
    card (`loads.short`), or one holding its resident that joining or waking lacks bytes on
    (`joined.short`). It is the gang reservation's rule (`_reservation`): later work of this pass
    (its own class's and lower classes'; higher classes were placed before it, so class order is
    unchanged) takes bytes there only within the spare or if it ends before the bytes come back
    by the leases' end times (never, without them); joining a resident it needs unloaded counts
    that resident's bytes. Returns what was reserved, or ""."""
    pass_, queued, now = attempt.pass_, attempt.queued, attempt.now
    # Whether it reserves depends on its own submission time.
    attempt.reusable = False
    budgets, reservations = pass_.budgets, pass_.reservations
    wake_need = {r.accelerator: need for r, need in joined.asleep}
    # (card, bytes it needs there, whether a load: only a load needs other residents unloaded)
    wanted = [(a, loads.need, True) for a in loads.short]
    wanted += [
        (a, wake_need.get(a, attempt.deployment.lease_extra_bytes), False)
        for a in joined.short
        if budgets[a].fresh and (attempt.production or not pass_.state.accelerators.get(a, IDLE_RUNTIME).pressure)
    ]
    best: tuple[int, int, str, int, bool] | None = None
    for accelerator, need, load in wanted:
        budget = budgets[accelerator]
        ceiling = budget.total_bytes - budget.reserve_bytes - budget.external_bytes - pass_.pinned.get(accelerator, 0)
        if accelerator in reservations or need > ceiling:
            continue
        option = (need - pass_.free(accelerator), pass_.position.get(accelerator, 0), accelerator, need, load)
        if best is None or option < best:
            best = option
    if best is None:
        return ""
    _, _, accelerator, need, load = best
    on = leases_on(pass_).get(accelerator, {}).values()
    free = pass_.free(accelerator)
    timeline = release_timeline(on, pass_.state.residents, now, [])
    starts_at = free_at(free, timeline, need, now)
    spare = free - need + (freed_by(timeline, starts_at) if not math.isinf(starts_at) else 0)
    reservations[accelerator] = Reservation(
        queued.request_id,
        starts_at,
        max(0, spare),
        starving=True,
        keeps_residents=load and need > free + sum(lease.bytes for lease in on),
        production=attempt.production,
    )
    waited = now - queued.submitted_at
    return f"{STARVED} waited {waited:.0f} s, past its class's starvation bound: reserved {accelerator}"


def _never_fits(pass_: DecisionPass, passed: list[str], need: int) -> tuple[FailureClass, str] | None:
    """Why no release of ModelForge's own work could ever make `need` bytes fit on any of the
    cards `passed`, or None. It reads budgets and pinned bytes, which a pass does not change:
    once per pass for each list of cards (the pass keeps them) and size."""
    key = ("never_fits", id(passed), need)
    memo = pass_.memo
    if key not in memo:
        memo[key] = _never_fits_now(pass_, passed, need)
    return memo[key]  # type: ignore[return-value]


def _never_fits_now(pass_: DecisionPass, passed: list[str], need: int) -> tuple[FailureClass, str] | None:
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
