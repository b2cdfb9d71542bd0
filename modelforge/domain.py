"""Catalog and request types shared by the policy, the workflows and the client.

Plain dataclasses of JSON-friendly fields: they cross Temporal's data converter unchanged and
the policy can import them without importing anything impure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property

GiB = 1024**3
# How long a request waits for a lease when it names no lease timeout: one default for the
# policy (PolicyConfig.default_lease_timeout_s) and the request workflow's own promise.
DEFAULT_LEASE_TIMEOUT_S = 300.0


class Priority(StrEnum):
    """The five built-in classes, highest first: the built-in class model of a catalog that configures no
    queues (`DEFAULT_QUEUES`). A catalog's `[[queues]]` replace them."""

    PRODUCTION = "production"
    INTERACTIVE = "interactive"
    BACKGROUND = "background"
    BENCHMARK = "benchmark"
    MAINTENANCE = "maintenance"

    @property
    def rank(self) -> int:
        """0 is the highest class."""
        return _PRIORITY_ORDER.index(self)


_PRIORITY_ORDER: list[Priority] = [
    Priority.PRODUCTION,
    Priority.INTERACTIVE,
    Priority.BACKGROUND,
    Priority.BENCHMARK,
    Priority.MAINTENANCE,
]


class Residency(StrEnum):
    ALWAYS_WARM = "always_warm"
    KEEP_WARM = "keep_warm"
    LOAD_ON_DEMAND = "load_on_demand"
    NONE = "none"
    # Accepted spellings reserved for later; rejected with a clear reason (RESIDENCY_CONFLICT) today.
    EXCLUSIVE = "exclusive"
    LAB_ONLY = "lab_only"


RESERVED_RESIDENCIES = (Residency.EXCLUSIVE, Residency.LAB_ONLY)

DEFAULT_QUEUE = "default"


@dataclass(frozen=True)
class PriorityLevel:
    """One level of a queue. `priority` orders levels across all queues (higher first) and is the
    `priority` factor of the fair-share formula (policy/_order.py); `preempts` names the levels whose
    preemptible work this level may stop (same queue by name, another as `queue.level`), each of
    strictly lower priority; `production` marks the level production admission rules apply to
    (eligible accelerators, measured envelopes)."""

    name: str
    priority: int
    preempts: list[str] = field(default_factory=list)
    production: bool = False
    # What a request of this level that cannot meet its deadline gets: refused with
    # DEADLINE_CANNOT_BE_MET as soon as that is known (False, the default), or run late (True:
    # its deadline is not an admission limit; the queue's order and lease timeout still hold).
    run_late: bool = False
    # Seconds a waiting request of this level may be overtaken by work ordered after it (its own
    # level's later work and every lower level's) while capacity for it exists; past that it
    # reserves a card (policy/_placement.py, `_reserve_starved`). None: no bound (the default).
    starvation_bound_s: float | None = None


@dataclass(frozen=True)
class Queue:
    """A named queue: its levels, highest first, and its fair-share weight."""

    name: str
    levels: list[PriorityLevel]
    weight: float = 1.0


@dataclass(frozen=True)
class PriorityClass:
    """A queue's level as requests name it: `level` in the default queue, `queue.level` in any
    other. Built from the catalog's queues; what the policy orders and preempts by."""

    id: str
    queue: str
    level: str
    priority: int
    queue_weight: float
    preempts: tuple[str, ...]
    production: bool
    run_late: bool = False
    starvation_bound_s: float | None = None

    @property
    def rank(self) -> int:
        """Sort key: lower sorts first (the highest priority)."""
        return -self.priority


def class_id(queue: str, level: str) -> str:
    return level if queue == DEFAULT_QUEUE else f"{queue}.{level}"


def level_ref(queue: str, ref: str) -> str:
    """A `preempts` entry as a class id: `level` within `queue`, or `other_queue.level`."""
    other, dot, level = ref.partition(".")
    return class_id(other, level) if dot else class_id(queue, ref)


def queue_of(class_id_: str) -> str:
    queue, dot, _ = class_id_.partition(".")
    return queue if dot else DEFAULT_QUEUE


def queue_entity(queue: str, tenant: str) -> str:
    """Whom usage is counted against: the tenant within a queue. In the default queue that is
    the tenant's name alone (the built-in classes' model, and what older ledgers and histories hold);
    elsewhere `queue/tenant` (queue names cannot contain `/` or `.`)."""
    return tenant if queue == DEFAULT_QUEUE else f"{queue}/{tenant}"


def fair_share_entity(class_id_: str, tenant: str) -> str:
    return queue_entity(queue_of(class_id_), tenant)


_BUILT_IN_PRIORITIES = {
    Priority.PRODUCTION: 50,
    Priority.INTERACTIVE: 40,
    Priority.BACKGROUND: 30,
    Priority.BENCHMARK: 20,
    Priority.MAINTENANCE: 10,
}

