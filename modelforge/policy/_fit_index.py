"""The pool's cards ordered by schedulable bytes, kept across passes, so a load's best fit is
found by a search from the bytes it needs instead of a walk over every card.

A pass used to compute the budget of every eligible card for every load it placed (`_score_loads`
walking them all for the least bytes left over): on a mostly idle cluster of 6,000 cards that was
almost all of a replay's time, for a choice the ordering answers at once. The index keeps each
card's schedulable bytes as of the last pass and the cards sorted by (bytes, id), the order a
best fit compares them in. A pass re-reads only the cards whose budget may have changed since:

- cards whose resident or lease bytes changed (the `_standing` groupings were rebuilt: their sums
  are compared, so only cards with residents or leases are looked at);
- cards an observation landed on (`mark_observed`, called by `apply_observations`, the one place
  an accelerator's observation, health or pressure is written);
- cards whose reserve moves with time alone (two or more recent external readings: the spread is
  taken over a window that slides with `now`), re-read on every pass.

A new catalog, or a state without an index (a fresh or deserialized one), builds it from scratch.
The reference pass never uses it; the property tests compare the two passes, and a pass that
finds a card's kept bytes differ from its budget drops the index (and places by the full walk).

It also keeps the pool's UNHEALTHY cards and those under GPU_PRESSURE, which change only where
observations land, so a pass does not walk every card's runtime to find them, and when each card was last observed
(`Staleness`), so the cards gone stale since the last pass are found without reading every
card's observation."""

from __future__ import annotations

from bisect import bisect_left, insort
from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING

from modelforge.domain import Accelerator, Catalog
from modelforge.policy._budget import reported_within

if TYPE_CHECKING:
    from collections.abc import Callable

    from modelforge.policy._state import PoolState

_KEY = "_policy_fit_index"


class FitIndex:
    """Schedulable bytes per card as of the last pass, the cards in (bytes, id) order, and the
    UNHEALTHY cards. Updated at the start of a fast pass, never during one: a pass's own
    promises are in `DecisionPass.committed`."""

    __slots__ = (
        "catalog",
        "changed",
        "generation",
        "leased_sum",
        "observed",
        "order",
        "pressured",
        "resident_sum",
        "schedulable",
        "staleness",
        "unhealthy",
        "volatile",
    )

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.schedulable: dict[str, int] = {}
        self.order: list[tuple[int, str]] = []
        self.volatile: dict[str, bool] = {}
        self.unhealthy: dict[str, bool] = {}
        # Cards an observation landed on since the last pass.
        self.observed: dict[str, bool] = {}
        # The groupings' sums this index was last brought up to date with (by identity).
        self.resident_sum: dict[str, int] | None = None
        self.leased_sum: dict[str, int] | None = None
        self.staleness = Staleness()
        self.pressured: dict[str, bool] = {}  # cards under GPU_PRESSURE (set only where observations land)
        # How many passes brought it up to date, and the cards the last one re-read (every other
        # card's schedulable bytes, volatility and health are as the pass before found them):
        # what is worked out from it and kept across passes is brought up to date by those.
        self.generation = 0
        self.changed: dict[str, bool] = {}

    def set(self, accelerator: str, schedulable: int) -> None:
        old = self.schedulable.get(accelerator)
        if old == schedulable:
            return
        order = self.order
        if old is not None:
            del order[bisect_left(order, (old, accelerator))]
        self.schedulable[accelerator] = schedulable
        insort(order, (schedulable, accelerator))

    def from_bytes(self, need: int) -> int:
        """Where the cards with at least `need` schedulable bytes start in `order`."""
        return bisect_left(self.order, (need, ""))


