"""Catalog and request types shared by the policy, the workflows and the client.

Plain dataclasses of JSON-friendly fields: they cross Temporal's data converter unchanged and
the policy can import them without importing anything impure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property

GiB = 1024**3


class Priority(StrEnum):
    """Seed 000's classes, highest first."""

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
    # Accepted spellings that the seed reserves for later; rejected with a clear reason today.
    EXCLUSIVE = "exclusive"
    LAB_ONLY = "lab_only"


RESERVED_RESIDENCIES = (Residency.EXCLUSIVE, Residency.LAB_ONLY)


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

    @property
    def deployment_id(self) -> str:
        return self.name or self.capability

    @property
    def resident_bytes(self) -> int:
        return self.idle_bytes if self.idle_bytes is not None else self.envelope_bytes

    @property
    def lease_extra_bytes(self) -> int:
        """Bytes a lease adds on top of residency (envelope peak minus idle)."""
        return max(0, self.envelope_bytes - self.resident_bytes)


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0
    default_priority: Priority = Priority.INTERACTIVE
    # The highest class this identity may ask for (seed 000, M6: ExampleRAG shadow jobs are
    # stamped background from their scoped identity).
    max_priority: Priority = Priority.INTERACTIVE


@dataclass(frozen=True)
class Catalog:
    accelerators: list[Accelerator] = field(default_factory=list)
    deployments: list[Deployment] = field(default_factory=list)
    tenants: list[Tenant] = field(default_factory=list)

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
