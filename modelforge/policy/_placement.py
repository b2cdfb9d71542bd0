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
from dataclasses import dataclass, field

from modelforge.domain import Accelerator, Deployment, Residency, fair_share_entity, resident_key
from modelforge.failures import FailureClass
from modelforge.policy._budget import Budget, budget_from_sums
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
    Wake,
)
from modelforge.policy._order import (
    class_rank,
    fair_share_scores,
    is_production,
    may_preempt,
    ordered_buckets,
    production_ranks,
)
from modelforge.policy._queue_index import Lane, queue_index
from modelforge.policy._reservation import Reservation, choose_reserved, free_at, freed_by, release_timeline
from modelforge.policy._state import AcceleratorRuntime, Lease, PoolState, QueuedRequest, ResidentPhase, ResidentState
from modelforge.policy._topology import GangShape, choose_gang

_IDLE_RUNTIME = AcceleratorRuntime()


@dataclass(frozen=True)
class FilterResult:
    accelerator: str
    passed: bool
    reason: str = ""
    permanent: bool = True


class _Reasons:
    """Why a request waits, one line per kind of reason with how many accelerators gave it."""

    def __init__(self) -> None:
        self._first: dict[str, str] = {}
        self._count: dict[str, int] = {}

    def add(self, kind: str, text: str, count: int = 1) -> None:
        if kind in self._count:
            self._count[kind] += count
        else:
            self._first[kind] = text
            self._count[kind] = count

    def __str__(self) -> str:
        parts = []
        for kind, text in self._first.items():
            more = self._count[kind] - 1
            parts.append(text if more == 0 else f"{text} (and {more} more like it)")
        return "; ".join(parts)


class _Budgets:
    """The invariant per accelerator, computed the first time a pass asks for it: most passes
    (a release, a heartbeat, an empty queue) look at a handful of a large pool's cards."""

    __slots__ = ("_cache", "_leased", "_now", "_resident", "_state")

    def __init__(self, state: PoolState, resident: dict[str, int], leased: dict[str, int], now: float) -> None:
        self._state = state
        self._resident = resident
        self._leased = leased
        self._now = now
        self._cache: dict[str, Budget] = {}

    def __getitem__(self, accelerator_id: str) -> Budget:
        budget = self._cache.get(accelerator_id)
        if budget is None:
            state = self._state
            accelerator = state.catalog.accelerator(accelerator_id)
            if accelerator is None:
                raise KeyError(accelerator_id)
            budget = budget_from_sums(
                accelerator,
                state.accelerators.get(accelerator_id, _IDLE_RUNTIME),
                self._resident.get(accelerator_id, 0),
                self._leased.get(accelerator_id, 0),
                state.config,
                self._now,
            )
            self._cache[accelerator_id] = budget
        return budget


