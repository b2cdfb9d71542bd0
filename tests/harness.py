"""An in-process ModelForge stack on a given Temporal client: real Postgres, the control worker,
simulated node workers, the scheduler and telemetry workflows."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowHandle
from temporalio.worker import Worker

from modelforge.catalog import example_catalog_path, load_catalog_file
from modelforge.domain import Catalog
from modelforge.gpu import SimulatedGpuBackend
from modelforge.messages import RequestInput, SchedulerInput
from modelforge.policy import PolicyConfig, PoolStatus
from modelforge.runtimes import SimulatedRuntime
from modelforge.settings import CONTROL_TASK_QUEUE
from modelforge.store import Store
from workers.control import build_control_worker, ensure_scheduler
from workers.node import build_node_worker, ensure_telemetry, simulated_backend
from workflows import CapabilityRequestWorkflow, PoolSchedulerWorkflow
from workflows._common import request_workflow_id


@dataclass
class Stack:
    client: Client
    store: Store
    catalog: Catalog
    scheduler: WorkflowHandle[PoolSchedulerWorkflow, None]
    backends: dict[str, SimulatedGpuBackend] = field(default_factory=dict)

    async def status(self) -> PoolStatus:
        status: PoolStatus = await self.scheduler.query(PoolSchedulerWorkflow.status)
        return status

    async def start_request(self, capability: str, **kwargs: Any) -> WorkflowHandle[CapabilityRequestWorkflow, Any]:
        request_id = kwargs.pop("request_id", uuid.uuid4().hex[:12])
        request = RequestInput(request_id=request_id, capability=capability, **kwargs)
        return await self.client.start_workflow(
            CapabilityRequestWorkflow.run,
            request,
            id=request_workflow_id(capability, request_id),
            task_queue=CONTROL_TASK_QUEUE,
        )


@contextlib.asynccontextmanager
async def running_stack(
    client: Client,
    database_url: str,
    catalog_path: Path | None = None,
    config: PolicyConfig | None = None,
    telemetry_interval_s: float = 10.0,
) -> AsyncIterator[Stack]:
    catalog, external = load_catalog_file(catalog_path or example_catalog_path())
    store = await Store.open(database_url)
    await store.migrate()
    await store.apply_catalog(catalog)
    backends = {node: simulated_backend(node, catalog, external) for node in catalog.nodes()}
    workers: list[Worker] = [build_control_worker(client, store)]
    workers += [
        build_node_worker(client, node, backend, {"simulated": SimulatedRuntime(backend)})
        for node, backend in backends.items()
    ]
    try:
        async with contextlib.AsyncExitStack() as stack:
            for worker in workers:
                await stack.enter_async_context(worker)
            scheduler = await ensure_scheduler(
                client, "default", SchedulerInput(pool="default", config=config or PolicyConfig())
            )
            for node in backends:
                await ensure_telemetry(client, node, interval_s=telemetry_interval_s)
            yield Stack(client=client, store=store, catalog=catalog, scheduler=scheduler, backends=backends)
    finally:
        await store.close()
