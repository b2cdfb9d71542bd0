"""Verdicts: for every waiting request, where it stands, why it waits and when it should start.

Pure, like the rest of the policy (no clock, no environment, no randomness; `now` is an
argument): the scheduler workflow answers its `verdicts` and `admission_check` queries with these
functions, the simulator and bench/verdicts.py call the very same ones.

A `Verdict` (one per queued request, in queue order):
- position: 1-based in its class (`position_in_class` of `class_depth`) and among the requests of
  its deployment (`position_in_deployment` of `deployment_depth`), both in the policy's queue
  order; `ahead_in_higher_classes` and `behind_class` (the highest class ordered ahead of it);
- reason: the policy's own Wait line (`message`, exactly what `status` and a timeout say) and
  the typed codes the policy gave with it (`WaitReason`; `reason` is the first, `reasons` all of
  them in the line's order), with what it names: the load in flight and its expected end (`load`), and who holds the
  memory on the card where it falls short least (`held_by`: external processes, residents,
  leases with their expected end);
- ETA: `eta_s` (seconds from `computed_at`; None when nothing measured can say), `eta_at`,
  `eta_basis` and `eta_quality`:
    `load_in_flight`     it waits on a load (or wake) already started: that load's expected end
                         (its deployment's measured load time in this pool, else the catalog's);
    `queue_service`      a resident of its deployment is there or on its way: the slots
                         (residents x concurrency) are run forward: each running lease ends
                         after its mean residual life (the mean of the measured runs that lasted
                         longer than it has so far, less what it has run; at most its
                         max_duration), the requests ordered ahead of it take the freed slots
                         for a mean service time each, except one that would start after it
                         expires (the policy refuses it then: its slot stays free);
    `release_then_load`  no resident has a slot for it: when the leases on its eligible cards
                         have ended (expected ends, as above) leaving room for the model, plus
                         the load (measured load history, else the catalog's figure);
    `reservation`        a gang the policy reserved cards for: the reservation's own start
                         (from the holders' max_duration) and its load: an upper bound;
    `gang_release`       a gang without a reservation: when enough eligible cards are free,
                         and its load, as a lower bound (room freed may go to others first);
    `unknown`            nothing to base it on (no service measured, no load to wait for).
  Quality: `measured` (this pool's measurements; `eta_samples` service samples), `catalog` (the
  catalog's load figure, nothing measured yet), `bound` (only a bound is known, so no ETA is
  claimed: `eta_at_most_s` when max_durations bound it: the slot timeline run at its latest, the
  running work and each request ahead holding a slot for its max_duration (`latest_slot`; no
  bound where one has none), or a reservation's start from its holders' max_duration and its
  load; `eta_at_least_s` when it waits for a load and then for a
  slot whose work has never been measured, or is a gang without a reservation), `none` (nothing
  to base even a bound on).
  A bound is never given as the ETA: an upper bound from a max_duration is typically many times
  the real wait, and a load's end is no estimate for a request its slots are not for.

An `AdmissionCheck` is the dry run: the policy's decision for a request as if it arrived now,
taken on a copy of the state (nothing is enqueued, started or held): `now` (granted at once),
`later` (it would wait or load; with the probe's verdict and ETA) or `never` (refused: the
failure class and the policy's message, with `detail` in GiB for memory refusals).

`stamp_predictions` keeps the first ETA of each waiting request on it (`QueuedRequest.eta_at`,
`eta_reason`), so a grant can say how far off the prediction was (`lease_granted`'s
`eta_error_s`: predicted minus actual start; the ETA-error metric)."""

from __future__ import annotations

import bisect
import copy
import heapq
import itertools
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from modelforge.domain import Deployment, GiB, Residency
from modelforge.failures import FailureClass
from modelforge.policy._admission import AdmissionRejected, AdmissionRequest, enqueue, validate_request
from modelforge.policy._budget import compute_budget
from modelforge.policy._decisions import Decisions, WaitReason
from modelforge.policy._lease_index import lease_index
from modelforge.policy._order import bucket_key, class_rank, fair_share_scores, queue_order, submission_key
from modelforge.policy._pass import filter_accelerators
from modelforge.policy._placement import decide
from modelforge.policy._queue_index import queue_index
from modelforge.policy._state import (
    AcceleratorRuntime,
    Lease,
    PoolState,
    QueuedRequest,
    ResidentPhase,
    ResidentState,
    operation_seconds,
    service_figures,
    sorted_service_samples,
)

# A gang's reservation start, as its Wait line gives it (seconds from that pass; _gang.py).
_RESERVED_FROM = re.compile(r"reserved \S.* from (-?\d+(?:\.\d+)?) s on")

# How many holders a verdict names (the biggest first), and how many reasons.
MAX_HOLDERS = 6


@dataclass(frozen=True)
class Holder:
    """Memory on a card a request waits for, and who holds it: `kind` external (a process
    ModelForge does not manage), resident (a model, idle or serving), lease (work running),
    reserve (the card's safety reserve)."""

    accelerator: str
    kind: str
    who: str
    bytes: int
    ends_at: float | None = None  # a lease's expected end (grant + mean measured service)


@dataclass(frozen=True)
class LoadInFlight:
    resident_key: str
    accelerator: str
    phase: str  # loading, waking
    started_at: float
    expected_end_at: float
    basis: str  # measured, catalog