@dataclass
class _Pass:
    """What one decision pass knows and has committed, so it never double-books."""

    state: PoolState
    budgets: _Budgets
    pool_accelerators: list[Accelerator]
    unhealthy: dict[str, bool]
    residents_of: dict[str, list[ResidentState]]
    evictable: dict[str, list[ResidentState]]
    pinned: dict[str, int]
    # Per accelerator: leases that may be preempted, those already being preempted first, then
    # the lowest class, then the youngest (the least work lost).
    preemptible: dict[str, list[Lease]] = field(default_factory=dict)
    preempting: dict[str, bool] = field(default_factory=dict)
    committed: dict[str, int] = field(default_factory=dict)
    slots: dict[str, int] = field(default_factory=dict)
    evicting: dict[str, bool] = field(default_factory=dict)
    # Residents this pass granted on or assigned to: busy from now on, whatever the state says.
    in_use: dict[str, bool] = field(default_factory=dict)
    # Accelerators on which a higher-ordered request waits for memory: later requests may join
    # ready residents there but must not take new bytes ahead of it.
    blocked: dict[str, bool] = field(default_factory=dict)
    position: dict[str, int] = field(default_factory=dict)
    # Lease bytes held for requests that wait on a load (request id -> bytes): promised when the
    # load was decided, so nothing ordered after them takes them while the model loads.
    reserved: dict[str, int] = field(default_factory=dict)
    static_filter: dict[tuple[str, bool], tuple[list[str], list[FilterResult]]] = field(default_factory=dict)
    eligible: dict[tuple[str, bool], dict[str, bool]] = field(default_factory=dict)
    # Asleep residents this pass decided to wake: later requests wait on them as on a load.
    waking: dict[str, bool] = field(default_factory=dict)
    # Accelerators held for waiting gangs (see `_reservation`): later work backfills them only.
    reservations: dict[str, Reservation] = field(default_factory=dict)
    # Set while placing a request whose outcome depended on its own max_duration (backfill) or
    # made a reservation: its wait is not reused for the rest of its capability in this pass.
    duration_sensitive: bool = False

    def free(self, accelerator: str) -> int:
        return self.budgets[accelerator].schedulable_bytes - self.committed.get(accelerator, 0)

    def commit(self, accelerator: str, nbytes: int) -> None:
        self.committed[accelerator] = self.committed.get(accelerator, 0) + nbytes

    def reserved_refusal(
        self, accelerator: str, queued: QueuedRequest, nbytes: int, persists: bool, now: float, lead_s: float = 0.0
    ) -> str:
        """Why `nbytes` may not be taken on `accelerator` for `queued` now ("" if they may): a
        reservation lets through work that ends before it starts, and bytes within its spare."""
        reservation = self.reservations.get(accelerator)
        if reservation is None or nbytes <= 0:
            return ""
        self.duration_sensitive = True
        if not persists and _ends_by(queued, now + lead_s) <= reservation.starts_at:
            return ""
        if nbytes <= reservation.spare:
            return ""
        return (
            f"{accelerator}: reserved for gang {reservation.gang} starting in {reservation.starts_at - now:.0f} s "
            "(only work that ends by then may use it)"
        )

    def take_reserved(
        self, accelerator: str, queued: QueuedRequest, nbytes: int, persists: bool, now: float, lead_s: float = 0.0
    ) -> None:
        """Bytes taken on a reserved accelerator that outlast the reservation's start come out
        of its spare."""
        reservation = self.reservations.get(accelerator)
        if reservation is None or nbytes <= 0:
            return
        if not persists and _ends_by(queued, now + lead_s) <= reservation.starts_at:
            return
        reservation.spare -= nbytes


def _idle_residents(pass_: _Pass, accelerator: str, production: bool) -> list[ResidentState]:
    """Idle residents an asker of this kind may unload on `accelerator` (a model that last
    served production goes only for production), none already going or in use this pass."""
    catalog = pass_.state.catalog
    return [
        r
        for r in pass_.evictable.get(accelerator, [])
        if r.key not in pass_.evicting
        and r.key not in pass_.in_use
        and (production or r.last_priority is None or not is_production(catalog, r.last_priority))
    ]


def _nodes_of(pass_: _Pass, accelerators: list[str]) -> list[str]:
    catalog = pass_.state.catalog
    return [acc.node if (acc := catalog.accelerator(a)) is not None else "" for a in accelerators]


def _ends_by(queued: QueuedRequest, start: float) -> float:
    return math.inf if queued.max_duration_s is None else start + queued.max_duration_s


_BECOMING_READY = (ResidentPhase.LOADING, ResidentPhase.WAKING, ResidentPhase.READY)


def _evictable(resident: ResidentState) -> bool:
    """Idle and not pinned: may be unloaded (or, awake and able to, put to sleep) to make room.
    An asleep resident still holds its kept bytes: it may be unloaded too."""
    return (
        resident.phase in (ResidentPhase.READY, ResidentPhase.ASLEEP)
        and resident.active_leases == 0
        and resident.residency != Residency.ALWAYS_WARM
    )


def _static_reason(accelerator: Accelerator, deployment: Deployment, production: bool) -> str:
    if deployment.accelerators and accelerator.id not in deployment.accelerators:
        return f"{accelerator.id}: not in the deployment's placement list"
    if deployment.gpu_memory_min and accelerator.total_bytes < deployment.gpu_memory_min:
        return (
            f"{accelerator.id}: {accelerator.total_bytes} B in all, below gpu_memory_min {deployment.gpu_memory_min} B"
        )
    if production:
        if not accelerator.production_eligible:
            return f"{accelerator.id}: production_eligible=false"
        if not deployment.production_eligible:
            return f"{accelerator.id}: deployment {deployment.deployment_id} is not production eligible"
        if accelerator.model not in deployment.measured_on:
            return (
                f"{accelerator.id}: envelope of {deployment.deployment_id} not measured on "
                f"{accelerator.model or 'this accelerator model'}"
            )
    return ""


