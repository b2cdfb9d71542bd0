"""Admission: a request checked against the catalog and its tenant (`validate_request`), its
class resolved (`resolve_priority`), a repeat recognised (`existing_admission`) and the request
queued in submission order (`enqueue`). What happens to it next is `decide`'s
(policy/_placement.py), carried out by policy/_transitions.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelforge.domain import (
    DEFAULT_QUEUE,
    RESERVED_RESIDENCIES,
    Deployment,
    Residency,
    level_ref,
)
from modelforge.failures import FailureClass
from modelforge.identifiers import MAX_DURATION_S, MAX_WAIT_S, identifier_problem
from modelforge.policy._lease_index import lease_index
from modelforge.policy._order import insert_in_submission_order, runs_late
from modelforge.policy._queue_index import current_index, queue_index
from modelforge.policy._state import (
    Lease,
    PoolState,
    QueuedRequest,
)


class AdmissionRejected(Exception):
    """Raised by `validate_request`; carries the typed class for the update validator."""

    def __init__(self, failure: FailureClass, message: str) -> None:
        super().__init__(message)
        self.failure = failure
        self.message = message


@dataclass(frozen=True)
class AdmissionRequest:
    request_id: str
    workflow_id: str
    capability: str
    tenant: str
    # A class id (`interactive`, `merge.critical`) or a bare level resolved in the tenant's queue.
    priority: str | None = None
    deadline_s: float | None = None
    lease_timeout_s: float | None = None
    # Requeued after preemption: keeps its original class and its place (submission time).
    preempted: bool = False
    submitted_at: float | None = None
    # The longest the lease will be held once granted (the request's max_duration): lets work
    # that ends before a waiting gang's reservation starts backfill the reserved accelerators.
    max_duration_s: float | None = None
    # The requester stops waiting for this admission at this moment (its admit call's budget):
    # an admission the scheduler only gets to later is refused, never granted to nobody.
    admit_by: float | None = None
    # Who the application says asked, within the tenant: kept on the lease's events.
    end_user: str = ""
    # The input's size as JSON (the client's measure): kept on the events that end its wait.
    input_bytes: int | None = None


def resolve_priority(state: PoolState, request: AdmissionRequest) -> str:
    """The class stamped from identity: the tenant's default, never above its ceiling, only in
    the tenant's queues. A bare level (`critical`) means that level of the tenant's default
    queue, or of the one queue that has it."""
    catalog = state.catalog
    tenant = catalog.tenant(request.tenant)
    if tenant is None:
        raise AdmissionRejected(FailureClass.REQUEST_INVALID, f"unknown tenant {request.tenant!r}")
    asked = request.priority or tenant.default_priority
    if "." in asked:
        asked = level_ref(DEFAULT_QUEUE, asked)  # `default.production` is `production`
    klass = catalog.priority_class(asked)
    if klass is None and "." not in asked:
        home = catalog.priority_class(tenant.default_priority)
        same_queue = [k for k in catalog.classes.values() if k.level == asked and home and k.queue == home.queue]
        anywhere = [k for k in catalog.classes.values() if k.level == asked]
        if same_queue:
            klass = same_queue[0]
        elif len(anywhere) == 1:
            klass = anywhere[0]
        elif anywhere:
            raise AdmissionRejected(
                FailureClass.REQUEST_INVALID,
                f"priority {asked!r} is a level of {', '.join(k.queue for k in anywhere)}: name the queue "
                f"({', '.join(k.id for k in anywhere)})",
            )
    if klass is None:
        raise AdmissionRejected(
            FailureClass.REQUEST_INVALID, f"unknown priority {asked!r} (classes: {', '.join(catalog.classes)})"
        )
    if tenant.queues and klass.queue not in tenant.queues:
        raise AdmissionRejected(
            FailureClass.REQUEST_INVALID,
            f"tenant {tenant.name!r} may submit to {', '.join(tenant.queues)}, not queue {klass.queue!r}",
        )
    ceiling = catalog.priority_class(tenant.max_priority)
    if ceiling is not None and klass.priority > ceiling.priority:
        raise AdmissionRejected(
            FailureClass.REQUEST_INVALID,
            f"tenant {tenant.name!r} may ask for at most {ceiling.id!r}, not {klass.id!r}",
        )
    return klass.id


def existing_admission(state: PoolState, request: AdmissionRequest) -> Lease | QueuedRequest | None:
    """The same requester asking again for the same request (its call was retried): what it
    already has, so admission is idempotent instead of a LEASE_CONFLICT with itself. Looked up
    by request id in the queue's and the leases' indexes, not by a walk over either."""
    index = queue_index(state)
    if len(index.by_id) == index.length:  # one queued request per id: the index finds it
        queued = index.by_id.get(request.request_id)
        if queued is not None and queued.workflow_id == request.workflow_id:
            return queued
    else:
        for queued in state.queue:
            if queued.request_id == request.request_id and queued.workflow_id == request.workflow_id:
                return queued
    for _, lease in lease_index(state).held_for(request.request_id):
        if lease.workflow_id == request.workflow_id:
            return lease
    return None


def validate_request(state: PoolState, request: AdmissionRequest, *, gangs: bool = True) -> tuple[Deployment, str]:
    """Everything that can be refused without touching the queue: a refused admission update
    writes no history.

    `gangs` (on): admit multi-GPU batch jobs (`gpu_count > 1`, residency none); off refuses
    them, for a caller that cannot run them (the request workflows run them)."""
    if not request.request_id or not request.capability:
        raise AdmissionRejected(FailureClass.REQUEST_INVALID, "request_id and capability are required")
    # The last entrance checks what every entrance checks (a client that skipped them, or an old
    # one): nothing unprintable or unbounded goes into the state, the history or the event log.
    for kind, identifier in (("request_id", request.request_id), ("capability", request.capability)):
        problem = identifier_problem(kind, identifier)
        if problem is not None:
            raise AdmissionRejected(FailureClass.REQUEST_INVALID, problem)
    for kind, identifier in (("tenant", request.tenant), ("end_user", request.end_user)):
        problem = identifier_problem(kind, identifier) if identifier else None  # empty: none given
        if problem is not None:
            raise AdmissionRejected(FailureClass.REQUEST_INVALID, problem)
    for name, value in (("deadline_s", request.deadline_s), ("lease_timeout_s", request.lease_timeout_s)):
        if value is not None and not (0 < value <= MAX_WAIT_S):
            raise AdmissionRejected(
                FailureClass.REQUEST_INVALID, f"{name} must be between 0 and {MAX_WAIT_S:.0f} seconds, got {value!r}"
            )
    if request.max_duration_s is not None and not (0 < request.max_duration_s <= MAX_DURATION_S):
        raise AdmissionRejected(
            FailureClass.REQUEST_INVALID,
            f"max_duration_s must be between 0 and {MAX_DURATION_S:.0f} seconds, got {request.max_duration_s!r}",
        )
    deployment = state.catalog.deployment_for(request.capability)
    if deployment is None:
        raise AdmissionRejected(FailureClass.CAPABILITY_UNAVAILABLE, f"no deployment serves {request.capability!r}")
    if deployment.residency in RESERVED_RESIDENCIES:
        raise AdmissionRejected(
            FailureClass.RESIDENCY_CONFLICT,
            f"residency {deployment.residency.value!r} is reserved for later and not served",
        )
    if deployment.gpu_count > 1 and deployment.residency != Residency.NONE:
        raise AdmissionRejected(
            FailureClass.CAPABILITY_UNAVAILABLE,
            f"{request.capability} needs a gang of {deployment.gpu_count} GPUs; a model server spread over "
            "several GPUs is not served: gangs are batch jobs (residency none)",
        )
    if deployment.gpu_count > 1 and not gangs:
        raise AdmissionRejected(
            FailureClass.CAPABILITY_UNAVAILABLE, f"{request.capability} needs a gang of {deployment.gpu_count} GPUs"
        )
    priority = resolve_priority(state, request)
    index = queue_index(state)
    if request.request_id in index.by_id or lease_index(state).held_for(request.request_id):
        raise AdmissionRejected(FailureClass.LEASE_CONFLICT, f"request {request.request_id} is already admitted")
    queued = index.per_capability.get(request.capability, 0)
    if queued >= deployment.queue_limit:
        raise AdmissionRejected(
            FailureClass.QUEUE_FULL,
            f"{queued} requests already queued for {request.capability} (queue_limit {deployment.queue_limit})",
        )
    return deployment, priority


def enqueue(state: PoolState, request: AdmissionRequest, priority: str, now: float) -> QueuedRequest:
    timeout = request.lease_timeout_s or state.config.default_lease_timeout_s
    submitted = now
    if request.preempted and request.submitted_at is not None and request.submitted_at <= now:
        submitted = request.submitted_at
    queued = QueuedRequest(
        request_id=request.request_id,
        workflow_id=request.workflow_id,
        capability=request.capability,
        priority=priority,
        tenant=request.tenant,
        submitted_at=submitted,
        preempted=request.preempted,
        lease_timeout_at=now + timeout,
        # A class that runs late (`on_deadline = "run_late"`) is never refused for its deadline.
        deadline_at=None
        if request.deadline_s is None or runs_late(state.catalog, priority)
        else now + request.deadline_s,
        max_duration_s=request.max_duration_s,
        end_user=request.end_user,
        input_bytes=request.input_bytes,
    )
    index = current_index(state)
    insert_in_submission_order(state.queue, queued)
    if index is not None:
        index.added(queued)
    return queued


def asked_for(queued: QueuedRequest) -> dict[str, str | int | float | bool | None]:
    """What a request asked for, in the events that end its wait (granted or refused), so the
    record alone can replay it (`modelforge simulate --from-record`)."""
    return {
        "capability": queued.capability,
        "tenant": queued.tenant,
        "priority": queued.priority,
        "submitted_at": queued.submitted_at,
        "deadline_s": None if queued.deadline_at is None else round(queued.deadline_at - queued.submitted_at, 3),
        "lease_timeout_s": round(queued.lease_timeout_at - queued.submitted_at, 3),
        "max_duration_s": queued.max_duration_s,
        "input_bytes": queued.input_bytes,
    }
