"""The control worker: every workflow, the catalog and event activities, the admission call,
and the request workflows on the task queue of a node gone silent."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from temporalio.client import Client, WorkflowHandle, WorkflowQueryFailedError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from activities import SchedulerGatewayActivities, StoreActivities
from modelforge.logging import get_logger
from modelforge.messages import SchedulerInput
from modelforge.metrics import Metrics
from modelforge.payloads import sweep_forever
from modelforge.policy import PoolStatus
from modelforge.settings import CONTROL_TASK_QUEUE, DEFAULT_POOL, SCHEDULER_TASK_QUEUE, Settings, node_task_queue
from modelforge.store import Store
from modelforge.temporal import connect, register_search_attributes
from workers.replay_guard import ReplayGuard, replayer_check
from workflows import ALL_WORKFLOWS, CapabilityRequestWorkflow, PoolSchedulerWorkflow
from workflows._common import SCHEDULER_TASK_TIMEOUT, scheduler_id
from workflows.scheduler import SCHEDULER_PATCHES, SCHEDULER_RULES

log = get_logger("modelforge.worker.control")
# How often a control worker serving the catalog's pools looks for pools the catalog added.
CATALOG_POOLS_S = 30.0


def workflow_runner() -> SandboxedWorkflowRunner:
    """The domain and the policy are deterministic and side-effect free: share them with the
    sandbox instead of re-importing them for every workflow run."""
    return SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_modules("modelforge", "pydantic", "pydantic_core")
    )


class NodeQueueAdopter:
    """Request workflows may run on a node's task queue (clients route a capability's requests to
    the node that served it last, so the invoke is dispatched eagerly). If that node goes silent,
    nothing would run them: their timers, their lease heartbeats, the invoke's timeout would wait
    for the node to come back. So while every accelerator of a node the scheduler has heard from
    is stale (no telemetry within `freshness_s`), this worker serves the request workflows on
    that node's queue (workflow tasks and the admission call only: the node's own activities stay
    with the node), and stops when the node reports again. A live node's queue is left to the
    node, whose worker would otherwise lose half its eager invokes to this one."""

    def __init__(
        self,
        client: Client,
        pools: Sequence[str],
        local_activities: Sequence[Callable[..., Awaitable[Any]]],
        interval_s: float = 5.0,
    ) -> None:
        self._client = client
        self._pools = list(pools)
        self._local_activities = list(local_activities)  # the admission calls (admit, confirm_lease)
        self._interval_s = interval_s
        self._workers: dict[str, tuple[Worker, asyncio.Task[None]]] = {}

    def add_pool(self, pool: str) -> None:
        """Watch this pool's nodes too (a pool the control worker took on)."""
        if pool not in self._pools:
            self._pools.append(pool)

    @property
    def adopted(self) -> list[str]:
        """The nodes whose request workflows this worker serves now."""
        return sorted(self._workers)

    async def run(self) -> None:
        try:
            while True:
                try:
                    await self.check()
                except Exception as error:  # the next round tries again; the process keeps serving
                    log.warning("adopter_check_failed", error=f"{type(error).__name__}: {error}")
                await asyncio.sleep(self._interval_s)
        finally:
            await self.close()

    async def check(self) -> None:
        for node, (_, task) in list(self._workers.items()):
            if task.done():  # its worker stopped on its own (a fatal poll error): start another
                del self._workers[node]
        fresh: dict[str, bool] = {}
        for pool in self._pools:
            try:
                status = await self._client.get_workflow_handle(scheduler_id(pool)).query(PoolSchedulerWorkflow.status)
            except (RPCError, WorkflowQueryFailedError) as error:  # not started yet: nothing known
                log.debug("adopter_status_failed", pool=pool, error=type(error).__name__)
                continue
            for accelerator in status.accelerators:
                if accelerator.observed_at is None:
                    continue  # never heard from: no request was ever routed to it
                fresh[accelerator.node] = fresh.get(accelerator.node, False) or accelerator.fresh
        for node in sorted(fresh):
            if not fresh[node] and node not in self._workers:
                try:
                    worker = Worker(
                        self._client,
                        task_queue=node_task_queue(node),
                        workflows=[CapabilityRequestWorkflow],
                        activities=self._local_activities,
                        # The admission call as a local activity only: this worker must never
                        # take the node's own activity tasks (an invoke here would fail, not wait).
                        no_remote_activities=True,
                    )
                except RuntimeError as error:
                    # The node's own worker runs in this process (`modelforge dev`): the SDK
                    # refuses a second one on its queue, and that one serves it anyway.
                    log.debug("node_queue_served_here", node=node, error=str(error).splitlines()[0])
                    continue
                self._workers[node] = (worker, asyncio.create_task(worker.run()))
                log.warning("node_queue_adopted", node=node, task_queue=node_task_queue(node))
            elif fresh[node] and node in self._workers:
                await self._release(node)
                log.info("node_queue_returned", node=node)

    async def _release(self, node: str) -> None:
        worker, task = self._workers.pop(node)
        await worker.shutdown()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task

    async def close(self) -> None:
        for node in list(self._workers):
            await self._release(node)