def filter_accelerators(state: PoolState, deployment: Deployment, priority: str, now: float) -> list[FilterResult]:
    """Phase 1: each accelerator of the pool, accepted or rejected with its reason."""
    results: list[FilterResult] = []
    for accelerator in state.catalog.accelerators:
        if accelerator.pool != state.pool:
            continue
        reason = _static_reason(accelerator, deployment, is_production(state.catalog, priority))
        if reason:
            results.append(FilterResult(accelerator.id, False, reason, True))
            continue
        runtime = state.accelerators.get(accelerator.id)
        if runtime is not None and not runtime.healthy:
            results.append(FilterResult(accelerator.id, False, f"{accelerator.id}: UNHEALTHY", False))
            continue
        results.append(FilterResult(accelerator.id, True))
    return results


def _start_pass(state: PoolState, now: float) -> _Pass:
    accelerators = [a for a in state.catalog.accelerators if a.pool == state.pool]
    resident_sum: dict[str, int] = {}
    pinned: dict[str, int] = {}
    residents_of: dict[str, list[ResidentState]] = {}
    evictable: dict[str, list[ResidentState]] = {}
    for resident in state.residents.values():
        # Residents of every phase count, unloading and unreclaimed included, until NVML confirms.
        resident_sum[resident.accelerator] = resident_sum.get(resident.accelerator, 0) + resident.bytes
        residents_of.setdefault(resident.deployment, []).append(resident)
        if resident.residency == Residency.ALWAYS_WARM:
            pinned[resident.accelerator] = pinned.get(resident.accelerator, 0) + resident.bytes
        if _evictable(resident):
            evictable.setdefault(resident.accelerator, []).append(resident)
    leased_sum: dict[str, int] = {}
    preemptible: dict[str, list[Lease]] = {}
    min_runtime = state.config.preempt_min_runtime_s
    for lease in state.leases.values():
        held_on = lease.accelerators if lease.gang else (lease.accelerator,)
        for accelerator_id in held_on:
            leased_sum[accelerator_id] = leased_sum.get(accelerator_id, 0) + lease.bytes
        if lease.lease_id in state.preempting:
            for accelerator_id in held_on:
                preemptible.setdefault(accelerator_id, []).append(lease)
            continue
        leased = state.catalog.deployment(lease.deployment)
        if leased is not None and leased.preemptible and now - lease.granted_at >= min_runtime:
            for accelerator_id in held_on:
                preemptible.setdefault(accelerator_id, []).append(lease)
    for leases in preemptible.values():
        leases.sort(
            key=lambda lease: (
                lease.lease_id not in state.preempting,
                class_rank(state.catalog, lease.priority),
                -lease.granted_at,
                lease.lease_id,
            )
        )
    budgets = _Budgets(state, resident_sum, leased_sum, now)
    # Cheapest to unload first, then the largest (fewest models go), then by key.
    catalog = state.catalog
    for candidates in evictable.values():
        candidates.sort(key=lambda r: (_unload_cost(catalog.deployment(r.deployment)), -r.bytes, r.key))
    unhealthy = {a: True for a, runtime in state.accelerators.items() if not runtime.healthy}
    pass_ = _Pass(
        state=state,
        budgets=budgets,
        pool_accelerators=accelerators,
        unhealthy=unhealthy,
        residents_of=residents_of,
        evictable=evictable,
        pinned=pinned,
        preemptible=preemptible,
        position={a.id: i for i, a in enumerate(accelerators)},
    )
    for resident in state.residents.values():
        deployment = catalog.deployment(resident.deployment)
        concurrency = deployment.concurrency if deployment else 1
        pass_.slots[resident.key] = concurrency - resident.active_leases
    for queued in queue_index(state).assigned.values():
        if queued.assigned_to:
            waited_on = state.residents.get(queued.assigned_to)
            if waited_on is None or waited_on.phase not in _BECOMING_READY:
                continue
            deployment = catalog.deployment(waited_on.deployment)
            extra = deployment.lease_extra_bytes if deployment is not None else 0
            if extra:
                pass_.commit(waited_on.accelerator, extra)
                pass_.reserved[queued.request_id] = extra
    return pass_


