"""Multi-GPU batch jobs (gangs): all-or-nothing placement on the topology, in the phases a
single request goes through (filter, refuse what can never fit, choose, make room, wait), and,
when a gang must wait, a reservation of the cards where it can start soonest, with backfill
(`_reservation`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from modelforge.domain import Accelerator, Deployment, Residency
from modelforge.failures import FailureClass
from modelforge.policy._decisions import Grant, Preempt, Reject, Sleep, Unload, Wait, WaitReason
from modelforge.policy._fit_index import FitIndex
from modelforge.policy._pass import (
    DecisionPass,
    FilterResult,
    filtered_accelerators,
    idle_residents,
    new_lease,
    static_filter,
    unload_cost,
)
from modelforge.policy._queue_index import queue_index
from modelforge.policy._reservation import Reservation, choose_reserved, free_at, freed_by, release_timeline
from modelforge.policy._room import Preemption, eviction_plan, preemptible_for, room_decisions
from modelforge.policy._rules import (
    Attempt,
    Landing,
    deadline_refusal,
    may_land,
    shut_cards,
    take_reservation,
)
from modelforge.policy._standing import LeasesOn, kept_groups
from modelforge.policy._standing import leases_on as held_on
from modelforge.policy._state import Lease, QueuedRequest, ResidentPhase, ResidentState, holder_of, operation_seconds
from modelforge.policy._topology import GangShape, choose_gang


@dataclass(frozen=True)
class _Gang:
    """What the phases of one gang's placement share."""

    count: int
    need: int  # bytes on each card
    shape: GangShape
    nvlink: bool  # it must fit inside one NVLink group
    passed: list[str]
    refused: list[FilterResult]
    # The cards it may use by NVLink group (nvlink) or by node; cards in no group are left out
    # when it needs one.
    groups: dict[str, list[str]]
    topology: dict[str, Accelerator]
    landing: Landing  # its bytes on each card, gone with its lease


def place_gang(attempt: Attempt) -> Grant | Reject | Wait | list[Unload | Sleep] | Preemption:
    """A multi-GPU batch job, all or nothing: `gpu_count` accelerators that each have the job's
    bytes schedulable, inside one NVLink group when the job requires it, else in the shape its
    deployment asks for (`_topology`: one node if it fits there, else one rack, else the pool);
    best fit among the candidates. Nothing stays resident: the lease is the whole job. Phases:
    1. filter: the accelerators it may use, grouped;
    2. refuse at once what could never fit (with every ModelForge byte gone) or start in time;
    3. choose: the cards where it fits now;
    4. make room: unload the idle residents in the way, else preempt what its class may;
    5. wait, reserving the cards where it can start soonest (later work backfills them)."""
    gang = _filter_gang(attempt)
    refusal = _never_fits(attempt, gang) or deadline_refusal(attempt, "starting")
    if refusal is not None:
        return refusal
    pass_ = attempt.pass_
    if pass_.indexed and len(pass_.pool_accelerators) - len(pass_.blocked) < gang.count:
        # Higher requests of this pass wait for memory on all but fewer cards than the gang
        # needs: no phase finds room, room to make or cards to reserve on the rest, and none
        # of that depended on this gang's own times (its wait stands for its deployment).
        return _wait(attempt, gang, reserve=False)
    settled = _settled_shape(attempt, gang)
    if settled is not None:
        return settled
    picked = _choose(attempt, gang, evicting=False)
    if picked is not None:
        return _grant_gang(attempt, gang, picked)
    room = _make_room(attempt, gang)
    if room is not None:
        return room
    waits = _wait(attempt, gang)
    _settle_shape(attempt, gang, waits)
    return waits


def _shape_key(attempt: Attempt, gang: _Gang) -> tuple[object, ...]:
    """What a gang's placement reads of its request and deployment, less its class's
    preemption rights: the cards it may use (the filter's list, by identity), its bytes, count,
    topology and kind of class. Gangs of different deployments share it (a trace's jobs of one
    shape, preemptible or not)."""
    return ("shape", id(gang.passed), gang.need, gang.count, gang.nvlink, gang.shape, attempt.production)


def _rights(attempt: Attempt) -> frozenset[str]:
    klass = attempt.pass_.state.catalog.classes.get(attempt.queued.priority)
    return frozenset(klass.preempts) if klass is not None else frozenset()


def _settled_shape(attempt: Attempt, gang: _Gang) -> Wait | None:
    """The fast pass: a gang of the same shape (`_shape_key`) waited earlier in this pass for
    room alone, with no reservation and nothing it did depending on its own times, and this
    one's class may preempt no more than that one's. A pass only takes capacity (bytes
    committed, cards blocked or reserved, work marked for preemption), so this gang finds no
    room, no room to make and no card to reserve either: it waits with the same reason."""
    pass_ = attempt.pass_
    if not pass_.indexed or pass_.residents_of.get(attempt.deployment.deployment_id):
        return None
    settled = pass_.memo.get(_shape_key(attempt, gang))
    if not isinstance(settled, tuple) or not _rights(attempt) <= settled[1]:
        return None
    return Wait(attempt.queued.request_id, settled[0], (WaitReason.GANG_ROOM,))


def _settle_shape(attempt: Attempt, gang: _Gang, waits: Wait) -> None:
    """Keeps a gang's wait for `_settled_shape` when it stands for its shape: room alone (no
    reservation), and its outcome depended on none of its own times (`Attempt.reusable`)."""
    pass_ = attempt.pass_
    if pass_.indexed and attempt.reusable and waits.codes == (WaitReason.GANG_ROOM,):
        if not pass_.residents_of.get(attempt.deployment.deployment_id):
            key = _shape_key(attempt, gang)
            kept = pass_.memo.get(key)
            rights = _rights(attempt)
            if not isinstance(kept, tuple) or not rights <= kept[1]:
                pass_.memo[key] = (waits.reason, rights)