class ControlWorker:
    """The control worker process's two Temporal workers, entered and left together: one for the
    pool schedulers on their own task queue, one for everything else. Under overload, request
    workflows' tasks queue up on the control queue; the schedulers' tasks never wait behind them
    (bench/sustained.py at 8 requests/s saw a scheduler's first task after continue-as-new held
    back past its admissions' limits when both shared one queue). And the adopter of silent
    nodes' queues."""

    def __init__(
        self, workers: list[Worker], adopter: NodeQueueAdopter | None = None, guard: ReplayGuard | None = None
    ) -> None:
        self.workers = workers
        self.adopter = adopter
        self.guard = guard
        self._tasks: list[asyncio.Task[None]] = []

    def serve_pool(self, pool: str) -> None:
        """A pool whose scheduler this worker now serves: its history guarded, its silent nodes'
        queues adopted (the scheduler itself runs on the shared scheduler queue already)."""
        if self.adopter is not None:
            self.adopter.add_pool(pool)
        if self.guard is not None:
            self.guard.watch(scheduler_id(pool))

    async def __aenter__(self) -> ControlWorker:
        for worker in self.workers:
            await worker.__aenter__()
        if self.adopter is not None:
            self._tasks.append(asyncio.create_task(self.adopter.run()))
        if self.guard is not None:
            self._tasks.append(asyncio.create_task(self.guard.run()))
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        for worker in reversed(self.workers):
            await worker.__aexit__(None, None, None)


