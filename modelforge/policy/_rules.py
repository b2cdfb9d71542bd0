"""The rules a placement checks, each written once and each returning its reason.

- `landing_refusals` (and `may_land`): may new bytes land on an accelerator now? Every load asks
  it: a request's model, an always_warm model, a gang's bytes, a gang looking for cards to reserve.
- `reservation_refuses`: may bytes be taken on an accelerator a waiting gang, or a request past
  its class's starvation bound, holds? (Backfill: only work that ends before it starts, or bytes
  within its spare.) Part of the rule above, and asked on its own when a request joins or wakes
  a resident there (`joining_keeps`: joining a resident the holder needs gone takes its bytes).
- `deadline_refusal`: can work that must load first still finish by its deadline (its load and
  its estimated service time, `service_estimate`)?
- `hopeless_refusal`: can a waiting request still finish by its deadline if it started now?
- `predicted_refusal`: will a request just submitted start in time to finish by its deadline,
  behind the work of its deployment ahead of it in the queue and on its slots?
- `expiry_refusal`: has a queued request run out of time (`QueuedRequest.expires_at`)?

`Attempt` is one request being placed: what the phases of `_placement` and `_gang` share, and
what its outcome depended on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from modelforge.domain import Deployment, Residency
from modelforge.failures import FailureClass
from modelforge.policy._decisions import Reject, WaitReason
from modelforge.policy._order import is_production
from modelforge.policy._pass import BECOMING_READY, IDLE_RUNTIME, DecisionPass, request_ends_by
from modelforge.policy._reservation import Reservation
from modelforge.policy._state import QueuedRequest, ResidentState, service_figures

# Why new bytes may not land on an accelerator now (the kinds a waiting request is told).
BLOCKED = "blocked"  # a higher-ordered request of this pass waits for memory there
STALE = "stale"  # its node has not reported within freshness_s: it may be gone
PRESSURE = "pressure"  # GPU_PRESSURE: only production work may load
RESERVED = "reserved"  # held for a waiting gang, or for a request past its starvation bound
# What a request past its class's starvation bound is told when it reserves a card, and the
# start of the line later work is told there.
STARVED = "starved:"


@dataclass(slots=True)
class Attempt:
    """One request being placed in a pass (slots: one is made per placement)."""

    pass_: DecisionPass
    queued: QueuedRequest
    deployment: Deployment
    production: bool
    now: float
    load_s: float  # the deployment's load, measured in this pool if it has been
    counter: int  # the lease counter: a grant's lease id is built from it
    # False once the outcome depended on this request's own durations: it consulted a gang's
    # reservation (whether it may backfill depends on its max_duration) or made one (that depends
    # on its own lease timeout and deadline). Its wait then stands for itself alone.
    reusable: bool = True


class Landing(NamedTuple):
    """Bytes that would land on an accelerator: how many, whether they stay after the work (a
    model does; a batch job's and a gang's go with the lease), for which attempt (None: an
    always_warm load, which no request asked for), and how long until the work starts."""

    nbytes: int
    persists: bool
    attempt: Attempt | None = None
    lead_s: float = 0.0

    def ends_before(self, reservation: Reservation) -> bool:
        """Gone before the gang starts: takes nothing the gang will need."""
        attempt = self.attempt
        if self.persists or attempt is None or math.isinf(reservation.starts_at):
            return False
        return request_ends_by(attempt.queued, attempt.now + self.lead_s) <= reservation.starts_at


def landing_refusals(
    pass_: DecisionPass,
    accelerators: Iterable[str],
    production: bool,
    landing: Landing | None,
    shut: dict[str, str] | None = None,
) -> Iterator[tuple[str, str]]:
    """May new bytes land on each of `accelerators` now? (accelerator, "") where they may, else
    (accelerator, the kind of reason: see `refusal_reason`): a higher request of this pass waits
    for memory there (it must not be overtaken), its observation is stale, it is under
    GPU_PRESSURE and the work is not production, or a waiting gang holds it (`landing` None: a
    gang looking for cards of its own, which shares none). Over many cards at once: a pass asks
    it of every card of a large pool; `shut` (`shut_cards`, for the same `production`) answers
    the staleness and pressure rules from one walk of the pass."""
    blocked, budgets, runtimes, reservations = (
        pass_.blocked,
        pass_.budgets,
        pass_.state.accelerators,
        pass_.reservations,
    )
    for accelerator in accelerators:
        if accelerator in blocked:
            yield accelerator, BLOCKED
            continue
        if shut is not None:
            kind = shut.get(accelerator)
            if kind:
                yield accelerator, kind
                continue
        elif not budgets.fresh(accelerator):
            yield accelerator, STALE
            continue
        elif not production and runtimes.get(accelerator, IDLE_RUNTIME).pressure:
            yield accelerator, PRESSURE
            continue
        if reservations and (
            accelerator in reservations if landing is None else reservation_refuses(pass_, accelerator, landing)
        ):
            yield accelerator, RESERVED
        else:
            yield accelerator, ""


def shut_cards(pass_: DecisionPass, production: bool) -> dict[str, str]:
    """The pool's cards where `landing_refusals` refuses any work of this kind (production or
    not) for its staleness or pressure, with that kind of reason: neither changes during a
    pass, so a pass works it out once, for the walks over every card (`_placement._score_loads`)
    that ask it of thousands of cards for each request that finds no room."""
    shut = pass_.shut.get(production)
    if shut is None:
        if pass_.fit is not None:  # the fast pass: the cards gone stale since the last one
            config = pass_.state.config
            shut = dict.fromkeys(pass_.fit.staleness.stale_at(pass_.budgets.now, config.freshness_s), STALE)
        else:
            shut = dict.fromkeys(pass_.budgets.stale([card.id for card in pass_.pool_accelerators]), STALE)
        if not production:
            if pass_.fit is not None:
                pressured: Iterable[str] = pass_.fit.pressured
            else:
                pressured = [a for a, runtime in pass_.state.accelerators.items() if runtime.pressure]
            for accelerator in pressured:
                if accelerator not in shut:
                    shut[accelerator] = PRESSURE
        pass_.shut[production] = shut
    return shut


def may_land(
    pass_: DecisionPass,
    accelerators: Iterable[str],
    production: bool,
    landing: Landing | None,
    shut: dict[str, str] | None = None,
) -> list[str]:
    """The accelerators of `accelerators` where `landing_refusals` finds nothing."""
    return [
        accelerator
        for accelerator, refusal in landing_refusals(pass_, accelerators, production, landing, shut)
        if not refusal
    ]


def reservation_refuses(pass_: DecisionPass, accelerator: str, landing: Landing) -> bool:
    """Whether a gang's reservation on `accelerator` keeps `landing` off it: a reservation lets
    through work that ends before it starts, and bytes within its spare. Consulting one makes
    the attempt's outcome its own (see `Attempt.reusable`)."""
    reservation = pass_.reservations.get(accelerator)
    if reservation is None or landing.nbytes <= 0:
        return False
    if landing.attempt is not None:
        landing.attempt.reusable = False
    if landing.ends_before(reservation):
        return False
    return landing.nbytes > reservation.spare


