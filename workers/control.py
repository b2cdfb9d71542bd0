"""The control worker: every workflow, the catalog and event activities, the admission call."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from activities import SchedulerGatewayActivities, StoreActivities
from modelforge.logging import get_logger
from modelforge.messages import SchedulerInput
from modelforge.metrics import Metrics
from modelforge.settings import CONTROL_TASK_QUEUE, DEFAULT_POOL, SCHEDULER_TASK_QUEUE, Settings
from modelforge.store import Store
from modelforge.temporal import connect, register_search_attributes
from workflows import ALL_WORKFLOWS, PoolSchedulerWorkflow
from workflows._common import scheduler_id

log = get_logger("modelforge.worker.control")
SCHEDULER_TASK_TIMEOUT = timedelta(seconds=60)


def workflow_runner() -> SandboxedWorkflowRunner:
    """The domain and the policy are deterministic and side-effect free: share them with the
    sandbox instead of re-importing them for every workflow run."""
    return SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_modules("modelforge", "pydantic", "pydantic_core")
    )


class ControlWorker:
    """The control worker process's two Temporal workers, entered and left together: one for the
    pool schedulers on their own task queue, one for everything else. Under overload, request
    workflows' tasks queue up on the control queue; the schedulers' tasks never wait behind them
    (bench/sustained.py at 8 requests/s saw a scheduler's first task after continue-as-new held
    back past its admissions' limits when both shared one queue)."""

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers

    async def __aenter__(self) -> ControlWorker:
        for worker in self.workers:
            await worker.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for worker in reversed(self.workers):
            await worker.__aexit__(None, None, None)


def build_control_worker(
    client: Client,
    store: Store,
    task_queue: str = CONTROL_TASK_QUEUE,
    snapshot_retention_s: float = 30 * 86400.0,
    metrics: Metrics | None = None,
) -> ControlWorker:
    gateway = SchedulerGatewayActivities(client)
    records = StoreActivities(store, snapshot_retention_s, metrics)
    control = Worker(
        client,
        task_queue=task_queue,
        # Every workflow type, the scheduler included: schedulers started before the scheduler
        # queue existed keep running here.
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
    schedulers = Worker(
        client, task_queue=SCHEDULER_TASK_QUEUE, workflows=[PoolSchedulerWorkflow], workflow_runner=workflow_runner()
    )
    return ControlWorker([schedulers, control])


async def ensure_scheduler(
    client: Client, pool: str = DEFAULT_POOL, start: SchedulerInput | None = None
) -> WorkflowHandle[PoolSchedulerWorkflow, None]:
    """Start the pool's scheduler unless it already runs (the singleton keeps its state)."""
    return await client.start_workflow(
        PoolSchedulerWorkflow.run,
        start or SchedulerInput(pool=pool),
        id=scheduler_id(pool),
        task_queue=SCHEDULER_TASK_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        # Under overload one scheduler task carries many batched admissions; past the default
        # 10 s the server times it out, the backlog grows and the next task is slower still (seen
        # in bench/sustained.py at 8 requests/s on 2 cores). Continue-as-new keeps this timeout.
        task_timeout=SCHEDULER_TASK_TIMEOUT,
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