def build_control_worker(
    client: Client,
    store: Store,
    task_queue: str = CONTROL_TASK_QUEUE,
    snapshot_retention_s: float = 30 * 86400.0,
    metrics: Metrics | None = None,
    pools: Sequence[str] = (DEFAULT_POOL,),
    adopt_interval_s: float = 5.0,
    replay_check_s: float = 60.0,
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
            *gateway.activities(),
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
    # A scheduler history that no worker can replay is moved out of before it wedges the pool
    # (workers/replay_guard.py); 0 turns the guard off.
    guard = (
        ReplayGuard(
            client,
            [scheduler_id(pool) for pool in pools],
            replayer_check([PoolSchedulerWorkflow], workflow_runner(), client.data_converter, SCHEDULER_PATCHES),
            interval_s=replay_check_s,
        )
        if replay_check_s > 0
        else None
    )
    adopter = NodeQueueAdopter(client, pools, gateway.activities(), adopt_interval_s)
    return ControlWorker([schedulers, control], adopter, guard)


async def ensure_scheduler(
    client: Client, pool: str = DEFAULT_POOL, start: SchedulerInput | None = None
) -> WorkflowHandle[PoolSchedulerWorkflow, None]:
    """Start the pool's scheduler unless it already runs (the singleton keeps its state). A new
    run follows the newest rules (SchedulerInput.rules)."""
    start = replace(start or SchedulerInput(pool=pool), rules=SCHEDULER_RULES)
    return await client.start_workflow(
        PoolSchedulerWorkflow.run,
        start,
        id=scheduler_id(pool),
        task_queue=SCHEDULER_TASK_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        # (why 60 s: workflows/_common.py). Continue-as-new keeps this timeout.
        task_timeout=SCHEDULER_TASK_TIMEOUT,
        static_summary=f"admission for pool {pool}",
    )


def _status_query(handle: WorkflowHandle[PoolSchedulerWorkflow, None]) -> Callable[[], Awaitable[PoolStatus]]:
    async def query() -> PoolStatus:
        status: PoolStatus = await handle.query(PoolSchedulerWorkflow.status)
        return status

    return query


def serve_metrics(metrics: Metrics, settings: Settings) -> int:
    """/metrics on MODELFORGE_METRICS_HOST (loopback unless configured; the compose stack sets
    0.0.0.0 inside its network) and MODELFORGE_METRICS_PORT; returns the bound port."""
    return metrics.serve(settings.metrics_port, settings.metrics_host)


async def catalog_pools(store: Store) -> list[str]:
    """The pools the stored catalog names (its accelerators'), or the default pool."""
    catalog = await store.load_catalog()
    return sorted({accelerator.pool for accelerator in catalog.accelerators}) or [DEFAULT_POOL]


async def run(settings: Settings, pools: Sequence[str] = (), catalog_check_s: float = CATALOG_POOLS_S) -> None:
    """Serve each of `pools` (none given: every pool the stored catalog names, looked up again
    every `catalog_check_s`, so a pool `catalog apply` adds is served): start its scheduler,
    guard its history, adopt its silent nodes' queues and export its metrics."""
    client = await connect(settings, worker=True, role="control")
    url = settings.resolved_database_url()
    if url is None:
        raise SystemExit(
            "modelforge worker control: MODELFORGE_DATABASE_URL is not set and no `modelforge dev` "
            f"database was found under {settings.run_dir}"
        )
    store = await Store.open(url)
    # Stored payloads (modelforge/payloads.py) kept for the workflows' retention, swept hourly.
    sweeper = asyncio.create_task(sweep_forever(client, settings.payload_retention_days))
    try:
        await store.migrate()
        with contextlib.suppress(Exception):
            await register_search_attributes(client)
        served = sorted(set(pools)) or await catalog_pools(store)
        metrics = Metrics()
        worker = build_control_worker(
            client,
            store,
            snapshot_retention_s=settings.snapshot_retention_days * 86400.0,
            metrics=metrics,
            pools=served,
            replay_check_s=settings.replay_check_s,
        )
        polls: dict[str, asyncio.Task[None]] = {}
        async with worker:
            try:
                for pool in served:
                    # Every pool's status into the same registry, each series labelled with its pool.
                    polls[pool] = asyncio.create_task(
                        metrics.poll(pool, _status_query(await ensure_scheduler(client, pool)))
                    )
                port = serve_metrics(metrics, settings)
                log.info("control_worker_started", task_queue=CONTROL_TASK_QUEUE, pools=served, metrics_port=port)
                if pools:
                    await asyncio.gather(*polls.values())
                while True:  # following the catalog: a pool it names later is served from then on
                    await asyncio.sleep(catalog_check_s)
                    try:
                        named = await catalog_pools(store)
                        for pool in named:
                            if pool not in polls:
                                handle = await ensure_scheduler(client, pool)
                                worker.serve_pool(pool)
                                polls[pool] = asyncio.create_task(metrics.poll(pool, _status_query(handle)))
                                log.info("pool_served", pool=pool)
                    except Exception as error:  # Postgres or Temporal away: the next look tries again
                        log.warning("catalog_pools_failed", error=f"{type(error).__name__}: {error}")
            finally:
                for task in polls.values():
                    task.cancel()
                await asyncio.gather(*polls.values(), return_exceptions=True)
    finally:
        sweeper.cancel()
        await store.close()
