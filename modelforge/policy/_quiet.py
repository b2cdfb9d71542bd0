"""A pool where everything waits, kept across passes: the pass after a new request, or after
telemetry that changed nothing, decides from what the last pass settled instead of walking the
queue again.

On a full pool (every card busy, nothing fits, every request waiting) a pass decides nothing but
waits, yet placed the first request of every capability again (each over every card) to learn
that. When the last fast pass decided only waits, it is remembered here with what its outcome
rested on; the next pass, if none of that changed, knows the outcome of every request already
queued (the same: they were told it) and decides a new request from its class and order alone:
it comes after the request at which its capability settled on waiting in that pass (the one the
fast pass placed; every later one of its kind is told the same reason, `_placement.Settled`),
so it is told that reason, as the walk would tell it. A new request ordered before that point,
of a capability that did not settle on waiting, past its starvation bound, with a deadline or
waiting on a load is decided by the whole pass.

What the outcome rests on, checked before it is reused (any change: the whole pass):
- the catalog and configuration, the residents and leases (`_standing`'s groupings, by
  identity: rebuilt whenever one came, went or changed), the leases being preempted, always_warm
  backoffs;
- every card's schedulable bytes, health and GPU_PRESSURE (`_fit_index`'s version), and no card
  whose reserve moves with time;
- the queue: no request whose placement changed what later ones saw left, none was assigned to
  a load since, and none has a deadline;
- the fair-share order of the tenants (which of them come first, ties included);
- time: the pass is reused only before the first moment something in it would change on its own
  (a request expiring or passing its class's starvation bound, a card's observation going
  stale, a node falling silent, a lease becoming preemptible, an always_warm backoff ending);
- the pass made no reservation (its text counts seconds from `now`).

The reference pass never uses it; the property tests (`test_policy_full_pool`) compare."""

from __future__ import annotations

import math
from dataclasses import dataclass

from modelforge.domain import fair_share_entity
from modelforge.policy._decisions import Decisions, Wait
from modelforge.policy._fit_index import FitIndex
from modelforge.policy._order import class_rank, fair_share_scores, production_ranks, starvation_bound, starving
from modelforge.policy._pass import IDLE_RUNTIME, DecisionPass
from modelforge.policy._queue_index import QueueIndex, queue_index
from modelforge.policy._standing import lease_groups, resident_groups
from modelforge.policy._state import PoolState, QueuedRequest

_KEY = "_policy_quiet_pool"

# Where a request comes in a pass's walk: (class rank, its tenant's place in the fair-share
# order, submission time, request id).
WalkKey = tuple[int, int, float, str]
# A settled capability: (production or not, capability) -> (where it settled, the reason).
SettledAt = dict[tuple[bool, str], tuple[WalkKey, str]]


@dataclass
class QuietPool:
    """The last pass that decided only waits, and what its outcome rested on."""

    catalog: object
    config: object
    residents: object
    leases: object
    fit: FitIndex
    fit_version: int
    queue: QueueIndex
    assignments: int
    # The requests whose placement changed what later ones saw (`DecisionPass.placed`): one of
    # them leaving may free what it held back; any other leaving changes no one's outcome (it was
    # told a settled reason, or its placement found what the next of its kind would find).
    placed: dict[str, bool]
    preempting: dict[str, bool]
    warm_backoff: dict[str, list[float]]
    order: dict[str, int]
    settled: SettledAt
    valid_until: float
    production: dict[int, bool]  # the ranks of production classes (`_order.production_ranks`)
    pending: list[Wait]  # the waits decided last: checked applied before the next reuse


def fair_share_order(scores: dict[str, float]) -> dict[str, int]:
    """Each fair-share entity's place in the order a pass walks the tenants of a class in
    (ties share a place), from `fair_share_scores`; "" is the place of an entity with no score
    (0)."""
    places = {value: n for n, value in enumerate(sorted({-v for v in scores.values()} | {0.0}))}
    order = {entity: places[-value] for entity, value in scores.items()}
    order[""] = places[0.0]
    return order


def walk_key(state: PoolState, queued: QueuedRequest, order: dict[str, int]) -> WalkKey:
    place = order.get(fair_share_entity(queued.priority, queued.tenant), order[""])
    return (class_rank(state.catalog, queued.priority), place, queued.submitted_at, queued.request_id)


def forget(state: PoolState) -> None:
    state.__dict__.pop(_KEY, None)