@dataclass(frozen=True)
class Verdict:
    request_id: str
    pool: str
    capability: str
    deployment: str
    tenant: str
    priority: str
    submitted_at: float
    waited_s: float
    expires_at: float
    reason: str  # a WaitReason value: the first of `reasons`
    reasons: list[str]
    message: str  # the policy's own Wait line
    position_in_class: int
    class_depth: int
    position_in_deployment: int
    deployment_depth: int
    ahead_in_higher_classes: int
    behind_class: str  # the highest class ordered ahead of it ("" when none)
    eta_s: float | None
    eta_at: float | None
    eta_basis: str
    eta_quality: str
    eta_samples: int
    computed_at: float
    load: LoadInFlight | None = None
    held_by: list[Holder] = field(default_factory=list)
    # Only a bound is known (quality `bound`; `eta_s` is None then): seconds from `computed_at`.
    eta_at_least_s: float | None = None
    eta_at_most_s: float | None = None

    def to_json(self) -> dict[str, object]:
        """The JSON shape every surface returns as is (gateway, `modelforge queue --json`)."""
        return {
            "request_id": self.request_id,
            "pool": self.pool,
            "capability": self.capability,
            "deployment": self.deployment,
            "tenant": self.tenant,
            "priority": self.priority,
            "state": "queued",
            "submitted_at": self.submitted_at,
            "waited_s": round(self.waited_s, 3),
            "expires_at": self.expires_at,
            "reason": self.reason,
            "reasons": list(self.reasons),
            "message": self.message,
            "position": {
                "in_class": self.position_in_class,
                "class_depth": self.class_depth,
                "in_deployment": self.position_in_deployment,
                "deployment_depth": self.deployment_depth,
                "ahead_in_higher_classes": self.ahead_in_higher_classes,
                "behind_class": self.behind_class or None,
            },
            "eta": {
                "seconds": None if self.eta_s is None else round(self.eta_s, 3),
                "at": self.eta_at,
                "basis": self.eta_basis,
                "quality": self.eta_quality,
                "samples": self.eta_samples,
                "at_least_s": _rounded(self.eta_at_least_s),
                "at_most_s": _rounded(self.eta_at_most_s),
                "after_expiry": self.starts_after_expiry,
            },
            "load": None
            if self.load is None
            else {
                "resident_key": self.load.resident_key,
                "accelerator": self.load.accelerator,
                "phase": self.load.phase,
                "started_at": self.load.started_at,
                "expected_end_at": self.load.expected_end_at,
                "basis": self.load.basis,
            },
            "held_by": [
                {"accelerator": h.accelerator, "kind": h.kind, "who": h.who, "bytes": h.bytes, "ends_at": h.ends_at}
                for h in self.held_by
            ],
            "computed_at": self.computed_at,
        }

    @property
    def starts_after_expiry(self) -> bool:
        """Its ETA (or the earliest it could start) is past when it stops waiting: the policy
        will refuse it then unless the queue moves faster than expected."""
        earliest = self.eta_at if self.eta_at is not None else self.eta_at_least_s
        if earliest is None:
            return False
        at = earliest if self.eta_at is not None else self.computed_at + earliest
        return at > self.expires_at

    def eta_text(self) -> str:
        text = _eta_text(self.eta_s, self.eta_basis, self.eta_quality, self.eta_at_least_s, self.eta_at_most_s)
        if self.starts_after_expiry:
            text += f", past its expiry in {_duration(max(0.0, self.expires_at - self.computed_at))}"
        return text

    def line(self) -> str:
        """One line for a live display (the CLI's wait line, a stream's progress)."""
        where = f"#{self.position_in_class} of {self.class_depth} in {self.priority}"
        if self.behind_class:
            where += f", behind {self.behind_class}"
        return f"{self.reason}: {where}; {self.eta_text()}; {self.message or 'not yet decided'}"


@dataclass(frozen=True)
class AdmissionCheck:
    """The dry run's answer. `answer`: now, later or never."""

    answer: str
    pool: str
    capability: str
    deployment: str
    priority: str
    action: str  # grant, join_load, load, wake, preempt, wait, reject
    checked_at: float
    accelerator: str = ""
    failure: str | None = None  # a FailureClass value, for never
    message: str = ""
    detail: str = ""
    eta_s: float | None = None
    eta_basis: str = ""
    eta_quality: str = ""
    verdict: Verdict | None = None
    eta_at_least_s: float | None = None
    eta_at_most_s: float | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "answer": self.answer,
            "pool": self.pool,
            "capability": self.capability,
            "deployment": self.deployment or None,
            "priority": self.priority or None,
            "action": self.action,
            "accelerator": self.accelerator or None,
            "failure": self.failure,
            "message": self.message,
            "detail": self.detail,
            "eta": {
                "seconds": None if self.eta_s is None else round(self.eta_s, 3),
                "basis": self.eta_basis or None,
                "quality": self.eta_quality or None,
                "at_least_s": _rounded(self.eta_at_least_s),
                "at_most_s": _rounded(self.eta_at_most_s),
            },
            "verdict": None if self.verdict is None else self.verdict.to_json(),
            "checked_at": self.checked_at,
        }

    def line(self) -> str:
        if self.answer == "now":
            return f"now: {self.action} on {self.accelerator}" if self.accelerator else f"now: {self.action}"
        if self.answer == "never":
            detail = f" ({self.detail})" if self.detail else ""
            return f"never: {self.failure}: {self.message}{detail}"
        eta = _eta_text(self.eta_s, self.eta_basis, self.eta_quality, self.eta_at_least_s, self.eta_at_most_s)
        return f"later: {self.action}; {eta}; {self.message}"


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


def _eta_text(
    seconds: float | None, basis: str, quality: str, at_least_s: float | None, at_most_s: float | None
) -> str:
    if seconds is not None:
        return f"ETA {_duration(seconds)} ({basis}, {quality})"
    if at_most_s is not None:
        return f"ETA at most {_duration(at_most_s)} ({basis}, {quality})"
    if at_least_s is not None:
        return f"ETA at least {_duration(at_least_s)} ({basis}, {quality})"
    return "ETA unknown"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


# --- the ETA model ------------------------------------------------------------------------------


