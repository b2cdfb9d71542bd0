"""A node worker: one per GPU host. NVML (real or simulated, labelled) and the runtimes."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.worker import Worker, WorkerDeploymentConfig

from activities import AdmissionActivities, NodeActivities
from activities._delegation import NodeSlots, PoolSlots
from activities._invoke_journal import InvokeJournal, fail_left_invokes, invoke_journal_dir
from modelforge.catalog import ExternalSpec, load_catalog_file
from modelforge.domain import Catalog
from modelforge.gpu import (
    ExternalProcess,
    GpuBackend,
    HostMemoryDevice,
    NodeDevices,
    NvmlGpuBackend,
    SimulatedDevice,
    SimulatedGpuBackend,
)
from modelforge.logging import get_logger
from modelforge.messages import TelemetryInput, device_index
from modelforge.retrying import retrying, supervised
from modelforge.runtimes import Runtime, build_runtimes
from modelforge.settings import CONTROL_TASK_QUEUE, DEFAULT_POOL, Settings, node_task_queue
from modelforge.temporal import connect
from modelforge.versioning import worker_deployment
from workers.lifetime import run_workers, until_sigterm
from workflows import CapabilityRequestWorkflow, TelemetryWorkflow
from workflows._common import telemetry_id

log = get_logger("modelforge.worker.node")


def simulated_backend(node: str, catalog: Catalog, external: list[ExternalSpec]) -> SimulatedGpuBackend:
    """Simulated devices for the accelerators the catalog puts on this node."""
    accelerators = [a for a in catalog.accelerators if a.node == node and a.kind == "gpu"]
    devices = [
        SimulatedDevice(device_index(a.id), a.uuid or f"GPU-simulated-{a.id}", f"{a.model} (simulated)", a.total_bytes)
        for a in accelerators
    ]
    ids = {a.id for a in accelerators}
    processes = [
        ExternalProcess(device_index(e.accelerator), 10_000 + n, e.name, e.bytes, e.start_s, e.end_s)
        for n, e in enumerate(external)
        if e.accelerator in ids
    ]
    return SimulatedGpuBackend(devices, processes)


def host_device(node: str, catalog: Catalog | None, cpu_device_bytes: int | None) -> HostMemoryDevice | None:
    """The node's declared CPU device: `--cpu-device-bytes`, else a `kind = "cpu"` accelerator the
    catalog puts on this node. Never implied: without either, no model runs on the CPU here."""
    if cpu_device_bytes:
        return HostMemoryDevice(node, cpu_device_bytes)
    declared = [a for a in (catalog.accelerators if catalog else []) if a.node == node and a.kind == "cpu"]
    return HostMemoryDevice(node, declared[0].total_bytes) if declared else None


def node_runtimes(devices: NodeDevices, home: Path, node: str) -> dict[str, Runtime]:
    """Every runtime a node serves: each of the registry (modelforge.runtimes.RUNTIMES). The
    simulated runtime only beside simulated cards: on a real one it would count bytes no process
    holds. Model servers and jobs an earlier run of this node's worker left behind (it was
    killed) are stopped first: their memory is not anyone's any more."""
    return build_runtimes(devices, home, node)


def build_node_worker(
    client: Client,
    node: str,
    backend: GpuBackend,
    runtimes: dict[str, Runtime],
    artifact_roots: list[Path] | None = None,
    labels: dict[str, str] | None = None,
    checkpoint_root: Path | None = None,
    slots: NodeSlots | PoolSlots | None = None,
    journal: InvokeJournal | None = None,
) -> Worker:
    """`slots`: the node's delegated slots (warm-path delegation); their sync loop is the
    caller's to run (`NodeSlots.run`). None: every request is admitted by the scheduler."""
    activities = node_activities(
        client, node, backend, runtimes, artifact_roots, labels, checkpoint_root, slots, journal
    )
    return node_temporal_worker(client, node, activities, slots)


