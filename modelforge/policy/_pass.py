"""What one decision pass knows and has promised (budgets, slots, bytes committed, residents
being evicted, reservations), built once per pass, and the filter phase."""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from modelforge.domain import Accelerator, Deployment, Residency
from modelforge.policy._budget import Budget, dynamic_reserve_bytes, is_fresh
from modelforge.policy._decisions import Grant, WaitReason
from modelforge.policy._fit_index import FitIndex, drop_fit_index, fit_index
from modelforge.policy._order import class_rank, is_production
from modelforge.policy._queue_index import queue_index
from modelforge.policy._reservation import Reservation
from modelforge.policy._standing import LeaseGroups, is_evictable, lease_groups, pool_cards, resident_groups
from modelforge.policy._state import (
    AcceleratorRuntime,
    Lease,
    PoolState,
    QueuedRequest,
    ResidentPhase,
    ResidentState,
    operation_seconds,
)

IDLE_RUNTIME = AcceleratorRuntime()


@dataclass(frozen=True)
class FilterResult:
    accelerator: str
    passed: bool
    reason: str = ""
    permanent: bool = True


class Reasons:
    """Why a request waits, one line per kind of reason with how many accelerators gave it, each
    kind with its typed code (None: a line that explains but is not why it waits)."""

    __slots__ = ("_count", "_first")

    def __init__(self) -> None:
        self._first: dict[str, tuple[WaitReason | None, str]] = {}
        self._count: dict[str, int] = {}

    def add(self, kind: str, code: WaitReason | None, text: str, count: int = 1) -> None:
        if kind in self._count:
            self._count[kind] += count
        else:
            self._first[kind] = (code, text)
            self._count[kind] = count

    def again(self, kind: str) -> bool:
        """Counts one more reason of `kind` if there is one already (its text would not be
        shown): the caller builds a reason's text only when this says False."""
        if kind in self._count:
            self._count[kind] += 1
            return True
        return False

    def extend(self, other: Reasons) -> None:
        """Adds `other`'s reasons after these, as if each had been added here."""
        for kind, (code, text) in other._first.items():
            self.add(kind, code, text, other._count[kind])

    def codes(self) -> tuple[WaitReason, ...]:
        """The typed codes of the line, in its order, each once."""
        return tuple(dict.fromkeys(code for code, _ in self._first.values() if code is not None))

    def __str__(self) -> str:
        parts = []
        for kind, (_, text) in self._first.items():
            more = self._count[kind] - 1
            parts.append(text if more == 0 else f"{text} (and {more} more like it)")
        return "; ".join(parts)


