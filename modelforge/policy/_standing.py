"""What a decision pass starts from, kept across passes: the residents and leases grouped per
accelerator and per deployment (bytes, always_warm bytes, idle residents, free slots, leases of
preemptible deployments), and the pool's accelerators in order.

`start_pass` used to walk every resident and every lease on every pass. These groupings depend
on the residents' and leases' fields alone (and the catalog), not on time, so they are kept in
the state's `__dict__` (never serialized) and rebuilt only when what they were built from
changed. Whether it did is checked, not trusted: residents are mutable and changed in place by
many transitions (and by tests), so each pass compares, at C speed, the residents' identities
and the fields read here with the ones the grouping was built from, and a change of any of them
rebuilds the residents' part from scratch, in the same walk order as a pass always used, so a
pass sees exactly what it computed before (what that walk reads of the catalog, per deployment
and card, is looked up once per catalog). Leases are frozen, so their identities suffice, and
their part is brought up to date by the leases that came and went (its readers sum, or sort
what they read). What depends on time or on per-pass state (a lease's minimum runtime, leases
being preempted, measured unload times) is still worked out per pass, from these groupings.

The reference pass (`decide_each(..., reuse_settled=False)`) never uses them: it builds its own
from scratch, and the property tests compare the two."""

from __future__ import annotations

from itertools import islice
from operator import attrgetter, is_
from typing import TYPE_CHECKING

from modelforge.domain import Accelerator, Catalog, Residency
from modelforge.policy._state import RESIDENT_WRITES, Lease, PoolState, ResidentPhase, ResidentState

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

_KEY = "_policy_standing"

# Every field of a resident that the groupings below read: its mark.
_Mark = tuple[str, str, str, int, ResidentPhase, Residency, int]
_resident_fields = attrgetter("key", "deployment", "accelerator", "bytes", "phase", "residency", "active_leases")


_IDLE_PHASES = (ResidentPhase.READY, ResidentPhase.ASLEEP)
# Residencies whose idle residents go when their last lease has ended and nobody waits.
GO_WITH_LAST_LEASE = (Residency.LOAD_ON_DEMAND, Residency.NONE)


def is_evictable(resident: ResidentState) -> bool:
    """Idle and not pinned: may be unloaded (or, awake and able to, put to sleep) to make room.
    An asleep resident still holds its kept bytes: it may be unloaded too."""
    return (
        resident.phase in _IDLE_PHASES and resident.active_leases == 0 and resident.residency != Residency.ALWAYS_WARM
    )


def _same(now: list[object], then: list[object]) -> bool:
    return len(now) == len(then) and all(map(is_, now, then))


class _CatalogFacts:
    """What the residents' walk reads of the catalog (immutable by contract) per deployment and
    card, looked up once and kept with every grouping made from that catalog: a busy cluster's
    rebuild would otherwise look up each of its hundreds of residents' deployment and card."""

    __slots__ = ("catalog", "concurrency", "known_cards", "known_deployments")

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.concurrency: dict[str, int] = {}  # 1 for a deployment the catalog lacks
        self.known_deployments: dict[str, bool] = {}
        self.known_cards: dict[str, bool] = {}


