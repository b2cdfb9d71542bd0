"""The rules a placement checks, each written once and each returning its reason.

- `landing_refusals` (and `may_land`): may new bytes land on an accelerator now? Every load asks
  it: a request's model, an always_warm model, a gang's bytes, a gang looking for cards to reserve.
- `reservation_refuses`: may bytes be taken on an accelerator a waiting gang holds? (Backfill:
  only work that ends before the gang starts, or bytes within the gang's spare.) Part of the
  rule above, and asked on its own when a request joins or wakes a resident there.
- `deadline_refusal`: can work that must load first still start before its deadline?
- `expiry_refusal`: has a queued request run out of time (`QueuedRequest.expires_at`)?

`Attempt` is one request being placed: what the phases of `_placement` and `_gang` share, and
what its outcome depended on.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from modelforge.domain import Deployment
from modelforge.failures import FailureClass
from modelforge.policy._decisions import Reject
from modelforge.policy._pass import IDLE_RUNTIME, DecisionPass, request_ends_by
from modelforge.policy._reservation import Reservation
from modelforge.policy._state import QueuedRequest

# Why new bytes may not land on an accelerator now (the kinds a waiting request is told).
BLOCKED = "blocked"  # a higher-ordered request of this pass waits for memory there
STALE = "stale"  # its node has not reported within freshness_s: it may be gone
PRESSURE = "pressure"  # GPU_PRESSURE: only production work may load
RESERVED = "reserved"  # held for a waiting gang


@dataclass
class Attempt:
    """One request being placed in a pass."""

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
        if self.persists or attempt is None:
            return False
        return request_ends_by(attempt.queued, attempt.now + self.lead_s) <= reservation.starts_at


def landing_refusals(
    pass_: DecisionPass, accelerators: Iterable[str], production: bool, landing: Landing | None
) -> Iterator[tuple[str, str]]:
    """May new bytes land on each of `accelerators` now? (accelerator, "") where they may, else
    (accelerator, the kind of reason: see `refusal_reason`): a higher request of this pass waits
    for memory there (it must not be overtaken), its observation is stale, it is under
    GPU_PRESSURE and the work is not production, or a waiting gang holds it (`landing` None: a
    gang looking for cards of its own, which shares none). Over many cards at once: a pass asks
    it of every card of a large pool."""
    blocked, budgets, runtimes, reservations = (
        pass_.blocked,
        pass_.budgets,
        pass_.state.accelerators,
        pass_.reservations,
    )
    for accelerator in accelerators:
        if accelerator in blocked:
            yield accelerator, BLOCKED
        elif not budgets[accelerator].fresh:
            yield accelerator, STALE
        elif not production and runtimes.get(accelerator, IDLE_RUNTIME).pressure:
            yield accelerator, PRESSURE
        elif reservations and (
            accelerator in reservations if landing is None else reservation_refuses(pass_, accelerator, landing)
        ):
            yield accelerator, RESERVED
        else:
            yield accelerator, ""


def may_land(pass_: DecisionPass, accelerators: Iterable[str], production: bool, landing: Landing | None) -> list[str]:
    """The accelerators of `accelerators` where `landing_refusals` finds nothing."""
    return [
        accelerator
        for accelerator, refusal in landing_refusals(pass_, accelerators, production, landing)
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


def take_reservation(pass_: DecisionPass, accelerator: str, landing: Landing) -> None:
    """Bytes taken on a reserved accelerator that outlast the reservation's start come out of
    its spare."""
    reservation = pass_.reservations.get(accelerator)
    if reservation is None or landing.nbytes <= 0 or landing.ends_before(reservation):
        return
    reservation.spare -= landing.nbytes


def refusal_reason(pass_: DecisionPass, kind: str, accelerator: str, now: float) -> str:
    """The line a waiting request is told for a refusal of `kind` on `accelerator`."""
    if kind == BLOCKED:
        return f"{accelerator}: a higher request waits for memory here"
    if kind == STALE:
        age_s = pass_.budgets[accelerator].age_s
        age = "never observed" if age_s is None else f"observation {age_s:.0f} s old"
        return f"{accelerator}: {FailureClass.SCHEDULER_STATE_STALE.value} ({age})"
    if kind == PRESSURE:
        return f"{accelerator}: GPU_PRESSURE, only production work may load"
    reservation = pass_.reservations[accelerator]
    return (
        f"{accelerator}: reserved for gang {reservation.gang} starting in {reservation.starts_at - now:.0f} s "
        "(only work that ends by then may use it)"
    )


def deadline_refusal(attempt: Attempt, doing: str) -> Reject | None:
    """Work that must first load (`doing`: "loading", "starting") cannot start before its
    deadline: refused now, not loaded for nothing."""
    queued, now = attempt.queued, attempt.now
    if queued.deadline_at is None or now + attempt.load_s <= queued.deadline_at:
        return None
    return Reject(
        queued.request_id,
        queued.workflow_id,
        FailureClass.DEADLINE_CANNOT_BE_MET,
        f"{doing} {attempt.deployment.deployment_id} takes {attempt.load_s:.1f} s; the deadline is in "
        f"{queued.deadline_at - now:.1f} s",
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