class Budgets(dict[str, Budget]):
    """The invariant per accelerator, computed the first time a pass asks for it: most passes
    (a release, a heartbeat, an empty queue) look at a handful of a large pool's cards. A dict,
    so a budget already computed is one lookup (a pass reads them per card, often twice)."""

    __slots__ = ("_leased", "_now", "_resident", "_state")

    def __init__(self, state: PoolState, resident: dict[str, int], leased: dict[str, int], now: float) -> None:
        super().__init__()
        self._state = state
        self._resident = resident
        self._leased = leased
        self._now = now

    def __missing__(self, accelerator_id: str) -> Budget:
        # `budget_from_sums`, written out: a pass of a full pool asks it of every card
        # (tests/unit/test_budget_one_formula.py holds the two to one answer).
        state = self._state
        accelerator = state.catalog.accelerator(accelerator_id)
        if accelerator is None:
            raise KeyError(accelerator_id)
        runtime = state.accelerators.get(accelerator_id, IDLE_RUNTIME)
        now = self._now
        if len(runtime.external_history) < 2:
            reserve = max(accelerator.reserve_bytes, 0)  # no spread of external usage to keep
        else:
            reserve = max(accelerator.reserve_bytes, dynamic_reserve_bytes(runtime, state.config, now))
        resident = self._resident.get(accelerator_id, 0)
        leased = self._leased.get(accelerator_id, 0)
        total = accelerator.total_bytes
        observation = runtime.observation
        if observation is None:
            budget = Budget(
                accelerator_id,
                total,
                None,
                0,
                resident,
                leased,
                reserve,
                total - resident - leased - reserve,
                False,
                None,
            )
        else:
            external = observation.external_bytes
            age = max(0.0, now - observation.received_at)
            budget = Budget(
                accelerator_id,
                total,
                observation.used_bytes,
                external,
                resident,
                leased,
                reserve,
                total - external - resident - leased - reserve,
                age <= state.config.freshness_s,
                age,
            )
        self[accelerator_id] = budget
        return budget

    @property
    def now(self) -> float:
        """The time the budgets are worked out for (the pass's)."""
        return self._now

    def stale(self, accelerator_ids: Iterable[str]) -> list[str]:
        """Those of `accelerator_ids` that are not `fresh`."""
        return [accelerator_id for accelerator_id in accelerator_ids if not self.fresh(accelerator_id)]

    def fresh(self, accelerator_id: str) -> bool:
        """`self[accelerator_id].fresh`, without working out a budget not asked for yet: the
        landing rules ask it of every card a walk passes, and most need nothing more."""
        budget = self.get(accelerator_id)
        if budget is not None:
            return budget.fresh
        return is_fresh(self._state.accelerators.get(accelerator_id), self._state.config, self._now)


@dataclass(slots=True)
class DecisionPass:
    """What one decision pass knows and has committed, so it never double-books."""

    state: PoolState
    budgets: Budgets
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
    # Per deployment: its residents as `residents_of` holds them, and in the cards' order.
    join_order: dict[str, tuple[list[ResidentState], list[ResidentState]]] = field(default_factory=dict)
    # Lease bytes held for requests that wait on a load (request id -> bytes): promised when the
    # load was decided, so nothing ordered after them takes them while the model loads.
    reserved: dict[str, int] = field(default_factory=dict)
    static_filter: dict[tuple[str, bool], tuple[list[str], list[FilterResult]]] = field(default_factory=dict)
    eligible: dict[tuple[str, bool], dict[str, bool]] = field(default_factory=dict)
    # Asleep residents this pass decided to wake: later requests wait on them as on a load.
    waking: dict[str, bool] = field(default_factory=dict)
    # Per kind of work (production or not): the cards stale or under pressure for it this pass
    # (`_rules.shut_cards`), once a walk over every card asked.
    shut: dict[bool, dict[str, str]] = field(default_factory=dict)
    # Accelerators held for waiting gangs (see `_reservation`): later work backfills them only.
    reservations: dict[str, Reservation] = field(default_factory=dict)
    # Resident and lease bytes per accelerator, as the budgets sum them.
    resident_sum: dict[str, int] = field(default_factory=dict)
    leased_sum: dict[str, int] = field(default_factory=dict)
    # What placement works out once per pass rather than once per request (a gang shape's
    # live cards and bounds, release timelines, the open order, why a size never fits), keyed
    # by what it is and what it was worked out from.
    memo: dict[tuple[object, ...], object] = field(default_factory=dict)
    # Whether a pass may keep such results (off: the reference pass, which looks at every card
    # for every gang).
    indexed: bool = True
    # The cards by schedulable bytes, kept across passes (`_fit_index`); None in the reference pass.
    fit: FitIndex | None = None
    fit_misses: int = 0  # searches of `fit` that ended without a card (`_placement._best_fit_indexed`)
    # Deadline-aware admission (`_rules.service_estimate`, `_rules.predicted_refusal`): per
    # deployment, its measured (mean, high percentile) service time; how many requests of it this
    # pass left waiting ahead of the one being placed, and granted; the seconds its running
    # leases still need (summed once per pass, when first asked).
    service: dict[str, tuple[float, float]] = field(default_factory=dict)
    # Per deployment: the most any request of it could need before its deadline (its load and
    # its service's high percentile; a batch job's max_duration is its own).
    margin: dict[str, float] = field(default_factory=dict)
    ahead: dict[str, int] = field(default_factory=dict)
    granted: dict[str, int] = field(default_factory=dict)
    busy_s: dict[str, float] | None = None
    # The cards bytes were committed to, in order: what is worked out from `committed` is
    # brought up to date by those committed to since (`_gang._Bounds`).
    commit_log: list[str] = field(default_factory=list)

    def free(self, accelerator: str) -> int:
        return self.budgets[accelerator].schedulable_bytes - self.committed.get(accelerator, 0)

    def commit(self, accelerator: str, nbytes: int) -> None:
        self.committed[accelerator] = self.committed.get(accelerator, 0) + nbytes
        self.commit_log.append(accelerator)

    def fit_agrees(self, accelerators: Iterable[str]) -> bool:
        """Whether the fit index holds each of `accelerators`' schedulable bytes as its budget
        does (true without an index). If not, the index missed a change: it is dropped for the
        rest of this pass and rebuilt from scratch by the next, and the caller chooses again
        without it. Every search that reads the index checks its choice here."""
        fit = self.fit
        if fit is None:
            return True
        budgets, kept = self.budgets, fit.schedulable
        if all(kept.get(a) == budgets[a].schedulable_bytes for a in accelerators):
            return True
        drop_fit_index(self.state)
        self.fit = None
        return False