class Staleness:
    """When each of the pool's cards was last observed (None: never), and the cards stale at the
    last time asked: `is_fresh`'s rule (`reported_within`) for every card, brought up to date
    by the cards observed since (`received_at`) and those whose last observation has aged past
    the limit since (a heap by observation time, whose entries for a card observed again are
    passed over)."""

    __slots__ = ("at", "expiring", "limit", "received", "stale")

    def __init__(self) -> None:
        self.received: dict[str, float | None] = {}
        self.stale: dict[str, bool] = {}
        self.expiring: list[tuple[float, str]] = []
        self.at: float | None = None  # the time and limit `stale` holds for
        self.limit = 0.0

    def received_at(self, accelerator: str, received: float | None) -> None:
        """The card's last observation is from `received` (None: it has none)."""
        if accelerator in self.received and self.received[accelerator] == received:
            return
        self.received[accelerator] = received
        if received is None:
            self.stale[accelerator] = True
            return
        self.stale.pop(accelerator, None)
        heappush(self.expiring, (received, accelerator))  # already old: stale at the next ask

    def stale_at(self, now: float, limit: float) -> dict[str, bool]:
        """The cards not fresh at `now` (read only)."""
        if self.at is None or now < self.at or limit != self.limit:
            # From scratch: the first time, for an earlier time, or another limit.
            self.stale = {a: True for a, t in self.received.items() if not reported_within(t, limit, now)}
            self.expiring = [(t, a) for a, t in self.received.items() if t is not None and a not in self.stale]
            heapify(self.expiring)
        else:
            expiring, received, stale = self.expiring, self.received, self.stale
            while expiring and not reported_within(expiring[0][0], limit, now):
                t, accelerator = heappop(expiring)
                if received.get(accelerator) == t:
                    stale[accelerator] = True
        self.at, self.limit = now, limit
        return self.stale


def mark_observed(state: PoolState, accelerator: str) -> None:
    """An observation, health or pressure change landed on `accelerator`: the next pass re-reads
    its budget."""
    index = state.__dict__.get(_KEY)
    if index is not None:
        index.observed[accelerator] = True


def drop_fit_index(state: PoolState) -> None:
    state.__dict__.pop(_KEY, None)


def fit_index(
    state: PoolState,
    cards: list[Accelerator],
    position: dict[str, int],
    schedulable: Callable[[str], int],
    resident_sum: dict[str, int],
    leased_sum: dict[str, int],
) -> FitIndex:
    """The index brought up to date for a pass: `schedulable(card)` reads a card's budget now."""
    index = state.__dict__.get(_KEY)
    runtimes = state.accelerators
    if not isinstance(index, FitIndex) or index.catalog is not state.catalog:
        index = FitIndex(state.catalog)
        for accelerator in cards:
            runtime = runtimes.get(accelerator.id)
            observation = runtime.observation if runtime is not None else None
            index.staleness.received_at(accelerator.id, observation.received_at if observation is not None else None)
        values = [(schedulable(card.id), card.id) for card in cards]
        index.schedulable = {card: value for value, card in values}
        index.order = sorted(values)
        changed: dict[str, bool] = dict.fromkeys(runtimes, True)
        state.__dict__[_KEY] = index
    else:
        changed = index.observed
        index.observed = {}
        changed.update(index.volatile)
        if resident_sum is not index.resident_sum:
            _differ(index.resident_sum or {}, resident_sum, changed)
        if leased_sum is not index.leased_sum:
            _differ(index.leased_sum or {}, leased_sum, changed)
        for card in changed:
            if card in position:
                index.set(card, schedulable(card))
    index.resident_sum, index.leased_sum = resident_sum, leased_sum
    volatile, unhealthy, staleness, pressured = index.volatile, index.unhealthy, index.staleness, index.pressured
    for card in changed:
        runtime = runtimes.get(card)
        if runtime is None:
            continue
        if card in position:
            observation = runtime.observation
            staleness.received_at(card, observation.received_at if observation is not None else None)
            if runtime.pressure:
                pressured[card] = True
            else:
                pressured.pop(card, None)
        if len(runtime.external_history) >= 2 and card in position:
            volatile[card] = True
        else:
            volatile.pop(card, None)
        if runtime.healthy:
            unhealthy.pop(card, None)
        else:
            unhealthy[card] = True
    index.generation += 1
    index.changed = changed
    return index


def _differ(old: dict[str, int], new: dict[str, int], changed: dict[str, bool]) -> None:
    """Marks the cards whose sum differs between `old` and `new` (or is in one only): the
    pairs in one dict and not the other, compared at C speed (thousands of cards a pass), by
    card id so the result never depends on string hashing."""
    for card in sorted({card for card, _ in new.items() ^ old.items()}):
        changed[card] = True
