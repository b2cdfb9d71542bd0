"""Pools as shards on one Temporal server: two pools, each with its own scheduler and node, one
control worker serving both. A client that names no pool sends each capability to a pool that
serves it (preferring the one where it is warm); `status` and `ps` show both pools."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
from prometheus_client import generate_latest
from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker
from typer.testing import CliRunner

from modelforge import cli
from modelforge.catalog import load_catalog_file
from modelforge.client import ModelForgeClient
from modelforge.metrics import Metrics
from modelforge.policy import PoolState, PoolStatus
from modelforge.settings import SCHEDULER_TASK_QUEUE, Settings, node_task_queue
from modelforge.store import Store
from tests.worker_process import control_worker_env, start_control_worker
from workers import control
from workers.control import catalog_pools, workflow_runner
from workers.stack import running_stack
from workflows import PoolSchedulerWorkflow

pytestmark = pytest.mark.workflow

CATALOG = Path(__file__).resolve().parents[1] / "catalogs" / "pools.toml"
POOLS = ("pool-a", "pool-b")


async def test_requests_go_to_a_pool_that_serves_them_and_status_shows_every_pool(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    temporal = dev_server_env.client
    async with running_stack(temporal, database_url, catalog_path=CATALOG, pools=POOLS) as stack:
        # `modelforge worker control` without --pool serves every pool the stored catalog names.
        assert await catalog_pools(stack.store) == list(POOLS)
        # z@1 may run in either pool: warm it in pool-b, the pool that loses a tie by name.
        warmed = await ModelForgeClient(temporal, "pool-b").request("z@1", input={"text": "warm"}, tenant="app")
        assert warmed.ok, warmed.message
        assert warmed.lease is not None and warmed.lease.accelerator == "node-b/0"

        routed = ModelForgeClient(temporal)  # no pool named
        for capability, card in (("x@1", "node-a/0"), ("y@1", "node-b/0"), ("z@1", "node-b/0")):
            result = await routed.request(capability, input={"text": capability}, tenant="app")
            assert result.ok, f"{capability}: {result.failure_class} {result.message}"
            assert result.lease is not None and result.lease.accelerator == card, capability
            if capability == "z@1":  # warm already: its first request starts on the warm node
                described = await temporal.get_workflow_handle(result.workflow_id).describe()
                assert described.task_queue == node_task_queue("node-b")
        # The node-queue hint still applies inside the chosen pool: z@1's next request runs on
        # node-b's queue (and, being warm there, in pool-b again).
        again = await routed.request("z@1", input={"text": "again"}, tenant="app")
        assert again.ok and again.lease is not None and again.lease.accelerator == "node-b/0"
        described = await temporal.get_workflow_handle(again.workflow_id).describe()
        assert described.task_queue == node_task_queue("node-b")

        # A capability no pool serves fails at once, named, and starts no workflow.
        unknown = await routed.request("nothing@1", input={}, tenant="app", request_id="unknown-1")
        assert not unknown.ok and unknown.failure_class == "CAPABILITY_UNAVAILABLE"
        assert "nothing@1" in unknown.message and "pool-a, pool-b" in unknown.message
        with pytest.raises(RPCError) as missing:
            await temporal.get_workflow_handle("request:nothing@1:unknown-1").describe()
        assert missing.value.status == RPCStatusCode.NOT_FOUND

        # Status: every pool, each with its own card; merged, both cards and the residents.
        statuses = await routed.statuses()
        assert sorted(statuses) == list(POOLS)
        assert all(isinstance(s, PoolStatus) for s in statuses.values())
        merged = await routed.status()
        assert sorted(a.id for a in merged.accelerators) == ["node-a/0", "node-b/0"]
        assert sorted((r.capability, r.accelerator) for r in merged.residents) == [
            ("x@1", "node-a/0"),
            ("y@1", "node-b/0"),
            ("z@1", "node-b/0"),
        ]

        # The CLI: `status` prints a table per pool, `--json` gives each card its pool;
        # `ps` has a pool column.
        config = temporal.service_client.config
        env = {
            "MODELFORGE_TEMPORAL_ADDRESS": config.target_host,
            "MODELFORGE_HOME": str(tmp_path),
            "COLUMNS": "120",
        }
        runner = CliRunner()
        table = await asyncio.to_thread(runner.invoke, cli.app, ["status"], env=env)
        assert table.exit_code == 0, table.output
        assert "pool pool-a" in table.stdout and "pool pool-b" in table.stdout
        as_json = await asyncio.to_thread(runner.invoke, cli.app, ["status", "--json"], env=env)
        assert as_json.exit_code == 0, as_json.output
        shown = json.loads(as_json.stdout)
        assert {(a["id"], a["pool"]) for a in shown["accelerators"]} == {
            ("node-a/0", "pool-a"),
            ("node-b/0", "pool-b"),
        }
        assert [(p["pool"], p["up"]) for p in shown["pools"]] == [("pool-a", True), ("pool-b", True)]
        ps = await asyncio.to_thread(runner.invoke, cli.app, ["ps", "--json"], env=env)
        assert ps.exit_code == 0, ps.output
        assert sorted((r["pool"], r["capability"]) for r in json.loads(ps.stdout)) == [
            ("pool-a", "x@1"),
            ("pool-b", "y@1"),
            ("pool-b", "z@1"),
        ]
        one = await asyncio.to_thread(runner.invoke, cli.app, ["ps", "--pool", "pool-a", "--json"], env=env)
        assert [r["capability"] for r in json.loads(one.stdout)] == ["x@1"]

        # Metrics: each pool's series under its own label, in one registry.
        metrics = Metrics()
        for pool in POOLS:
            metrics.observe_status(await stack.status(pool))
        scraped = generate_latest(metrics.registry).decode()
        for pool in POOLS:
            assert f'modelforge_scheduler_up{{pool="{pool}"}} 1.0' in scraped
        assert 'modelforge_resident_models{pool="pool-b",state="ready"} 2.0' in scraped


async def test_an_explicit_pool_list_limits_the_choice(dev_server_env: WorkflowEnvironment, database_url: str) -> None:
    """MODELFORGE_POOLS (or `pools=`) names the pools to route among: one that leaves out the
    pool serving a capability makes it unavailable, while the other capabilities still route."""
    temporal = dev_server_env.client
    async with running_stack(temporal, database_url, catalog_path=CATALOG, pools=POOLS):
        only_a = ModelForgeClient(temporal, pools=["pool-a"])
        x = await only_a.request("x@1", input={"text": "x"}, tenant="app")
        assert x.ok and x.lease is not None and x.lease.accelerator == "node-a/0"
        previous = os.environ.get("MODELFORGE_POOLS")
        os.environ["MODELFORGE_POOLS"] = "pool-a, pool-c"
        try:
            from_env = ModelForgeClient(temporal)
        finally:
            if previous is None:
                del os.environ["MODELFORGE_POOLS"]
            else:
                os.environ["MODELFORGE_POOLS"] = previous
        assert await from_env.router.pools() == ["pool-a", "pool-c"]
        y = await from_env.request("y@1", input={"text": "y"}, tenant="app")
        assert not y.ok and y.failure_class == "CAPABILITY_UNAVAILABLE"
        assert "y@1" in y.message and "pool pool-c did not answer" in y.message


async def test_while_no_scheduler_answers_a_request_goes_to_the_pool_the_catalog_places_it_in(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    """While a pool's scheduler is slow to answer (a catalog apply, a Temporal restart, a busy
    control worker), a client that named no pool was refused at once with "no pool serves
    capability" although a pool serves it. Live: the schedulers' worker stops, so route queries
    go unanswered as a slow scheduler's do; the gateway's client (it reads the stored catalog)
    sends y@1 to pool-b, where it waits in admission and is served once the scheduler moves
    again. A client with no catalog to read can only name the pools that did not answer; a
    capability the catalog places nowhere is still refused at once, by name."""
    temporal = dev_server_env.client
    async with running_stack(temporal, database_url, catalog_path=CATALOG, pools=POOLS) as stack:
        assert stack.control is not None
        [schedulers] = [w for w in stack.control.workers if w.task_queue == SCHEDULER_TASK_QUEUE]
        await schedulers.shutdown()
        routed = ModelForgeClient(temporal, catalog=stack.store.load_catalog)
        routed.router.query_timeout_s = 1.0  # the gateway's is 5 s: the same path, sooner
        blind = ModelForgeClient(temporal)
        blind.router.query_timeout_s = 1.0
        refused = await blind.request("y@1", input={"text": "y"}, tenant="app")
        assert refused.failure_class == "CAPABILITY_UNAVAILABLE" and "did not answer" in refused.message
        nowhere = await routed.request("nothing@1", input={}, tenant="app")
        assert nowhere.failure_class == "CAPABILITY_UNAVAILABLE"
        assert "no pool serves capability 'nothing@1'" in nowhere.message

        asked = asyncio.create_task(routed.request("y@1", input={"text": "y"}, tenant="app"))
        await asyncio.sleep(4.0)  # routed by the catalog, then waiting in pool-b's admission
        assert not asked.done(), asked.result()
        back = Worker(
            temporal,
            task_queue=SCHEDULER_TASK_QUEUE,
            workflows=[PoolSchedulerWorkflow],
            workflow_runner=workflow_runner(),
        )
        stack.control.workers[stack.control.workers.index(schedulers)] = back  # stopped with the stack
        await back.__aenter__()
        result = await asyncio.wait_for(asked, timeout=60)
        assert result.ok, f"{result.failure_class} {result.message}"
        assert result.lease is not None and result.lease.accelerator == "node-b/0"


async def test_one_control_worker_process_serves_every_pool_of_the_catalog(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    """`modelforge worker control` with no --pool, as compose and the fault tests run it: it
    starts and serves the scheduler of each pool the stored catalog names, and exports both
    pools' metrics."""
    catalog, _ = load_catalog_file(CATALOG)
    store = await Store.open(database_url)
    try:
        await store.migrate()
        await store.apply_catalog(catalog)
    finally:
        await store.close()
    target = dev_server_env.client.service_client.config.target_host
    environ = control_worker_env(target, database_url, tmp_path)
    port = int(environ["MODELFORGE_METRICS_PORT"])
    control = start_control_worker(environ, tmp_path / "control.log")
    try:
        async with running_stack(
            dev_server_env.client, database_url, catalog_path=CATALOG, control_in_process=False, pools=POOLS
        ):
            routed = ModelForgeClient(dev_server_env.client)
            for capability, card in (("x@1", "node-a/0"), ("y@1", "node-b/0")):
                result = await routed.request(capability, input={"text": capability}, tenant="app")
                assert result.ok, f"{capability}: {result.failure_class} {result.message}"
                assert result.lease is not None and result.lease.accelerator == card
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            while True:  # the metrics poll runs every 5 s
                async with httpx.AsyncClient() as http:
                    scraped = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
                if all(f'modelforge_resident_models{{pool="{p}",state="ready"}} 1.0' in scraped for p in POOLS):
                    break
                assert loop.time() < deadline, scraped[-2000:]
                await asyncio.sleep(0.5)
    finally:
        control.send_signal(signal.SIGTERM)
        try:
            control.wait(timeout=15)
        except subprocess.TimeoutExpired:
            control.kill()
            control.wait()
    assert "control_worker_started" in (tmp_path / "control.log").read_text()