def idle_residents(pass_: DecisionPass, accelerator: str, production: bool) -> list[ResidentState]:
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


def nodes_of(pass_: DecisionPass, accelerators: list[str]) -> list[str]:
    catalog = pass_.state.catalog
    return [acc.node if (acc := catalog.accelerator(a)) is not None else "" for a in accelerators]


def request_ends_by(queued: QueuedRequest, start: float) -> float:
    return math.inf if queued.max_duration_s is None else start + queued.max_duration_s


BECOMING_READY = (ResidentPhase.LOADING, ResidentPhase.WAKING, ResidentPhase.READY)


def static_reason(accelerator: Accelerator, deployment: Deployment, production: bool) -> str:
    if deployment.accelerators and accelerator.id not in deployment.accelerators:
        return f"{accelerator.id}: not in the deployment's placement list"
    if accelerator.kind == "cpu" and not deployment.accelerators:
        # The host CPU is for the deployments placed there, never a fallback for the others.
        return f"{accelerator.id}: a CPU device, only for deployments whose placement list names it"
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
        reason = static_reason(accelerator, deployment, is_production(state.catalog, priority))
        if reason:
            results.append(FilterResult(accelerator.id, False, reason, True))
            continue
        runtime = state.accelerators.get(accelerator.id)
        if runtime is not None and not runtime.healthy:
            results.append(FilterResult(accelerator.id, False, f"{accelerator.id}: UNHEALTHY", False))
            continue
        results.append(FilterResult(accelerator.id, True))
    return results


# A pool of at most this many cards is searched by walking them: the fit index costs more to
# keep than a walk over a few cards.
FIT_INDEX_FROM = 4