class _Model:
    """What every verdict of one call reads, computed once: service and load figures per
    deployment, each lease's expected end, per-card budgets, the slot timelines."""

    def __init__(self, state: PoolState, now: float, only: set[str] | None = None, bounds: bool = False) -> None:
        self.state = state
        self.now = now
        self.only = only  # the deployments whose timelines are run (None: all)
        # Whether the slot timelines are also run at their latest (`latest_slots`): what an
        # upper bound needs; the first ETA a pass keeps (`stamp_predictions`) never is one.
        self.bounds = bounds
        self._latest: dict[str, list[float]] = {}
        self._service: dict[str, tuple[float, int]] = {}
        self._residual: dict[str, tuple[list[float], list[float]]] = {}
        self._load: dict[str, tuple[float, str]] = {}
        self._slots: dict[str, list[tuple[float, bool]]] = {}
        self._holds: dict[str, float] = {}
        self._ends: dict[str, Callable[[Lease], tuple[float | None, bool]]] = {}
        self._room: dict[str, float | None] = {}
        self._holders: dict[str, list[Holder]] = {}
        self._eligible: dict[tuple[str, str], list[str]] = {}

    # Built on first use: stamping a new waiter on a resident's queue never needs them.
    @cached_property
    def leases_on(self) -> dict[str, list[Lease]]:
        found: dict[str, list[Lease]] = {}
        for lease in self.state.leases.values():
            if lease.lease_id in self.state.slots:
                continue  # a lent slot: no work runs on it until a node's request does
            for accelerator in lease.accelerators:
                found.setdefault(accelerator, []).append(lease)
        return found

    @cached_property
    def leases_of_resident(self) -> dict[tuple[str, int], list[Lease]]:
        """The leases running on each resident (its key and incarnation)."""
        found: dict[tuple[str, int], list[Lease]] = {}
        slots, only = self.state.slots, self.only
        if only is None:
            for lease in self.state.leases.values():
                if lease.resident_key and lease.lease_id not in slots:
                    found.setdefault((lease.resident_key, lease.incarnation), []).append(lease)
            return found
        # The deployments' leases from the index (in the dict's order), not every lease.
        index = lease_index(self.state)
        for deployment_id in sorted(only):
            for held in index.of_deployment(deployment_id):
                if held.resident_key and held.lease_id not in slots:
                    found.setdefault((held.resident_key, held.incarnation), []).append(held)
        return found

    @cached_property
    def residents_on(self) -> dict[str, list[ResidentState]]:
        found: dict[str, list[ResidentState]] = {}
        for resident in self.state.residents.values():
            found.setdefault(resident.accelerator, []).append(resident)
        return found

    @cached_property
    def residents_of(self) -> dict[str, list[ResidentState]]:
        """The residents of each deployment (of `only`'s when given)."""
        found: dict[str, list[ResidentState]] = {}
        only = self.only
        for resident in self.state.residents.values():
            if only is None or resident.deployment in only:
                found.setdefault(resident.deployment, []).append(resident)
        return found

    def service(self, deployment_id: str) -> tuple[float, int]:
        """(mean measured service seconds, samples)."""
        figure = self._service.get(deployment_id)
        if figure is None:
            mean, _ = service_figures(self.state, deployment_id)
            measured = self.state.measured.get(deployment_id)
            figure = self._service[deployment_id] = (mean, len(measured.service_s) if measured else 0)
        return figure

    def load(self, deployment: Deployment, operation: str = "load") -> tuple[float, str]:
        """(seconds, basis) of a load (or wake) of `deployment`."""
        key = f"{deployment.deployment_id}/{operation}"
        figure = self._load.get(key)
        if figure is None:
            measured = self.state.measured.get(deployment.deployment_id)
            seen = measured is not None and getattr(measured, f"{operation}_s") is not None
            figure = self._load[key] = (
                operation_seconds(self.state, deployment, operation),
                "measured" if seen else "catalog",
            )
        return figure

    def lease_end(self, lease: Lease) -> float | None:
        return self.lease_end_and_kind(lease)[0]

    def lease_end_and_kind(self, lease: Lease) -> tuple[float | None, bool]:
        """A running lease's expected end, and whether it is only a bound: its mean residual
        life from the measured service times (the mean of the runs that lasted longer than it
        has so far, less what it has run: a lease past the mean is not about to end, it is one
        of the long ones), at most its max_duration; that bound alone while nothing is measured,
        or when it has outrun every measured run (None: no bound either)."""
        return self.lease_ends(lease.deployment)(lease)

    def lease_ends(self, deployment_id: str) -> Callable[[Lease], tuple[float | None, bool]]:
        """`lease_end_and_kind` for the leases of one deployment, its figures read once (a slot
        timeline asks it for each lease of its deployment)."""
        ends = self._ends.get(deployment_id)
        if ends is not None:
            return ends
        now = self.now
        if not self.service(deployment_id)[1]:

            def ends(lease: Lease) -> tuple[float | None, bool]:
                return (None if lease.ends_by is None else max(now, lease.ends_by)), True

        else:
            ordered, suffix = self._residual_table(deployment_id)
            count, right = len(ordered), bisect.bisect_right

            def ends(lease: Lease) -> tuple[float | None, bool]:
                elapsed = max(0.0, now - lease.granted_at)
                longer = right(ordered, elapsed)
                ends_by = lease.ends_by
                if longer == count:  # it has outrun every measured run
                    return (None if ends_by is None else max(now, ends_by)), True
                end = now + suffix[longer] / (count - longer) - elapsed
                return (end if ends_by is None else max(now, min(end, ends_by))), False

        self._ends[deployment_id] = ends
        return ends

    def _residual_table(self, deployment_id: str) -> tuple[list[float], list[float]]:
        """The deployment's measured service times in order, and their suffix sums."""
        table = self._residual.get(deployment_id)
        if table is None:
            ordered = sorted_service_samples(self.state, deployment_id)
            suffix = [0.0] * (len(ordered) + 1)
            for index in range(len(ordered) - 1, -1, -1):
                suffix[index] = suffix[index + 1] + ordered[index]
            table = self._residual[deployment_id] = (ordered, suffix)
        return table

    def eligible(self, deployment: Deployment, priority: str) -> list[str]:
        key = (deployment.deployment_id, priority)
        found = self._eligible.get(key)
        if found is None:
            results = filter_accelerators(self.state, deployment, priority, self.now)
            found = self._eligible[key] = [r.accelerator for r in results if r.passed]
        return found

    def budget(self, accelerator_id: str) -> tuple[int, int, int] | None:
        """(schedulable bytes now, external bytes, reserve bytes) of a card."""
        accelerator = self.state.catalog.accelerator(accelerator_id)
        if accelerator is None:
            return None
        runtime = self.state.accelerators.get(accelerator_id, AcceleratorRuntime())
        budget = compute_budget(
            accelerator,
            runtime,
            self.residents_on.get(accelerator_id, []),
            self.leases_on.get(accelerator_id, []),
            self.state.config,
            self.now,
        )
        return budget.schedulable_bytes, budget.external_bytes, budget.reserve_bytes

    def room_at(self, accelerator: str, need: int) -> float | None:
        """When `need` bytes are schedulable on the card: now, or as its leases end (expected
        ends), idle evictable residents counted as room (making room unloads them)."""
        figures = self.budget(accelerator)
        if figures is None:
            return None
        free = figures[0]
        for resident in self.residents_on.get(accelerator, []):
            if (
                resident.phase == ResidentPhase.READY
                and resident.active_leases == 0
                and resident.residency != Residency.ALWAYS_WARM
            ):
                free += resident.bytes
        if need <= free:
            return self.now
        # Room comes back as work ends: a lease's own bytes at its end, and a resident's when
        # its last lease ends (it is idle then, and making room may unload it).
        freed: list[tuple[float, int]] = []
        last_end: dict[str, float | None] = {}
        for lease in self.leases_on.get(accelerator, []):
            end = self.lease_end(lease)
            if lease.bytes and end is not None:
                freed.append((end, lease.bytes))
            if lease.resident_key:
                before = last_end.get(lease.resident_key, self.now)
                last_end[lease.resident_key] = None if end is None or before is None else max(before, end)
        for resident in self.residents_on.get(accelerator, []):
            end = last_end.get(resident.key)
            if resident.active_leases and end is not None and resident.residency != Residency.ALWAYS_WARM:
                freed.append((end, resident.bytes))
        for end, nbytes in sorted(freed):
            free += nbytes
            if need <= free:
                return end
        return None

    def earliest_room(self, deployment: Deployment, priority: str) -> float | None:
        key = f"{deployment.deployment_id}/{priority}"
        if key not in self._room:
            need = deployment.resident_bytes + deployment.lease_extra_bytes
            times = [t for a in self.eligible(deployment, priority) if (t := self.room_at(a, need)) is not None]
            self._room[key] = min(times) if times else None
        return self._room[key]

    def gang_room(self, deployment: Deployment, priority: str) -> float | None:
        need = deployment.resident_bytes + deployment.lease_extra_bytes
        times = sorted(t for a in self.eligible(deployment, priority) if (t := self.room_at(a, need)) is not None)
        return times[deployment.gpu_count - 1] if len(times) >= deployment.gpu_count else None

    def slots(self, deployment: Deployment) -> list[tuple[float, bool]]:
        """The deployment's slot timeline: a heap of when each slot of its residents is next
        free (a running lease's expected end; a loading resident's expected readiness), each
        with whether that time is only a bound (a max_duration)."""
        found = self._slots.get(deployment.deployment_id)
        if found is not None:
            return found
        heap: list[tuple[float, bool]] = []
        latest: list[float] = []
        turnover = self.turnover(deployment)
        lease_end = self.lease_ends(deployment.deployment_id)
        now, leases_of, bounds = self.now, self.leases_of_resident, self.bounds
        for resident in self.residents_of.get(deployment.deployment_id, []):
            ready = now if resident.phase == ResidentPhase.READY else self.ready_at(resident, deployment)
            if ready is None:
                continue
            busy = leases_of.get((resident.key, resident.incarnation), [])
            if len(busy) > deployment.concurrency:  # over (its concurrency lowered): the first granted
                busy = sorted(busy, key=lambda lease: (lease.granted_at, lease.lease_id))
            for lease in busy[: deployment.concurrency]:
                end, bound = lease_end(lease)
                if end is None:  # no measured service and no max_duration: its end is unknown
                    heap.append((math.inf, False))
                else:
                    heap.append((max(ready, end + turnover), bound and end + turnover > ready))
                if bounds:
                    latest.append(math.inf if lease.ends_by is None else max(ready, lease.ends_by + turnover))
            free = max(0, deployment.concurrency - len(busy))
            heap.extend([(ready, False)] * free)
            if bounds:
                latest.extend([ready] * free)
        heapq.heapify(heap)
        self._slots[deployment.deployment_id] = heap
        if bounds:
            heapq.heapify(latest)
            self._latest[deployment.deployment_id] = latest
        return heap

    def latest_slot(self, deployment: Deployment, queued: QueuedRequest) -> float:
        """When `queued` gets a slot at the latest, taken in queue order as `_next_slot` takes
        the expected one: every running lease runs to its max_duration and every request ahead
        holds its slot for its own (one without a max_duration holds it for good). A start time
        of a first-come-first-served queue only grows with its service times, so this bounds the
        start as long as no request of a higher class arrives meanwhile. Every request ahead is
        counted as served (one that expires first only makes it earlier). Needs `bounds`."""
        self.slots(deployment)
        latest = self._latest.get(deployment.deployment_id)
        if not latest:
            return math.inf
        start = latest[0]
        held = math.inf if queued.max_duration_s is None else queued.max_duration_s + self.turnover(deployment)
        heapq.heapreplace(latest, start + held)
        return start

    def holds(self, deployment: Deployment) -> float:
        """How long a request keeps the slot it takes: a mean service time (and the turnover);
        unknown (never free again, for this model) while the service was never measured."""
        held = self._holds.get(deployment.deployment_id)
        if held is None:
            mean, samples = self.service(deployment.deployment_id)
            held = self._holds[deployment.deployment_id] = mean + self.turnover(deployment) if samples else math.inf
        return held

    def turnover(self, deployment: Deployment) -> float:
        """What passes between one lease's end and the next start on its slot: nothing on a
        resident that stays; a batch job's resident goes with its lease, so the next job waits
        for its unload and a load of its own."""
        if deployment.residency != Residency.NONE:
            return 0.0
        return self.load(deployment, "unload")[0] + self.load(deployment)[0]

    def ready_at(self, resident: ResidentState, deployment: Deployment) -> float | None:
        if resident.phase == ResidentPhase.READY:
            return self.now
        if resident.phase in (ResidentPhase.LOADING, ResidentPhase.WAKING):
            operation = "load" if resident.phase == ResidentPhase.LOADING else "wake"
            seconds, _ = self.load(deployment, operation)
            return max(self.now, resident.requested_at + seconds)
        if resident.phase == ResidentPhase.ASLEEP:
            return self.now + self.load(deployment, "wake")[0]
        return None  # unloading, sleeping, unreclaimed: no slot to count on

    def slot_holders(self, deployment: Deployment) -> list[Holder]:
        """Who holds the slots of the deployment's residents (for a request at concurrency):
        the leases running on them, soonest expected end first."""
        holders: list[Holder] = []
        for resident in self.residents_of.get(deployment.deployment_id, []):
            for lease in self.leases_of_resident.get((resident.key, resident.incarnation), []):
                who = f"{lease.tenant}/{lease.priority} {lease.request_id}"
                holders.append(Holder(resident.accelerator, "lease", who, lease.bytes, self.lease_end(lease)))
        holders.sort(key=lambda h: (math.inf if h.ends_at is None else h.ends_at, h.who))
        return holders[:MAX_HOLDERS]

    def holders(self, deployment: Deployment, priority: str) -> list[Holder]:
        """Who holds the memory on the eligible card where the model falls short least."""
        key = f"{deployment.deployment_id}/{priority}"
        found = self._holders.get(key)
        if found is not None:
            return found
        best: tuple[int, str] | None = None
        for accelerator in self.eligible(deployment, priority):
            figures = self.budget(accelerator)
            if figures is not None and (best is None or (-figures[0], accelerator) < best):
                best = (-figures[0], accelerator)
        holders: list[Holder] = []
        if best is not None:
            accelerator = best[1]
            runtime = self.state.accelerators.get(accelerator)
            observation = runtime.observation if runtime is not None else None
            figures = self.budget(accelerator)
            if observation is not None and figures is not None and figures[1] > 0:
                named = [p for p in observation.processes if not p.managed]
                who = ", ".join(sorted({p.name or f"pid {p.pid}" for p in named})[:4]) or "unmanaged processes"
                holders.append(Holder(accelerator, "external", who, figures[1]))
            for resident in self.residents_on.get(accelerator, []):
                state = "serving" if resident.active_leases else resident.phase.value
                holders.append(Holder(accelerator, "resident", f"{resident.deployment} ({state})", resident.bytes))
            for lease in self.leases_on.get(accelerator, []):
                if lease.bytes:
                    who = f"{lease.tenant}/{lease.priority} {lease.request_id}"
                    holders.append(Holder(accelerator, "lease", who, lease.bytes, self.lease_end(lease)))
            if figures is not None and figures[2] > 0:
                holders.append(Holder(accelerator, "reserve", "safety reserve", figures[2]))
            holders.sort(key=lambda h: (-h.bytes, h.kind, h.who))
            holders = holders[:MAX_HOLDERS]
        self._holders[key] = holders
        return holders