async def test_a_pool_the_catalog_adds_later_is_served_by_the_running_control_worker(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    """`catalog apply` of a catalog with a new pool: the control worker that follows the catalog
    (no --pool) starts that pool's scheduler at its next look, without a restart."""
    full, _ = load_catalog_file(CATALOG)
    only_a = dataclasses.replace(
        full,
        accelerators=[a for a in full.accelerators if a.pool == "pool-a"],
        deployments=[d for d in full.deployments if d.capability != "y@1"],
    )
    store = await Store.open(database_url)
    try:
        await store.migrate()
        await store.apply_catalog(only_a)
        settings = Settings(
            temporal_address=dev_server_env.client.service_client.config.target_host,
            database_url=database_url,
            home=tmp_path,
            metrics_port=0,
        )
        worker = asyncio.create_task(control.run(settings, catalog_check_s=0.5))
        try:
            assert await _running(dev_server_env, "scheduler:pool-a", 30)
            assert not await _running(dev_server_env, "scheduler:pool-b", 2)
            await store.apply_catalog(full)
            assert await _running(dev_server_env, "scheduler:pool-b", 15)
        finally:
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
    finally:
        await store.close()


async def _running(env: WorkflowEnvironment, workflow_id: str, within_s: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while loop.time() < deadline:
        try:
            described = await env.client.get_workflow_handle(workflow_id).describe()
            if described.status == WorkflowExecutionStatus.RUNNING:
                return True
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:
                raise
        await asyncio.sleep(0.2)
    return False


SHARED = Path(__file__).resolve().parents[1] / "catalogs" / "shared_node.toml"


async def test_a_node_whose_cards_are_in_two_pools_reports_to_both_and_is_lent_slots_by_each(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    temporal = dev_server_env.client
    async with running_stack(temporal, database_url, catalog_path=SHARED, pools=POOLS, delegation_sync_s=0.3) as stack:
        # Each scheduler sees its own card fresh from the one node's samples, and only that card.
        for pool, card in (("pool-a", "shared/0"), ("pool-b", "shared/1")):
            for _ in range(100):
                status = await stack.status(pool)
                if all(a.fresh for a in status.accelerators):
                    break
                await asyncio.sleep(0.2)
            assert [(a.id, a.fresh) for a in status.accelerators] == [(card, True)], status.accelerators
        client = ModelForgeClient(temporal)  # routes each capability to the pool that serves it
        for capability, pool in (("x@1", "pool-a"), ("y@1", "pool-b")):
            delegated = False
            for _ in range(30):
                result = await client.request(capability, input={"text": "hi"}, tenant="app")
                assert result.ok and result.lease is not None, result
                assert result.lease.node == "shared" and result.lease.accelerator.startswith("shared/")
                if result.timings.get("delegated"):
                    delegated = True
                    break
                await asyncio.sleep(0.2)
            assert delegated, f"{capability}: the node was never lent a slot by {pool}"
            state = await stack.schedulers[pool].query("state", result_type=PoolState)
            assert state.slots and all(slot.node == "shared" for slot in state.slots.values())