class ResidentGroups:
    """The residents grouped as a pass reads them. Never changed once built: a pass copies what
    it changes (`slots`, `residents_of`)."""

    __slots__ = (
        "catalog",
        "evictable",
        "facts",
        "marks",
        "pinned",
        "removed",
        "resident_sum",
        "residents",
        "residents_of",
        "slots",
        "unloading",
        "unused",
        "writes",
    )

    def __init__(
        self,
        catalog: Catalog,
        residents: list[ResidentState],
        marks: list[_Mark],
        writes: int,
        facts: _CatalogFacts | None = None,
    ) -> None:
        self.catalog = catalog
        self.facts = facts if facts is not None and facts.catalog is catalog else _CatalogFacts(catalog)
        self.residents = residents
        self.marks = marks
        self.writes = writes  # `RESIDENT_WRITES` when the marks were last found the residents'
        # Residents of every phase count, unloading and unreclaimed included, until NVML confirms.
        self.resident_sum: dict[str, int] = {}
        self.pinned: dict[str, int] = {}
        self.residents_of: dict[str, list[ResidentState]] = {}
        # Idle residents per accelerator in the residents' order (a pass sorts them by cost).
        self.evictable: dict[str, list[ResidentState]] = {}
        self.slots: dict[str, int] = {}
        # Residents being unloaded, in the residents' order: their bytes come back once done.
        self.unloading: list[ResidentState] = []
        # Idle load_on_demand and batch residents, in the residents' order: those a pass unloads
        # when nobody waits on them (`_placement._unload_unused`), where a busy cluster's
        # residents are mostly running jobs.
        self.unused: list[ResidentState] = []
        # Residents whose deployment or card the catalog no longer has, in the residents' order:
        # those a pass unloads once idle (`_placement._unload_removed`).
        self.removed: list[ResidentState] = []
        resident_sum, pinned, residents_of, evictable, slots, unused, unloading = (
            self.resident_sum,
            self.pinned,
            self.residents_of,
            self.evictable,
            self.slots,
            self.unused,
            self.unloading,
        )
        # One walk, each resident's fields read from its mark (the same values, in one tuple):
        # a busy cluster rebuilds this on nearly every pass, over hundreds of running jobs.
        always_warm, idle, by_pass = Residency.ALWAYS_WARM, _IDLE_PHASES, GO_WITH_LAST_LEASE
        unloading_phase = ResidentPhase.UNLOADING
        facts = self.facts
        concurrency, known_deployments, known_cards = facts.concurrency, facts.known_deployments, facts.known_cards
        for resident, (key, deployment_id, accelerator, nbytes, phase, residency, active) in zip(
            residents, marks, strict=True
        ):
            resident_sum[accelerator] = resident_sum.get(accelerator, 0) + nbytes
            of_deployment = residents_of.get(deployment_id)
            if of_deployment is None:
                residents_of[deployment_id] = [resident]
            else:
                of_deployment.append(resident)
            if residency == always_warm:
                pinned[accelerator] = pinned.get(accelerator, 0) + nbytes
            elif phase in idle and active == 0:  # `is_evictable`
                evictable.setdefault(accelerator, []).append(resident)
                if residency in by_pass:
                    unused.append(resident)
            if phase == unloading_phase:
                unloading.append(resident)
            most = concurrency.get(deployment_id)
            if most is None:
                deployment = catalog.deployment(deployment_id)
                most = concurrency[deployment_id] = deployment.concurrency if deployment else 1
                known_deployments[deployment_id] = deployment is not None
            slots[key] = most - active
            on_card = known_cards.get(accelerator)
            if on_card is None:
                on_card = known_cards[accelerator] = catalog.accelerator(accelerator) is not None
            if not (on_card and known_deployments[deployment_id]):
                self.removed.append(resident)