_MEMORY_REASONS = frozenset(
    {WaitReason.MEMORY_HELD, WaitReason.BEHIND_HIGHER_CLASS, WaitReason.MAKING_ROOM, WaitReason.GANG_ROOM}
)


class _Eta(NamedTuple):
    """One request's ETA: `start` when there is a figure to claim, else at most a bound
    (`at_least`/`at_most`, absolute times, quality `bound`)."""

    start: float | None
    basis: str
    quality: str
    samples: int
    load: LoadInFlight | None = None
    at_least: float | None = None
    at_most: float | None = None


_UNKNOWN = _Eta(None, "unknown", "none", 0)


def _eta(model: _Model, queued: QueuedRequest, deployment: Deployment | None) -> _Eta:
    """One request's ETA, in queue order: it takes a slot of its deployment's timeline, so the
    next one sees what is left."""
    if deployment is None:
        return _UNKNOWN
    now = model.now
    samples = model.service(deployment.deployment_id)[1]
    holds = model.holds(deployment)
    if deployment.gpu_count > 1:
        reserved = _RESERVED_FROM.search(queued.waiting_reason)
        if reserved is not None:
            # From the holders' max_duration: when the reserved cards are free at the latest,
            # and its own load then.
            free_by = now + max(0.0, float(reserved.group(1)))
            return _Eta(None, "reservation", "bound", samples, at_most=free_by + model.load(deployment)[0])
        start = model.gang_room(deployment, queued.priority)
        if start is None:
            return _Eta(None, "unknown", "none", samples)
        # Not reserved: room freed on its cards may go to work ordered ahead of it or backfilled
        # behind it, so when enough is free is when it could start at the earliest, no estimate.
        seconds, _ = model.load(deployment)
        return _Eta(None, "gang_release", "bound", samples, at_least=start + seconds)
    heap = model.slots(deployment)
    if queued.assigned_to:
        resident = model.state.residents.get(queued.assigned_to)
        if resident is not None and resident.phase in (ResidentPhase.LOADING, ResidentPhase.WAKING):
            operation = "load" if resident.phase == ResidentPhase.LOADING else "wake"
            seconds, basis = model.load(deployment, operation)
            end = max(now, resident.requested_at + seconds)
            load = LoadInFlight(
                resident.key, resident.accelerator, resident.phase.value, resident.requested_at, end, basis
            )
            # The load's slots go to the first ones assigned to it; one assigned past its
            # concurrency waits for a slot after that (the load's slots are in the timeline).
            start, bound = _next_slot(heap, queued, holds) if heap else (end, False)
            latest = model.latest_slot(deployment, queued) if model.bounds and heap else math.inf
            if start <= end + 1e-6:
                return _Eta(end, "load_in_flight", basis, samples, load)
            if math.isinf(start):  # a slot after the load's, held by work never measured
                return _Eta(None, "load_in_flight", "bound", samples, load, at_least=end)
            if bound:  # no estimate for the slot it gets: the latest it can start, if that is known
                if math.isinf(latest):
                    return _Eta(None, "unknown", "none", samples, load)
                return _Eta(None, "queue_service", "bound", samples, load, at_most=max(now, latest))
            return _Eta(start, "queue_service", "measured" if samples else basis, samples, load)
    if heap:
        start, bound = _next_slot(heap, queued, holds)
        latest = model.latest_slot(deployment, queued) if model.bounds else math.inf
        if math.isinf(start):
            return _Eta(None, "unknown", "none", samples)
        if bound:  # no estimate for the slot it gets: the latest it can start, if that is known
            if math.isinf(latest):
                return _Eta(None, "unknown", "none", samples)
            return _Eta(None, "queue_service", "bound", samples, at_most=max(now, latest))
        # Nothing measured: the slot is a resident's readiness (its load's figure).
        quality = "measured" if samples else model.load(deployment)[1]
        return _Eta(max(now, start), "queue_service", quality, samples)
    room = model.earliest_room(deployment, queued.priority)
    if room is None:
        return _Eta(None, "unknown", "none", samples)
    seconds, basis = model.load(deployment)
    ready = room + seconds
    if deployment.residency != Residency.NONE:
        # The resident it waits for serves the requests after it too: its slots join the
        # timeline. (A batch job's resident goes with its lease: each waits for room and a
        # load of its own.)
        for _ in range(max(1, deployment.concurrency) - 1):
            heapq.heappush(heap, (ready, False))
        heapq.heappush(heap, (ready + holds, False))
    return _Eta(ready, "release_then_load", basis, samples)