def joining_keeps(pass_: DecisionPass, resident: ResidentState) -> bool:
    """Whether joining `resident` keeps bytes a starving request's reservation on its card waits
    for: the reservation counts on residents there being unloaded (`Reservation.keeps_residents`)
    and this is one its holder may unload (never always_warm; one that last served production
    only for a production holder). Joining it then counts its bytes as taken."""
    reservation = pass_.reservations.get(resident.accelerator)
    if reservation is None or not reservation.keeps_residents or resident.residency == Residency.ALWAYS_WARM:
        return False
    return (
        reservation.production
        or resident.last_priority is None
        or not is_production(pass_.state.catalog, resident.last_priority)
    )


def take_reservation(pass_: DecisionPass, accelerator: str, landing: Landing) -> None:
    """Bytes taken on a reserved accelerator that outlast the reservation's start come out of
    its spare."""
    reservation = pass_.reservations.get(accelerator)
    if reservation is None or landing.nbytes <= 0 or landing.ends_before(reservation):
        return
    reservation.spare -= landing.nbytes


def refusal_reason(pass_: DecisionPass, kind: str, accelerator: str, now: float) -> tuple[WaitReason, str]:
    """What a waiting request is told for a refusal of `kind` on `accelerator`: the typed code
    and the line."""
    if kind == BLOCKED:
        return WaitReason.BEHIND_HIGHER_CLASS, f"{accelerator}: a higher request waits for memory here"
    if kind == STALE:
        age_s = pass_.budgets[accelerator].age_s
        age = "never observed" if age_s is None else f"observation {age_s:.0f} s old"
        return WaitReason.STATE_STALE, f"{accelerator}: {FailureClass.SCHEDULER_STATE_STALE.value} ({age})"
    if kind == PRESSURE:
        return WaitReason.GPU_PRESSURE, f"{accelerator}: GPU_PRESSURE, only production work may load"
    reservation = pass_.reservations[accelerator]
    if reservation.starving:
        starts_in = reservation.starts_at - now
        ends = "" if math.isinf(starts_in) else f", work that ends within {starts_in:.0f} s"
        return WaitReason.STARVATION_RESERVATION, (
            f"{accelerator}: {STARVED} {reservation.holder} waits past its class's starvation bound "
            f"(only work of a higher class{ends} or within {reservation.spare} B may take memory there)"
        )
    return WaitReason.GANG_RESERVATION, (
        f"{accelerator}: reserved for gang {reservation.holder} starting in {reservation.starts_at - now:.0f} s "
        "(only work that ends by then may use it)"
    )


