"""What the policy returns: decisions, each with its typed reason, and the events they imply."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from modelforge.domain import Catalog
from modelforge.failures import Alert, FailureClass
from modelforge.policy._state import Lease, ResidentState


@dataclass(frozen=True)
class PolicyEvent:
    kind: str
    message: str = ""
    failure: FailureClass | None = None
    request_id: str = ""
    lease_id: str = ""
    accelerator: str = ""
    deployment: str = ""
    workflow_id: str = ""
    payload: dict[str, str | int | float | bool | None] = field(default_factory=dict)
    # Set on events an operator is alerted by (GPU_PRESSURE, CAPABILITY_CAPACITY).
    alert: Alert | None = None


Payload = dict[str, str | int | float | bool | None]


def catalog_loaded_event(catalog: Catalog) -> PolicyEvent:
    """A scheduler took a catalog (`catalog apply`; the simulator's replay of one applied inside
    a record's window): what it now holds."""
    return PolicyEvent(
        kind="catalog_loaded",
        payload={
            "accelerators": len(catalog.accelerators),
            "deployments": len(catalog.deployments),
            "tenants": len(catalog.tenants),
        },
    )


def lease_granted_event(
    pool: str, lease: Lease, waited_s: float | None, **extra: str | int | float | bool | None
) -> PolicyEvent:
    """A lease began: one story whichever path granted it (the scheduler, or a node on a slot lent
    to it: `delegated`). With the `lease_released` below, everything the lease ledger keeps."""
    return PolicyEvent(
        kind="lease_granted",
        request_id=lease.request_id,
        lease_id=lease.lease_id,
        accelerator=lease.accelerator,
        deployment=lease.deployment,
        workflow_id=lease.workflow_id,
        payload={**_lease_payload(pool, lease), "waited_s": None if waited_s is None else round(waited_s, 3), **extra},
    )


def lease_released_event(
    pool: str, lease: Lease, outcome: str, now: float, **extra: str | int | float | bool | None
) -> PolicyEvent:
    """A lease ended (`outcome`: ok, a failure class, preempted, reclaimed...) at `now`, with the
    whole ledger row, so the row is complete even if this event is written before its grant's
    (and ends when the lease ended: a delegated run is reported at its node's next sync)."""
    return PolicyEvent(
        kind="lease_released",
        request_id=lease.request_id,
        lease_id=lease.lease_id,
        accelerator=lease.accelerator,
        deployment=lease.deployment,
        workflow_id=lease.workflow_id,
        message=outcome,
        payload={
            **_lease_payload(pool, lease),
            "held_s": round(max(0.0, now - lease.granted_at), 3),
            "ended_at": now,
            "outcome": outcome,
            **extra,
        },
    )


def _lease_payload(pool: str, lease: Lease) -> Payload:
    payload: Payload = {
        "bytes": lease.bytes,
        "tenant": lease.tenant,
        "capability": lease.capability,
        "priority": lease.priority,
        "pool": pool,
        "accelerators": ",".join(lease.accelerators),
        "granted_at": lease.granted_at,
    }
    if lease.end_user:
        payload["end_user"] = lease.end_user
    return payload


def resident_event(
    resident: ResidentState,
    kind: str,
    message: str = "",
    payload: dict[str, str | int | float | bool | None] | None = None,
) -> PolicyEvent:
    """An event about one resident model: where it is and which workflow owns it."""
    return PolicyEvent(
        kind=kind,
        accelerator=resident.accelerator,
        deployment=resident.deployment,
        workflow_id=resident.workflow_id,
        message=message,
        payload=payload or {},
    )


@dataclass(frozen=True)
class Grant:
    request_id: str
    workflow_id: str
    lease: Lease


@dataclass(frozen=True)
class Reject:
    request_id: str
    workflow_id: str
    failure: FailureClass
    message: str


@dataclass(frozen=True)
class StartLoad:
    resident_key: str
    deployment: str
    accelerator: str
    node: str
    bytes: int
    # Requests that wait on this load.
    for_requests: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Assign:
    """A request waits on a resident that is loading; granted when it is ready."""

    request_id: str
    resident_key: str


@dataclass(frozen=True)
class Unload:
    resident_key: str
    reason: str


@dataclass(frozen=True)
class Sleep:
    """Put an idle resident to sleep: it keeps a little memory and wakes faster than it loads."""

    resident_key: str
    reason: str


@dataclass(frozen=True)
class Wake:
    """Wake a sleeping resident for the requests that wait on it (granted when it is awake)."""

    resident_key: str
    bytes: int
    for_requests: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Preempt:
    """Ask the holder of a lease to stop, release and requeue at its original priority with
    `preempted=true`, within `grace_s`."""

    lease_id: str
    request_id: str
    workflow_id: str
    reason: str
    grace_s: float


class WaitReason(StrEnum):
    """Why a request waits, typed: every `Wait` the policy returns names its codes, in the order
    its line (`Wait.reason`) gives the parts they stand for."""

    PENDING = "pending"  # admitted, no decision pass has looked at it yet
    LOAD_IN_FLIGHT = "load_in_flight"  # a load (or wake) of its model is under way for it
    CONCURRENCY_FULL = "concurrency_full"  # its model's residents are at their concurrency
    MEMORY_HELD = "memory_held"  # not enough schedulable memory where it may land
    MAKING_ROOM = "making_room"  # idle models are being unloaded / lower work preempted for it
    BEHIND_HIGHER_CLASS = "behind_higher_class"  # a request ordered ahead waits for that memory
    GANG_RESERVATION = "gang_reservation"  # the cards are reserved for a waiting gang
    STARVATION_RESERVATION = "starvation_reservation"  # held for a request past its starvation bound
    GANG_ROOM = "gang_room"  # a gang: not enough cards free together yet
    UNHEALTHY = "unhealthy"  # its eligible cards are UNHEALTHY
    STATE_STALE = "state_stale"  # its cards' telemetry is stale (SCHEDULER_STATE_STALE)
    GPU_PRESSURE = "gpu_pressure"  # GPU_PRESSURE: only production work may load
    MODEL_PHASE = "model_phase"  # its model is unloading or going to sleep


@dataclass(frozen=True)
class Wait:
    """A request stays queued: `reason` is the line a person reads (status, a timeout's
    message), `codes` what it says, typed, in the same order (never empty)."""

    request_id: str
    reason: str
    codes: tuple[WaitReason, ...]


@dataclass(frozen=True)
class Decisions:
    grants: list[Grant] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    loads: list[StartLoad] = field(default_factory=list)
    assigns: list[Assign] = field(default_factory=list)
    unloads: list[Unload] = field(default_factory=list)
    waits: list[Wait] = field(default_factory=list)
    preemptions: list[Preempt] = field(default_factory=list)
    sleeps: list[Sleep] = field(default_factory=list)
    wakes: list[Wake] = field(default_factory=list)

    def empty(self) -> bool:
        return not (
            self.grants
            or self.rejects
            or self.loads
            or self.assigns
            or self.unloads
            or self.preemptions
            or self.sleeps
            or self.wakes
        )
