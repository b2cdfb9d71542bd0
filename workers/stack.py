"""An in-process ModelForge stack on a given Temporal client: real Postgres, the control worker,
simulated node workers, the scheduler and telemetry workflows. What the tests and the benchmarks
start (benchmarks import it from here, never from the tests)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowHandle
from temporalio.worker import Worker, WorkerDeploymentConfig

from activities._delegation import NodeSlots, PoolSlots
from activities._invoke_journal import InvokeJournal, invoke_journal_dir
from modelforge.catalog import ExternalSpec, example_catalog_path, load_catalog_file
from modelforge.domain import Catalog
from modelforge.failures import FailureClass
from modelforge.gpu import NodeDevices, SimulatedGpuBackend
from modelforge.messages import RequestInput, SchedulerInput
from modelforge.metrics import Metrics
from modelforge.policy import AdmissionCheck, AdmissionRequest, PolicyConfig, PoolStatus
from modelforge.runtimes import SubprocessHttpRuntime
from modelforge.settings import CONTROL_TASK_QUEUE
from modelforge.store import Store
from modelforge.versioning import set_current
from workers.control import ControlWorker, build_control_worker, ensure_scheduler
from workers.node import build_node_worker, ensure_telemetry, host_device, node_runtimes, simulated_backend
from workflows import CapabilityRequestWorkflow, PoolSchedulerWorkflow
from workflows._common import request_workflow_id


@dataclass
class Stack:
    client: Client
    store: Store
    catalog: Catalog
    scheduler: WorkflowHandle[PoolSchedulerWorkflow, None]
    backends: dict[str, SimulatedGpuBackend] = field(default_factory=dict)
    node_workers: dict[str, Worker] = field(default_factory=dict)
    external: list[ExternalSpec] = field(default_factory=list)
    node_tasks: list[asyncio.Task[None]] = field(default_factory=list)
    control: ControlWorker | None = None  # None when the caller runs the control worker
    # The node workers' home (model servers' logs and pid files, job logs, checkpoints): the
    # stack's own, so a node worker's start, which stops the servers its node's earlier runs
    # left (`reap_orphans`), never touches another stack's on the same host.
    home: Path = field(default_factory=lambda: Path(tempfile.gettempdir()) / "modelforge")
    # Every pool's scheduler by pool (`scheduler` is the first pool's).
    schedulers: dict[str, WorkflowHandle[PoolSchedulerWorkflow, None]] = field(default_factory=dict)
    # Each node's delegated slots (warm-path delegation) when the stack runs it; the sync loops
    # run as tasks of their own, stopped with the stack.
    delegation_sync_s: float = 0.0
    slots: dict[str, NodeSlots] = field(default_factory=dict)
    sync_tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    async def events(self, kind: str, at_least: int, within_s: float = 10.0) -> list[dict[str, Any]]:
        """Events of a kind in order, once at least `at_least` are written: the event log is
        written off the admission path, so it trails the workflows by a moment."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while True:
            events = sorted(await self.store.list_events(kind=kind), key=lambda e: int(e["seq"]))
            if len(events) >= at_least or loop.time() > deadline:
                return events
            await asyncio.sleep(0.1)

    async def restart_node(self, node: str) -> None:
        """Stop a node worker and start a fresh one, as a crashed or upgraded node would come
        back: its runtimes hold nothing, and only the external processes are on the card. On a
        connection of its own, as a node on its own host has: the SDK allows one worker per task
        queue and connection, and the control worker may be serving this node's queue while
        the node is away (workers/control.py, NodeQueueAdopter)."""
        await self.stop_node(node)
        await self.start_node(node)

    def node_pools(self, node: str) -> list[str]:
        """The pools of a node's cards that this stack runs (the first pool when none)."""
        pools = sorted({a.pool for a in self.catalog.accelerators if a.node == node and a.pool in self.schedulers})
        return pools or [next(iter(self.schedulers), "default")]

    def _new_slots(self, client: Client, node: str) -> NodeSlots | PoolSlots | None:
        """A node worker's slots, a fresh life of them (its sync loops started), or None. A node
        whose cards are in several pools has slots of each (`PoolSlots`); `slots[node]` is then
        those of its first pool."""
        if not self.delegation_sync_s:
            return None
        lives = [NodeSlots(client, node, pool, sync_s=self.delegation_sync_s) for pool in self.node_pools(node)]
        slots: NodeSlots | PoolSlots = lives[0] if len(lives) == 1 else PoolSlots(lives)
        self.slots[node] = lives[0]
        self.sync_tasks[node] = asyncio.create_task(slots.run())
        return slots

    async def stop_node(self, node: str) -> None:
        """Stop a node worker (its queue goes unserved until `start_node`), and its slots' sync."""
        if node in self.sync_tasks:
            self.sync_tasks[node].cancel()
        worker = self.node_workers[node]
        if worker.is_running and not worker.is_shutdown:
            await worker.shutdown()

    async def start_node(self, node: str) -> None:
        """A fresh node worker for a stopped one, as `restart_node` describes."""
        backend = simulated_backend(node, self.catalog, self.external)
        self.backends[node] = backend
        config = self.client.service_client.config
        # The same data converter as the stack's client: a payload one stored, the other reads.
        own = await Client.connect(
            config.target_host,
            namespace=self.client.namespace,
            tls=config.tls,
            data_converter=self.client.data_converter,
        )
        worker = _node_worker(own, node, backend, self.catalog, self.home, self._new_slots(own, node))
        self.node_workers[node] = worker
        self.node_tasks.append(asyncio.create_task(worker.run()))

    async def status(self, pool: str | None = None) -> PoolStatus:
        """The first pool's status, or `pool`'s."""
        scheduler = self.scheduler if pool is None else self.schedulers[pool]
        status: PoolStatus = await scheduler.query(PoolSchedulerWorkflow.status)
        return status

    async def catalog_loaded(self, pool: str) -> bool:
        """Whether `pool`'s scheduler has loaded its catalog and admits: its state shows the
        cards, and its dry run no longer answers SCHEDULER_STATE_STALE (the state holds the
        catalog while the scheduler still seeds its fair-share usage, refusing updates until
        it is done)."""
        if not (await self.status(pool)).accelerators:
            return False
        probe = AdmissionRequest(request_id="stack-ready", workflow_id="stack-ready", capability="", tenant="")
        check: AdmissionCheck = await self.schedulers[pool].query(PoolSchedulerWorkflow.admission_check, probe)
        return check.failure != FailureClass.SCHEDULER_STATE_STALE.value

    async def start_request(
        self, capability: str, task_queue: str = CONTROL_TASK_QUEUE, **kwargs: Any
    ) -> WorkflowHandle[CapabilityRequestWorkflow, Any]:
        """`task_queue`: a node's, to start it there as a client routes a capability's requests
        to the node that served it last."""
        request_id = kwargs.pop("request_id", uuid.uuid4().hex[:12])
        request = RequestInput(request_id=request_id, capability=capability, **kwargs)
        return await self.client.start_workflow(
            CapabilityRequestWorkflow.run,
            request,
            id=request_workflow_id(capability, request_id),
            task_queue=task_queue,
        )


