"""What crosses Temporal between the client, the workflows and the activities."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from modelforge.domain import Accelerator, Deployment, Observation
from modelforge.events import EventRecord
from modelforge.policy import (
    AcceleratorStatus,
    AdmissionRequest,
    Lease,
    PolicyConfig,
    PoolState,
    SlotReply,
    SlotSync,
)

MAX_INPUT_BYTES = 1_000_000


@dataclass(frozen=True)
class StreamTarget:
    """Where the node pushes a streamed answer as it is generated: the gateway that holds the
    client's connection (`url`, its internal stream endpoint) and the stream's random id. Set by
    the gateway only, never from a client's input; the lease is held while the stream runs."""

    url: str
    stream_id: str


@dataclass(frozen=True)
class RequestInput:
    request_id: str
    capability: str
    input: dict[str, Any] = field(default_factory=dict)
    priority: str | None = None
    tenant: str = "default"
    deadline_s: float | None = None
    lease_timeout_s: float | None = None
    pool: str = "default"
    # Longest an invoke may run once it holds its lease.
    max_duration_s: float = 600.0
    # What the node does with the lease: "" invokes the model with `input`; PROFILE_OPERATION
    # measures its envelope (`modelforge profile`, `input` then holds the cases). Set by trusted
    # code (the CLI), never read from a client's input: the request workflow copies it to
    # InvokeInput.operation.
    operation: str = ""
    # Set by the gateway for a streamed answer (stream=true): the node pushes it there as it is
    # generated. A streamed request is never retried after its invoke started: the client has
    # part of the answer already.
    stream: StreamTarget | None = None
    # Who the application says asked, within the tenant (Open WebUI's forwarded user): on the
    # lease's events, never the tenant ("" none).
    end_user: str = ""
    # The input's size as JSON, measured by the client that checked it against the payload
    # limit: on the events that end the request's wait, so a record keeps what it asked for.
    input_bytes: int | None = None


@dataclass(frozen=True)
class RequestResult:
    request_id: str
    capability: str
    output: dict[str, Any]
    lease: Lease | None
    timings: dict[str, float] = field(default_factory=dict)
    # Where the next request for this capability can start (InvokeResult.route); "" for none.
    route: str = ""


@dataclass(frozen=True)
class AdmitCall:
    pool: str
    request: AdmissionRequest
    # The scheduler's update id for this acquisition (Temporal deduplicates by it).
    update_id: str = ""


@dataclass(frozen=True)
class LeaseConfirmCall:
    """A holder asks whether its lease is still held before it uses a grant that reached it
    late (its worker or Temporal was away): a reclaimed lease must never be used."""

    pool: str
    lease_id: str
    request_id: str


@dataclass(frozen=True)
class AdmitBatch:
    requests: list[AdmissionRequest]


@dataclass(frozen=True)
class AdmitBatchReply:
    replies: list[AdmitReply]


@dataclass(frozen=True)
class AdmitReply:
    status: str  # granted | queued | rejected
    lease: Lease | None = None
    failure: str | None = None
    message: str = ""
    priority: str = ""


@dataclass(frozen=True)
class LeaseDecision:
    request_id: str
    lease: Lease | None = None
    failure: str | None = None
    message: str = ""


@dataclass(frozen=True)
class ReleaseSignal:
    lease_id: str
    request_id: str
    outcome: str  # "ok" or a failure class
    invoke_s: float = 0.0
    message: str = ""
    retrying: bool = False  # the request workflow will ask for a new lease
    # When its holder was done with it (epoch seconds; None: when the scheduler hears it). The
    # ledger's end: a release the scheduler hears late (applied again after a reset of its run,
    # delayed by a Temporal backlog) ended when its holder let go, not when it was heard.
    ended_at: float | None = None


# How often a request holding a lease tells the scheduler it is alive; well inside the
# scheduler's stale_lease_s (60 s by default), so two lost signals never cost a live lease.
LEASE_HEARTBEAT_S = 20.0


@dataclass(frozen=True)
class LeaseHeartbeat:
    lease_id: str
    request_id: str = ""
    # The holder's request workflow: a scheduler that does not hold the lease (its run was reset
    # past the grant, or the grant was never recorded) stops that invoke.
    holder: str = ""


@dataclass(frozen=True)
class PreemptSignal:
    """Stop, checkpoint where the runtime can, release and requeue within grace_s."""

    lease_id: str
    reason: str
    grace_s: float = 30.0


