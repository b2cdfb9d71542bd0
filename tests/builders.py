"""Small builders for policy tests: a pool state in a line or two."""

from __future__ import annotations

from modelforge.domain import (
    Accelerator,
    Catalog,
    Deployment,
    GiB,
    Observation,
    Priority,
    ProcessUsage,
    Residency,
    Tenant,
)
from modelforge.policy import (
    AcceleratorRuntime,
    AdmissionRequest,
    PolicyConfig,
    PoolState,
    ResidentPhase,
    ResidentState,
    apply_observations,
)

NOW = 1_000_000.0


def gpu(
    id: str = "n/0", total: float = 24, production: bool = True, reserve: float = 1, model: str = "M", **kw: object
) -> Accelerator:
    return Accelerator(
        id=id,
        node=id.split("/")[0],
        total_bytes=int(total * GiB),
        production_eligible=production,
        reserve_bytes=int(reserve * GiB),
        model=model,
        **kw,
    )  # type: ignore[arg-type]


def deployment(capability: str = "emb@1", gib: float = 1, **kw: object) -> Deployment:
    kw.setdefault("measured_on", ["M"])
    return Deployment(capability=capability, envelope_bytes=int(gib * GiB), **kw)  # type: ignore[arg-type]


def tenant(name: str = "t", max_priority: Priority = Priority.PRODUCTION, **kw: object) -> Tenant:
    return Tenant(name=name, max_priority=max_priority, **kw)  # type: ignore[arg-type]


def state(
    accelerators: list[Accelerator],
    deployments: list[Deployment],
    tenants: list[Tenant] | None = None,
    config: PolicyConfig | None = None,
) -> PoolState:
    return PoolState(
        pool="default",
        config=config or PolicyConfig(),
        catalog=Catalog(accelerators=accelerators, deployments=deployments, tenants=tenants or [tenant()]),
    )


def observe(
    s: PoolState,
    accelerator: str,
    external_gib: float = 0,
    managed_gib: float = 0,
    at: float = NOW,
    healthy: bool = True,
    loaded: list[str] | None = None,
    labels: dict[str, str] | None = None,
) -> None:
    """One NVML sample. The node holds the resident keys in `loaded` (none by default: a READY
    resident missing from a later sample is reconciled as lost)."""
    acc = s.catalog.accelerator(accelerator)
    assert acc is not None
    processes = []
    if external_gib:
        processes.append(ProcessUsage(pid=1, used_bytes=int(external_gib * GiB), name="ollama"))
    if managed_gib:
        processes.append(ProcessUsage(pid=2, used_bytes=int(managed_gib * GiB), name="mf", managed=True))
    used = sum(p.used_bytes for p in processes)
    apply_observations(
        s,
        [
            Observation(
                accelerator=accelerator,
                total_bytes=acc.total_bytes,
                used_bytes=used,
                processes=processes,
                healthy=healthy,
                loaded=loaded or [],
                labels=labels or {},
                health_reason="" if healthy else "xid 79",
                received_at=at,
                observed_at=at,
            )
        ],
        at,
    )


def resident(
    s: PoolState,
    capability: str,
    accelerator: str,
    gib: float,
    *,
    phase: ResidentPhase = ResidentPhase.READY,
    residency: Residency = Residency.KEEP_WARM,
    leases: int = 0,
    last_used: float = NOW,
) -> ResidentState:
    key = f"{capability}@{accelerator}"
    r = ResidentState(
        key=key,
        deployment=capability,
        capability=capability,
        accelerator=accelerator,
        node=accelerator.split("/")[0],
        bytes=int(gib * GiB),
        phase=phase,
        residency=residency,
        ttl_s=901,
        workflow_id=f"resident:{capability}:{accelerator}",
        active_leases=leases,
        last_used=last_used,
        loaded_at=NOW - 100,
    )
    s.residents[key] = r
    s.accelerators.setdefault(accelerator, AcceleratorRuntime())
    return r


def ask(
    request_id: str, capability: str = "emb@1", tenant_name: str = "t", priority: Priority | None = None, **kw: object
) -> AdmissionRequest:
    return AdmissionRequest(
        request_id=request_id,
        workflow_id=f"request:{capability}:{request_id}",
        capability=capability,
        tenant=tenant_name,
        priority=priority,
        **kw,
    )  # type: ignore[arg-type]