def _filter_gang(attempt: Attempt) -> _Gang:
    """Phase 1: the accelerators that pass the filter, grouped by NVLink group or node."""
    deployment = attempt.deployment
    pass_ = attempt.pass_
    passed, refused = filtered_accelerators(pass_, deployment, attempt.production)
    groups, topology = _grouped(pass_, deployment, attempt.production, passed)
    need = deployment.envelope_bytes
    return _Gang(
        count=deployment.gpu_count,
        need=need,
        shape=GangShape.of(deployment),
        nvlink=deployment.nvlink_required,
        passed=passed,
        refused=refused,
        groups=groups,
        topology=topology,
        landing=Landing(need, persists=False, attempt=attempt, lead_s=attempt.load_s),
    )


def _grouped(
    pass_: DecisionPass, deployment: Deployment, production: bool, passed: list[str]
) -> tuple[dict[str, list[str]], dict[str, Accelerator]]:
    """`passed` grouped by NVLink group (cards in none left out) or by node, and each card's
    topology. Kept with the catalog while `passed` is the catalog's own filter result (no card
    unhealthy), else for the pass: read only, never changed by a placement."""
    state = pass_.state
    static_passed, _, _ = static_filter(state, deployment, production)
    nvlink = deployment.nvlink_required
    key: tuple[object, ...] = (state.pool, deployment.deployment_id, production, nvlink)
    cache: dict[tuple[object, ...], tuple[dict[str, list[str]], dict[str, Accelerator]]]
    if passed is static_passed:
        cache = state.catalog.__dict__.setdefault("_policy_gang_groups", {})
    else:
        cache = pass_.memo  # type: ignore[assignment]
        key = ("groups", *key)
    cached = cache.get(key)
    if cached is not None:
        return cached
    catalog = state.catalog
    groups: dict[str, list[str]] = {}
    topology: dict[str, Accelerator] = {}
    for accelerator in passed:
        acc = catalog.accelerator(accelerator)
        assert acc is not None
        topology[accelerator] = acc
        group = acc.nvlink_group if nvlink else acc.node
        if nvlink and not group:
            continue
        groups.setdefault(group, []).append(accelerator)
    cache[key] = (groups, topology)
    return groups, topology


def _ceiling_shortfall(pass_: DecisionPass) -> dict[str, int]:
    """Per accelerator holding anything: bytes that stay taken there whatever a gang's placement
    does in this pass. `total - reserve_bytes - shortfall` bounds from above what any phase of
    `place_gang` counts on a card (free bytes, idle residents unloaded, work preempted or ending
    by its max_duration, unloads under way, lease bytes promised to loads): a card below the
    gang's bytes by that bound can be passed over unseen. Generous where unsure (a larger bound
    only prunes less): committed bytes, external bytes and the dynamic reserve are left out
    (`_live` counts external bytes where the fit index has them)."""
    memo = pass_.memo
    cached = memo.get(("shortfall",))
    if cached is not None:
        return cached  # type: ignore[return-value]
    shortfall = dict(pass_.resident_sum)
    for accelerator, nbytes in pass_.leased_sum.items():
        shortfall[accelerator] = shortfall.get(accelerator, 0) + nbytes
    for accelerator, nbytes in _let_go(pass_).items():
        shortfall[accelerator] -= nbytes
    memo[("shortfall",)] = shortfall
    return shortfall


def _let_go(pass_: DecisionPass) -> dict[str, int]:
    """Per accelerator, what `_ceiling_shortfall` counts as possibly let go in this pass: idle
    residents, unloads under way, and leases that end by their max_duration, are being
    preempted or may be (with their batch runners); only the cards where that is anything."""
    memo = pass_.memo
    cached = memo.get(("let_go",))
    if cached is not None:
        return cached  # type: ignore[return-value]
    state = pass_.state
    catalog = state.catalog
    let_go: dict[str, int] = {}
    for accelerator, idle in pass_.evictable.items():
        let_go[accelerator] = let_go.get(accelerator, 0) + sum(r.bytes for r in idle)
    for resident in _unloading(pass_):
        let_go[resident.accelerator] = let_go.get(resident.accelerator, 0) + resident.bytes
    kept = kept_groups(state) if pass_.indexed else None
    if kept is None:
        ending: Iterable[Lease] = state.leases.values()
    else:
        # The fast pass reads the leases that may end from the kept groupings (a busy
        # cluster's leases are mostly of neither kind): those with an end time, those of
        # preemptible deployments, and those being preempted.
        leases = kept[1]
        ids = dict.fromkeys(leases.of_timed)
        ids.update(dict.fromkeys(leases.of_preemptible))
        ids.update(dict.fromkeys(state.preempting))
        held = state.leases
        ending = [held[lease_id] for lease_id in ids if lease_id in held]
    for lease in ending:
        leased = catalog.deployment(lease.deployment)
        if lease.ends_by is None and lease.lease_id not in state.preempting and not (leased and leased.preemptible):
            continue
        freed = lease.bytes
        holder = holder_of(state, lease)
        if holder is not None and holder.residency == Residency.NONE:
            freed += holder.bytes
        for accelerator in lease.accelerators if lease.gang else (lease.accelerator,):
            let_go[accelerator] = let_go.get(accelerator, 0) + freed
    memo[("let_go",)] = let_go
    return let_go


def _live(pass_: DecisionPass, gang: _Gang) -> tuple[list[str], dict[str, list[str]]]:
    """The cards of `gang.passed` where the gang's bytes could ever be found in this pass (see
    `_ceiling_shortfall`), and (NVLink) the groups holding `count` of them, with those cards;
    an NVLink gang's cards are those of such groups only. Every phase of `place_gang` finds
    nothing on the others (no room, no reservation), so it looks at these alone."""
    if not pass_.indexed:
        return gang.passed, gang.groups
    memo = pass_.memo
    key = ("live", id(gang.passed), gang.need, gang.count, gang.nvlink)
    cached = memo.get(key)
    if cached is not None:
        return cached  # type: ignore[return-value]
    live = _live_cards(pass_, gang)
    groups: dict[str, list[str]] = {}
    if gang.nvlink:
        count = gang.count
        for group, kept in _live_groups(pass_, gang, live).items():
            if len(kept) >= count:
                groups[group] = kept
        # In the groups' order, not the filter's: their only reader, the reservation's search,
        # looks each card up and sorts what it chooses from.
        cards = [a for kept in groups.values() for a in kept]
    else:
        cards = [a for a in gang.passed if a in live]
    memo[key] = (cards, groups)
    return cards, groups