@dataclass(frozen=True)
class CancelSignal:
    request_id: str
    reason: str
    # When its requester gave up (epoch seconds; None: when the scheduler hears it). A lease
    # granted to it ends then in the ledger: a cancel heard late (applied again after a reset of
    # the scheduler's run, held by a Temporal backlog) did not hold the lease until it was heard.
    sent_at: float | None = None


@dataclass(frozen=True)
class DeadlineDue:
    """A requester's own clock says this request's deadline passed while it still waits."""

    request_id: str


@dataclass(frozen=True)
class RebaseSignal:
    """Continue as new now: the run's history cannot be replayed (the replay guard found a
    nondeterminism error in it), but its cached state is sound, so it moves that state into a
    fresh run before a worker restart would have to replay the history."""

    reason: str


@dataclass(frozen=True)
class ResidencyControl:
    """An operator's residency operation (`modelforge load|unload|pin|unpin`, the gateway's
    /v1/residency, Ollama's keep_alive): `deployment` is a deployment id or a capability;
    `accelerator` narrows it to one card; `drain` lets an unload wait for active leases. A load
    is admitted as a request of `tenant`'s class (`priority` if given) and released once placed."""

    action: str
    deployment: str
    accelerator: str = ""
    drain: bool = False
    actor: str = ""
    tenant: str = "default"
    priority: str | None = None


@dataclass(frozen=True)
class ResidencyControlReply:
    ok: bool
    message: str
    failure: str | None = None
    residents: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class VerdictQuery:
    """The scheduler's `verdicts` query (modelforge/verdicts.py): every queued request's verdict,
    or only those of `request_ids`, or only `tenant`'s (both: both must hold)."""

    request_ids: list[str] = field(default_factory=list)
    tenant: str = ""


@dataclass(frozen=True)
class SchedulerInput:
    pool: str
    state: PoolState | None = None
    config: PolicyConfig = field(default_factory=PolicyConfig)
    # How often the scheduler re-evaluates with no message (staleness, timeouts).
    reconcile_interval_s: float = 30.0
    # Continue-as-new at this history length even before Temporal suggests it: the history of a
    # busy pool stays short to replay and well under Temporal's limits.
    max_history_events: int = 5000
    # A capacity snapshot per accelerator into Postgres this often (0: none).
    snapshot_interval_s: float = 60.0
    # What the previous run had decided but not yet delivered or written when it continued as
    # new: carried so that nothing is dropped and continue-as-new never waits on Postgres.
    carried: CarriedOutbox | None = None
    # How often the scheduler compares the lease ledger's open rows with the leases it holds
    # (a lease it no longer knows, as after a reset of its run, is reclaimed and its row closed),
    # and when the next comparison is due (carried across continue-as-new; None: one interval on).
    ledger_audit_interval_s: float = 60.0
    ledger_audit_at: float | None = None
    # Since when grants wait for a ledger audit asked with a reset (carried across
    # continue-as-new: a reset run may continue as new at once; None: they do not wait).
    grants_wait_for_audit_since: float | None = None
    # The grants the reset's discarded part of the history made (`LedgerAudit`), not yet
    # reclaimed by an audit: carried so that the next run's audit reclaims them.
    lost_grants: list[Lease] = field(default_factory=list)
    # Whether the guard's repair was still going on (`LedgerAudit.final`), carried likewise.
    audit_repair_open: bool = False
    # The leases an audit reclaimed whose holders were told to stop and have not said they did
    # (lease id -> when told): grants wait for them, carried likewise.
    holders_stopping: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class AddressedDecision:
    workflow_id: str
    decision: LeaseDecision


@dataclass(frozen=True)
class AddressedCommand:
    workflow_id: str
    command: ResidentCommand


@dataclass(frozen=True)
class AddressedPreempt:
    workflow_id: str
    preempt: PreemptSignal


@dataclass(frozen=True)
class LedgerAudit:
    """The replay guard's `audit_ledger` with a reset of a scheduler's run. `lost_grants`: the
    leases the discarded part of the history granted (read by the guard from the old run's
    history): the audit reclaims them whether or not their ledger row was ever written (a grant's
    event is written lazily, and a row never written is one no audit of the ledger can find)."""

    lost_grants: list[Lease] = field(default_factory=list)
    # False: the guard's repair goes on (an ask naming grants found later may follow), so grants
    # keep waiting past this ask's audit, until an ask with final=True has been audited too (or
    # AUDIT_BEFORE_GRANTS_LIMIT_S from the first ask, should the guard be gone).
    final: bool = True


