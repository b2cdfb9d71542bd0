"""Now, later or never, and why: the one client-side source of admission verdicts.

The gateway, the CLI (`modelforge queue`, `why`, `request --dry-run`, the live wait line) and
anything else that shows a waiting request read it here, through the pool scheduler's queries
(no update, no history event):

    async def pool_verdicts(client, pool=None, *, tenant="") -> list[Verdict]
        Every queued request's verdict in the pool (None: every pool routed among, one list, each
        pool's in its queue order), only `tenant`'s when given.
    async def request_verdict(client, request_id, *, pool=None, tenant="") -> Verdict | None
        One request's verdict while it waits in a scheduler's queue; None when no pool has it
        queued (not yet admitted, already granted or done, or another tenant's when `tenant`).
    async def admission_check(client, spec: CheckSpec) -> AdmissionCheck
        The dry run: what the policy would decide for `spec` if it arrived now (answer `now`,
        `later` with an ETA, or `never` with the failure class and why), on a copy of the
        scheduler's state: nothing is enqueued, started or held.

`client` is a `ModelForgeClient` (its Temporal client and pool router). A scheduler that does
not answer raises `ModelForgeError(CAPABILITY_UNAVAILABLE)`; bad input in a `CheckSpec` gives an
AdmissionCheck answering `never` with REQUEST_INVALID, never an exception.

JSON: `Verdict.to_json()` and `AdmissionCheck.to_json()` are the shapes every surface returns as
is. A verdict's JSON:

    {"request_id", "pool", "capability", "deployment", "tenant", "priority", "state": "queued",
     "submitted_at", "waited_s", "expires_at",
     "reason": a WaitReason value, "reasons": [...], "message": the policy's own line,
     "position": {"in_class", "class_depth", "in_deployment", "deployment_depth",
                  "ahead_in_higher_classes", "behind_class"},
     "eta": {"seconds", "at", "basis", "quality", "samples", "at_least_s", "at_most_s", "after_expiry"},
     "load": null | {"resident_key", "accelerator", "phase", "started_at", "expected_end_at", "basis"},
     "held_by": [{"accelerator", "kind", "who", "bytes", "ends_at"}], "computed_at"}

An admission check's: {"answer": "now" | "later" | "never", "pool", "capability", "deployment",
"priority", "action", "accelerator", "failure", "message", "detail", "eta": {"seconds", "basis",
"quality", "at_least_s", "at_most_s"}, "verdict": a verdict's JSON or null, "checked_at"}. The reasons, ETA bases and
qualities are described in modelforge/policy/_verdicts.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from temporalio.client import WorkflowQueryFailedError
from temporalio.service import RPCError

from modelforge.failures import FailureClass, ModelForgeError
from modelforge.identifiers import identifier_problem
from modelforge.messages import VerdictQuery
from modelforge.names import scheduler_id
from modelforge.policy import AdmissionCheck, AdmissionRequest, Verdict, WaitReason

if TYPE_CHECKING:
    from modelforge.client import ModelForgeClient

__all__ = [
    "AdmissionCheck",
    "CheckSpec",
    "Verdict",
    "WaitReason",
    "admission_check",
    "pool_verdicts",
    "request_verdict",
]

QUERY_TIMEOUT = timedelta(seconds=10)


@dataclass(frozen=True)
class CheckSpec:
    """A request to try without sending it: what `ModelForgeClient.request` would be asked."""

    capability: str
    tenant: str = "default"
    priority: str | None = None  # a class id or a level; with `queue`, a level of that queue
    queue: str | None = None
    deadline_s: float | None = None
    max_duration_s: float | None = None
    lease_timeout_s: float | None = None
    pool: str | None = None  # None: the pool the client's router would choose


async def _pools(client: ModelForgeClient, pool: str | None) -> list[str]:
    if pool is not None:
        return [pool]
    if client.pool is not None:
        return [client.pool]
    return await client.router.pools()


async def _query_verdicts(client: ModelForgeClient, pool: str, query: VerdictQuery) -> list[Verdict]:
    try:
        found: list[Verdict] = await client.temporal.get_workflow_handle(scheduler_id(pool)).query(
            "verdicts", query, result_type=list[Verdict], rpc_timeout=QUERY_TIMEOUT
        )
    except (RPCError, WorkflowQueryFailedError) as error:
        raise ModelForgeError(
            FailureClass.CAPABILITY_UNAVAILABLE, f"the scheduler of pool {pool!r} does not answer: {error}"
        ) from None
    return found


async def pool_verdicts(client: ModelForgeClient, pool: str | None = None, *, tenant: str = "") -> list[Verdict]:
    """Every queued request's verdict, pool by pool in queue order. Unbound (`pool` None and a
    routing client), the pools that answer; CAPABILITY_UNAVAILABLE only when none does."""
    pools = await _pools(client, pool)
    answers = await asyncio.gather(
        *(_query_verdicts(client, name, VerdictQuery(tenant=tenant)) for name in pools), return_exceptions=True
    )
    out: list[Verdict] = []
    errors: list[ModelForgeError] = []
    for answer in answers:
        if isinstance(answer, ModelForgeError):
            errors.append(answer)
        elif isinstance(answer, BaseException):
            raise answer
        else:
            out.extend(answer)
    if errors and (len(errors) == len(pools) or pool is not None):
        raise errors[0]
    return out


async def request_verdict(
    client: ModelForgeClient, request_id: str, *, pool: str | None = None, tenant: str = ""
) -> Verdict | None:
    """The verdict of one queued request, asked of each pool until one has it."""
    problem = identifier_problem("request_id", request_id)
    if problem is not None:
        raise ModelForgeError(FailureClass.REQUEST_INVALID, problem)
    pools = await _pools(client, pool)
    query = VerdictQuery(request_ids=[request_id], tenant=tenant)
    answers = await asyncio.gather(*(_query_verdicts(client, name, query) for name in pools), return_exceptions=True)
    errors: list[ModelForgeError] = []
    for answer in answers:
        if isinstance(answer, ModelForgeError):
            errors.append(answer)
        elif isinstance(answer, BaseException):
            raise answer
        elif answer:
            return answer[0]
    if errors and len(errors) == len(pools):
        raise errors[0]
    return None


def _spec_problem(spec: CheckSpec) -> str | None:
    for kind, name in (("capability", spec.capability), ("tenant", spec.tenant)):
        problem = identifier_problem(kind, name)
        if problem is not None:
            return problem
    for name, value in (
        ("deadline_s", spec.deadline_s),
        ("max_duration_s", spec.max_duration_s),
        ("lease_timeout_s", spec.lease_timeout_s),
    ):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or not (0 < value <= 7 * 24 * 3600)
        ):
            return f"{name} must be between 0 and 604800 seconds"
    if spec.queue is not None and (spec.priority is None or "." in spec.priority):
        return "a queue needs a level: --queue merge --priority critical"
    return None


def _refused(spec: CheckSpec, pool: str, failure: FailureClass, message: str) -> AdmissionCheck:
    return AdmissionCheck(
        answer="never",
        pool=pool,
        capability=spec.capability,
        deployment="",
        priority=spec.priority or "",
        action="reject",
        checked_at=0.0,
        failure=failure.value,
        message=message,
    )


async def admission_check(client: ModelForgeClient, spec: CheckSpec) -> AdmissionCheck:
    """The dry run of `spec` at the pool that would admit it (a query of its scheduler)."""
    problem = _spec_problem(spec)
    if problem is not None:
        return _refused(spec, spec.pool or client.pool or "", FailureClass.REQUEST_INVALID, problem)
    priority = f"{spec.queue}.{spec.priority}" if spec.queue is not None else spec.priority
    try:
        pool = spec.pool or client.pool or await client.router.choose(spec.capability, spec.tenant, priority)
    except ModelForgeError as error:
        return _refused(spec, "", error.failure, error.message)
    request = AdmissionRequest(
        request_id="probe",
        workflow_id="",
        capability=spec.capability,
        tenant=spec.tenant,
        priority=priority,
        deadline_s=spec.deadline_s,
        lease_timeout_s=spec.lease_timeout_s,
        max_duration_s=spec.max_duration_s,
    )
    try:
        check: AdmissionCheck = await client.temporal.get_workflow_handle(scheduler_id(pool)).query(
            "admission_check", request, result_type=AdmissionCheck, rpc_timeout=QUERY_TIMEOUT
        )
    except (RPCError, WorkflowQueryFailedError) as error:
        raise ModelForgeError(
            FailureClass.CAPABILITY_UNAVAILABLE, f"the scheduler of pool {pool!r} does not answer: {error}"
        ) from None
    return check