def start_pass(state: PoolState, now: float, indexed: bool = True) -> DecisionPass:
    """What a pass starts from. `indexed` (the fast pass): the residents' and leases' groupings
    kept across passes (`_standing`, rebuilt when they changed); off (the reference pass): built
    here from scratch by one walk over residents and leases."""
    if indexed:
        accelerators, position = pool_cards(state)
        residents = resident_groups(state)
        leases = lease_groups(state)
        resident_sum, pinned, leased_sum = residents.resident_sum, residents.pinned, leases.leased_sum
        # Copied: a pass adds the loads it starts to these (`_start_load`) and counts slots down.
        residents_of = dict(residents.residents_of)
        slots = dict(residents.slots)
        evictable = dict(residents.evictable)
        preemptible = _kept_preemptible(state, leases, now)
    else:
        accelerators = [a for a in state.catalog.accelerators if a.pool == state.pool]
        position = {a.id: i for i, a in enumerate(accelerators)}
        resident_sum, pinned, residents_of, evictable, slots = _group_residents(state)
        leased_sum, preemptible = _group_leases(state, now)
        for leases_on in preemptible.values():
            if len(leases_on) >= 2:
                leases_on.sort(key=lambda lease: _preemption_order(state, lease))
    budgets = Budgets(state, resident_sum, leased_sum, now)
    # Cheapest to unload first, then the largest (fewest models go), then by key.
    catalog = state.catalog
    for accelerator_id, candidates in evictable.items():
        if len(candidates) > 1:
            evictable[accelerator_id] = sorted(
                candidates, key=lambda r: (unload_cost(state, catalog.deployment(r.deployment)), -r.bytes, r.key)
            )
    fit: FitIndex | None = None
    if indexed and len(accelerators) > FIT_INDEX_FROM:
        fit = fit_index(
            state,
            accelerators,
            position,
            lambda card: budgets[card].schedulable_bytes,
            resident_sum,
            leased_sum,
        )
        unhealthy = dict(fit.unhealthy)
    else:
        unhealthy = {a: True for a, runtime in state.accelerators.items() if not runtime.healthy}
    pass_ = DecisionPass(
        state=state,
        budgets=budgets,
        pool_accelerators=accelerators,
        unhealthy=unhealthy,
        residents_of=residents_of,
        evictable=evictable,
        pinned=pinned,
        preemptible=preemptible,
        position=position,
        resident_sum=resident_sum,
        leased_sum=leased_sum,
        slots=slots,
        indexed=indexed,
        fit=fit,
    )
    for queued in queue_index(state).assigned.values():
        if queued.assigned_to:
            waited_on = state.residents.get(queued.assigned_to)
            if waited_on is None or waited_on.phase not in BECOMING_READY:
                continue
            deployment = catalog.deployment(waited_on.deployment)
            extra = deployment.lease_extra_bytes if deployment is not None else 0
            if extra:
                pass_.commit(waited_on.accelerator, extra)
                pass_.reserved[queued.request_id] = extra
    return pass_


def _group_residents(
    state: PoolState,
) -> tuple[
    dict[str, int], dict[str, int], dict[str, list[ResidentState]], dict[str, list[ResidentState]], dict[str, int]
]:
    """(resident bytes, always_warm bytes, residents per deployment, idle residents, free slots)
    by one walk over the residents: what `_standing.ResidentGroups` keeps across passes."""
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
        if is_evictable(resident):
            evictable.setdefault(resident.accelerator, []).append(resident)
    slots: dict[str, int] = {}
    for resident in state.residents.values():
        deployment = state.catalog.deployment(resident.deployment)
        concurrency = deployment.concurrency if deployment else 1
        slots[resident.key] = concurrency - resident.active_leases
    return resident_sum, pinned, residents_of, evictable, slots


def _group_leases(state: PoolState, now: float) -> tuple[dict[str, int], dict[str, list[Lease]]]:
    """(lease bytes per accelerator, the leases a pass may preempt per accelerator, unsorted) by
    one walk over the leases."""
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
    return leased_sum, preemptible


def _preemption_order(state: PoolState, lease: Lease) -> tuple[bool, int, float, str]:
    """A card's preemptible leases in the order a pass preempts them: those being preempted
    already first, then the lowest class, then the youngest (the least work lost)."""
    return (
        lease.lease_id not in state.preempting,
        class_rank(state.catalog, lease.priority),
        -lease.granted_at,
        lease.lease_id,
    )


_KEPT_PREEMPTIBLE = "_policy_preemptible"
# Tests set this: every pass compares the kept lists with ones worked out afresh.
CHECK_KEPT_PREEMPTIBLE = False