def _node_worker(
    client: Client,
    node: str,
    backend: SimulatedGpuBackend,
    catalog: Catalog,
    home: Path,
    slots: NodeSlots | PoolSlots | None = None,
) -> Worker:
    """A node worker as `modelforge worker node --simulate-from` builds one: every runtime, the
    catalog's CPU device when it declares one on this node."""
    devices = NodeDevices(backend, host_device(node, catalog, None))
    runtimes = node_runtimes(devices, home, node)
    worker = build_node_worker(
        client,
        node,
        devices,
        runtimes,
        checkpoint_root=home / "checkpoints",
        slots=slots,
        journal=InvokeJournal(invoke_journal_dir(home, node)),
    )
    _SERVERS[worker] = [r for r in runtimes.values() if isinstance(r, SubprocessHttpRuntime)]
    return worker


# How long a node worker's shutdown may take in a stack's teardown (its activities are cancelled
# at once: graceful_shutdown_timeout is 0) before the teardown names what holds it and fails.
WORKER_SHUTDOWN_S = 30.0
# The same for the in-process control worker (its two Temporal workers and side tasks).
CONTROL_SHUTDOWN_S = 60.0

# Each node worker's model-server runtime, stopped with the stack as `modelforge worker node` does.
_SERVERS: dict[Worker, list[SubprocessHttpRuntime]] = {}