class LeaseGroups:
    """The leases grouped as a pass reads them, kept across passes and brought up to date by
    the leases that came, went or were replaced since (a busy pool grants and ends leases on
    nearly every pass, and rebuilding walked every lease). `leased_sum` is a new dict whenever
    a lease changed it, never changed once handed out: the fit index tells what changed by
    comparing the one it last saw with the one it is given."""

    __slots__ = ("catalog", "held", "holding", "leased_sum", "of_preemptible", "of_timed", "timed_on")

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.held: dict[str, Lease] = {}
        self.leased_sum: dict[str, int] = {}
        self.holding: dict[str, int] = {}  # leases per card: a card is in `leased_sum` while any holds it
        # Leases of preemptible deployments, with the cards each holds: those a pass may
        # preempt once past their minimum runtime (a pass sorts them per card).
        self.of_preemptible: dict[str, tuple[Lease, Iterable[str]]] = {}
        # Leases with an end time (`Lease.ends_by`), with the cards each holds; and per card, how
        # many there are (a card without one gets nothing back at a known time from its leases).
        self.of_timed: dict[str, tuple[Lease, Iterable[str]]] = {}
        self.timed_on: dict[str, int] = {}

    def update(self, leases: dict[str, Lease]) -> None:
        held = self.held
        if held == leases:
            # Every lease is the one counted (or one equal to it, field by field): none came or
            # went. At C speed, each value compared by identity first; a pass asks it again
            # after the observations that started its step asked it.
            return
        self.leased_sum = dict(self.leased_sum)
        for gone, came in lease_changes(held, leases):
            self._count(gone, came, leases)

    def _count(self, gone: Iterable[str], came: Iterable[str], leases: dict[str, Lease]) -> None:
        held, leased_sum, holding, timed_on = self.held, self.leased_sum, self.holding, self.timed_on
        for lease_id in gone:
            lease = held.pop(lease_id)
            self.of_preemptible.pop(lease_id, None)
            timed = self.of_timed.pop(lease_id, None) is not None
            for accelerator_id in lease.accelerators if lease.gang else (lease.accelerator,):
                if holding[accelerator_id] == 1:
                    del holding[accelerator_id], leased_sum[accelerator_id]
                else:
                    holding[accelerator_id] -= 1
                    leased_sum[accelerator_id] -= lease.bytes
                if timed:
                    if timed_on[accelerator_id] == 1:
                        del timed_on[accelerator_id]
                    else:
                        timed_on[accelerator_id] -= 1
        catalog = self.catalog
        for lease_id in came:
            lease = held[lease_id] = leases[lease_id]
            held_on = lease.accelerators if lease.gang else (lease.accelerator,)
            for accelerator_id in held_on:
                leased_sum[accelerator_id] = leased_sum.get(accelerator_id, 0) + lease.bytes
                holding[accelerator_id] = holding.get(accelerator_id, 0) + 1
            leased = catalog.deployment(lease.deployment)
            if leased is not None and leased.preemptible:
                self.of_preemptible[lease_id] = (lease, held_on)
            if lease.ends_by is not None:
                self.of_timed[lease_id] = (lease, held_on)
                for accelerator_id in held_on:
                    timed_on[accelerator_id] = timed_on.get(accelerator_id, 0) + 1


def lease_changes(held: dict[str, Lease], leases: dict[str, Lease]) -> Iterator[tuple[list[str], list[str]]]:
    """What brings `held` (a copy kept of `leases` that its reader pops and adds to) up to
    date, in steps of (ids gone, ids come in `leases`' order), each taken before the next is
    asked. A busy pool changes a few of its thousands of leases a pass: those gone are a
    difference of keys and those come the dict's tail (a new id is added at its end), both
    found at C speed; the walk over every lease is left to what that misses, a lease replaced
    under its id (rare), asked once `held` has taken the rest. The reader's tables follow from
    the ids alone (sums and counts), so the order those gone are taken in does not change them."""
    gone = list(held.keys() - leases.keys())
    come = len(leases) - len(held) + len(gone)  # the ids of `leases` not held, exactly
    came = list(islice(reversed(leases.keys()), come))
    came.reverse()
    if not any(lease_id in held for lease_id in came):
        yield gone, came
        if held == leases:
            return
    gone = [lease_id for lease_id, lease in held.items() if leases.get(lease_id) is not lease]
    yield gone, []
    yield [], [lease_id for lease_id in leases if lease_id not in held]


