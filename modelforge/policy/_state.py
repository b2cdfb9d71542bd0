"""The scheduler's state: what the pool scheduler workflow carries across continue-as-new and
what the simulator replays. Plain dataclasses, JSON-friendly, iterated in insertion order."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from enum import StrEnum

from modelforge.domain import DEFAULT_LEASE_TIMEOUT_S, Catalog, Deployment, Observation, Residency


@dataclass(frozen=True)
class PolicyConfig:
    # Observations older than this make an accelerator SCHEDULER_STATE_STALE.
    freshness_s: float = 30.0
    # The dynamic reserve is the spread of external usage over this window times the factor.
    volatility_window_s: float = 3600.0
    volatility_factor: float = 1.0
    # GPU_PRESSURE hysteresis on schedulable / total.
    pressure_enter_fraction: float = 0.05
    pressure_exit_fraction: float = 0.10
    pressure_hold_s: float = 60.0
    unhealthy_after_failures: int = 3
    # A capability whose last this-many requests or loads failed shows as degraded in `status`.
    degraded_after_failures: int = 3
    healthy_after_successes: int = 3
    default_lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S
    # A lease whose holder has not heart-beaten for this long is reclaimed.
    stale_lease_s: float = 60.0
    # A lease whose holder has never been heard from since the grant (no heartbeat, no
    # confirmation) is reclaimed only after this long: a holder whose worker was down when the
    # grant went out (a killed worker, a Temporal restart) cannot have heard of it yet, and
    # silence then proves nothing. None: the same as stale_lease_s (the scheduler workflow sets
    # 5 x stale_lease_s in its place; the simulator's holders hear of their grants at once).
    unheard_lease_s: float | None = None
    # Preemption of strictly lower, preemptible work: never before it ran this long, and its
    # holder gets this long to checkpoint and release.
    preempt_min_runtime_s: float = 30.0
    preempt_grace_s: float = 30.0
    # A node whose telemetry has been silent this long (its accelerators long stale) loses its
    # leases: they are preempted, so their holders stop and requeue, and the node's residents are
    # reconciled against NVML when it samples again.
    node_silent_s: float = 120.0
    # A waiting gang reserves the accelerators where it starts soonest; later work backfills them
    # only if it ends in time (off: nothing is reserved, each freed card may go to later work and
    # the gang waits until room happens to appear, so a stream of small jobs can starve it).
    gang_reservations: bool = True
    fair_share_half_life_s: float = 3600.0
    # Deadline-aware admission: a request's service time is estimated (`service_estimate`: this
    # percentile of its deployment's measured lease times, a batch job's max_duration) and its
    # deadline checks count it on top of any load; work that cannot meet its deadline is refused
    # as soon as that is known.
    service_percentile: float = 0.95


class ResidentPhase(StrEnum):
    LOADING = "loading"
    READY = "ready"
    UNLOADING = "unloading"
    # Unloaded, but NVML never showed the bytes back: they stay counted (GPU_MEMORY_NOT_RECLAIMED).
    UNRECLAIMED = "unreclaimed"
    # Sleep (vLLM's sleep mode and the like): most of the memory given back, the process kept, so
    # a wake costs far less than a load. Its full bytes stay counted until the node says it slept.
    SLEEPING = "sleeping"
    ASLEEP = "asleep"
    WAKING = "waking"


# Every field set on any resident, its construction included, draws the next number here and
# leaves it in `RESIDENT_WRITES[0]`: the residents' groupings a pass starts from (`_standing`)
# are checked field by field only when it moved since they were last found current, not each
# time they are asked (twice a step, by the observations and by the pass, over the thousands
# of residents of a busy cluster). `next` on a count is atomic and each number is drawn once,
# so the value a grouping saw is still there only if no resident was written since, whichever
# thread ran a workflow's task.
_RESIDENT_WRITE_NUMBERS = itertools.count(1)
RESIDENT_WRITES = [0]


@dataclass
class ResidentState:
    key: str
    deployment: str
    capability: str
    accelerator: str
    node: str
    bytes: int
    phase: ResidentPhase
    residency: Residency
    ttl_s: float
    workflow_id: str
    active_leases: int = 0
    last_used: float = 0.0
    loaded_at: float | None = None
    requested_at: float = 0.0
    # The class of the last lease granted on it: a model that last served production is evicted
    # only to make room for production.
    last_priority: str | None = None
    # While asleep: the bytes it held awake, which a wake takes back.
    awake_bytes: int | None = None
    # Which life of `key` this is (PoolState.incarnations at its load): a resident lost and
    # loaded again under the same key is another incarnation, and the leases of the lost one
    # never count on it (`holder_of`). 0: a resident of a state from before incarnations.
    incarnation: int = 0

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        RESIDENT_WRITES[0] = next(_RESIDENT_WRITE_NUMBERS)

    @property
    def idle_expires_at(self) -> float:
        """When its keep-warm TTL runs out if nothing uses it again: the one definition, used by
        the TTL timer (`keep_warm_check`) and every view of it (`pool_status`, `ps`, Ollama's
        `/api/ps`, through `ResidentStatus.expires_at`)."""
        return self.last_used + self.ttl_s


@dataclass(frozen=True)
class Lease:
    lease_id: str
    request_id: str
    workflow_id: str
    capability: str
    deployment: str
    accelerator: str
    node: str
    resident_key: str
    # Bytes this lease adds on top of residency (envelope peak minus idle).
    bytes: int
    granted_at: float
    priority: str  # the class id (`production`, `merge.critical`)
    tenant: str
    # How often the holder must say it is alive; silence for stale_lease_s loses the lease.
    heartbeat_s: float = 0.0
    # A multi-GPU gang lease: the other accelerators it holds `bytes` on, besides `accelerator`,
    # and the node of each of `accelerators` (what the request workflow runs the job on).
    gang: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    # When the holder's max_duration ends its work at the latest (None: unknown): what a waiting
    # gang's reservation counts on, and what backfill is measured against.
    ends_by: float | None = None
    # The incarnation of `resident_key` it was granted (or lent) on: a lease belongs to that one
    # life of the resident; ending it touches no later resident under the same key.
    incarnation: int = 0
    # Who the application says asked, within the tenant ("" none): on the lease's events.
    end_user: str = ""

    @property
    def accelerators(self) -> list[str]:
        return [self.accelerator, *self.gang] if self.gang else [self.accelerator]


def holder_of(state: PoolState, lease: Lease) -> ResidentState | None:
    """The resident `lease` holds a slot of: the one under its key, if it is still the
    incarnation the lease was granted on. None for a gang's lease (no resident), and for a lease
    that outlived its resident (lost, unloaded, loaded again): its end must not change the
    counts of whatever holds the key now. The one home of "which resident does a lease count
    on", for every transition that changes a count and every reading of one."""
    resident = state.residents.get(lease.resident_key) if lease.resident_key else None
    if resident is None or resident.incarnation != lease.incarnation:
        return None
    return resident