def _live_groups(pass_: DecisionPass, gang: _Gang, live: dict[str, bool]) -> dict[str, list[str]]:
    """Each NVLink group's cards of `live`, in the group's order: the same for every gang of
    those cards and bytes, whatever its count (gangs of 2, 4 and 8 cards of one size wait in
    the same pass on a busy cluster), so worked out once per pass, and brought up to date from
    the last pass's where `live` is kept across passes (`_KeptLive`)."""
    memo = pass_.memo
    key = ("live_groups", id(gang.passed), gang.need)
    cached = memo.get(key)
    if cached is not None:
        return cached  # type: ignore[return-value]
    kept = _kept_live_of(pass_, gang)
    groups = kept.live_groups(gang) if kept is not None and kept.live is live else _groups_of(gang, live)
    if CHECK_KEPT_LIVE:
        assert list(groups.items()) == list(_groups_of(gang, live).items())
    memo[key] = groups
    return groups


def _groups_of(gang: _Gang, live: dict[str, bool]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for group, members in gang.groups.items():
        kept = [a for a in members if a in live]
        if kept:
            groups[group] = kept
    return groups


def _live_cards(pass_: DecisionPass, gang: _Gang) -> dict[str, bool]:
    """The cards of `gang.passed` whose bound (`_live`) holds the gang's bytes: the same for
    every gang of those cards and bytes, whatever its count (worked out once per pass)."""
    memo = pass_.memo
    key = ("live_cards", id(gang.passed), gang.need)
    cached = memo.get(key)
    if cached is not None:
        return cached  # type: ignore[return-value]
    need = gang.need
    live: dict[str, bool] = {}
    fit = pass_.fit
    if fit is None:
        shortfall = _ceiling_shortfall(pass_)
        for accelerator, acc in gang.topology.items():
            if acc.total_bytes - acc.reserve_bytes - shortfall.get(accelerator, 0) >= need:
                live[accelerator] = True
    else:
        kept = _kept_live(pass_, gang, fit)
        live = kept.live if kept is not None else _live_cards_indexed(pass_, gang, fit)
    memo[key] = live
    return live


def _live_cards_indexed(pass_: DecisionPass, gang: _Gang, fit: FitIndex) -> dict[str, bool]:
    """`_live_cards` with the fit index, worked out from scratch.

    Tighter where the fit index holds the card's schedulable bytes for this pass (total -
    external - resident - leased - reserve) and its reserve does not move with time (it is
    then the card's own): what the gang could count on there is those bytes plus what
    `_ceiling_shortfall` lets go, so a card an unmanaged process fills is passed over too.
    Looked at card by card only where the bound is not the card's schedulable bytes
    (something there may be let go, its reserve moves, or the index lacks it); every
    other card holds the gang if it has the bytes now: the index's tail from `need`."""
    need = gang.need
    live: dict[str, bool] = {}
    schedulable, volatile, topology = fit.schedulable, fit.volatile, gang.topology
    let_go = _let_go(pass_)
    order = fit.order
    for i in range(fit.from_bytes(need), len(order)):
        accelerator = order[i][1]
        if accelerator in topology:
            live[accelerator] = True  # the bound is at least the schedulable bytes
    closer = [a for a in (*let_go, *volatile) if a in topology and a not in live]
    if len(schedulable) < len(pass_.pool_accelerators):
        closer += [a for a in topology if a not in schedulable]
    resident_sum, leased_sum = pass_.resident_sum, pass_.leased_sum
    for accelerator in closer:
        if accelerator in volatile or accelerator not in schedulable:
            acc = topology[accelerator]
            taken = resident_sum.get(accelerator, 0) + leased_sum.get(accelerator, 0) - let_go.get(accelerator, 0)
            bound = acc.total_bytes - acc.reserve_bytes - taken
        else:
            bound = schedulable[accelerator] + let_go.get(accelerator, 0)
        if bound >= need:
            live[accelerator] = True
    return live


# Where `_KeptLive`s are kept (the state's `__dict__`, never serialized), with the fit index
# they were worked out from (a new index drops them all), and how many at most.
_KEPT_LIVE = "_policy_gang_live"
_KEPT_LIVE_MOST = 64
# Tests set this: every kept result brought up to date is compared with one worked out afresh.
CHECK_KEPT_LIVE = False


class _KeptLive:
    """`_live_cards` (and `_live_groups`) for one list of cards and one size, kept across passes
    with the fit index they were worked out from and the bytes `_let_go` counted then. A card's
    place in it reads only its schedulable bytes (the index's), whether its reserve moves with
    time (the index re-reads such cards every pass), its let-go bytes and, for those, its
    resident and lease sums: so a pass re-reads only the cards the index re-read since the last
    one and those whose let-go bytes differ, where working it out again walked the index's tail
    and every NVLink group's members (the gangs of a busy cluster wait on every pass). Brought
    up to date only from the pass just before (the index counts its updates); else worked out
    afresh."""

    __slots__ = (
        "fit",
        "flipped",
        "generation",
        "group_of",
        "grouped_at",
        "groups",
        "let_go",
        "live",
        "passed",
        "shaped",
    )

    def __init__(self, passed: list[str], fit: FitIndex, live: dict[str, bool], let_go: dict[str, int]) -> None:
        self.passed = passed  # held, so its identity stays its own
        self.fit = fit
        self.generation = fit.generation
        self.live = live
        self.let_go = let_go
        # The cards whose place changed at the last update (None: worked out afresh then).
        self.flipped: list[str] | None = None
        # `_live_groups`' answer, the groups it was worked out from, and at which update.
        self.groups: dict[str, list[str]] = {}
        self.shaped: dict[str, list[str]] | None = None
        self.group_of: dict[str, str] = {}
        self.grouped_at = -1

    def catch_up(self, pass_: DecisionPass, gang: _Gang, let_go: dict[str, int]) -> None:
        fit = self.fit
        changed = dict.fromkeys(fit.changed, True)
        if let_go is not self.let_go:
            changed.update(dict.fromkeys((card for card, _ in let_go.items() ^ self.let_go.items()), True))
        live, topology, need = self.live, gang.topology, gang.need
        schedulable, volatile = fit.schedulable, fit.volatile
        resident_sum, leased_sum = pass_.resident_sum, pass_.leased_sum
        flipped: list[str] = []
        for card in changed:
            acc = topology.get(card)
            if acc is None:
                continue
            # As `_live_cards_indexed` places it.
            if schedulable[card] >= need:
                holds = True
            elif card in volatile:
                taken = resident_sum.get(card, 0) + leased_sum.get(card, 0) - let_go.get(card, 0)
                holds = acc.total_bytes - acc.reserve_bytes - taken >= need
            else:
                holds = card in let_go and schedulable[card] + let_go[card] >= need
            if holds != (card in live):
                flipped.append(card)
                if holds:
                    live[card] = True
                else:
                    del live[card]
        self.flipped, self.let_go, self.generation = flipped, let_go, fit.generation

    def live_groups(self, gang: _Gang) -> dict[str, list[str]]:
        """`_groups_of(gang, self.live)`, brought up to date by the cards whose place changed
        at the last update where it was worked out at the one before."""
        groups = self.groups
        if self.shaped is not gang.groups or self.flipped is None or self.grouped_at != self.generation - 1:
            if self.shaped is not gang.groups:
                self.group_of = {a: group for group, members in gang.groups.items() for a in members}
                self.shaped = gang.groups
            groups = self.groups = _groups_of(gang, self.live)
        else:
            live, group_of, added = self.live, self.group_of, False
            for group in dict.fromkeys(group_of[a] for a in self.flipped if a in group_of):
                kept = [a for a in gang.groups[group] if a in live]
                if not kept:
                    groups.pop(group, None)
                    continue
                added = added or group not in groups
                groups[group] = kept
            if added:  # in the groups' order, as `_groups_of` has them
                groups = self.groups = {group: groups[group] for group in gang.groups if group in groups}
        self.grouped_at = self.generation
        return groups


def _kept_live_of(pass_: DecisionPass, gang: _Gang) -> _KeptLive | None:
    held: tuple[FitIndex, dict[tuple[int, int], _KeptLive]] | None = pass_.state.__dict__.get(_KEPT_LIVE)
    if held is None or held[0] is not pass_.fit:
        return None
    kept = held[1].get((id(gang.passed), gang.need))
    return kept if kept is not None and kept.passed is gang.passed else None


def _kept_live(pass_: DecisionPass, gang: _Gang, fit: FitIndex) -> _KeptLive | None:
    """The kept `_live_cards` for the gang's cards and bytes, brought up to date for this pass
    (None where the index lacks a card: worked out afresh each pass)."""
    if len(fit.schedulable) < len(pass_.pool_accelerators):
        return None
    held: tuple[FitIndex, dict[tuple[int, int], _KeptLive]] | None = pass_.state.__dict__.get(_KEPT_LIVE)
    if held is None or held[0] is not fit:
        held = pass_.state.__dict__[_KEPT_LIVE] = (fit, {})
    store = held[1]
    key = (id(gang.passed), gang.need)
    kept = store.get(key)
    let_go = _let_go(pass_)
    if kept is not None and kept.passed is gang.passed and kept.generation == fit.generation - 1:
        kept.catch_up(pass_, gang, let_go)
    elif kept is None or kept.passed is not gang.passed or kept.generation != fit.generation:
        if len(store) >= _KEPT_LIVE_MOST:
            store.clear()
        kept = store[key] = _KeptLive(gang.passed, fit, _live_cards_indexed(pass_, gang, fit), let_go)
    if CHECK_KEPT_LIVE:
        fresh = _live_cards_indexed(pass_, gang, fit)
        assert kept.live.keys() == fresh.keys(), (sorted(kept.live.keys() ^ fresh.keys()), fit.generation)
    return kept


def _never_fits(attempt: Attempt, gang: _Gang) -> Reject | None:
    """Phase 2: could it ever fit, with every ModelForge byte gone? Only the card sizes and
    reserves count (fixed for the pass), so the answer is worked out once per deployment and
    kind of class in a pass; else it is refused now, with why."""
    key = ("never", attempt.deployment.deployment_id, attempt.production)
    memo = attempt.pass_.memo
    never: tuple[FailureClass, str] | None
    if key in memo and attempt.pass_.indexed:
        never = memo[key]  # type: ignore[assignment]
    else:
        never = memo[key] = _never_fits_why(attempt.pass_, gang)
    if never is None:
        return None
    return Reject(attempt.queued.request_id, attempt.queued.workflow_id, never[0], never[1])


def _never_fits_why(pass_: DecisionPass, gang: _Gang) -> tuple[FailureClass, str] | None:
    budgets, need, count = pass_.budgets, gang.need, gang.count
    if gang.nvlink:
        # One group that could hold it is enough: the groups are looked at until one is found.
        for members in gang.groups.values():
            if sum(1 for a in members if need <= budgets[a].total_bytes - budgets[a].reserve_bytes) >= count:
                return None
        detail = "; ".join(f.reason for f in gang.refused[:3])
        return (
            FailureClass.CAPABILITY_UNAVAILABLE if not gang.groups else FailureClass.INSUFFICIENT_SCHEDULABLE_VRAM,
            f"no NVLink group has {count} eligible accelerators with {need} B each"
            + (f" ({detail})" if detail else ""),
        )
    ever = {a: True for a in gang.passed if need <= budgets[a].total_bytes - budgets[a].reserve_bytes}
    possible = [members for members in gang.groups.values() if sum(1 for a in members if a in ever) >= count]
    if sum(len(m) for m in possible) < count:
        cards = len(ever)
        if cards < count:
            return (
                FailureClass.INSUFFICIENT_SCHEDULABLE_VRAM,
                f"needs {count} accelerators with {need} B each; the pool has {cards}",
            )
    # Could its shape ever be satisfied, with every card empty?
    if choose_gang([(0, a) for a in ever], gang.shape, gang.topology) is None:
        return (
            FailureClass.INSUFFICIENT_SCHEDULABLE_VRAM,
            f"no placement in the pool satisfies {gang.shape.describe()} with {need} B each",
        )
    return None


def _choose(attempt: Attempt, gang: _Gang, evicting: bool, preempting: bool = False) -> list[str] | None:
    """Phase 3 (and 4, asked how things would be after making room): the cards for the gang,
    best fit, inside one NVLink group when it needs one, else as its shape allows."""
    cards, groups = _live(attempt.pass_, gang)
    if not gang.nvlink:
        return choose_gang(_room(attempt, gang, cards, evicting, preempting), gang.shape, gang.topology)
    count = gang.count
    best: tuple[int, str, list[str]] | None = None
    rights = _rights(attempt) if preempting else None
    for bound, key, members in _groups_by_bound(attempt.pass_, gang, groups, evicting, rights, attempt.production):
        if best is not None and (bound, key) >= best[:2]:
            break  # this group and every later one leave at least as much over
        room = _room(attempt, gang, members, evicting, preempting)
        if len(room) >= count:
            leftover = sum(left for left, _ in room[:count])
            if best is None or (leftover, key) < best[:2]:
                best = (leftover, key, [a for _, a in room[:count]])
    if best is not None and not attempt.pass_.fit_agrees(best[2]):
        return _choose(attempt, gang, evicting, preempting)  # the index is gone: every group looked at
    return None if best is None else best[2]


def _groups_by_bound(
    pass_: DecisionPass,
    gang: _Gang,
    groups: dict[str, list[str]],
    evicting: bool,
    rights: frozenset[str] | None,
    production: bool,
) -> list[tuple[int, str, list[str]]]:
    """The NVLink groups `_choose` compares, each with a lower bound of what its best cards
    leave over, in (bound, group) order, so the search stops at the first group whose bound
    is no better than the best found. With the fit index (the fast pass), a card's free bytes
    come from it and not from its budget (most of a large pool's cards are never looked at
    closer), and only groups holding a card that could hold the gang are looked at
    (`_holding_groups`). Each group's bound is `_Bound.of`'s: the landing rules only take
    cards away, so no group leaves less over (or, preempting, newly stops less) than its
    bound. `rights`: preempting, the classes the gang's class may preempt (None: not
    preempting). Without the index, every group, bound 0, in group order. A card stale or
    under pressure for this kind of work (`shut_cards`) may hold nothing new, so holds no
    gang either. Kept for the pass and brought up to date as bytes are committed (`_Bounds`);
    gangs of the same cards, bytes, count and rights share it."""
    fit = pass_.fit
    if fit is None:
        return [(0, key, members) for key, members in sorted(groups.items())]
    memo_key = ("by_bound", id(groups), gang.need, gang.count, evicting, rights, production)
    memo = pass_.memo.get(memo_key)
    log = pass_.commit_log
    if isinstance(memo, _Bounds) and memo.groups is groups:
        if memo.seen < len(log):
            memo.catch_up(gang, log)
        return memo.ordered
    bound = _Bound(pass_, fit.schedulable, gang, evicting, rights, shut_cards(pass_, production))
    bounds = _Bounds(groups, bound, len(log))
    for key, members in _holding_groups(pass_, gang, groups, evicting or rights is not None, bound.stoppable):
        entry = bound.of(key, members)
        if entry is not None:
            bounds.entries[key] = entry
    bounds.order()
    pass_.memo[memo_key] = bounds
    return bounds.ordered


class _Bound:
    """A group's bound for `_groups_by_bound`, for one gang's bytes and count and one search
    (`evicting`, `preempting`): what it reads of the pass besides the bytes committed."""

    # It holds what it reads of the pass, never the pass: the pass keeps it (`memo`), and a
    # pass in a reference cycle outlives its decisions until the cyclic collector finds it.
    __slots__ = (
        "committed",
        "count",
        "evictable",
        "need",
        "preempting",
        "schedulable",
        "shut",
        "stoppable",
        "stopping",
    )

    def __init__(
        self,
        pass_: DecisionPass,
        schedulable: dict[str, int],
        gang: _Gang,
        evicting: bool,
        rights: frozenset[str] | None,
        shut: dict[str, str],
    ) -> None:
        self.committed, self.schedulable, self.shut = pass_.committed, schedulable, shut
        self.need, self.count, self.preempting = gang.need, gang.count, rights is not None
        self.evictable = pass_.evictable if evicting or rights is not None else {}
        self.stoppable, self.stopping = _preemptible_bytes(pass_, rights) if rights is not None else ({}, {})

    def of(self, key: str, members: list[str]) -> tuple[int, str, list[str]] | None:
        """(bound, key, members), or None when fewer than `count` of its cards could hold the
        gang. A card could if its free bytes do (`evicting`: with every idle resident there
        unloaded, the bound from its free bytes alone, as `_room` unloads only some of them);
        preempting: with all the work there its class may stop gone too, and its bound is the
        least it newly stops: what the gang needs beyond its free bytes, every idle resident
        and the work there already being stopped."""
        committed, need, count, shut = self.committed, self.need, self.count, self.shut
        schedulable, evictable, preempting = self.schedulable, self.evictable, self.preempting
        least: list[int] = []
        for accelerator in members:
            if accelerator in shut:
                continue
            free = schedulable.get(accelerator)
            if free is None:  # not in the index: no bound from this group
                return (0, key, members)
            free -= committed.get(accelerator, 0)
            idle = evictable.get(accelerator)
            idle_bytes = sum(r.bytes for r in idle) if idle else 0
            if preempting:
                free += idle_bytes
                if free + self.stoppable.get(accelerator, 0) >= need:
                    least.append(max(0, need - free - self.stopping.get(accelerator, 0)))
            elif free + idle_bytes >= need:
                least.append(max(0, free - need))
        if len(least) < count:
            return None
        least.sort()
        return (sum(least[:count]), key, members)


class _Bounds:
    """`_groups_by_bound`'s groups for one search, kept for the pass: bytes committed only take
    bytes away, so a group left out stays out, and only the groups of the cards committed to
    since are worked out again (`catch_up`)."""

    __slots__ = ("bound", "entries", "groups", "ordered", "seen")

    def __init__(self, groups: dict[str, list[str]], bound: _Bound, seen: int) -> None:
        self.groups, self.bound, self.seen = groups, bound, seen
        self.entries: dict[str, tuple[int, str, list[str]]] = {}
        self.ordered: list[tuple[int, str, list[str]]] = []

    def order(self) -> None:
        self.ordered = sorted(self.entries.values(), key=lambda entry: (entry[0], entry[1]))

    def catch_up(self, gang: _Gang, log: list[str]) -> None:
        entries, topology = self.entries, gang.topology
        changed = False
        for accelerator in log[self.seen :]:
            acc = topology.get(accelerator)
            key = acc.nvlink_group if acc is not None else ""
            if key in entries:
                entry = self.bound.of(key, self.groups[key])
                if entry is None:
                    del entries[key]
                else:
                    entries[key] = entry
                changed = True
        self.seen = len(log)
        if changed:
            self.order()


def _holding_groups(
    pass_: DecisionPass, gang: _Gang, groups: dict[str, list[str]], evicting: bool, stoppable: dict[str, int]
) -> Iterable[tuple[str, list[str]]]:
    """The groups of `groups` (`_live`'s, by NVLink group) `_groups_by_bound` may keep: those holding a
    card that could hold the gang's bytes, its schedulable bytes enough (the fit index's tail
    from `need`: bytes committed in the pass only take some away), or (`evicting`) with its
    idle residents or (`stoppable` given) its preemptible work gone too. Every group when that
    is not far fewer cards, or the index lacks some card."""
    fit = pass_.fit
    assert fit is not None
    start = fit.from_bytes(gang.need)
    tail = len(fit.order) - start
    cards = sum(len(members) for members in groups.values()) if tail < len(fit.order) else 0
    if (
        tail * 4 >= cards
        or len(fit.schedulable) < len(pass_.pool_accelerators)
        or (evicting and (len(pass_.evictable) + len(stoppable)) * 4 >= cards)
    ):
        return groups.items()
    topology = gang.topology
    held: dict[str, bool] = {}
    candidates: list[Iterable[str]] = [[a for _, a in fit.order[start:]]]
    if evicting:
        candidates += [pass_.evictable, stoppable]
    for some in candidates:
        for accelerator in some:
            acc = topology.get(accelerator)
            if acc is not None and acc.nvlink_group in groups:
                held[acc.nvlink_group] = True
    return [(key, groups[key]) for key in held]


def _preemptible_bytes(pass_: DecisionPass, rights: frozenset[str]) -> tuple[dict[str, int], dict[str, int]]:
    """Per card, the most that stopping the work there a class with `rights` (the classes it
    may preempt) may stop could give back: each lease's bytes, its batch runner's too, and a
    lease already being stopped whatever its class (`preemptible_for`), more than
    `_newly_stopped` ever counts. And the most of it already being stopped (by an earlier
    pass), which `_newly_stopped` counts as coming back without a new preemption. Once per
    pass for each set of rights."""
    memo_key = ("preemptible_bytes", rights)
    cached = pass_.memo.get(memo_key)
    if cached is not None:
        return cached  # type: ignore[return-value]
    state = pass_.state
    preempting = state.preempting
    stoppable: dict[str, int] = {}
    stopping: dict[str, int] = {}
    for accelerator, leases in pass_.preemptible.items():
        total = being_stopped = 0
        for lease in leases:
            stopped = lease.lease_id in preempting
            if not stopped and lease.priority not in rights:
                continue
            freed = lease.bytes
            holder = holder_of(state, lease)
            if holder is not None and holder.residency == Residency.NONE:
                freed += holder.bytes
            total += freed
            if stopped:
                being_stopped += freed
        if total:
            stoppable[accelerator] = total
        if being_stopped:
            stopping[accelerator] = being_stopped
    pass_.memo[memo_key] = (stoppable, stopping)
    return stoppable, stopping


def _room(attempt: Attempt, gang: _Gang, members: list[str], evicting: bool, preempting: bool) -> list[tuple[int, str]]:
    """(bytes left over, accelerator), best fit first, for the cards of `members` where the
    gang may land (`may_land`) and fits now, or (`evicting`) once the idle residents
    there are unloaded, or (`preempting`) once the work it may preempt has gone too."""
    pass_, need = attempt.pass_, gang.need
    room = []
    # The fast pass reads staleness and pressure from one walk of the pass (`shut_cards`).
    shut = shut_cards(pass_, attempt.production) if pass_.indexed else None
    for accelerator in may_land(pass_, members, attempt.production, gang.landing, shut):
        free = pass_.free(accelerator)
        if evicting or preempting:
            free += sum(r.bytes for r in idle_residents(pass_, accelerator, attempt.production))
        if preempting:
            newly_stopped = _newly_stopped(attempt, accelerator, free, need)
            if newly_stopped is not None:
                room.append((newly_stopped, accelerator))
        elif need <= free:
            room.append((free - need, accelerator))
    room.sort()
    return room


def _newly_stopped(attempt: Attempt, accelerator: str, free: int, need: int) -> int | None:
    """The bytes of work newly stopped for the gang on `accelerator`, or None if preempting all
    it may does not make room. Cards whose work is already being preempted (by an earlier pass)
    rank first, so passes do not spread the damage."""
    preempting = attempt.pass_.state.preempting
    stoppable = preemptible_for(attempt.pass_, attempt.queued, accelerator)
    free += sum(freed for lease, freed in stoppable if lease.lease_id in preempting)
    fresh = 0
    for lease, freed in stoppable:
        if free >= need:
            break
        if lease.lease_id not in preempting:
            free += freed
            fresh += freed
    return fresh if need <= free else None


def _make_room(attempt: Attempt, gang: _Gang) -> list[Unload | Sleep] | Preemption | None:
    """Phase 4: as a single request does, the idle residents in the way go first; then work its
    class may preempt, on the cards needing the least of it."""
    pass_, queued = attempt.pass_, attempt.queued
    if pass_.evictable:
        room_after = _choose(attempt, gang, evicting=True)
        plans = [
            eviction_plan(pass_, a, attempt.deployment.deployment_id, gang.need, attempt.production) or []
            for a in room_after or []
        ]
        if room_after is not None and any(plans):
            unloads = []
            for accelerator, plan in zip(room_after, plans, strict=True):
                pass_.blocked[accelerator] = True
                for key, _ in plan:
                    pass_.evicting[key] = True
                unloads.extend(room_decisions(plan, f"making room for {queued.capability} ({queued.priority})"))
            return unloads
    if pass_.preemptible:
        room_after = _choose(attempt, gang, evicting=True, preempting=True)
        if room_after is not None:
            return _preempt_for_gang(pass_, queued, room_after, gang.need, attempt.production)
    return None


def _wait(attempt: Attempt, gang: _Gang, reserve: bool = True) -> Wait:
    """Phase 5: it waits, and reserves the cards where it can start soonest if it can (and
    `reserve`: False when no card could be reserved)."""
    where = "in one NVLink group" if gang.nvlink else f"for {gang.shape.describe()}"
    waiting = f"gang of {gang.count} x {gang.need} B: not enough room {where} yet"
    reserving = reserve and attempt.pass_.state.config.gang_reservations
    reserved = _reserve_for_gang(attempt, gang) if reserving else ""
    if reserved:
        codes = (WaitReason.GANG_ROOM, WaitReason.GANG_RESERVATION)
        return Wait(attempt.queued.request_id, f"{waiting}; {reserved}", codes)
    return Wait(attempt.queued.request_id, waiting, (WaitReason.GANG_ROOM,))


def _grant_gang(attempt: Attempt, gang: _Gang, chosen: list[str]) -> Grant:
    pass_, queued = attempt.pass_, attempt.queued
    for accelerator in chosen:
        pass_.commit(accelerator, gang.need)
        take_reservation(pass_, accelerator, gang.landing)
    first = pass_.state.catalog.accelerator(chosen[0])
    assert first is not None
    lease = new_lease(
        pass_, queued, attempt.deployment, chosen, first.node, "", gang.need, attempt.now, attempt.counter
    )
    return Grant(queued.request_id, queued.workflow_id, lease)


def _preempt_for_gang(
    pass_: DecisionPass, queued: QueuedRequest, accelerators: list[str], need: int, production: bool
) -> Preemption | None:
    """On each chosen card, as little preemption as makes the gang's bytes fit with the idle
    residents gone too (their unloads follow on the next pass)."""
    state = pass_.state
    preempts: list[Preempt] = []
    stopping: list[str] = []
    stopped: list[Lease] = []
    reason = f"{queued.priority} {queued.capability} (a gang) needs room on {', '.join(sorted(accelerators))}"
    for accelerator in accelerators:
        free = pass_.free(accelerator) + sum(r.bytes for r in idle_residents(pass_, accelerator, production))
        # A gang lease stopped for an earlier card frees this one too.
        free += sum(lease.bytes for lease in stopped if accelerator in lease.gang)
        for lease, freed in preemptible_for(pass_, queued, accelerator):
            if free >= need:
                break
            free += freed
            pass_.preempting[lease.lease_id] = True
            stopping.append(lease.lease_id)
            stopped.append(lease)
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
        Wait(
            queued.request_id,
            f"making room: preempting lower-class work ({', '.join(stopping)})",
            (WaitReason.MAKING_ROOM,),
        ),
    )