class LeasesOn:
    """The leases held on each card (a gang's on each of its cards), by lease id, kept across
    passes and brought up to date by the leases that came, went or were replaced since: a busy
    pool grants and ends leases on nearly every pass, and rebuilding this walked every card of
    every lease (a tenth of a busy cluster's replay). Its readers (a reservation's release
    timeline) sum and sort, so the order within a card is not kept."""

    __slots__ = ("held", "on")

    def __init__(self) -> None:
        self.held: dict[str, Lease] = {}
        self.on: dict[str, dict[str, Lease]] = {}

    def update(self, leases: dict[str, Lease]) -> None:
        held, on = self.held, self.on
        if held == leases:
            return  # as `LeaseGroups.update`: none came or went
        for gone, came in lease_changes(held, leases):
            for lease_id in gone:
                lease = held.pop(lease_id)
                for card in lease.accelerators:
                    cards = on[card]
                    del cards[lease_id]
                    if not cards:
                        del on[card]
            for lease_id in came:
                lease = held[lease_id] = leases[lease_id]
                for card in lease.accelerators:
                    on.setdefault(card, {})[lease_id] = lease


def leases_on(state: PoolState, kept: bool = True) -> LeasesOn:
    """Per card, the leases held there (`LeasesOn`): kept across passes, or (`kept` False: the
    reference pass) built from scratch."""
    if not kept:
        fresh = LeasesOn()
        fresh.update(state.leases)
        return fresh
    cached: dict[str, object] = state.__dict__.setdefault(_KEY, {})
    index = cached.get("leases_on")
    if not isinstance(index, LeasesOn):
        index = cached["leases_on"] = LeasesOn()
    index.update(state.leases)
    return index


def resident_groups(state: PoolState) -> ResidentGroups:
    """The residents' groupings, rebuilt when a resident came, went, or changed a field read.
    Their fields are compared only when a field of some resident was written since the
    groupings were last found current (`RESIDENT_WRITES`): most passes write none."""
    cached: dict[str, object] = state.__dict__.setdefault(_KEY, {})
    writes = RESIDENT_WRITES[0]
    residents = list(state.residents.values())
    groups = cached.get("residents")
    if (
        isinstance(groups, ResidentGroups) and groups.catalog is state.catalog and _same(residents, groups.residents)  # type: ignore[arg-type]
    ):
        if groups.writes == writes:
            return groups
        marks: list[_Mark] = list(map(_resident_fields, residents))
        if groups.marks == marks:
            groups.writes = writes
            return groups
    else:
        marks = list(map(_resident_fields, residents))
    facts = groups.facts if isinstance(groups, ResidentGroups) else None
    groups = cached["residents"] = ResidentGroups(state.catalog, residents, marks, writes, facts)
    return groups


def lease_groups(state: PoolState) -> LeaseGroups:
    """The leases' groupings, brought up to date by the leases that came or went (a lease is
    frozen), rebuilt with a new catalog."""
    cached: dict[str, object] = state.__dict__.setdefault(_KEY, {})
    groups = cached.get("leases")
    if not isinstance(groups, LeaseGroups) or groups.catalog is not state.catalog:
        groups = cached["leases"] = LeaseGroups(state.catalog)
    groups.update(state.leases)
    return groups


def kept_groups(state: PoolState) -> tuple[ResidentGroups, LeaseGroups] | None:
    """The groupings as the fast pass under way started from (`resident_groups` and
    `lease_groups` brought them up to date; a pass changes neither residents nor leases), or
    None where no fast pass kept them."""
    cached = state.__dict__.get(_KEY, {})
    residents, leases = cached.get("residents"), cached.get("leases")
    if not isinstance(residents, ResidentGroups) or not isinstance(leases, LeaseGroups):
        return None
    return residents, leases


def pool_cards(state: PoolState) -> tuple[list[Accelerator], dict[str, int]]:
    """The pool's accelerators in catalog order and each one's position, kept with the catalog
    (immutable by contract). Neither is changed by a pass."""
    cache: dict[str, tuple[list[Accelerator], dict[str, int]]]
    cache = state.catalog.__dict__.setdefault("_policy_pool_cards", {})
    cards = cache.get(state.pool)
    if cards is None:
        accelerators = [a for a in state.catalog.accelerators if a.pool == state.pool]
        cards = cache[state.pool] = (accelerators, {a.id: i for i, a in enumerate(accelerators)})
    return cards