# The built-in classes: five, each preempting the preemptible work of every class below it.
DEFAULT_QUEUES: list[Queue] = [
    Queue(
        name=DEFAULT_QUEUE,
        weight=1.0,
        levels=[
            PriorityLevel(
                name=priority.value,
                priority=_BUILT_IN_PRIORITIES[priority],
                preempts=[lower.value for lower in list(Priority)[position + 1 :]],
                production=priority == Priority.PRODUCTION,
            )
            for position, priority in enumerate(Priority)
        ],
    )
]


def build_classes(queues: list[Queue]) -> dict[str, PriorityClass]:
    """Class id -> class, highest priority first (then queue order, then level order)."""
    classes: list[PriorityClass] = []
    for queue in queues:
        for level in queue.levels:
            preempts = tuple(level_ref(queue.name, ref) for ref in level.preempts)
            classes.append(
                PriorityClass(
                    id=class_id(queue.name, level.name),
                    queue=queue.name,
                    level=level.name,
                    priority=level.priority,
                    queue_weight=queue.weight,
                    preempts=preempts,
                    production=level.production,
                    run_late=level.run_late,
                    starvation_bound_s=level.starvation_bound_s,
                )
            )
    ordered = sorted(enumerate(classes), key=lambda item: (-item[1].priority, item[0]))
    return {klass.id: klass for _, klass in ordered}


@dataclass(frozen=True)
class Accelerator:
    id: str
    node: str
    total_bytes: int
    production_eligible: bool = False
    kind: str = "gpu"
    model: str = ""
    uuid: str = ""
    pool: str = "default"
    nvlink_group: str = ""
    rack: str = ""
    network_bandwidth_gbps: float = 0.0
    reserve_bytes: int = GiB
    # True when the device is the simulated backend: shown wherever a user sees the device.
    simulated: bool = False


