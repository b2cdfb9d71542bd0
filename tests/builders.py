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
    apply_decisions,
    apply_observations,
    decide,
    enqueue,
    resident_ready,
    validate_request,
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


def pool_with_running_job(job_max_duration_s: float | None) -> PoolState:
    """One node, two 24 GiB cards (1 GiB reserve each: 23 usable). A 12 GiB batch job runs on
    n/0 since NOW, ending by NOW + 100 when it has a max_duration. A 2 x 16 GiB gang then waits:
    n/0 has 11 GiB free (< 16) until the job ends; n/1 has 23. Later work is kept to n/1."""
    s = state(
        [gpu("n/0"), gpu("n/1")],
        [
            deployment("job@1", gib=12, residency=Residency.NONE, accelerators=["n/0"]),
            deployment("gang@1", gib=16, residency=Residency.NONE, idle_bytes=0, gpu_count=2),
            deployment("small@1", gib=10, residency=Residency.NONE, idle_bytes=0, concurrency=4, accelerators=["n/1"]),
            deployment("tiny@1", gib=6, residency=Residency.NONE, idle_bytes=0, accelerators=["n/1"]),
            deployment("warm@1", gib=10, residency=Residency.KEEP_WARM, accelerators=["n/1"]),
        ],
    )
    for card in ("n/0", "n/1"):
        observe(s, card)
    enqueue(s, ask("job", "job@1", max_duration_s=job_max_duration_s), Priority.INTERACTIVE, NOW)
    apply_decisions(s, decide(s, NOW), NOW, {})
    resident_ready(s, "job@1@n/0", 12 * GiB, NOW)
    observe(s, "n/0", managed_gib=12, loaded=["job@1@n/0"])
    apply_decisions(s, decide(s, NOW), NOW, {})
    assert [lease.request_id for lease in s.leases.values()] == ["job"]
    _, priority = validate_request(s, ask("gang", "gang@1"), gangs=True)
    enqueue(s, ask("gang", "gang@1", lease_timeout_s=3600), priority, NOW + 1)
    return s