def _unload_cost(deployment: Deployment | None) -> float:
    return deployment.unload_s if deployment is not None else 0.0


def _static_filter(
    state: PoolState, deployment: Deployment, production: bool
) -> tuple[list[str], list[FilterResult], dict[str, bool]]:
    """The filter results that depend on the catalog alone (passed, refused with reasons, passed
    as a lookup), kept with the catalog (immutable by contract) so a pass over thousands of
    accelerators computes them once per catalog."""
    cache: dict[tuple[str, str, bool], tuple[list[str], list[FilterResult], dict[str, bool]]]
    cache = state.catalog.__dict__.setdefault("_policy_static_filter", {})
    key = (state.pool, deployment.deployment_id, production)
    cached = cache.get(key)
    if cached is None:
        passed: list[str] = []
        refused: list[FilterResult] = []
        for accelerator in state.catalog.accelerators:
            if accelerator.pool != state.pool:
                continue
            reason = _static_reason(accelerator, deployment, production)
            if reason:
                refused.append(FilterResult(accelerator.id, False, reason, True))
            else:
                passed.append(accelerator.id)
        cached = cache[key] = (passed, refused, dict.fromkeys(passed, True))
    return cached


def _filtered(pass_: _Pass, deployment: Deployment, production: bool) -> tuple[list[str], list[FilterResult]]:
    """(accelerators that pass, those that do not with their reasons); health is the only part
    that changes between passes."""
    key = (deployment.deployment_id, production)
    cached = pass_.static_filter.get(key)
    if cached is None:
        passed, refused, eligible = _static_filter(pass_.state, deployment, production)
        if pass_.unhealthy and any(a in pass_.unhealthy for a in passed):
            refused = refused + [
                FilterResult(a, False, f"{a}: UNHEALTHY", False) for a in passed if a in pass_.unhealthy
            ]
            passed = [a for a in passed if a not in pass_.unhealthy]
            eligible = dict.fromkeys(passed, True)
        cached = (passed, refused)
        pass_.static_filter[key] = cached
        pass_.eligible[key] = eligible
    return cached


def decide(state: PoolState, now: float) -> Decisions:
    return decide_each(state, now, reuse_settled=True)


def decide_each(state: PoolState, now: float, reuse_settled: bool) -> Decisions:
    """`decide`, and with `reuse_settled=False` the reference it must agree with: every request
    placed on its own, no outcome reused (the property tests compare the two)."""
    pass_ = _start_pass(state, now)
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
                and _evictable(resident)
                and resident.key not in pass_.evicting
                and resident.key not in pass_.in_use
            ):
                pass_.evicting[resident.key] = True
                decisions.unloads.append(Unload(resident.key, f"{resident.accelerator} is UNHEALTHY"))

    _preempt_on_silent_nodes(pass_, decisions, now)

    # load_on_demand and batch residents go when their last lease has ended and nobody waits.
    waiting_on = {a.resident_key: True for a in decisions.assigns}
    for queued in queue_index(state).assigned.values():
        waiting_on[queued.assigned_to] = True
    granted_on = {g.lease.resident_key: True for g in decisions.grants}
    for resident in state.residents.values():
        if (
            resident.residency in (Residency.LOAD_ON_DEMAND, Residency.NONE)
            and _evictable(resident)
            and resident.key not in pass_.evicting
            and resident.key not in waiting_on
            and resident.key not in granted_on
        ):
            decisions.unloads.append(Unload(resident.key, "last lease ended (load_on_demand)"))
    return decisions


Settled = dict[str, tuple[FailureClass, str] | tuple[None, str]]