@dataclass(frozen=True)
class Deployment:
    capability: str
    envelope_bytes: int
    residency: Residency = Residency.KEEP_WARM
    ttl_s: float = 300.0
    concurrency: int = 1
    queue_limit: int = 16
    load_s: float = 0.0
    unload_s: float = 0.0
    # Bytes the model holds while idle; a lease adds envelope_bytes - idle_bytes on top.
    idle_bytes: int | None = None
    # Set when its runtime can sleep (vLLM's sleep mode): the bytes it keeps asleep. Making room
    # then puts it to sleep rather than unloading it when that frees enough and costs less
    # (sleep_s + wake_s against unload_s + load_s).
    sleep_bytes: int | None = None
    sleep_s: float = 0.0
    wake_s: float = 0.0
    gpu_count: int = 1
    nvlink_required: bool = False
    # Gang topology: cards per node (0: any split), no two cards on one "node" or in one "rack",
    # rack affinity ("preferred", "required", "none") and the nodes' network bandwidth floor.
    gpu_per_node: int = 0
    node_count: int = 0  # with gpu_per_node: the gang is node_count x gpu_per_node cards
    # Cards smaller than this (total memory) are never used, whatever is free on them.
    gpu_memory_min: int = 0
    anti_affinity: str = ""
    rack_affinity: str = "preferred"
    min_network_bandwidth_gbps: float = 0.0
    preemptible: bool = False
    production_eligible: bool = True
    # Accelerator ids this deployment may be placed on; empty means any in the pool.
    accelerators: list[str] = field(default_factory=list)
    # Accelerator models the envelope was measured on. Production work lands only on these.
    measured_on: list[str] = field(default_factory=list)
    runtime: str = "simulated"
    artifact: str = ""
    artifact_sha256: str = ""
    runtime_config: dict[str, str] = field(default_factory=dict)
    name: str = ""
    # subprocess_http: the model server's argument list (never a shell string).
    command: list[str] = field(default_factory=list)
    openai_models: list[str] = field(default_factory=list)
    # subprocess_http: environment variable -> the name of a node secret (never its value), read
    # on the node from MODELFORGE_SECRET_<NAME> or $MODELFORGE_SECRETS_DIR/<name> at its start.
    env_from_secrets: dict[str, str] = field(default_factory=dict)
    # The model's context window in tokens (0: not said): the gateway shows it to clients (Ollama's
    # /api/show and /api/ps) and refuses a num_ctx past it.
    context_length: int = 0
    # What the model can do beyond text or vectors, as Ollama names it ("tools", "vision",
    # "thinking", "insert"): shown by /api/show, so applications offer those features.
    features: list[str] = field(default_factory=list)

    # Read on every placement of every pass: worked out once per deployment (frozen, so they
    # cannot go stale; `dataclasses.replace` makes a new one; not fields, so never serialised).
    @cached_property
    def deployment_id(self) -> str:
        return self.name or self.capability

    @cached_property
    def resident_bytes(self) -> int:
        return self.idle_bytes if self.idle_bytes is not None else self.envelope_bytes

    @cached_property
    def lease_extra_bytes(self) -> int:
        """Bytes a lease adds on top of residency (envelope peak minus idle)."""
        return max(0, self.envelope_bytes - self.resident_bytes)

    @property
    def load_timeout_s(self) -> float:
        """How long one attempt at its load may take (its residency's load activity)."""
        return max(60.0, self.load_s * 10)

    @property
    def wake_timeout_s(self) -> float:
        """How long one attempt at waking it may take (its residency's wake activity)."""
        return max(60.0, self.wake_s * 10)

    @property
    def load_report_limit_s(self) -> float:
        """How long after its load (or an adopted residency's wake) was asked its residency has
        reported, at the latest, while its workflows run: two attempts at the load or wake and
        two at the health check (60 s each), with room to spare. Past it, the scheduler asks
        the residency whether it is still there, and fails the load if it is gone (ended without
        a word: terminated by hand, or adopted while it was closing)."""
        return 2 * max(self.load_timeout_s, self.wake_timeout_s) + 180.0


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0
    # Class ids (`interactive`, or `merge.normal` with configured queues).
    default_priority: str = Priority.INTERACTIVE.value
    # The highest class this identity may ask for (ExampleRAG's shadow jobs are
    # stamped background from their scoped identity): compared by priority across queues.
    max_priority: str = Priority.INTERACTIVE.value
    # The queues this tenant may submit to; empty: any.
    queues: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Catalog:
    accelerators: list[Accelerator] = field(default_factory=list)
    deployments: list[Deployment] = field(default_factory=list)
    tenants: list[Tenant] = field(default_factory=list)
    # Configured queues ([[queues]]); empty: the five built-in classes (`DEFAULT_QUEUES`).
    queues: list[Queue] = field(default_factory=list)

    # Lookups are by index: the scheduler asks them per queued request, on catalogs of thousands
    # of accelerators. A catalog is immutable by contract (frozen; its lists are never mutated
    # after construction), so the indexes are built once, on first use, and never go stale.
    @cached_property
    def _deployments_by_capability(self) -> dict[str, Deployment]:
        index: dict[str, Deployment] = {}
        for deployment in self.deployments:
            index.setdefault(deployment.capability, deployment)
        return index

    @cached_property
    def _deployments_by_id(self) -> dict[str, Deployment]:
        index: dict[str, Deployment] = {}
        for deployment in self.deployments:
            index.setdefault(deployment.deployment_id, deployment)
        return index

    @cached_property
    def _accelerators_by_id(self) -> dict[str, Accelerator]:
        index: dict[str, Accelerator] = {}
        for accelerator in self.accelerators:
            index.setdefault(accelerator.id, accelerator)
        return index

    @cached_property
    def _tenants_by_name(self) -> dict[str, Tenant]:
        index: dict[str, Tenant] = {}
        for tenant in self.tenants:
            index.setdefault(tenant.name, tenant)
        return index

    @cached_property
    def classes(self) -> dict[str, PriorityClass]:
        """Every priority class of this catalog's queues, highest first."""
        return build_classes(self.queues or DEFAULT_QUEUES)

    def priority_class(self, class_id_: str) -> PriorityClass | None:
        return self.classes.get(class_id_)

    def deployment_for(self, capability: str) -> Deployment | None:
        return self._deployments_by_capability.get(capability)

    def deployment(self, deployment_id: str) -> Deployment | None:
        return self._deployments_by_id.get(deployment_id)

    def accelerator(self, accelerator_id: str) -> Accelerator | None:
        return self._accelerators_by_id.get(accelerator_id)

    def tenant(self, name: str) -> Tenant | None:
        return self._tenants_by_name.get(name)

    def nodes(self) -> list[str]:
        return sorted({accelerator.node for accelerator in self.accelerators})


@dataclass(frozen=True)
class ProcessUsage:
    pid: int
    used_bytes: int
    name: str = ""
    # True for processes ModelForge started; everything else is external and never controlled.
    managed: bool = False


@dataclass(frozen=True)
class Observation:
    """One NVML sample of one accelerator."""

    accelerator: str
    total_bytes: int
    used_bytes: int
    processes: list[ProcessUsage] = field(default_factory=list)
    # Resident keys (deployment@accelerator) the node's runtimes hold right now.
    loaded: list[str] = field(default_factory=list)
    healthy: bool = True
    health_reason: str = ""
    utilization_pct: float = 0.0
    temperature_c: float = 0.0
    # What the node advertises about the accelerator: `nvlink_group_id` (from NVML's topology),
    # `rack_id` and `network_bandwidth_gbps` (from the node's configuration).
    labels: dict[str, str] = field(default_factory=dict)
    observed_at: float = 0.0  # the node's clock, for display
    received_at: float = 0.0  # workflow time when the sample reached the scheduler: freshness
    simulated: bool = False

    # Cached: an observation is immutable, and the scheduler reads these on every decision pass.
    @cached_property
    def managed_bytes(self) -> int:
        return sum(p.used_bytes for p in self.processes if p.managed)

    @cached_property
    def external_bytes(self) -> int:
        """NVML used minus what ModelForge's own processes hold; never negative."""
        return max(0, self.used_bytes - self.managed_bytes)


def resident_key(deployment_id: str, accelerator_id: str) -> str:
    return f"{deployment_id}@{accelerator_id}"