def _next_slot(heap: list[tuple[float, bool]], queued: QueuedRequest, holds: float) -> tuple[float, bool]:
    """When `queued` gets the next free slot of its deployment's timeline (and whether that is
    only a bound), which it then holds for `holds` seconds (a mean service time). One that would
    start after it expires leaves the queue unserved at its expiry (the policy refuses it then):
    the slot stays for those behind it."""
    start, bound = heap[0]
    if start <= queued.expires_at:
        heapq.heapreplace(heap, (start + holds, bound))
    return start, bound


def verdicts(state: PoolState, now: float, request_ids: set[str] | None = None) -> list[Verdict]:
    """Every queued request's verdict, in queue order (only those of `request_ids` when given;
    the others still count ahead of them)."""
    order = queue_order(state, now)
    model = _Model(state, now, bounds=True)
    catalog = state.catalog
    class_depth: dict[str, int] = {}
    deployment_of: dict[str, Deployment | None] = {}
    for queued in order:
        class_depth[queued.priority] = class_depth.get(queued.priority, 0) + 1
        if queued.capability not in deployment_of:
            deployment_of[queued.capability] = catalog.deployment_for(queued.capability)
    deployment_depth: dict[str, int] = {}
    for queued in order:
        deployment = deployment_of[queued.capability]
        key = deployment.deployment_id if deployment is not None else queued.capability
        deployment_depth[key] = deployment_depth.get(key, 0) + 1
    # Asked for a few: only their deployments' timelines are run forward, and only up to the
    # last of them.
    timed: set[str] | None = None
    last = len(order) - 1
    if request_ids is not None:
        timed = set()
        last = -1
        for index, queued in enumerate(order):
            if queued.request_id in request_ids:
                deployment = deployment_of[queued.capability]
                timed.add(deployment.deployment_id if deployment is not None else queued.capability)
                last = index
    in_class: dict[str, int] = {}
    in_deployment: dict[str, int] = {}
    ahead_by_class: dict[str, int] = {}
    out: list[Verdict] = []
    for queued in order[: last + 1]:
        deployment = deployment_of[queued.capability]
        key = deployment.deployment_id if deployment is not None else queued.capability
        in_class[queued.priority] = in_class.get(queued.priority, 0) + 1
        in_deployment[key] = in_deployment.get(key, 0) + 1
        if timed is not None and key not in timed:
            ahead_by_class[queued.priority] = ahead_by_class.get(queued.priority, 0) + 1
            continue
        message = _message(state, queued)
        eta = _eta(model, queued, deployment)
        if request_ids is None or queued.request_id in request_ids:
            reasons = _codes(state, queued)
            rank = class_rank(catalog, queued.priority)
            higher = [c for c, n in ahead_by_class.items() if n and class_rank(catalog, c) < rank]
            held = (
                model.holders(deployment, queued.priority)
                if deployment is not None and any(r in _MEMORY_REASONS for r in reasons)
                else model.slot_holders(deployment)
                if deployment is not None and WaitReason.CONCURRENCY_FULL in reasons
                else []
            )
            out.append(
                Verdict(
                    request_id=queued.request_id,
                    pool=state.pool,
                    capability=queued.capability,
                    deployment=deployment.deployment_id if deployment is not None else "",
                    tenant=queued.tenant,
                    priority=queued.priority,
                    submitted_at=queued.submitted_at,
                    waited_s=max(0.0, now - queued.submitted_at),
                    expires_at=queued.expires_at,
                    reason=reasons[0].value,
                    reasons=[r.value for r in reasons],
                    message=message,
                    position_in_class=in_class[queued.priority],
                    class_depth=class_depth[queued.priority],
                    position_in_deployment=in_deployment[key],
                    deployment_depth=deployment_depth[key],
                    ahead_in_higher_classes=sum(ahead_by_class[c] for c in higher),
                    behind_class=min(higher, key=lambda c: (class_rank(catalog, c), c)) if higher else "",
                    eta_s=_seconds_from(eta.start, now),
                    eta_at=eta.start,
                    eta_basis=eta.basis,
                    eta_quality=eta.quality,
                    eta_samples=eta.samples,
                    computed_at=now,
                    load=eta.load,
                    held_by=held,
                    eta_at_least_s=_seconds_from(eta.at_least, now),
                    eta_at_most_s=_seconds_from(eta.at_most, now),
                )
            )
        ahead_by_class[queued.priority] = ahead_by_class.get(queued.priority, 0) + 1
    return out


