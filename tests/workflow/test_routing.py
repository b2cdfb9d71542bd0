"""Requests routed to the node that served their capability last: the client
starts them on that node's task queue, where the node's worker runs the request workflow and
hands itself the invoke. If that node goes silent, the control worker serves its queue, so a
request routed there is still admitted (elsewhere) and answered, never left waiting for a
node that may not come back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from modelforge.client import ModelForgeClient
from modelforge.gateway import GatewayConfig, create_app
from modelforge.policy import PolicyConfig
from modelforge.settings import CONTROL_TASK_QUEUE, node_task_queue
from workers.node import ensure_telemetry
from workers.stack import running_stack
from workflows._common import telemetry_id

pytestmark = pytest.mark.workflow

CATALOG = Path(__file__).resolve().parents[1] / "catalogs" / "routing.toml"
CAPABILITY = "route.embed@1"


async def _task_queue(client: ModelForgeClient, workflow_id: str) -> str:
    description = await client.temporal.get_workflow_handle(workflow_id).describe()
    return description.task_queue


async def _until(check: object, within_s: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while loop.time() < deadline:
        if await check():  # type: ignore[operator]
            return True
        await asyncio.sleep(0.2)
    return False


async def test_a_capabilitys_next_request_runs_on_the_node_that_served_it(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG):
        client = ModelForgeClient(dev_server_env.client)
        first = await client.request(CAPABILITY, input={"text": "a"}, tenant="app")
        assert first.ok and first.lease is not None
        node = first.lease.node
        # Nothing known yet: the first request starts on the control queue.
        assert await _task_queue(client, first.workflow_id) == CONTROL_TASK_QUEUE
        second = await client.request(CAPABILITY, input={"text": "b"}, tenant="app")
        assert second.ok and second.lease is not None and second.lease.node == node
        assert await _task_queue(client, second.workflow_id) == node_task_queue(node)
        # Its invoke was handed to the node's worker in the workflow task's reply (eager): the
        # activity was started the moment it was scheduled, with no task queue hop between.
        history = await client.temporal.get_workflow_handle(second.workflow_id).fetch_history()
        scheduled = next(e for e in history.events if e.HasField("activity_task_scheduled_event_attributes"))
        started = next(e for e in history.events if e.HasField("activity_task_started_event_attributes"))
        gap_ms = (started.event_time.ToDatetime() - scheduled.event_time.ToDatetime()).total_seconds() * 1000
        assert scheduled.activity_task_scheduled_event_attributes.activity_type.name == "invoke"
        assert gap_ms < 5, f"the routed invoke waited {gap_ms:.1f} ms for a worker"
        # A failed request forgets the route: the next one starts from the control queue again.
        failed = await client.request(CAPABILITY, input={"simulate_fault": "INVALID_OUTPUT"}, tenant="app")
        assert not failed.ok and failed.failure_class == "INVALID_OUTPUT"
        third = await client.request(CAPABILITY, input={"text": "c"}, tenant="app")
        assert third.ok and await _task_queue(client, third.workflow_id) == CONTROL_TASK_QUEUE


async def test_a_request_routed_to_a_silent_node_is_served_by_the_other_node(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    config = PolicyConfig(freshness_s=2.0)
    async with running_stack(
        dev_server_env.client,
        database_url,
        catalog_path=CATALOG,
        config=config,
        telemetry_interval_s=0.5,
        adopt_interval_s=0.5,
    ) as stack:
        assert stack.control is not None and stack.control.adopter is not None
        adopter = stack.control.adopter
        client = ModelForgeClient(dev_server_env.client)
        first = await client.request(CAPABILITY, input={"text": "a"}, tenant="app")
        assert first.ok and first.lease is not None
        gone = first.lease.node
        other = next(n for n in ("route-a", "route-b") if n != gone)

        # The node that served it stops: its worker and its telemetry.
        await stack.node_workers[gone].shutdown()
        await dev_server_env.client.get_workflow_handle(telemetry_id(gone)).terminate("test: node gone")
        assert await _until(lambda: _adopted(adopter, [gone]), 15)

        # Routed to the gone node's queue, the request is run by the control worker, admitted on
        # the other node (the gone node's card is stale) and answered.
        second = await asyncio.wait_for(client.request(CAPABILITY, input={"text": "b"}, tenant="app"), 60)
        assert await _task_queue(client, second.workflow_id) == node_task_queue(gone)
        assert second.ok, second.message
        assert second.lease is not None and second.lease.node == other

        # The node comes back: its queue is its own again.
        await stack.restart_node(gone)
        await ensure_telemetry(dev_server_env.client, gone, interval_s=0.5)
        assert await _until(lambda: _adopted(adopter, []), 15)


async def _adopted(adopter: object, nodes: list[str]) -> bool:
    return adopter.adopted == nodes  # type: ignore[attr-defined]


async def test_a_gateway_on_the_nodes_own_client_starts_requests_eagerly(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    """`modelforge worker node --gateway-port`: the gateway answers through the node worker's own
    Temporal client, so the server hands a request's first workflow task back in the start's
    reply to that process's worker (eager start), where a client on a connection of its own
    waits for the server to dispatch it. The answers are the same; the gateway's /metrics counts
    both kinds."""
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        shared = ModelForgeClient(dev_server_env.client)  # the workers' own connection
        config = dev_server_env.client.service_client.config
        own = ModelForgeClient(
            await Client.connect(
                config.target_host,
                namespace=dev_server_env.client.namespace,
                data_converter=dev_server_env.client.data_converter,
            )
        )
        app = create_app(shared, stack.store.load_catalog, GatewayConfig())
        headers = {"X-ModelForge-Tenant": "app"}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", headers=headers) as http:
            for text in ("a", "b", "c"):
                call = {"capability": CAPABILITY, "input": {"text": text}, "request_id": f"eager-{text}"}
                answered = await http.post("/v1/requests", json=call, timeout=60)
                assert answered.status_code == 200, answered.text
            metrics = (await http.get("/metrics")).text
        assert (shared.workflow_starts, shared.eager_starts) == (3, 3)
        assert 'modelforge_gateway_workflow_starts{eager="true"} 3.0' in metrics, metrics
        assert 'modelforge_gateway_workflow_starts{eager="false"} 0.0' in metrics
        # The last ran on the node that served the first: that node's worker ran it from the start.
        queue = await _task_queue(shared, f"request:{CAPABILITY}:eager-c")
        assert queue in {node_task_queue(node) for node in stack.node_workers}, queue
        # A client on a connection with no worker: the same answers, none started eagerly.
        for text in ("d", "e"):
            result = await own.request(CAPABILITY, input={"text": text}, tenant="app")
            assert result.ok, result.message
        assert (own.workflow_starts, own.eager_starts) == (2, 0)
