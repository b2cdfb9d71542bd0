"""An index of the queue kept across decision passes, so a pass costs what changed rather than
the length of the queue.

The queue (`PoolState.queue`, in submission order) stays the truth: it is what the scheduler
carries across continue-as-new and what `status` shows. The index is derived from it and kept
beside it (in the state's `__dict__`, never serialized): lanes of requests sharing a class, a
tenant and a capability, each in submission order with what lets a pass skip it whole (how many
wait on a load, the earliest expiry, how many carry each waiting reason), plus lookups by id and
per capability. Every transition that changes the queue tells the index; a queue replaced or
resized behind its back (its identity or length differ) is re-indexed from scratch, so a missed
update costs speed, never a wrong decision."""

from __future__ import annotations

import math
from bisect import insort
from collections.abc import Sequence

from modelforge.policy._order import submission_key
from modelforge.policy._state import PoolState, QueuedRequest

_KEY = "_policy_queue_index"


class Lane:
    """The queued requests of one (class, tenant, capability), in submission order."""

    __slots__ = ("assigned", "capability", "deadlines", "items", "min_expiry", "priority", "reasons", "tenant")

    def __init__(self, priority: str, tenant: str, capability: str) -> None:
        self.priority = priority
        self.tenant = tenant
        self.capability = capability
        self.items: list[QueuedRequest] = []
        self.assigned = 0  # requests waiting on a load (never settled in bulk)
        self.reasons: dict[str, int] = {}  # waiting reason -> how many carry it
        self.min_expiry = math.inf  # never above the earliest expiry in the lane
        self.deadlines = 0  # requests with a deadline (a request's deadline is set when it is queued)

    def add(self, queued: QueuedRequest) -> None:
        if not self.items or submission_key(self.items[-1]) <= submission_key(queued):
            self.items.append(queued)
        else:
            insort(self.items, queued, key=submission_key)
        self.assigned += bool(queued.assigned_to)
        self.deadlines += queued.deadline_at is not None
        self.reasons[queued.waiting_reason] = self.reasons.get(queued.waiting_reason, 0) + 1
        self.min_expiry = min(self.min_expiry, queued.expires_at)

    def remove(self, gone: dict[str, bool]) -> None:
        kept = []
        for queued in self.items:
            if queued.request_id in gone:
                self.assigned -= bool(queued.assigned_to)
                self.deadlines -= queued.deadline_at is not None
                left = self.reasons[queued.waiting_reason] - 1
                if left:
                    self.reasons[queued.waiting_reason] = left
                else:
                    del self.reasons[queued.waiting_reason]
            else:
                kept.append(queued)
        self.items = kept
        # `min_expiry` stays a lower bound (removing can only raise the true minimum); it is made
        # exact again only when a pass needs it (`none_expires_by`).
        if not kept:
            self.min_expiry = math.inf

    def none_expires_by(self, moment: float) -> bool:
        """No request of this lane expires at or before `moment`."""
        if self.min_expiry <= moment:
            self.min_expiry = min((q.expires_at for q in self.items), default=math.inf)
        return self.min_expiry > moment

    def not_carrying(self, reason: str) -> list[int]:
        """The positions, in order, of the requests that do not carry `reason` yet. The lane
        counts how many carry each reason, so the walk stops once it has found them all; it
        starts from the end, where requests submitted since the last pass are."""
        missing = len(self.items) - self.reasons.get(reason, 0)
        found: list[int] = []
        if missing:
            items = self.items
            for position in range(len(items) - 1, -1, -1):
                if items[position].waiting_reason != reason:
                    found.append(position)
                    if len(found) == missing:
                        break
            found.reverse()
        return found


class QueueIndex:
    def __init__(self, queue: list[QueuedRequest]) -> None:
        self.queue = queue
        self.length = 0
        self.by_id: dict[str, QueuedRequest] = {}
        self.lanes: dict[tuple[str, str, str], Lane] = {}
        self.lanes_of: dict[str, list[Lane]] = {}  # capability -> its lanes
        self.per_capability: dict[str, int] = {}
        # Requests waiting on a load, in the order they were assigned.
        self.assigned: dict[str, QueuedRequest] = {}
        # Requests no pass has told an ETA yet (`eta_reason` empty): the verdicts' upkeep
        # (`stamp_predictions`) looks a pass's waiters up here, not on every waiter.
        self.unstamped: dict[str, QueuedRequest] = {}
        for queued in queue:
            self._add(queued)

    def _add(self, queued: QueuedRequest) -> None:
        key = (queued.priority, queued.tenant, queued.capability)
        lane = self.lanes.get(key)
        if lane is None:
            lane = self.lanes[key] = Lane(*key)
            self.lanes_of.setdefault(queued.capability, []).append(lane)
        lane.add(queued)
        self.by_id[queued.request_id] = queued
        self.per_capability[queued.capability] = self.per_capability.get(queued.capability, 0) + 1
        if queued.assigned_to:
            self.assigned[queued.request_id] = queued
        if not queued.eta_reason:
            self.unstamped[queued.request_id] = queued
        self.length += 1

    def added(self, queued: QueuedRequest) -> None:
        """`queued` was just inserted into the indexed queue."""
        self._add(queued)

    def removed(self, gone: dict[str, bool], queue: list[QueuedRequest]) -> None:
        """The requests in `gone` left; `queue` is the queue without them."""
        touched: dict[tuple[str, str, str], bool] = {}
        for request_id in gone:
            queued = self.by_id.pop(request_id, None)
            if queued is None:
                continue
            touched[(queued.priority, queued.tenant, queued.capability)] = True
            left = self.per_capability[queued.capability] - 1
            if left:
                self.per_capability[queued.capability] = left
            else:
                del self.per_capability[queued.capability]
            self.assigned.pop(request_id, None)
            self.unstamped.pop(request_id, None)
            self.length -= 1
        for key in touched:
            lane = self.lanes[key]
            lane.remove(gone)
            if not lane.items:
                del self.lanes[key]
                of_capability = self.lanes_of[lane.capability]
                of_capability.remove(lane)
                if not of_capability:
                    del self.lanes_of[lane.capability]
        self.queue = queue

    def assign(self, queued: QueuedRequest, resident_key: str) -> None:
        if not queued.assigned_to and resident_key:
            self.lanes[(queued.priority, queued.tenant, queued.capability)].assigned += 1
            self.assigned[queued.request_id] = queued
        queued.assigned_to = resident_key

    def set_reason(self, queued: QueuedRequest, reason: str, codes: Sequence[str]) -> None:
        if queued.waiting_reason == reason:
            return
        queued.waiting_codes = list(codes)
        reasons = self.lanes[(queued.priority, queued.tenant, queued.capability)].reasons
        left = reasons[queued.waiting_reason] - 1
        if left:
            reasons[queued.waiting_reason] = left
        else:
            del reasons[queued.waiting_reason]
        reasons[reason] = reasons.get(reason, 0) + 1
        queued.waiting_reason = reason


def queue_index(state: PoolState) -> QueueIndex:
    """The index of `state.queue`, rebuilt when the queue changed behind its back."""
    index: QueueIndex | None = state.__dict__.get(_KEY)
    if index is None or index.queue is not state.queue or index.length != len(state.queue):
        index = QueueIndex(state.queue)
        state.__dict__[_KEY] = index
    return index


def current_index(state: PoolState) -> QueueIndex | None:
    """The index when it matches the queue as it is now, else None (it will be rebuilt)."""
    index: QueueIndex | None = state.__dict__.get(_KEY)
    if index is None or index.queue is not state.queue or index.length != len(state.queue):
        return None
    return index