def _seconds_from(at: float | None, now: float) -> float | None:
    return None if at is None else max(0.0, at - now)


def stamp_predictions(state: PoolState, now: float, decisions: Decisions) -> int:
    """Keep the first ETA of each request a decision pass left waiting (`eta_at`, `eta_reason`):
    the ones it made wait, and those it started a load or wake for or assigned to one (a
    request's first wait is always among these, so a pass with none costs nothing). Returns how
    many were stamped. What the ETA-error figures compare a grant's actual start with.

    Runs on every pass that has a new waiter, so it pays only for what it keeps: the ETA and the
    first reason (no depths, no holders), walking the queue order only until the last of them."""
    waiting = {wait.request_id for wait in decisions.waits}
    waiting.update(assign.request_id for assign in decisions.assigns)
    for load in decisions.loads:
        waiting.update(load.for_requests)
    for wake in decisions.wakes:
        waiting.update(wake.for_requests)
    if not waiting:
        return 0
    unstamped = queue_index(state).unstamped
    by_id = {rid: queued for rid in waiting if (queued := unstamped.get(rid)) is not None and queued.eta_reason == ""}
    if not by_id:
        return 0
    catalog = state.catalog
    deployment_of: dict[str, Deployment | None] = {}
    for queued in by_id.values():
        if queued.capability not in deployment_of:
            deployment_of[queued.capability] = catalog.deployment_for(queued.capability)
    timed = {d.deployment_id if d is not None else c for c, d in deployment_of.items()}
    model = _Model(state, now, only=timed)
    left = len(by_id)
    # Per capability: its deployment's slot timeline and how long a slot is held, where one
    # ahead just takes the next slot (as `_eta` has it: the common case, taken cheaply).
    plain: dict[str, tuple[list[tuple[float, bool]], float] | None] = {}
    for queued in _timeline_order(state, now, deployment_of, timed):
        if queued.request_id in by_id:
            queued.eta_at = _eta(model, queued, deployment_of[queued.capability]).start  # a bound is no prediction
            queued.eta_reason = _first_code(state, queued)
            del unstamped[queued.request_id]
            left -= 1
            if not left:
                break
            continue
        capability = queued.capability
        if capability not in plain:
            deployment = deployment_of[capability]
            single = deployment is not None and deployment.gpu_count == 1
            plain[capability] = (model.slots(deployment), model.holds(deployment)) if single else None  # type: ignore[arg-type]
        taken = plain[capability]
        if taken is not None and taken[0]:
            _next_slot(taken[0], queued, taken[1])
        else:
            _eta(model, queued, deployment_of[capability])  # whatever it takes: a gang none, a load its slots
    return len(by_id)