@contextlib.asynccontextmanager
async def running_stack(
    client: Client,
    database_url: str,
    catalog_path: Path | None = None,
    config: PolicyConfig | None = None,
    telemetry_interval_s: float = 10.0,
    max_history_events: int = 5000,
    snapshot_interval_s: float = 60.0,
    metrics: Metrics | None = None,
    control_in_process: bool = True,
    adopt_interval_s: float = 5.0,
    pools: Sequence[str] = ("default",),
    delegation_sync_s: float = 0.0,
    deployment: WorkerDeploymentConfig | None = None,
    replay_check_s: float = 60.0,
    home: Path | None = None,
) -> AsyncIterator[Stack]:
    """`control_in_process=False`: the caller runs the control worker (a process of its own, to
    be killed and restarted); the stack brings only Postgres rows, node workers and telemetry.
    `pools`: the pools whose schedulers start (one control worker serves them all); each node
    sends its telemetry to the pool of its accelerators (the first pool when none is listed).
    `deployment`: the control worker's Worker Deployment Version; versioned, it is made the
    deployment's current one before the schedulers start (as `worker control` does).
    `replay_check_s`: the replay guard's interval (0: off, for a test whose interceptor changes
    the scheduler's commands, which a replay without it cannot match).
    `home`: the node workers' home (`Stack.home`); None: a fresh folder, removed with the stack."""
    catalog, external = load_catalog_file(catalog_path or example_catalog_path())
    own_home = home is None
    home = Path(tempfile.mkdtemp(prefix="modelforge-stack-")) if home is None else home
    store = await Store.open(database_url)
    await store.migrate()
    await store.apply_catalog(catalog)
    backends = {node: simulated_backend(node, catalog, external) for node in catalog.nodes()}
    running = Stack(
        client=client,
        store=store,
        catalog=catalog,
        scheduler=None,  # type: ignore[arg-type]
        backends=backends,
        external=external,
        delegation_sync_s=delegation_sync_s,
        schedulers={pool: None for pool in pools},  # type: ignore[misc]  # set below; names the pools
        home=home,
    )
    node_workers = {
        node: _node_worker(client, node, backend, catalog, home, running._new_slots(client, node))
        for node, backend in backends.items()
    }
    running.node_workers = node_workers
    try:
        async with contextlib.AsyncExitStack() as stack:
            if control_in_process:
                control = build_control_worker(
                    client,
                    store,
                    metrics=metrics,
                    adopt_interval_s=adopt_interval_s,
                    pools=list(pools),
                    deployment=deployment,
                    replay_check_s=replay_check_s,
                )
                running.control = await control.__aenter__()
                stack.push_async_callback(_stop_control, control)
                if deployment is not None and deployment.use_worker_versioning:
                    await set_current(client, deployment.version)
            # Node workers run as tasks, not contexts, so a test can restart one.
            running.node_tasks = [asyncio.create_task(worker.run()) for worker in node_workers.values()]
            stack.push_async_callback(_shutdown_all, running)
            for pool in pools:
                running.schedulers[pool] = await ensure_scheduler(
                    client,
                    pool,
                    SchedulerInput(
                        pool=pool,
                        config=config or PolicyConfig(),
                        max_history_events=max_history_events,
                        snapshot_interval_s=snapshot_interval_s,
                    ),
                )
            running.scheduler = running.schedulers[pools[0]]
            # Ready when each scheduler has its catalog: a request sent before would be refused
            # as SCHEDULER_STATE_STALE and, with time skipped, could use up its retries (an
            # update such as `residency_control` is refused outright).
            for pool in pools:
                for _ in range(300):
                    if await running.catalog_loaded(pool):
                        break
                    await asyncio.sleep(0.1)
                else:
                    raise RuntimeError(f"the scheduler of pool {pool} did not load its catalog within 30 s")
            for node in backends:
                await ensure_telemetry(client, node, running.node_pools(node), interval_s=telemetry_interval_s)
            yield running
    finally:
        await store.close()
        if own_home:
            shutil.rmtree(home, ignore_errors=True)