def _decide_queue(
    pass_: _Pass, decisions: Decisions, settled_production: Settled, settled_other: Settled, now: float, counter: int
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
    pass_: _Pass,
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


def _preempt_on_silent_nodes(pass_: _Pass, decisions: Decisions, now: float) -> None:
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
            observation = state.accelerators.get(accelerator, _IDLE_RUNTIME).observation
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


def _keep_always_warm(pass_: _Pass, decisions: Decisions, now: float) -> None:
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
        passed, _ = _filtered(pass_, deployment, production)
        need = deployment.resident_bytes
        best: tuple[int, str] | None = None
        for accelerator in passed:
            budget = pass_.budgets[accelerator]
            if not budget.fresh or accelerator in pass_.blocked:
                continue
            reservation = pass_.reservations.get(accelerator)
            if reservation is not None and need > reservation.spare:
                continue  # a model stays: it may only take what a waiting gang will not need
            if not production and state.accelerators.get(accelerator, _IDLE_RUNTIME).pressure:
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
    pass_: _Pass,
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
    elif isinstance(outcome, _Preemption):
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


def _lease(
    pass_: _Pass,
    queued: QueuedRequest,
    deployment: Deployment,
    accelerators: list[str],
    node: str,
    resident: str,
    nbytes: int,
    now: float,
    counter: int,
) -> Lease:
    return Lease(
        lease_id=f"{queued.request_id}.{counter + 1}",
        request_id=queued.request_id,
        workflow_id=queued.workflow_id,
        capability=queued.capability,
        deployment=deployment.deployment_id,
        accelerator=accelerators[0],
        node=node,
        resident_key=resident,
        bytes=nbytes,
        granted_at=now,
        priority=queued.priority,
        tenant=queued.tenant,
        heartbeat_s=pass_.state.config.stale_lease_s / 3,
        gang=accelerators[1:],
        nodes=_nodes_of(pass_, accelerators) if len(accelerators) > 1 else [],
        ends_by=None if queued.max_duration_s is None else now + queued.max_duration_s,
    )


def _grant(
    queued: QueuedRequest, deployment: Deployment, resident: ResidentState, now: float, pass_: _Pass, counter: int
) -> Grant:
    extra = deployment.lease_extra_bytes
    pass_.commit(resident.accelerator, extra)
    pass_.slots[resident.key] = pass_.slots.get(resident.key, 0) - 1
    pass_.in_use[resident.key] = True
    lease = _lease(pass_, queued, deployment, [resident.accelerator], resident.node, resident.key, extra, now, counter)
    return Grant(queued.request_id, queued.workflow_id, lease)


def _place(
    pass_: _Pass, queued: QueuedRequest, deployment: Deployment, now: float, counter: int
) -> Grant | Reject | StartLoad | Assign | Wake | Wait | list[Unload | Sleep] | _Preemption:
    state = pass_.state
    if deployment.gpu_count > 1:
        return _place_gang(pass_, queued, deployment, now, counter)
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
                return _grant(queued, deployment, resident, now, pass_, counter)

    production = is_production(pass_.state.catalog, queued.priority)
    passed, refused = _filtered(pass_, deployment, production)
    if not passed:
        if all(f.permanent for f in refused):
            detail = "; ".join(f.reason for f in refused) or "the pool has no accelerators"
            return Reject(
                queued.request_id,
                queued.workflow_id,
                FailureClass.CAPABILITY_UNAVAILABLE,
                f"no {queued.priority} placement for {queued.capability}: {detail}",
            )
        reasons = _Reasons()
        for f in refused:
            if not f.passed:
                reasons.add("unhealthy" if not f.permanent else "filtered", f.reason)
        return Wait(queued.request_id, str(reasons))

    # Phase 2, score: join a ready resident (no new load) > join a loading one > load with best fit.
    reasons = _Reasons()
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
                    return _grant(queued, deployment, resident, now, pass_, counter)
                reasons.add(
                    "lease_bytes", f"{accelerator}: lease needs {extra} B, {pass_.free(accelerator)} B schedulable"
                )
            elif resident.phase in (ResidentPhase.LOADING, ResidentPhase.WAKING) or resident.key in pass_.waking:
                if extra and extra > pass_.free(accelerator):
                    reasons.add(
                        "lease_bytes", f"{accelerator}: lease needs {extra} B, {pass_.free(accelerator)} B schedulable"
                    )
                    continue
                pass_.take_reserved(accelerator, queued, extra, False, now, deployment.load_s)
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
            age = "never observed" if budget.age_s is None else f"observation {budget.age_s:.0f} s old"
            reasons.add("stale", f"{accelerator}: {FailureClass.SCHEDULER_STATE_STALE.value} ({age})")
            continue
        if not production and state.accelerators.get(accelerator, _IDLE_RUNTIME).pressure:
            reasons.add("pressure", f"{accelerator}: GPU_PRESSURE, only production work may load")
            continue
        if pass_.reservations:
            refusal = pass_.reserved_refusal(accelerator, queued, need, persists, now, deployment.load_s)
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
            plan = _eviction_plan(pass_, accelerator, deployment.deployment_id, need, production)
            if plan is not None:
                evicted = sum(state.residents[k].bytes for k, _ in plan)
                eviction_options.append((evicted, accelerator, plan))
        reasons.add("no_room", f"{accelerator}: needs {need} B, {free} B schedulable")
    # An asleep copy of this model whose wake does not fit yet: making room for the wake is an
    # option as good as making room for a load elsewhere.
    for sleeper, wake_need in asleep:
        accelerator = sleeper.accelerator
        if accelerator in pass_.evictable and accelerator not in pass_.reservations:
            plan = _eviction_plan(pass_, accelerator, deployment.deployment_id, wake_need, production)
            if plan is not None:
                evicted = sum(state.residents[k].bytes for k, _ in plan)
                eviction_options.append((evicted, accelerator, plan))

    if best is not None and queued.deadline_at is not None and now + deployment.load_s > queued.deadline_at:
        return Reject(
            queued.request_id,
            queued.workflow_id,
            FailureClass.DEADLINE_CANNOT_BE_MET,
            f"loading {deployment.deployment_id} takes {deployment.load_s:.1f} s; the deadline is in "
            f"{queued.deadline_at - now:.1f} s",
        )
    if best is not None:
        # Phase 3, choose: best fit (least schedulable left over), ties by accelerator id.
        _, accelerator = best
        acc = state.catalog.accelerator(accelerator)
        assert acc is not None
        # The model's bytes and this request's lease bytes: both are promised from now on.
        pass_.commit(accelerator, need)
        pass_.take_reserved(accelerator, queued, need, persists, now, deployment.load_s)
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
        return _room_decisions(plan, f"making room for {queued.capability} ({queued.priority})")
    if pass_.preemptible:
        preemption = _slot_preemption(pass_, queued, full) if full else None
        if preemption is None:
            preemption = _preemption_plan(pass_, queued, deployment, need, room_candidates)
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


def _place_gang(
    pass_: _Pass, queued: QueuedRequest, deployment: Deployment, now: float, counter: int
) -> Grant | Reject | Wait | list[Unload | Sleep] | _Preemption:
    """A multi-GPU batch job, all or nothing: `gpu_count` accelerators that each have the job's
    bytes schedulable, inside one NVLink group when the job requires it, else on as few nodes as
    possible; best fit (least left over) among the candidates. Nothing stays resident: the lease
    is the whole job. A waiting gang drains nothing: holding back a node for days (the Alibaba
    trace's jobs run that long) timed out 1,577 other jobs in simulation, so a stream of small
    jobs can still delay a gang (reservations with backfill are the next step)."""
    state = pass_.state
    count = deployment.gpu_count
    need = deployment.envelope_bytes
    production = is_production(pass_.state.catalog, queued.priority)
    passed, refused = _filtered(pass_, deployment, production)
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
    if queued.deadline_at is not None and now + deployment.load_s > queued.deadline_at:
        return Reject(
            queued.request_id,
            queued.workflow_id,
            FailureClass.DEADLINE_CANNOT_BE_MET,
            f"starting {deployment.deployment_id} takes {deployment.load_s:.1f} s; the deadline is in "
            f"{queued.deadline_at - now:.1f} s",
        )

    def fitting(members: list[str], evicting: bool, preempting: bool = False) -> list[tuple[int, str]]:
        """(bytes left over, accelerator) where the job fits now, or (`evicting`) once the idle
        residents there are unloaded, or (`preempting`) once the work it may preempt has gone too."""
        room = []
        for accelerator in members:
            if accelerator in pass_.blocked or not budgets[accelerator].fresh:
                continue
            if not production and state.accelerators.get(accelerator, _IDLE_RUNTIME).pressure:
                continue
            if pass_.reservations and pass_.reserved_refusal(accelerator, queued, need, False, now, deployment.load_s):
                continue
            free = pass_.free(accelerator)
            if evicting or preempting:
                free += sum(r.bytes for r in _idle_residents(pass_, accelerator, production))
            if preempting:
                # Ranked by the bytes of work newly stopped for it: cards whose work is already
                # being preempted (by an earlier pass) first, so passes do not spread the damage.
                stoppable = _preemptible_for(pass_, queued, accelerator)
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
        plans = [_eviction_plan(pass_, a, deployment.deployment_id, need, production) or [] for a in room_after or []]
        if room_after is not None and any(plans):
            unloads = []
            for accelerator, plan in zip(room_after, plans, strict=True):
                pass_.blocked[accelerator] = True
                for key, _ in plan:
                    pass_.evicting[key] = True
                unloads.extend(_room_decisions(plan, f"making room for {queued.capability} ({queued.priority})"))
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
        pass_.take_reserved(accelerator, queued, need, False, now, deployment.load_s)
    first = catalog.accelerator(chosen[0])
    assert first is not None
    lease = _lease(pass_, queued, deployment, chosen, first.node, "", need, now, counter)
    return Grant(queued.request_id, queued.workflow_id, lease)


def _preemptible_for(pass_: _Pass, queued: QueuedRequest, accelerator: str) -> list[tuple[Lease, int]]:
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
        holder = state.residents.get(lease.resident_key)
        if holder is not None and holder.residency == Residency.NONE and holder.active_leases <= 1:
            freed += holder.bytes
        found.append((lease, freed))
    return found


def _preempt_for_gang(
    pass_: _Pass, queued: QueuedRequest, accelerators: list[str], need: int, production: bool
) -> _Preemption | None:
    """On each chosen card, as little preemption as makes the gang's bytes fit with the idle
    residents gone too (their unloads follow on the next pass)."""
    state = pass_.state
    preempts: list[Preempt] = []
    stopping: list[str] = []
    reason = f"{queued.priority} {queued.capability} (a gang) needs room on {', '.join(sorted(accelerators))}"
    for accelerator in accelerators:
        free = pass_.free(accelerator) + sum(r.bytes for r in _idle_residents(pass_, accelerator, production))
        # A gang lease stopped for an earlier card frees this one too.
        free += sum(
            lease.bytes for lease in state.leases.values() if lease.lease_id in stopping and accelerator in lease.gang
        )
        for lease, freed in _preemptible_for(pass_, queued, accelerator):
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
    return _Preemption(
        accelerators[0],
        preempts,
        Wait(queued.request_id, f"making room: preempting lower-class work ({', '.join(stopping)})"),
    )


def _reserve_for_gang(
    pass_: _Pass,
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
            done = now + (unloading.unload_s if unloading is not None else 0.0)
            promised.setdefault(resident.accelerator, []).append((done, resident.bytes))
    if pass_.reserved:
        by_id = queue_index(state).by_id
        for request_id, held in pass_.reserved.items():
            waiting = by_id.get(request_id)
            holder = state.residents.get(waiting.assigned_to) if waiting is not None else None
            if waiting is None or holder is None or waiting.max_duration_s is None:
                continue
            loading = state.catalog.deployment(holder.deployment)
            start = now + (loading.load_s if loading is not None and holder.phase == ResidentPhase.LOADING else 0.0)
            promised.setdefault(holder.accelerator, []).append((start + waiting.max_duration_s, held))
    timelines: dict[str, list[tuple[float, int]]] = {}
    ready_at: dict[str, float] = {}
    for accelerator in passed:
        if accelerator in pass_.blocked or accelerator in pass_.reservations or not pass_.budgets[accelerator].fresh:
            continue
        if not production and state.accelerators.get(accelerator, _IDLE_RUNTIME).pressure:
            continue
        coming = promised.get(accelerator, [])
        for idle in _idle_residents(pass_, accelerator, production):
            # Unloaded to make room when the gang's time comes (as it does when it fits now).
            unloading = state.catalog.deployment(idle.deployment)
            coming = [*coming, (now + (unloading.unload_s if unloading is not None else 0.0), idle.bytes)]
        timeline = release_timeline(on.get(accelerator, []), state.residents, now, coming)
        timelines[accelerator] = timeline
        ready_at[accelerator] = free_at(pass_.free(accelerator), timeline, need, now)
    chosen = choose_reserved(ready_at, deployment.gpu_count, shape, topology, nvlink_groups)
    if chosen is None:
        return ""
    starts_at, accelerators = chosen
    latest = queued.lease_timeout_at if queued.deadline_at is None else min(queued.lease_timeout_at, queued.deadline_at)
    if starts_at + deployment.load_s >= latest:
        return ""
    for accelerator in accelerators:
        spare = pass_.free(accelerator) + freed_by(timelines[accelerator], starts_at) - need
        pass_.reservations[accelerator] = Reservation(queued.request_id, starts_at, max(0, spare))
    return (
        f"reserved {', '.join(sorted(accelerators))} from {starts_at - now:.0f} s on (backfill: work that ends by then)"
    )


@dataclass(frozen=True)
class _Preemption:
    accelerator: str
    preempts: list[Preempt]
    wait: Wait


def _preemption_plan(
    pass_: _Pass, queued: QueuedRequest, deployment: Deployment, need: int, accelerators: list[str]
) -> _Preemption | None:
    """Strictly lower, preemptible work whose leases (and, once idle, residents) make `need` fit:
    on the accelerator needing the fewest new preemptions, then the fewest in all."""
    state = pass_.state
    catalog = state.catalog
    best: tuple[int, int, str, list[Lease]] | None = None
    for accelerator in accelerators:
        candidates = pass_.preemptible.get(accelerator)
        if not candidates:
            continue
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
            holder = state.residents.get(lease.resident_key)
            if holder is not None:
                left = remaining.get(holder.key, holder.active_leases) - 1
                remaining[holder.key] = left
                if (
                    left <= 0
                    and holder.residency != Residency.ALWAYS_WARM
                    and holder.deployment != deployment.deployment_id
                ):
                    free += holder.bytes
        if free >= need and chosen and (best is None or (fresh, len(chosen), accelerator) < best[:3]):
            best = (fresh, len(chosen), accelerator, chosen)
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
    return _Preemption(
        accelerator, preempts, Wait(queued.request_id, f"making room: preempting lower-class work ({waiting})")
    )


def _slot_preemption(pass_: _Pass, queued: QueuedRequest, full: list[ResidentState]) -> _Preemption | None:
    """A slot on a ready resident of the asked deployment, freed by stopping one lease on it that
    the asker's class may preempt: no load, no bytes to find. A slot already being freed (its
    holder was told to stop in an earlier pass) is waited for rather than freeing another."""
    state = pass_.state
    catalog = state.catalog
    for resident in full:
        for lease in pass_.preemptible.get(resident.accelerator, []):
            if lease.resident_key != resident.key or lease.lease_id in pass_.preempting:
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
            return _Preemption(
                resident.accelerator,
                preempts,
                Wait(queued.request_id, f"making room: preempting {lease.priority} work ({lease.lease_id})"),
            )
    return None


def _eviction_plan(
    pass_: _Pass, accelerator: str, deployment_id: str, need: int, production: bool
) -> list[tuple[str, bool]] | None:
    """The idle residents whose memory makes `need` fit, as (key, put to sleep rather than
    unloaded). Sleepers first, the cheapest sleep (sleep_s + wake_s) first: a model whose runtime
    can sleep gives back all but `sleep_bytes` far more cheaply than an unload and a reload (it
    sleeps only where sleep_s + wake_s is below unload_s + load_s). Then unloads, fastest first, then the
    largest, so the fewest models go; if sleeping frees too little, sleepers are unloaded
    instead. A model that last served production is evicted only for production: no other work
    unloads a warm production model (it waits until that model's TTL lets it go). Below
    production, any class may evict an idle model, as the seed's making-room order says."""
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
        if (
            resident.phase == ResidentPhase.READY
            and deployment is not None
            and deployment.sleep_bytes is not None
            and deployment.sleep_s + deployment.wake_s < deployment.unload_s + deployment.load_s
        ):
            kept = min(resident.bytes, deployment.sleep_bytes)
            sleepers.append((deployment.sleep_s + deployment.wake_s, kept - resident.bytes, resident.key, kept))
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


def _room_decisions(plan: list[tuple[str, bool]], reason: str) -> list[Unload | Sleep]:
    return [Sleep(key, reason) if sleep else Unload(key, reason) for key, sleep in plan]


def _never_fits(pass_: _Pass, passed: list[str], need: int) -> tuple[FailureClass, str] | None:
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