@dataclass(frozen=True)
class OpenLease:
    """A lease-ledger row with no end: what the ledger says a pool's scheduler granted and has
    not yet released (the `open_leases` activity's answer)."""

    lease_id: str
    request_id: str = ""
    tenant: str = ""
    capability: str = ""
    deployment: str = ""
    priority: str = ""
    accelerators: list[str] = field(default_factory=list)
    bytes: int = 0
    granted_at: float = 0.0


@dataclass(frozen=True)
class CarriedOutbox:
    decisions: list[AddressedDecision] = field(default_factory=list)
    commands: list[AddressedCommand] = field(default_factory=list)
    preempts: list[AddressedPreempt] = field(default_factory=list)
    loads: list[ResidencyInput] = field(default_factory=list)
    # Unwritten events, and those whose write had not been confirmed (written again: idempotent).
    events: list[EventRecord] = field(default_factory=list)


@dataclass(frozen=True)
class ResidencyInput:
    pool: str
    key: str
    deployment: Deployment
    accelerator: Accelerator
    device_index: int


@dataclass(frozen=True)
class ResidentReport:
    key: str
    ok: bool
    measured_bytes: int = 0
    load_s: float = 0.0
    health_s: float = 0.0
    failure: str | None = None
    message: str = ""
    workflow_id: str = ""  # the residency workflow that reports; a previous life of the key is ignored
    # What it loaded where (a load's report): a scheduler that does not hold it adopts it by these.
    deployment: str = ""
    accelerator: str = ""
    # A load reported again, to a scheduler that adopted the residency (`adopt`): not a load's
    # measurement (its load time is the first report's), nor a load to record again.
    again: bool = False


@dataclass(frozen=True)
class ResidentCommand:
    # extend | unload | sleep | wake | lost | adopt (the scheduler's start of this residency was
    # refused because it runs already: a reset run deciding again a load its lost part started)
    action: str
    until: float = 0.0
    reason: str = ""


@dataclass(frozen=True)
class ResidentIdle:
    key: str
    workflow_id: str = ""


@dataclass(frozen=True)
class UnloadReport:
    key: str
    reclaimed: bool
    unload_s: float = 0.0
    message: str = ""
    workflow_id: str = ""


@dataclass(frozen=True)
class TelemetryInput:
    node: str
    pool: str = "default"
    # The other pools this node's cards are in: each of their schedulers gets the same sample
    # (each keeps its own cards' observations).
    other_pools: list[str] = field(default_factory=list)
    interval_s: float = 10.0
    samples_before_continue: int = 200


@dataclass(frozen=True)
class NodeSample:
    node: str
    observations: list[Observation] = field(default_factory=list)
    backend: str = ""
    error: str = ""


@dataclass(frozen=True)
class LoadInput:
    key: str
    deployment: Deployment
    accelerator_id: str
    device_index: int
    device_uuid: str


@dataclass(frozen=True)
class LoadResult:
    measured_bytes: int
    load_s: float
    pid: int


@dataclass(frozen=True)
class InvokeInput:
    key: str
    lease_id: str
    payload: dict[str, Any]
    # On success the node releases the lease itself, one signal to the scheduler that spares
    # the request workflow a round trip. Failures are always released by the workflow.
    release_to: str = ""  # the scheduler's workflow id
    request_id: str = ""
    # Set by the request workflow only (never from the client's input, whose `modelforge_*` keys
    # are refused): RequestInput.operation, and the checkpoint a resumed run starts from.
    operation: str = ""
    resume_from: str = ""
    # The node heartbeats the lease to the scheduler (release_to) this often while the invoke
    # runs; a request workflow always sets both (the node refuses an invoke without them). The
    # party that uses the memory vouches for it, so a holder whose own worker is away (killed,
    # restarting) does not lose a lease its invoke is still using.
    heartbeat_s: float = 0.0
    # RequestInput.stream: the answer is pushed there as it is generated.
    stream: StreamTarget | None = None
    # The lease is a slot the node was lent (warm-path delegation): the node reports the request
    # in its next sync and keeps the slot, instead of releasing a lease (release_to heartbeats only).
    delegated: bool = False


@dataclass(frozen=True)
class SlotClaim:
    """A request workflow running on a node's worker asks that node for one of its delegated
    slots (a local activity: no round trip). Answered with the request's lease, or None: no free
    slot here, and the request is admitted by the scheduler as always."""

    pool: str
    request_id: str
    workflow_id: str
    capability: str
    tenant: str
    priority: str | None = None
    end_user: str = ""


@dataclass(frozen=True)
class DelegationSync:
    """A node's `delegation_sync` update to its pool's scheduler (policy.SlotSync)."""

    sync: SlotSync


@dataclass(frozen=True)
class DelegationReply:
    reply: SlotReply