@dataclass
class QueuedRequest:
    request_id: str
    workflow_id: str
    capability: str
    priority: str  # the class id (`production`, `merge.critical`)
    tenant: str
    submitted_at: float
    lease_timeout_at: float
    deadline_at: float | None = None
    # The resident this request waits on while it loads; empty while unplaced.
    assigned_to: str = ""
    preempted: bool = False
    # Why it is still waiting, for `status` and for the failure message when it times out, and
    # what that line says typed (`WaitReason` values, in its order; verdicts read these).
    waiting_reason: str = ""
    waiting_codes: list[str] = field(default_factory=list)
    # The longest its lease will be held (the request's max_duration); None: unknown.
    max_duration_s: float | None = None
    # The first ETA a verdict gave it once it waited (policy/_verdicts.py `stamp_predictions`)
    # and that verdict's reason: its grant says how far off it was (the ETA-error figures).
    eta_at: float | None = None
    eta_reason: str = ""
    # Who the application says asked, within the tenant ("" none): on its lease's events.
    end_user: str = ""
    # The input's size as JSON, when the client measured it (None: not known).
    input_bytes: int | None = None

    @property
    def expires_at(self) -> float:
        """When it stops waiting, whatever happens: its lease timeout, or its deadline if that
        comes first. The one definition of a queued request's expiry."""
        return self.lease_timeout_at if self.deadline_at is None else min(self.lease_timeout_at, self.deadline_at)


HOLDER_PREFIX = "delegation:"


def holder_id(node: str) -> str:
    """The holder of a node's free slots (a slot in use names its request's workflow)."""
    return f"{HOLDER_PREFIX}{node}"