def _reserve_for_gang(attempt: Attempt, gang: _Gang) -> str:
    """Reserve the accelerators where this waiting gang can start soonest, when the work there
    has known end times and it would start before it expires (its lease timeout or deadline);
    returns what was reserved, or "" (nothing can be promised)."""
    pass_, queued, now = attempt.pass_, attempt.queued, attempt.now
    timelines, ready_at = _release_timelines(attempt, gang)
    # Only the groups `_live` kept hold cards with a time (the others could not be chosen).
    chosen = choose_reserved(
        ready_at, gang.count, gang.shape, gang.topology, _live(pass_, gang)[1] if gang.nvlink else None
    )
    if chosen is None:
        # Nothing this gang's own times decide: no card gets its bytes back at a known time.
        # A pass only takes capacity (cards blocked, reserved, bytes promised), so every later
        # gang of its deployment and kind of class finds no reservation either: its wait stands
        # for them (`Outcome.reusable`), as it does with reservations off.
        return ""
    # Whether a reservation is made depends on this request's own lease timeout and deadline.
    attempt.reusable = False
    starts_at, accelerators = chosen
    if starts_at + attempt.load_s >= queued.expires_at:
        return ""
    for accelerator in accelerators:
        spare = pass_.free(accelerator) + freed_by(timelines[accelerator], starts_at) - gang.need
        pass_.reservations[accelerator] = Reservation(queued.request_id, starts_at, max(0, spare))
    return (
        f"reserved {', '.join(sorted(accelerators))} from {starts_at - now:.0f} s on (backfill: work that ends by then)"
    )