def reuse(pass_: DecisionPass, now: float) -> Decisions | None:
    """The decisions of this pass from the last one, if nothing it rested on changed and every
    request that came since is told a settled reason; else None (the whole pass decides)."""
    state = pass_.state
    quiet: QuietPool | None = state.__dict__.get(_KEY)
    if quiet is None:
        return None
    index = queue_index(state)
    fit = pass_.fit
    if (
        now >= quiet.valid_until
        or fit is None
        or fit is not quiet.fit
        or fit.version != quiet.fit_version
        or fit.volatile
        or index is not quiet.queue
        or index.assignments != quiet.assignments
        or any(request_id in quiet.placed for request_id in index.departed)
        or index.deadlines
        or state.catalog is not quiet.catalog
        or state.config is not quiet.config
        or resident_groups(state) is not quiet.residents
        or lease_groups(state) is not quiet.leases
        or state.preempting != quiet.preempting
        or state.warm_backoff != quiet.warm_backoff
    ):
        forget(state)
        return None
    # The waits it decided were applied: the requests still queued carry what they were told.
    by_id = index.by_id
    for wait in quiet.pending:
        told = by_id.get(wait.request_id)
        if told is not None and told.waiting_reason != wait.reason:
            forget(state)
            return None
    order = fair_share_order(fair_share_scores(state, now))
    if order != quiet.order:
        forget(state)
        return None
    decisions = Decisions()
    catalog = state.catalog
    valid_until = quiet.valid_until
    for queued in index.arrivals:
        if queued.request_id not in by_id:
            continue  # came and went
        key = walk_key(state, queued, order)
        settled = quiet.settled.get((class_rank(catalog, queued.priority) in quiet.production, queued.capability))
        if (
            settled is None
            or key <= settled[0]
            or queued.assigned_to
            or queued.deadline_at is not None
            or queued.expires_at <= now
            or starving(catalog, queued, now)
        ):
            forget(state)
            return None
        if queued.waiting_reason != settled[1]:
            decisions.waits.append(Wait(queued.request_id, settled[1]))
        valid_until = min(valid_until, queued.expires_at, _starves_at(state, queued))
    index.arrivals, index.departed = [], []
    quiet.valid_until = valid_until
    quiet.pending = decisions.waits
    return decisions


def remember(pass_: DecisionPass, decisions: Decisions, settled: SettledAt, order: dict[str, int], now: float) -> None:
    """After a whole fast pass: remembered if it decided nothing but waits, else forgotten."""
    state = pass_.state
    forget(state)
    index = queue_index(state)
    index.arrivals, index.departed = [], []
    fit = pass_.fit
    if (
        fit is None
        or fit.volatile
        or index.deadlines
        or pass_.reservations
        or decisions.grants
        or decisions.rejects
        or decisions.loads
        or decisions.assigns
        or decisions.unloads
        or decisions.sleeps
        or decisions.wakes
        or decisions.preemptions
    ):
        return
    valid_until = _valid_until(pass_, index, now)
    if valid_until <= now:
        return
    state.__dict__[_KEY] = QuietPool(
        catalog=state.catalog,
        config=state.config,
        residents=resident_groups(state),
        leases=lease_groups(state),
        fit=fit,
        fit_version=fit.version,
        queue=index,
        assignments=index.assignments,
        placed=pass_.placed,
        preempting=dict(state.preempting),
        warm_backoff={deployment: list(backoff) for deployment, backoff in state.warm_backoff.items()},
        order=order,
        settled=settled,
        valid_until=valid_until,
        production=production_ranks(state.catalog),
        pending=decisions.waits,
    )


def _starves_at(state: PoolState, queued: QueuedRequest) -> float:
    bound = starvation_bound(state.catalog, queued.priority)
    return math.inf if bound is None else queued.submitted_at + bound


def _valid_until(pass_: DecisionPass, index: QueueIndex, now: float) -> float:
    """The first moment the pass's outcome would change with time alone."""
    state = pass_.state
    config = state.config
    until = math.inf
    for lane in index.lanes.values():
        until = min(until, lane.min_expiry)
        bound = starvation_bound(state.catalog, lane.priority)
        if bound is not None and lane.items:
            until = min(until, lane.items[0].submitted_at + bound)
    stale_after = min(config.freshness_s, config.node_silent_s)
    if math.isfinite(stale_after):
        runtimes = state.accelerators
        for card in pass_.pool_accelerators:
            observation = runtimes.get(card.id, IDLE_RUNTIME).observation
            if observation is None:
                return -math.inf  # never observed: stale, and its reason counts nothing
            until = min(until, observation.received_at + stale_after)
    min_runtime = config.preempt_min_runtime_s
    for lease, _ in lease_groups(state).of_preemptible:
        eligible_at = lease.granted_at + min_runtime
        if eligible_at > now:
            until = min(until, eligible_at)
    for backoff in state.warm_backoff.values():
        if backoff[1] > now:
            until = min(until, backoff[1])
    return until