def is_delegation_holder(workflow_id: str) -> bool:
    return workflow_id.startswith(HOLDER_PREFIX)


def serves_nobody(state: PoolState, lease: Lease) -> bool:
    """A slot lent to a node that is free by its node's last sync (held by `delegation:<node>`,
    not by a request's workflow): it keeps its resident's count (so nothing is evicted or lent
    twice under the node's feet) but is no active lease: `status`, `ps` and an unload do not
    count it (an unload takes it back, `control_residents`)."""
    return lease.lease_id in state.slots and is_delegation_holder(lease.workflow_id)


def free_lent_slots_on(state: PoolState, resident: ResidentState) -> int:
    """How many of `resident`'s active leases are slots lent to its node that serve nobody."""
    return sum(
        1
        for lease_id in state.slots
        if (lease := state.leases.get(lease_id)) is not None
        and serves_nobody(state, lease)
        and holder_of(state, lease) is resident
    )


@dataclass
class DelegatedSlot:
    """A lease lent to a node for its warm requests (policy/_delegation.py): which node, which
    life of its worker, and whether it still takes new requests (closed: the node gives it back
    once free)."""

    node: str
    boot: str
    open: bool = True
    closed_reason: str = ""
    # The longest its node said it may wait before its next sync (SlotSync.within_s; 0: a node
    # of a release that does not say): how long a vouch counts when routing to it.
    within_s: float = 0.0


@dataclass
class AcceleratorRuntime:
    observation: Observation | None = None
    # [received_at, external_bytes] pairs inside the volatility window.
    external_history: list[list[float]] = field(default_factory=list)
    healthy: bool = True
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    pressure: bool = False
    pressure_clear_since: float | None = None


@dataclass
class TenantUsage:
    gpu_seconds: float = 0.0
    updated_at: float = 0.0


@dataclass
class CapabilityHealth:
    """Consecutive failed outcomes of a capability's requests and loads, reset by a success."""

    consecutive_failures: int = 0
    last_failure: str = ""
    last_message: str = ""
    last_failure_at: float = 0.0


@dataclass
class MeasuredTimes:
    """The latest measured seconds of a deployment's operations in this pool, from request to
    done (a load's includes its health check: the time until the model serves). None: not seen
    yet, and the catalog's figure stands in."""

    load_s: float | None = None
    unload_s: float | None = None
    sleep_s: float | None = None
    wake_s: float | None = None
    # The latest SERVICE_SAMPLES lease times (grant to a successful release; a delegated run's
    # invoke), oldest first: what a request's service time is estimated from.
    service_s: list[float] = field(default_factory=list)


# How many recent lease times per deployment the service estimate is taken over.
SERVICE_SAMPLES = 64
# Where a deployment's samples in order and its `service_figures` are kept beside its samples
# (never serialized).
_SORTED = "_policy_service_sorted"
_FIGURES = "_policy_service_figures"


def note_service(state: PoolState, deployment_id: str, seconds: float) -> None:
    """A lease of `deployment_id` held `seconds` to a successful end: one more sample of its
    service time (the scheduler's release and a node's delegated runs call it)."""
    times = state.measured.setdefault(deployment_id, MeasuredTimes())
    samples = times.service_s
    samples.append(max(0.0, float(seconds)))
    if len(samples) > SERVICE_SAMPLES:
        del samples[: len(samples) - SERVICE_SAMPLES]
    times.__dict__.pop(_SORTED, None)
    times.__dict__.pop(_FIGURES, None)


def service_figures(state: PoolState, deployment_id: str) -> tuple[float, float]:
    """(mean, the configured high percentile) of a deployment's measured service times; (0, 0)
    while none was measured (nothing is counted then, as before service was measured)."""
    ordered = sorted_service_samples(state, deployment_id)
    if not ordered:
        return 0.0, 0.0
    percentile = state.config.service_percentile
    measured = state.measured[deployment_id]
    kept: tuple[float, tuple[float, float]] | None = measured.__dict__.get(_FIGURES)
    if kept is not None and kept[0] == percentile:
        return kept[1]
    rank = max(0, min(len(ordered) - 1, math.ceil(percentile * len(ordered)) - 1))
    figures = (sum(ordered) / len(ordered), ordered[rank])
    measured.__dict__[_FIGURES] = (percentile, figures)
    return figures