@dataclass(frozen=True)
class GangJobInput:
    """One node's part of a multi-GPU batch job (a gang lease): its cards, its rank among the
    nodes, the job's input."""

    lease_id: str
    request_id: str
    deployment: Deployment
    accelerators: list[str]
    payload: dict[str, Any]
    rank: int = 0
    world_size: int = 1
    # This rank's checkpoint when the job resumes (set by the request workflow, never by a client).
    resume_from: str = ""
    # This node heartbeats the gang's lease to the scheduler (`release_to`) this often while its
    # part runs, as an invoke's node does: whoever uses the memory vouches for it (both set by
    # the request workflow; the node refuses a part without them).
    release_to: str = ""
    heartbeat_s: float = 0.0


@dataclass(frozen=True)
class InvokeResult:
    output: dict[str, Any]
    invoke_s: float
    released: bool = False
    # The task queue of a node worker that also runs request workflows: later requests for the
    # same capability may start there, so their invoke is dispatched eagerly (no task queue hop).
    route: str = ""


@dataclass(frozen=True)
class CollectInvokeInput:
    """Ask the node for the outcome of the invoke it ran under `lease_id`, whose completion the
    request workflow never heard (lost in flight while Temporal was away)."""

    lease_id: str
    request_id: str


# The type of `collect_invoke`'s error when the node has no record of the invoke (not a failure
# class: the request decides what it means, a task lost in flight or a node restarted).
NO_INVOKE_RECORD = "NO_INVOKE_RECORD"


@dataclass(frozen=True)
class CheckpointInput:
    """Save the progress of the invoke running under `lease_id` before it is preempted."""

    key: str
    lease_id: str
    request_id: str
    preemption: int  # how many times this request was preempted before: one checkpoint each


@dataclass(frozen=True)
class GangCheckpointInput:
    """Save the progress of one node's part (`rank`) of the gang job running under `lease_id`
    before it is preempted."""

    lease_id: str
    request_id: str
    rank: int
    preemption: int


RESUME_KEY = "modelforge_resume_from"
"""The checkpoint a resumed run starts from, as the node hands it to a runtime in the invoke's
payload. The request workflow sets InvokeInput.resume_from (older workflow code put this key in the
payload: the node still takes it there, confined to this request's own checkpoints)."""

PROFILE_OPERATION = "profile"
"""RequestInput.operation / InvokeInput.operation asking the node to measure the envelope."""
OPERATIONS = ("", PROFILE_OPERATION)

RESERVED_INPUT_PREFIX = "modelforge_"
"""Input keys that belong to the node and the scheduler, never to a client."""


def client_input_problem(input: object) -> str | None:
    """Why a client's request input is refused (REQUEST_INVALID), or None. Every top-level key
    starting with `modelforge_` is reserved for the node and the scheduler: a client can neither
    choose a node operation (profiling) nor a checkpoint to resume from. The client, the CLI, the
    gateway and the request workflow call this on `RequestInput.input`; the node refuses such keys
    again (defence in depth)."""
    if not isinstance(input, dict):
        return "input must be a JSON object"
    reserved = sorted(str(key) for key in input if not isinstance(key, str) or key.startswith(RESERVED_INPUT_PREFIX))
    if reserved:
        shown = ", ".join(repr(key[:60]) for key in reserved[:5])
        return f"input keys starting with {RESERVED_INPUT_PREFIX!r} are reserved for ModelForge: {shown}"
    return None


@dataclass(frozen=True)
class RuntimeOpResult:
    """A sleep, wake, checkpoint or unload as the node measured it."""

    key: str
    operation: str
    seconds: float
    bytes_after: int = 0  # what the model holds after it (sleep, wake)
    location: str = ""  # checkpoint


@dataclass(frozen=True)
class ReclaimInput:
    key: str
    accelerator_id: str
    timeout_s: float = 30.0


@dataclass(frozen=True)
class ReclaimResult:
    reclaimed: bool
    message: str = ""


def device_index(accelerator_id: str) -> int:
    """Accelerator ids are `<node>/<device index>`, and `<node>/cpu` for a declared host CPU (-1)."""
    tail = accelerator_id.rsplit("/", 1)[-1]
    if tail == "cpu":
        return -1
    return int(tail) if tail.isdigit() else 0


@dataclass(frozen=True)
class SnapshotBatch:
    """What `modelforge status` shows per accelerator, at one moment, for the capacity history."""

    pool: str
    at: float
    accelerators: list[AcceleratorStatus] = field(default_factory=list)


@dataclass(frozen=True)
class UsageQuery:
    pool: str
    half_life_s: float
    as_of: float
