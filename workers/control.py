"""The control worker: every workflow, the catalog and event activities, the admission call,
and the request workflows on the task queue of a node gone silent."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from temporalio.client import Client, WorkflowHandle, WorkflowQueryFailedError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError
from temporalio.worker import Worker, WorkerDeploymentConfig
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from activities import AdmissionActivities, StoreActivities
from modelforge.logging import get_logger
from modelforge.messages import SchedulerInput, VerdictQuery
from modelforge.metrics import Metrics
from modelforge.payloads import sweep_forever
from modelforge.policy import PoolStatus, Verdict
from modelforge.retrying import DEFAULT_BACKOFF, describe, retrying, supervised
from modelforge.settings import CONTROL_TASK_QUEUE, DEFAULT_POOL, SCHEDULER_TASK_QUEUE, Settings, node_task_queue
from modelforge.store import Store
from modelforge.temporal import connect, register_search_attributes
from modelforge.versioning import deployment_version, promote_if_newer, worker_deployment
from workers.lifetime import run_workers, until_sigterm
from workers.replay_guard import ReplayGuard, replayer_check
from workflows import ALL_WORKFLOWS, CapabilityRequestWorkflow, PoolSchedulerWorkflow
from workflows._common import SCHEDULER_TASK_TIMEOUT, scheduler_id
from workflows.scheduler import SCHEDULER_PATCHES

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
        failures = 0
        try:
            while True:
                try:
                    await self.check()
                    failures = 0
                except Exception as error:  # the next round tries again; the process keeps serving
                    failures += 1
                    delay = max(self._interval_s, DEFAULT_BACKOFF.delay_s(failures))
                    log.warning("adopter_check_failed", attempt=failures, retry_in_s=delay, error=describe(error))
                    await asyncio.sleep(delay)
                    continue
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

    def _start_side_tasks(self) -> None:
        # Each restarted (after the back-off) should it ever raise: neither ends the worker.
        if self.adopter is not None:
            self._tasks.append(asyncio.create_task(supervised(self.adopter.run, "node_queue_adopter", logger=log)))
        if self.guard is not None:
            self._tasks.append(asyncio.create_task(supervised(self.guard.run, "replay_guard", logger=log)))

    def side_tasks(self) -> list[asyncio.Task[None]]:
        """The adopter's and the replay guard's tasks while they run (a stuck stop names them)."""
        return list(self._tasks)

    async def _stop_side_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def run(self) -> None:
        """Serve until cancelled (the process's way: `run` below). Raises when one of the
        Temporal workers stops on its own (a fatal poll or namespace-check error), after
        shutting the other down: the caller starts a fresh ControlWorker."""
        self._start_side_tasks()
        try:
            await run_workers(self.workers)
        finally:
            await self._stop_side_tasks()

    async def __aenter__(self) -> ControlWorker:
        for worker in self.workers:
            await worker.__aenter__()
        self._start_side_tasks()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stop_side_tasks()
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
    deployment: WorkerDeploymentConfig | None = None,
) -> ControlWorker:
    """`deployment`: the Worker Deployment Version both Temporal workers declare
    (modelforge/versioning.py); versioned, every run they start is pinned to this build."""
    gateway = AdmissionActivities(client)
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
            records.open_leases,
        ],
        activity_executor=ThreadPoolExecutor(4),
        deployment_config=deployment,
    )
    schedulers = Worker(
        client,
        task_queue=SCHEDULER_TASK_QUEUE,
        workflows=[PoolSchedulerWorkflow],
        workflow_runner=workflow_runner(),
        deployment_config=deployment,
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
    """Start the pool's scheduler unless it already runs (the singleton keeps its state)."""
    return await client.start_workflow(
        PoolSchedulerWorkflow.run,
        start or SchedulerInput(pool=pool),
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


def _verdicts_query(handle: WorkflowHandle[PoolSchedulerWorkflow, None]) -> Callable[[], Awaitable[list[Verdict]]]:
    async def query() -> list[Verdict]:
        found: list[Verdict] = await handle.query(PoolSchedulerWorkflow.verdicts, VerdictQuery())
        return found

    return query


def serve_metrics(metrics: Metrics, settings: Settings) -> int:
    """/metrics on MODELFORGE_METRICS_HOST (loopback unless configured; the compose stack sets
    0.0.0.0 inside its network) and MODELFORGE_METRICS_PORT; returns the bound port."""
    return metrics.serve(settings.metrics_port, settings.metrics_host)


async def catalog_pools(store: Store) -> list[str]:
    """The pools the stored catalog names (its accelerators'), or the default pool."""
    catalog = await store.load_catalog()
    return sorted({accelerator.pool for accelerator in catalog.accelerators}) or [DEFAULT_POOL]


async def serve_pool(client: Client, metrics: Metrics, pool: str) -> None:
    """The pool's scheduler started (retried with back-off while Temporal does not answer: a
    restart, a loaded host), then its status polled into the metrics, for as long as this runs."""
    handle = await retrying(lambda: ensure_scheduler(client, pool), "ensure_scheduler", logger=log, pool=pool)
    await metrics.poll(pool, _status_query(handle), verdicts=_verdicts_query(handle))


async def run(settings: Settings, pools: Sequence[str] = (), catalog_check_s: float = CATALOG_POOLS_S) -> None:
    """Serve each of `pools` (none given: every pool the stored catalog names, looked up again
    every `catalog_check_s`, so a pool `catalog apply` adds is served): start its scheduler,
    guard its history, adopt its silent nodes' queues and export its metrics.

    No failure of Temporal or Postgres ends it (modelforge/retrying.py): the first connections
    are retried, and each loop (the Temporal workers, each pool's scheduler and poll, the
    catalog's pools, the payload sweep) is restarted after a back-off of 1 s doubling to 30 s,
    each failure logged. SIGTERM stops it (exit status 0)."""
    await until_sigterm(_run(settings, pools, catalog_check_s), log, "control_worker_stopped")


async def _run(settings: Settings, pools: Sequence[str], catalog_check_s: float) -> None:
    url = settings.resolved_database_url()
    if url is None:
        raise SystemExit(
            "modelforge worker control: MODELFORGE_DATABASE_URL is not set and no `modelforge dev` "
            f"database was found under {settings.run_dir}"
        )
    client = await retrying(lambda: connect(settings, worker=True, role="control"), "temporal_connect", logger=log)
    store = await retrying(lambda: Store.open(url), "postgres_open", logger=log)
    tasks: list[asyncio.Task[None]] = []
    try:
        # Stored payloads (modelforge/payloads.py) kept for the workflows' retention, swept hourly.
        tasks.append(
            asyncio.create_task(
                supervised(lambda: sweep_forever(client, settings.payload_retention_days), "payload_sweep", logger=log)
            )
        )
        await retrying(store.migrate, "postgres_migrate", logger=log)
        with contextlib.suppress(Exception):
            await register_search_attributes(client)
        served = sorted(set(pools)) or await retrying(lambda: catalog_pools(store), "catalog_pools", logger=log)
        metrics = Metrics()
        port = serve_metrics(metrics, settings)
        polls: dict[str, asyncio.Task[None]] = {}
        current: list[ControlWorker] = []  # the Temporal workers running now (a fresh one per restart)

        def serve(pool: str) -> None:
            # Every pool's status into the same registry, each series labelled with its pool.
            polls[pool] = asyncio.create_task(
                supervised(lambda: serve_pool(client, metrics, pool), "pool_scheduler", logger=log, pool=pool)
            )
            for worker in current:
                worker.serve_pool(pool)

        async def temporal_workers() -> None:
            worker = build_control_worker(
                client,
                store,
                snapshot_retention_s=settings.snapshot_retention_days * 86400.0,
                metrics=metrics,
                pools=sorted(polls),
                replay_check_s=settings.replay_check_s,
                deployment=worker_deployment(settings, versioned=True),
            )
            current[:] = [worker]
            log.info("control_worker_started", task_queue=CONTROL_TASK_QUEUE, pools=sorted(polls), metrics_port=port)
            await worker.run()

        async def follow_catalog() -> None:  # a pool the catalog names later is served from then on
            while True:
                await asyncio.sleep(catalog_check_s)
                for pool in await catalog_pools(store):
                    if pool not in polls:
                        serve(pool)
                        log.info("pool_served", pool=pool)

        for pool in served:
            serve(pool)
        tasks.append(asyncio.create_task(supervised(temporal_workers, "temporal_workers", logger=log)))
        if settings.worker_versioning:  # this build takes new runs when it is the first or the newest
            version = deployment_version(settings)

            async def promote() -> None:
                await promote_if_newer(client, version)

            tasks.append(asyncio.create_task(retrying(promote, "worker_build_promote", logger=log)))
        if not pools:
            tasks.append(asyncio.create_task(supervised(follow_catalog, "catalog_pools", logger=log)))
        try:
            await asyncio.Event().wait()  # until cancelled: every loop above restarts itself
        finally:
            tasks.extend(polls.values())
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await store.close()