def sorted_service_samples(state: PoolState, deployment_id: str) -> list[float]:
    """A deployment's measured service times in order (read only: kept with the samples until
    the next one, `note_service`, checked against the list they came from should it be
    replaced; the figures of `service_figures` are kept and dropped with them)."""
    measured = state.measured.get(deployment_id)
    samples = measured.service_s if measured is not None else None
    if not samples:
        return []
    assert measured is not None
    kept: tuple[list[float], int, list[float]] | None = measured.__dict__.get(_SORTED)
    if kept is not None and kept[0] is samples and kept[1] == len(samples):
        return kept[2]
    ordered = sorted(samples)
    measured.__dict__[_SORTED] = (samples, len(samples), ordered)
    measured.__dict__.pop(_FIGURES, None)
    return ordered


def operation_seconds(state: PoolState, deployment: Deployment, operation: str) -> float:
    """How long `operation` (load, unload, sleep, wake) of `deployment` takes: measured here if
    it has been, else as the catalog says. What making room weighs."""
    name = _OPERATION_FIELD[operation]  # called on every placement: no name built per call
    measured = state.measured.get(deployment.deployment_id)
    seconds = getattr(measured, name) if measured is not None else None
    return float(getattr(deployment, name)) if seconds is None else float(seconds)


_OPERATION_FIELD = {operation: f"{operation}_s" for operation in ("load", "unload", "sleep", "wake")}


def measured(state: PoolState, deployment_id: str, operation: str, seconds: float) -> None:
    times = state.measured.setdefault(deployment_id, MeasuredTimes())
    setattr(times, f"{operation}_s", max(0.0, seconds))


@dataclass
class PoolState:
    pool: str
    catalog: Catalog = field(default_factory=Catalog)
    config: PolicyConfig = field(default_factory=PolicyConfig)
    accelerators: dict[str, AcceleratorRuntime] = field(default_factory=dict)
    residents: dict[str, ResidentState] = field(default_factory=dict)
    leases: dict[str, Lease] = field(default_factory=dict)
    # lease id -> when its holder last showed it is alive (granted, or a heartbeat since).
    lease_seen: dict[str, float] = field(default_factory=dict)
    # Leases whose holder has been heard from since the grant (a heartbeat or a confirmation):
    # only those are reclaimed after stale_lease_s of silence; the others after unheard_lease_s.
    lease_heard: dict[str, bool] = field(default_factory=dict)
    capability_health: dict[str, CapabilityHealth] = field(default_factory=dict)
    # always_warm deployment -> [consecutive failed loads, earliest next attempt]: a model that
    # keeps failing to load is retried with backoff, never in a tight loop.
    warm_backoff: dict[str, list[float]] = field(default_factory=dict)
    # lease id -> why it is being preempted; its bytes are already promised to whoever asked.
    preempting: dict[str, str] = field(default_factory=dict)
    # When stale leases were last looked for: a long gap means the scheduler itself was away.
    stale_checked_at: float = 0.0
    # With lease fencing: when the next lease was due to go stale at the last look (the
    # scheduler's timer wakes it then). A look much later than that means it was away.
    stale_due_at: float | None = None
    queue: list[QueuedRequest] = field(default_factory=list)
    usage: dict[str, TenantUsage] = field(default_factory=dict)
    lease_counter: int = 0
    load_counter: int = 0
    # Residents loaded so far: each load is the next incarnation (ResidentState.incarnation).
    incarnations: int = 0
    # Production deployments under a raised CAPABILITY_CAPACITY alert, in the order raised.
    capacity_short: list[str] = field(default_factory=list)
    # deployment id -> its operations' latest measured seconds (cost-aware making room).
    measured: dict[str, MeasuredTimes] = field(default_factory=dict)
    # Residents an operator asked to unload with drain (key -> when): they take no new lease and
    # are unloaded when their last lease ends (policy/_control.py).
    draining: dict[str, float] = field(default_factory=dict)
    # Slots lent to nodes (warm-path delegation), by lease id; each is also in `leases`.
    slots: dict[str, DelegatedSlot] = field(default_factory=dict)
    # Bumped at each catalog load: a node whose view of tenants and classes is older gets it again.
    view_epoch: int = 0

    def pool_accelerators(self) -> list[str]:
        return [a.id for a in self.catalog.accelerators if a.pool == self.pool]