async def _shutdown_all(stack: Stack) -> None:
    for task in stack.sync_tasks.values():
        task.cancel()
    await asyncio.gather(*stack.sync_tasks.values(), return_exceptions=True)
    # Bounded: a test that fails mid-way must not hang its teardown on a still-running invoke.
    # A worker that does not stop is named with what holds it, after the rest is stopped.
    stuck: list[str] = []
    for node, worker in stack.node_workers.items():
        if worker.is_running and not worker.is_shutdown:
            try:
                await asyncio.wait_for(asyncio.shield(worker.shutdown()), timeout=WORKER_SHUTDOWN_S)
            except TimeoutError:
                stuck.append(
                    f"node {node}'s worker did not shut down in {WORKER_SHUTDOWN_S:g} s: {_still_running(worker)}"
                )
    timeout = 5 if stuck else 30
    done, pending = await asyncio.wait(stack.node_tasks, timeout=timeout) if stack.node_tasks else (set(), set())
    for task in done:
        if not task.cancelled():
            task.exception()  # retrieved: a worker that failed has failed its test already
    if pending and not stuck:
        stuck.append(f"{len(pending)} node worker task(s) still running {timeout} s after their workers shut down")
    for task in pending:
        task.cancel()
    try:
        for worker in stack.node_workers.values():
            for servers in _SERVERS.pop(worker, []):
                await asyncio.wait_for(servers.close(), timeout=30)
    finally:
        if stuck:
            raise RuntimeError("; ".join(stuck))


async def _stop_control(control: ControlWorker) -> None:
    """The control worker left as its context would leave it, bounded as the node workers'
    shutdown is: one that does not stop in CONTROL_SHUTDOWN_S is named with what holds it (its
    side tasks, its Temporal workers' activities and runs), not left to a test's timeout."""
    stopping = asyncio.ensure_future(control.__aexit__(None, None, None))
    done, _ = await asyncio.wait({stopping}, timeout=CONTROL_SHUTDOWN_S)
    if stopping in done:
        stopping.result()
        return
    held = [f"side task at {_awaiting(task)}" for task in control.side_tasks() if not task.done()]
    held += [_still_running(worker) for worker in control.workers]
    raise RuntimeError(f"the control worker did not stop in {CONTROL_SHUTDOWN_S:g} s: " + "; ".join(held))


def _still_running(worker: Worker) -> str:
    """What holds a worker's shutdown, for the failure's message: its activities still running
    (with where each waits) and the workflow runs it still has. Reads the SDK's private state:
    a diagnostic only, never a decision."""
    parts: list[str] = []
    activities = getattr(getattr(worker, "_activity_worker", None), "_running_activities", {}) or {}
    for running in activities.values():
        info = getattr(running, "info", None)
        name = f"{info.activity_type} of {info.workflow_id}" if info is not None else "an activity"
        task = getattr(running, "task", None)
        where = f" at {_awaiting(task)}" if task is not None and not task.done() else ""
        parts.append(f"{name}{where}")
    workflows = getattr(getattr(worker, "_workflow_worker", None), "_running_workflows", {}) or {}
    parts += [f"workflow run {run_id}" for run_id in workflows]
    # The SDK's poll loops still waiting (of every worker in this process: the control worker's too).
    for task in asyncio.all_tasks():
        name = getattr(task.get_coro(), "__qualname__", "")
        if name.split(".")[0] in ("_ActivityWorker", "_WorkflowWorker", "_NexusWorker") and not task.done():
            parts.append(f"{name} waiting at {_awaiting(task)}")
    return "; ".join(parts) or "nothing in the SDK's Python side: its core, then"


def _awaiting(task: asyncio.Task[Any]) -> str:
    """Where a task waits: its coroutine chain, outermost first, as `function:line` (the
    innermost frames tell what it waits on)."""
    names: list[str] = []
    coro: Any = task.get_coro()
    while coro is not None and len(names) < 12:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            names.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " > ".join(names) or repr(task)