def _timeline_order(
    state: PoolState, now: float, deployment_of: dict[str, Deployment | None], timed: set[str]
) -> Iterable[QueuedRequest]:
    """The queue order (`iter_queue_order`) of the requests whose deployment is in `timed`
    only, from the queue index's lanes (one per class, tenant and capability, each in submission
    order), without ordering the rest of the queue. `deployment_of` gains the lanes' capabilities."""
    catalog = state.catalog
    lanes_of = queue_index(state).lanes_of
    lanes: list[tuple[str, str, list[QueuedRequest]]] = []
    for key in timed:  # a deployment's id (the one serving its capability), or a capability without one
        deployment = catalog.deployment(key)
        capabilities = [deployment.capability] if deployment is not None else []
        if catalog.deployment_for(key) is None:
            capabilities.append(key)
        for capability in capabilities:
            for lane in lanes_of.get(capability, ()):
                if capability not in deployment_of:
                    deployment_of[capability] = catalog.deployment_for(capability)
                lanes.append((lane.priority, lane.tenant, lane.items))
    if len(lanes) == 1:
        return lanes[0][2]  # one lane: its submission order is the order
    # Fair-share scores order the lanes of one class only: worked out when two of these share
    # one (as the decision pass has it); else no score moves anything.
    classes = {priority for priority, _, _ in lanes}
    scores = fair_share_scores(state, now) if len(classes) < len(lanes) else {}
    buckets: dict[tuple[int, float], list[list[QueuedRequest]]] = {}
    for priority, tenant, items in lanes:
        buckets.setdefault(bucket_key(catalog, scores, priority, tenant), []).append(items)
    # The lanes of one bucket interleave in submission order, as in the queue. (A chain, not a
    # generator: this is walked on every pass with a new waiter.)
    return itertools.chain.from_iterable(
        bucket[0] if len(bucket) == 1 else heapq.merge(*bucket, key=submission_key)
        for bucket in (buckets[key] for key in sorted(buckets))
    )


def _first_code(state: PoolState, queued: QueuedRequest) -> str:
    """The first of `_codes`, as its value: what a pass keeps on each new waiter, without making
    the codes (`_codes` is made from it)."""
    if queued.waiting_reason:
        return queued.waiting_codes[0] if queued.waiting_codes else WaitReason.PENDING.value
    on_load = state.residents.get(queued.assigned_to) if queued.assigned_to else None
    if on_load is not None and on_load.phase in (ResidentPhase.LOADING, ResidentPhase.WAKING):
        return WaitReason.LOAD_IN_FLIGHT.value
    return WaitReason.PENDING.value


def _message(state: PoolState, queued: QueuedRequest) -> str:
    """What `queued` waits on in words: the policy's Wait line, or the load (or wake) a pass
    started for it (such a pass says no Wait: it waits on that)."""
    on_load = state.residents.get(queued.assigned_to) if queued.assigned_to else None
    if queued.waiting_reason or on_load is None:
        return queued.waiting_reason
    if on_load.phase not in (ResidentPhase.LOADING, ResidentPhase.WAKING):
        return ""
    verb = "load" if on_load.phase == ResidentPhase.LOADING else "wake"
    return f"waiting for {on_load.key} to {verb}"


def _codes(state: PoolState, queued: QueuedRequest) -> list[WaitReason]:
    """What `_message` says, typed: the codes the policy gave with its Wait line, the load in
    flight a pass started for it, or PENDING (no pass has looked at it yet)."""
    if queued.waiting_reason and queued.waiting_codes:
        return [WaitReason(code) for code in queued.waiting_codes]
    return [WaitReason(_first_code(state, queued))]