def deadline_refusal(attempt: Attempt, doing: str) -> Reject | None:
    """Work that must first load (`doing`: "loading", "starting") cannot finish by its deadline,
    its load and its estimated service time counted: refused now, not loaded for nothing."""
    queued, now = attempt.queued, attempt.now
    if queued.deadline_at is None:
        return None
    # Estimated here, not with the attempt: only a request with a deadline that loads reads it.
    service_s = service_estimate(attempt.pass_, queued, attempt.deployment)
    if now + attempt.load_s + service_s <= queued.deadline_at:
        return None
    service = f" and its service about {service_s:.1f} s" if service_s else ""
    return Reject(
        queued.request_id,
        queued.workflow_id,
        FailureClass.DEADLINE_CANNOT_BE_MET,
        f"{doing} {attempt.deployment.deployment_id} takes {attempt.load_s:.1f} s{service}; the deadline is in "
        f"{queued.deadline_at - now:.1f} s",
    )


def service_of(pass_: DecisionPass, deployment_id: str) -> tuple[float, float]:
    """(mean, high percentile) of a deployment's measured service times, once per pass."""
    figures = pass_.service.get(deployment_id)
    if figures is None:
        figures = pass_.service[deployment_id] = service_figures(pass_.state, deployment_id)
    return figures


def service_estimate(pass_: DecisionPass, queued: QueuedRequest, deployment: Deployment) -> float:
    """How long `queued` will hold its lease: a batch job's max_duration (it says how long it
    may run; none is measured for its kind of work), else the configured high percentile of its
    deployment's measured lease times, at most its max_duration; 0 while nothing is known."""
    if deployment.residency == Residency.NONE and queued.max_duration_s is not None:
        return queued.max_duration_s
    high = service_of(pass_, deployment.deployment_id)[1]
    return high if queued.max_duration_s is None else min(high, queued.max_duration_s)


def hopeless_refusal(
    pass_: DecisionPass, queued: QueuedRequest, deployment: Deployment, now: float, load_s: float
) -> Reject | None:
    """A waiting request that could not finish by its deadline even if it started now (loading
    its model first where none of it is resident) leaves the queue at once: the capacity goes to
    work that can."""
    if queued.deadline_at is None:
        return None
    service = service_estimate(pass_, queued, deployment)
    load = 0.0 if pass_.residents_of.get(deployment.deployment_id) else load_s
    if now + load + service <= queued.deadline_at:
        return None
    loading = f"a {load:.1f} s load and " if load else ""
    return Reject(
        queued.request_id,
        queued.workflow_id,
        FailureClass.DEADLINE_CANNOT_BE_MET,
        f"cannot finish by its deadline: {loading}about {service:.1f} s of service "
        f"({deployment.deployment_id}, p{pass_.state.config.service_percentile * 100:g} of its measured runs), "
        f"{queued.deadline_at - now:.1f} s left",
    )


def _busy_s(pass_: DecisionPass, now: float) -> dict[str, float]:
    """Per deployment, the seconds its running leases still need at their mean service time."""
    busy = pass_.busy_s
    if busy is None:
        busy = pass_.busy_s = {}
        for lease in pass_.state.leases.values():
            mean = service_of(pass_, lease.deployment)[0]
            busy[lease.deployment] = busy.get(lease.deployment, 0.0) + max(0.0, lease.granted_at + mean - now)
    return busy


def predicted_refusal(pass_: DecisionPass, queued: QueuedRequest, deployment: Deployment, now: float) -> Reject | None:
    """A request just submitted (never told a reason yet) that has to wait for its deployment's
    slots, and would start too late to finish by its deadline: refused at submission. Its start
    is predicted from the work ahead of it: its deployment's running leases (what they still
    need at the mean service time), the requests of it this pass granted or left waiting before
    it, each at the mean, spread over the slots of its residents; its own service at the high
    percentile (`service_estimate`)."""
    if queued.deadline_at is None or queued.waiting_reason:
        return None
    deployment_id = deployment.deployment_id
    mean = service_of(pass_, deployment_id)[0]
    if mean <= 0.0:
        return None
    slots = sum(deployment.concurrency for r in pass_.residents_of.get(deployment_id, ()) if r.phase in BECOMING_READY)
    if slots <= 0:
        return None
    work = _busy_s(pass_, now).get(deployment_id, 0.0)
    work += (pass_.ahead.get(deployment_id, 0) + pass_.granted.get(deployment_id, 0)) * mean
    start = now + work / slots
    service = service_estimate(pass_, queued, deployment)
    if start + service <= queued.deadline_at:
        return None
    return Reject(
        queued.request_id,
        queued.workflow_id,
        FailureClass.DEADLINE_CANNOT_BE_MET,
        f"would start in about {start - now:.1f} s behind {work:.0f} s of {deployment_id} work on {slots} slots "
        f"and need about {service:.1f} s; the deadline is in {queued.deadline_at - now:.1f} s",
    )


def expiry_refusal(queued: QueuedRequest, now: float) -> Reject | None:
    """A queued request past its expiry leaves the queue: LEASE_TIMEOUT when its lease timeout
    came, else DEADLINE_CANNOT_BE_MET; either with the reason it last waited for."""
    if now < queued.expires_at:
        return None
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