def node_activities(
    client: Client,
    node: str,
    backend: GpuBackend,
    runtimes: dict[str, Runtime],
    artifact_roots: list[Path] | None = None,
    labels: dict[str, str] | None = None,
    checkpoint_root: Path | None = None,
    slots: NodeSlots | PoolSlots | None = None,
    journal: InvokeJournal | None = None,
) -> NodeActivities:
    """The node's activities and what they know (the models loaded here): one per process, kept
    across restarts of its Temporal worker (`node_temporal_worker`). `journal`: where the
    invokes running here are noted (activities/_invoke_journal.py)."""
    activities = NodeActivities(
        node,
        backend,
        runtimes,
        client=client,
        artifact_roots=artifact_roots,
        labels=labels,
        checkpoint_root=checkpoint_root,
        request_queue=node_task_queue(node),
        slots=slots,
        journal=journal,
    )
    if slots is not None:
        # A slot is claimed only on a model this worker has loaded: a restarted worker (its
        # model servers reaped) is lent slots before its next sample tells the scheduler so.
        slots.serve_only(activities.serves)
    return activities


def node_temporal_worker(
    client: Client,
    node: str,
    node_activities: NodeActivities,
    slots: NodeSlots | PoolSlots | None = None,
    deployment: WorkerDeploymentConfig | None = None,
) -> Worker:
    """A Temporal worker on the node's queue serving `node_activities` (a fresh one after a
    fatal error: a Worker runs once). `deployment`: the build it declares, never versioned
    (modelforge/versioning.py: one node worker per host, its activities both builds' contract)."""
    return Worker(
        client,
        task_queue=node_task_queue(node),
        deployment_config=deployment,
        # Heartbeats carry cancellation back: a preempted invoke must hear of it in seconds, not
        # in the SDK's default 0.8 x heartbeat timeout (48 s for an invoke).
        max_heartbeat_throttle_interval=timedelta(seconds=2),
        # Request workflows routed here (clients send a capability's requests to the node that
        # served it last) schedule their invoke on this same queue, so Temporal hands it back
        # in the workflow task's reply (eager dispatch) instead of a matching round trip: about
        # 25 ms of a warm request on the dev server. The admission call is their local activity.
        workflows=[CapabilityRequestWorkflow],
        activities=[
            *AdmissionActivities(client, slots).activities(),
            node_activities.sample_node,
            node_activities.load_model,
            node_activities.health_check,
            node_activities.invoke,
            node_activities.collect_invoke,
            node_activities.unload_model,
            node_activities.verify_reclaim,
            node_activities.sleep_model,
            node_activities.wake_model,
            node_activities.checkpoint_invocation,
            node_activities.run_gang_job,
            node_activities.checkpoint_gang_job,
        ],
    )


async def ensure_telemetry(
    client: Client, node: str, pool: str | Sequence[str] = DEFAULT_POOL, interval_s: float = 10.0
) -> None:
    """The node's telemetry workflow, its samples to the scheduler of `pool` (or of each of
    several pools, for a node whose cards are in more than one)."""
    pools = [pool] if isinstance(pool, str) else list(pool) or [DEFAULT_POOL]
    await client.start_workflow(
        TelemetryWorkflow.run,
        TelemetryInput(node=node, pool=pools[0], other_pools=pools[1:], interval_s=interval_s),
        id=telemetry_id(node),
        task_queue=CONTROL_TASK_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        static_summary=f"NVML samples of {node}",
    )


def choose_backend(
    settings: Settings, node: str, simulate_from: Path | None, cpu_device_bytes: int | None = None
) -> tuple[NodeDevices, dict[str, Runtime]]:
    use_nvml = settings.gpu_backend == "nvml" or (settings.gpu_backend == "auto" and NvmlGpuBackend.available())
    catalog = load_catalog_file(simulate_from)[0] if simulate_from is not None else None
    host = host_device(node, catalog, cpu_device_bytes)
    if use_nvml:
        devices = NodeDevices(NvmlGpuBackend(), host)
        return devices, node_runtimes(devices, settings.home, node)
    if simulate_from is None:
        raise SystemExit(
            f"modelforge worker node: no NVIDIA GPU here (MODELFORGE_GPU_BACKEND={settings.gpu_backend});"
            " pass --simulate-from CATALOG to run simulated devices"
        )
    catalog, external = load_catalog_file(simulate_from)
    backend = simulated_backend(node, catalog, external)
    log.warning(
        "simulated_gpu",
        node=node,
        devices=len(backend.devices()),
        note="no NVIDIA GPU in use: devices and memory on this node are SIMULATED",
    )
    devices = NodeDevices(backend, host)
    return devices, node_runtimes(devices, settings.home, node)