def _release_timelines(attempt: Attempt, gang: _Gang) -> tuple[dict[str, list[tuple[float, int]]], dict[str, float]]:
    """For each card a gang could reserve (`may_land` with no reservation to share): the
    bytes it gets back and when, and when the gang's bytes would be free there."""
    pass_, now = attempt.pass_, attempt.now
    state = pass_.state
    timelines: dict[str, list[tuple[float, int]]] = {}
    ready_at: dict[str, float] = {}
    # The others never have the gang's bytes free, nor are chosen (`_live`).
    cards, _ = _live(pass_, gang)
    if not cards:
        return timelines, ready_at
    held = _held(pass_)
    on = held.on
    unloading = _unloading_releases(pass_, now)
    reserved = _reserved_releases(pass_, now)
    evictable = pass_.evictable
    groups = kept_groups(state) if pass_.indexed and pass_.fit is not None else None
    if groups is not None:
        cards = _could_be_ready(pass_, gang, cards, groups[1].timed_on, unloading, reserved)
    # A card's leases and unloads give the same timeline to every gang of the pass (neither
    # changes during it): the fast pass works it out once; what a pass changes (idle residents
    # it unloads or uses, bytes promised to requests waiting on a load) is added per gang.
    kept: dict[str, list[tuple[float, int]]] | None = None
    if pass_.indexed:
        kept = pass_.memo.setdefault(("timelines",), {})  # type: ignore[assignment]
    shut = shut_cards(pass_, attempt.production) if pass_.indexed else None
    for accelerator in may_land(pass_, cards, attempt.production, None, shut):
        timeline = kept.get(accelerator) if kept is not None else None
        if timeline is None:
            timeline = release_timeline(
                on.get(accelerator, {}).values(), state.residents, now, unloading.get(accelerator, [])
            )
            if kept is not None:
                kept[accelerator] = timeline
        coming = reserved.get(accelerator, [])
        if evictable.get(accelerator):
            for idle in idle_residents(pass_, accelerator, attempt.production):
                # Unloaded to make room when the gang's time comes (as it does when it fits now).
                coming = [*coming, (now + unload_cost(state, state.catalog.deployment(idle.deployment)), idle.bytes)]
        if coming:
            timeline = sorted([*timeline, *coming])
        timelines[accelerator] = timeline
        ready_at[accelerator] = free_at(pass_.free(accelerator), timeline, gang.need, now)
    return timelines, ready_at