class _KeptPreemptible:
    """The leases a pass may preempt on each card, in `_preemption_order`, kept across passes:
    a busy cluster holds thousands of preemptible gang leases on thousands of cards, and
    listing them afresh each pass was about 6% of its replay. Brought up to date per card, by
    the leases of preemptible deployments that came or went (`LeaseGroups.of_preemptible`),
    those past their minimum runtime since (a heap by grant time), and the leases being
    preempted that changed (`PoolState.preempting`); only those cards' lists are made again.
    Worked out afresh with new lease groupings (a new catalog), another minimum runtime, or a
    clock that went back. The lists are the pass's to read, never to change."""

    __slots__ = ("at", "groups", "min_runtime", "on", "pending", "ripe", "ripe_on", "seen", "stopping", "stopping_on")

    def __init__(self, groups: LeaseGroups, min_runtime: float) -> None:
        self.groups = groups
        self.min_runtime = min_runtime
        self.at = -math.inf
        self.seen: dict[str, tuple[Lease, Iterable[str]]] = {}  # `of_preemptible` as last seen
        self.pending: list[tuple[float, str]] = []  # (granted_at, lease id) not yet past min runtime
        self.ripe: dict[str, bool] = {}
        self.ripe_on: dict[str, dict[str, Lease]] = {}
        self.stopping: dict[str, Lease | None] = {}  # `state.preempting`, each with its lease then
        self.stopping_on: dict[str, dict[str, Lease]] = {}
        self.on: dict[str, list[Lease]] = {}

    def update(self, state: PoolState, now: float) -> None:
        changed: dict[str, bool] = {}
        seen, of = self.seen, self.groups.of_preemptible
        ripe, ripe_on = self.ripe, self.ripe_on
        if seen != of:
            for lease_id in [lease_id for lease_id, entry in seen.items() if of.get(lease_id) is not entry]:
                _, held_on = seen.pop(lease_id)
                if ripe.pop(lease_id, None):
                    for card in held_on:
                        _drop(ripe_on, card, lease_id)
                        changed[card] = True
            for lease_id, entry in of.items():
                if lease_id not in seen:
                    seen[lease_id] = entry
                    heapq.heappush(self.pending, (entry[0].granted_at, lease_id))
        pending, min_runtime = self.pending, self.min_runtime
        while pending:
            granted_at, lease_id = pending[0]
            found = seen.get(lease_id)
            if found is None or lease_id in ripe or found[0].granted_at != granted_at:
                heapq.heappop(pending)  # gone, or an entry for a lease it replaced
                continue
            if not now - granted_at >= min_runtime:
                break  # nor any granted later
            heapq.heappop(pending)
            ripe[lease_id] = True
            for card in found[1]:
                ripe_on.setdefault(card, {})[lease_id] = found[0]
                changed[card] = True
        stopping, stopping_on = self.stopping, self.stopping_on
        now_stopping = {lease_id: state.leases.get(lease_id) for lease_id in state.preempting}
        if now_stopping != stopping or any(stopping[i] is not lease for i, lease in now_stopping.items()):
            for lease_id in {*stopping, *now_stopping}:
                before, after = stopping.get(lease_id), now_stopping.get(lease_id)
                if before is after and lease_id in stopping and lease_id in now_stopping:
                    continue
                for stopped, held in ((before, False), (after, True)):
                    if stopped is None:
                        continue
                    for card in stopped.accelerators if stopped.gang else (stopped.accelerator,):
                        changed[card] = True
                        if held:
                            stopping_on.setdefault(card, {})[lease_id] = stopped
                        else:
                            _drop(stopping_on, card, lease_id)
            self.stopping = now_stopping
        preempting, on = state.preempting, self.on
        for card in changed:
            leases = [lease for lease_id, lease in ripe_on.get(card, {}).items() if lease_id not in preempting]
            leases += stopping_on.get(card, {}).values()
            if leases:
                leases.sort(key=lambda lease: _preemption_order(state, lease))
                on[card] = leases
            else:
                on.pop(card, None)
        self.at = now