# --- the dry run --------------------------------------------------------------------------------

_PROBE_PREFIX = "dry-run:"  # the probe request's id and workflow id start so


def admission_check(state: PoolState, request: AdmissionRequest, now: float) -> AdmissionCheck:
    """What the policy would decide for `request` if it arrived now, on a copy of the state:
    nothing is enqueued, loaded or held, and `state` is not touched."""
    base = AdmissionCheck(
        answer="never",
        pool=state.pool,
        capability=request.capability,
        deployment="",
        priority=request.priority or "",
        action="reject",
        checked_at=now,
    )
    probe = AdmissionRequest(
        # Its own id: a probe never meets a queued request's (nor its admission record).
        request_id=f"{_PROBE_PREFIX}{request.request_id or 'probe'}"[:128],
        workflow_id=_PROBE_PREFIX,
        capability=request.capability,
        tenant=request.tenant,
        priority=request.priority,
        deadline_s=request.deadline_s,
        lease_timeout_s=request.lease_timeout_s,
        max_duration_s=request.max_duration_s,
    )
    try:
        deployment, priority = validate_request(state, probe, gangs=True)
    except AdmissionRejected as rejected:
        return _with(base, failure=rejected.failure.value, message=rejected.message)
    base = _with(base, deployment=deployment.deployment_id, priority=priority)
    # The catalog is immutable by contract: shared, not copied (most of a big state's bytes).
    trial = copy.deepcopy(state, {id(state.catalog): state.catalog})
    # It arrives after everything queued: the scheduler answers a query at its last workflow
    # task's time, which is the submission time of the request that task queued, and a tie
    # would order the probe by its id, ahead of that request.
    arrival = now if not trial.queue or trial.queue[-1].submitted_at < now else trial.queue[-1].submitted_at + 1e-6
    queued = enqueue(trial, probe, priority, arrival)
    decisions = decide(trial, now)
    rid = probe.request_id
    for grant in decisions.grants:
        if grant.request_id == rid:
            return _with(base, answer="now", action="grant", accelerator=grant.lease.accelerator, eta_s=0.0)
    for reject in decisions.rejects:
        if reject.request_id == rid:
            return _with(
                base,
                failure=reject.failure.value,
                message=reject.message,
                detail=_memory_detail(state, deployment, priority, now, reject.failure),
            )
    # It would wait: what the pass would set it waiting on, then its verdict in the new queue.
    action, accelerator, message = "wait", "", ""
    for load in decisions.loads:
        if rid in load.for_requests:
            action, accelerator = "load", load.accelerator
            queued.assigned_to = load.resident_key
    for assign in decisions.assigns:
        if assign.request_id == rid:
            action, queued.assigned_to = "join_load", assign.resident_key
    for wake in decisions.wakes:
        if rid in wake.for_requests:
            action, queued.assigned_to = "wake", wake.resident_key
    for wait in decisions.waits:
        if wait.request_id == rid:
            message = queued.waiting_reason = wait.reason
            queued.waiting_codes = list(wait.codes)
    if decisions.preemptions and action == "wait" and "preempting" in message:
        action = "preempt"
    if action in ("load", "wake") and queued.assigned_to not in trial.residents:
        # The load was decided, not applied: it starts now and the request waits for its end.
        seconds, basis = _Model(trial, now).load(deployment, action)
        return _with(
            base,
            answer="later",
            action=action,
            accelerator=accelerator,
            message=message or f"{action} {deployment.deployment_id} on {accelerator}",
            eta_s=seconds,
            eta_basis="load_in_flight",
            eta_quality=basis,
            verdict=_single(trial, rid, now),
        )
    verdict = _single(trial, rid, now)
    return _with(
        base,
        answer="later",
        action=action,
        accelerator=accelerator,
        message=message,
        eta_s=None if verdict is None else verdict.eta_s,
        eta_basis="" if verdict is None else verdict.eta_basis,
        eta_quality="" if verdict is None else verdict.eta_quality,
        verdict=verdict,
        eta_at_least_s=None if verdict is None else verdict.eta_at_least_s,
        eta_at_most_s=None if verdict is None else verdict.eta_at_most_s,
    )


def _single(state: PoolState, request_id: str, now: float) -> Verdict | None:
    found = verdicts(state, now, {request_id})
    return found[0] if found else None


def _with(check: AdmissionCheck, **changes: object) -> AdmissionCheck:
    values = {name: getattr(check, name) for name in check.__dataclass_fields__}
    values.update(changes)
    return AdmissionCheck(**values)


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.1f} GiB"


def _memory_detail(state: PoolState, deployment: Deployment, priority: str, now: float, failure: FailureClass) -> str:
    """A memory refusal in a person's words: what it needs, what the best eligible card can give
    and what external processes hold there."""
    if failure not in (
        FailureClass.INSUFFICIENT_SCHEDULABLE_VRAM,
        FailureClass.EXTERNAL_GPU_PRESSURE,
        FailureClass.EVICTION_NOT_ALLOWED,
    ):
        return ""
    model = _Model(state, now)
    need = deployment.resident_bytes + deployment.lease_extra_bytes
    best: tuple[int, int, str] | None = None
    for accelerator_id in model.eligible(deployment, priority):
        accelerator = state.catalog.accelerator(accelerator_id)
        figures = model.budget(accelerator_id)
        if accelerator is None or figures is None:
            continue
        _, external, reserve = figures
        could = accelerator.total_bytes - reserve - external
        if best is None or (could, -external, accelerator_id) > (best[0], -best[1], best[2]):
            best = (could, external, accelerator_id)
    if best is None:
        return f"needs {_gib(need)}; no eligible card"
    could, external, accelerator_id = best
    held = f" while external processes hold {_gib(external)}" if external else ""
    return f"needs {_gib(need)}, the largest eligible card ({accelerator_id}) can give {_gib(max(0, could))}{held}"