def _could_be_ready(
    pass_: DecisionPass,
    gang: _Gang,
    cards: list[str],
    timed: dict[str, int],
    unloading: dict[str, list[tuple[float, int]]],
    reserved: dict[str, list[tuple[float, int]]],
) -> list[str]:
    """The cards of `cards` where the gang's bytes could be free at some known time: those with
    the bytes free now, or with bytes coming back at a known time (a lease with an end time,
    an unload under way, bytes promised to a load, an idle resident). On every other card its
    ready time is never (`free_at`: nothing comes back and too little is free), and a card
    never ready is never reserved (`choose_reserved` reads only finite times): a busy
    cluster's waiting gang otherwise worked out a timeline for every card that could ever
    hold it, most of them full of work with no end time. Free bytes come from the fit index
    where it holds the card and its reserve does not move, as `_live_cards` reads them; the
    cards kept are then read from their budgets."""
    fit = pass_.fit
    assert fit is not None
    schedulable, volatile, committed, evictable = fit.schedulable, fit.volatile, pass_.committed, pass_.evictable
    need = gang.need
    kept = []
    for accelerator in cards:
        bytes_now = schedulable.get(accelerator)
        if (
            bytes_now is None
            or bytes_now - committed.get(accelerator, 0) >= need
            or accelerator in timed
            or accelerator in volatile
            or accelerator in unloading
            or accelerator in reserved
            or evictable.get(accelerator)
        ):
            kept.append(accelerator)
    return kept