def _drop(index: dict[str, dict[str, Lease]], card: str, lease_id: str) -> None:
    leases = index.get(card)
    if leases is not None:
        leases.pop(lease_id, None)
        if not leases:
            del index[card]


def _kept_preemptible(state: PoolState, groups: LeaseGroups, now: float) -> dict[str, list[Lease]]:
    """Per card, the leases a pass may preempt, in `_preemption_order` (`_KeptPreemptible`)."""
    kept = state.__dict__.get(_KEPT_PREEMPTIBLE)
    min_runtime = state.config.preempt_min_runtime_s
    if (
        not isinstance(kept, _KeptPreemptible)
        or kept.groups is not groups
        or kept.min_runtime != min_runtime
        or now < kept.at
    ):
        kept = state.__dict__[_KEPT_PREEMPTIBLE] = _KeptPreemptible(groups, min_runtime)
    kept.update(state, now)
    if CHECK_KEPT_PREEMPTIBLE:
        _, fresh = _group_leases(state, now)  # the reference pass's walk over every lease
        for leases_on in fresh.values():
            leases_on.sort(key=lambda lease: _preemption_order(state, lease))
        assert kept.on == fresh, sorted(kept.on.keys() ^ fresh.keys())
    return kept.on


def unload_cost(state: PoolState, deployment: Deployment | None) -> float:
    return operation_seconds(state, deployment, "unload") if deployment is not None else 0.0


def static_filter(
    state: PoolState, deployment: Deployment, production: bool
) -> tuple[list[str], list[FilterResult], dict[str, bool]]:
    """The filter results that depend on the catalog alone: passed, refused with reasons, passed
    as a lookup. Kept with the catalog (immutable by contract) so a pass over thousands of
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
            reason = static_reason(accelerator, deployment, production)
            if reason:
                refused.append(FilterResult(accelerator.id, False, reason, True))
            else:
                passed.append(accelerator.id)
        # One list for every deployment the filter passes the same cards for: what is worked out
        # per list in a pass (a gang's `_live` cards) is then worked out once for all of them.
        interned: dict[tuple[str, ...], list[str]] = state.catalog.__dict__.setdefault("_policy_passed_lists", {})
        passed = interned.setdefault(tuple(passed), passed)
        cached = cache[key] = (passed, refused, dict.fromkeys(passed, True))
    return cached


def filtered_accelerators(
    pass_: DecisionPass, deployment: Deployment, production: bool
) -> tuple[list[str], list[FilterResult]]:
    """(accelerators that pass, those that do not with their reasons); health is the only part
    that changes between passes."""
    key = (deployment.deployment_id, production)
    cached = pass_.static_filter.get(key)
    if cached is None:
        passed, refused, eligible = static_filter(pass_.state, deployment, production)
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


def new_lease(
    pass_: DecisionPass,
    queued: QueuedRequest,
    deployment: Deployment,
    accelerators: list[str],
    node: str,
    resident: str,
    nbytes: int,
    now: float,
    counter: int,
    incarnation: int = 0,
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
        nodes=nodes_of(pass_, accelerators) if len(accelerators) > 1 else [],
        ends_by=None if queued.max_duration_s is None else now + queued.max_duration_s,
        incarnation=incarnation,
        end_user=queued.end_user,
    )


def grant_on(
    queued: QueuedRequest,
    deployment: Deployment,
    resident: ResidentState,
    now: float,
    pass_: DecisionPass,
    counter: int,
) -> Grant:
    extra = deployment.lease_extra_bytes
    pass_.commit(resident.accelerator, extra)
    pass_.slots[resident.key] = pass_.slots.get(resident.key, 0) - 1
    pass_.in_use[resident.key] = True
    lease = new_lease(
        pass_,
        queued,
        deployment,
        [resident.accelerator],
        resident.node,
        resident.key,
        extra,
        now,
        counter,
        resident.incarnation,
    )
    return Grant(queued.request_id, queued.workflow_id, lease)
