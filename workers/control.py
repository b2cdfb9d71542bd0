"""The control worker: every workflow, the catalog and event activities, the admission call."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from activities import SchedulerGatewayActivities, StoreActivities
from modelforge.logging import get_logger
from modelforge.messages import SchedulerInput
from modelforge.metrics import Metrics
from modelforge.settings import CONTROL_TASK_QUEUE, DEFAULT_POOL, Settings
from modelforge.store import Store
from modelforge.temporal import connect, register_search_attributes
from workflows import ALL_WORKFLOWS, PoolSchedulerWorkflow
from workflows._common import scheduler_id

log = get_logger("modelforge.worker.control")


def workflow_runner() -> SandboxedWorkflowRunner:
    """The domain and the policy are deterministic and side-effect free: share them with the
    sandbox instead of re-importing them for every workflow run."""
    return SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_modules("modelforge", "pydantic", "pydantic_core")
    )


def build_control_worker(
    client: Client,
    store: Store,
    task_queue: str = CONTROL_TASK_QUEUE,
    snapshot_retention_s: float = 30 * 86400.0,
    metrics: Metrics | None = None,
) -> Worker:
    gateway = SchedulerGatewayActivities(client)
    records = StoreActivities(store, snapshot_retention_s, metrics)
    return Worker(
        client,
        task_queue=task_queue,
        workflows=ALL_WORKFLOWS,
        workflow_runner=workflow_runner(),
        activities=[
            gateway.admit,
            records.load_catalog,
            records.record_events,
            records.record_snapshots,
            records.usage_from_ledger,
        ],
        activity_executor=ThreadPoolExecutor(4),
    )


async def ensure_scheduler(
    client: Client, pool: str = DEFAULT_POOL, start: SchedulerInput | None = None
) -> WorkflowHandle[PoolSchedulerWorkflow, None]:
    """Start the pool's scheduler unless it already runs (the singleton keeps its state)."""
    return await client.start_workflow(
        PoolSchedulerWorkflow.run,
        start or SchedulerInput(pool=pool),
        id=scheduler_id(pool),
        task_queue=CONTROL_TASK_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        static_summary=f"admission for pool {pool}",
    )


async def run(settings: Settings, pool: str = DEFAULT_POOL) -> None:
    client = await connect(settings)
    url = settings.resolved_database_url()
    if url is None:
        raise SystemExit(
            "modelforge worker control: MODELFORGE_DATABASE_URL is not set and no `modelforge dev` "
            f"database was found under {settings.run_dir}"
        )
    store = await Store.open(url)
    try:
        await store.migrate()
        with contextlib.suppress(Exception):
            await register_search_attributes(client)
        metrics = Metrics()
        worker = build_control_worker(
            client, store, snapshot_retention_s=settings.snapshot_retention_days * 86400.0, metrics=metrics
        )
        async with worker:
            handle = await ensure_scheduler(client, pool)
            port = metrics.serve(settings.metrics_port)
            log.info("control_worker_started", task_queue=CONTROL_TASK_QUEUE, pool=pool, metrics_port=port)
            await metrics.poll(pool, lambda: handle.query(PoolSchedulerWorkflow.status))
    finally:
        await store.close()