def leases_on(pass_: DecisionPass) -> dict[str, dict[str, Lease]]:
    """The leases held on each accelerator by lease id (a gang's on each of its cards), brought
    up to date once per pass (`_standing.leases_on`)."""
    return _held(pass_).on


def _held(pass_: DecisionPass) -> LeasesOn:
    cached = pass_.memo.get(("leases_on",))
    if cached is not None:
        return cached  # type: ignore[return-value]
    held = held_on(pass_.state, kept=pass_.indexed)
    pass_.memo[("leases_on",)] = held
    return held


def _unloading_releases(pass_: DecisionPass, now: float) -> dict[str, list[tuple[float, int]]]:
    """Bytes coming back per accelerator besides leases' ends, that no placement changes:
    residents being unloaded, once the unload is done. Once per pass (the fast pass)."""
    cached = pass_.memo.get(("unloading",)) if pass_.indexed else None
    if cached is not None:
        return cached  # type: ignore[return-value]
    state = pass_.state
    unloading: dict[str, list[tuple[float, int]]] = {}
    for resident in _unloading(pass_):
        done = now + unload_cost(state, state.catalog.deployment(resident.deployment))
        unloading.setdefault(resident.accelerator, []).append((done, resident.bytes))
    if pass_.indexed:
        pass_.memo[("unloading",)] = unloading
    return unloading


def _unloading(pass_: DecisionPass) -> list[ResidentState]:
    """The residents being unloaded, in the residents' order: from the kept groupings in the
    fast pass, else from every resident."""
    kept = kept_groups(pass_.state) if pass_.indexed else None
    if kept is not None:
        return kept[0].unloading
    return [r for r in pass_.state.residents.values() if r.phase == ResidentPhase.UNLOADING]


def _reserved_releases(pass_: DecisionPass, now: float) -> dict[str, list[tuple[float, int]]]:
    """Lease bytes this pass promised to requests waiting on a load, per accelerator, by when
    their work ends (those with a max_duration)."""
    state = pass_.state
    promised: dict[str, list[tuple[float, int]]] = {}
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
    return promised