@dataclass(frozen=True)
class NodeGateway:
    """The gateway a node worker serves in its own process (`modelforge worker node --gateway-port`)."""

    host: str
    port: int
    database_url: str
    keys: dict[str, str] = field(default_factory=dict)


async def run(
    settings: Settings,
    node: str,
    simulate_from: Path | None,
    pool: str | Sequence[str] = DEFAULT_POOL,
    cpu_device_bytes: int | None = None,
    labels: dict[str, str] | None = None,
    gateway: NodeGateway | None = None,
) -> None:
    """`pool`: the pool of this node's cards, or each of the pools they are in. `gateway`: the
    HTTP gateway served from this process on the node's own Temporal client, so a request routed
    to this node starts eagerly (its first workflow task comes back in the start's reply to this
    worker instead of through the server's matching): a single GPU host's deployment.

    No failure of Temporal ends it (modelforge/retrying.py): the connection and the telemetry
    workflow's start are retried, and the Temporal worker and the delegation sync are restarted
    after a back-off of 1 s doubling to 30 s, each failure logged. SIGTERM stops it (exit status
    0) after stopping every model server and job it started."""
    await until_sigterm(
        _run(settings, node, simulate_from, pool, cpu_device_bytes, labels, gateway), log, "node_worker_stopped"
    )


async def _run(
    settings: Settings,
    node: str,
    simulate_from: Path | None,
    pool: str | Sequence[str],
    cpu_device_bytes: int | None,
    labels: dict[str, str] | None,
    gateway: NodeGateway | None = None,
) -> None:
    pools = [pool] if isinstance(pool, str) else list(pool) or [DEFAULT_POOL]
    backend, runtimes = choose_backend(settings, node, simulate_from, cpu_device_bytes)
    tasks: list[asyncio.Task[None]] = []
    try:
        client = await retrying(
            lambda: connect(settings, worker=True, role="node"), "temporal_connect", logger=log, node=node
        )
        slots = (
            PoolSlots([NodeSlots(client, node, name, sync_s=settings.delegation_sync_s) for name in pools])
            if settings.delegation_sync_s
            else None
        )
        # The invokes the previous process of this worker was running (killed, crashed) are
        # failed at once, their leases released, not held until their heartbeat timeout.
        journal = InvokeJournal(invoke_journal_dir(settings.home, node))

        async def fail_left() -> None:
            await fail_left_invokes(client, journal, node)

        tasks.append(asyncio.create_task(retrying(fail_left, "fail_left_invokes", logger=log, node=node)))
        activities = node_activities(
            client,
            node,
            backend,
            runtimes,
            settings.resolved_artifact_roots(),
            labels,
            settings.resolved_checkpoint_dir(),
            slots,
            journal,
        )
        # Each pool's delegation sync a loop of its own, restarted alone should it ever raise.
        for name, pool_slots in (slots.by_pool if slots is not None else {}).items():
            tasks.append(
                asyncio.create_task(supervised(pool_slots.run, "delegation_sync", logger=log, node=node, pool=name))
            )
        tasks.append(
            asyncio.create_task(
                retrying(lambda: ensure_telemetry(client, node, pools), "ensure_telemetry", logger=log, node=node)
            )
        )
        if gateway is not None:

            async def serve_gateway() -> None:
                from modelforge.gateway import run_gateway  # only a node serving it pays its imports

                await run_gateway(
                    settings,
                    gateway.database_url,
                    gateway.host,
                    gateway.port,
                    gateway.keys,
                    temporal=client,
                    announce=lambda line: log.info("gateway_started", node=node, message=line),
                )

            tasks.append(asyncio.create_task(supervised(serve_gateway, "gateway", logger=log, node=node)))
        log.info(
            "node_worker_started",
            node=node,
            backend=backend.label,
            cpu_device_bytes=backend.host.budget_bytes if backend.host else None,
            runtimes=sorted(runtimes),
            labels=labels or {},
        )

        async def serve() -> None:
            deployment = worker_deployment(settings, versioned=False)
            await run_workers([node_temporal_worker(client, node, activities, slots, deployment)])

        await supervised(serve, "temporal_worker", logger=log, node=node)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for runtime in runtimes.values():
            close = getattr(runtime, "close", None)  # no model server or job outlives its node worker
            if close is not None and inspect.isawaitable(closing := close()):
                await closing
