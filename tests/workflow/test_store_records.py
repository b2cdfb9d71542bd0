"""What the running scheduler writes to Postgres after real requests: the lease ledger (and the
usage it adds up to), capacity snapshots that match `status`, and alerts as events."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from modelforge import temporal as sa
from modelforge.catalog import example_catalog_path, load_catalog_file
from modelforge.domain import Deployment, GiB
from modelforge.gpu import ExternalProcess
from modelforge.messages import SchedulerInput
from modelforge.policy import PolicyConfig, PoolState
from workers.control import ensure_scheduler
from workers.stack import Stack, running_stack
from workflows import PoolSchedulerWorkflow

pytestmark = pytest.mark.workflow


async def _until(probe: Any, within_s: float = 30.0) -> Any:
    """Poll an async probe until it returns something truthy: the store trails the workflows."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        found = await probe()
        if found or loop.time() > deadline:
            return found
        await asyncio.sleep(0.2)


async def test_ledger_holds_one_row_per_lease_and_usage_adds_it_up(
    time_skipping_env: WorkflowEnvironment, database_url: str
) -> None:
    async with running_stack(time_skipping_env.client, database_url) as stack:
        handles = [await stack.start_request("rag.embedding@1", tenant="rag") for _ in range(3)]
        handles += [await stack.start_request("chat.small@1", tenant="default") for _ in range(2)]
        results = [await h.result() for h in handles]
        leases = {r.lease.lease_id: r for r in results}

        async def ended() -> list[dict[str, Any]]:
            rows = await stack.store.ledger()
            return rows if len(rows) == 5 and all(r["ended_at"] for r in rows) else []

        rows = await _until(ended)
        assert {r["lease_id"] for r in rows} == set(leases)
        for row in rows:
            result = leases[row["lease_id"]]
            assert row["request_id"] == result.request_id
            assert row["capability"] == result.capability
            assert row["tenant"] == ("rag" if result.capability == "rag.embedding@1" else "default")
            assert row["outcome"] == "ok"
            assert row["accelerators"] == [result.lease.accelerator]
            assert row["bytes"] == result.lease.bytes
            assert row["gpu_seconds"] == pytest.approx(row["held_s"]) and row["held_s"] >= 0
            assert row["ended_at"] >= row["granted_at"]
        granted = await stack.events("lease_granted", at_least=5)
        assert sorted(e["lease_id"] for e in granted) == sorted(leases)
        usage = {u["tenant"]: u for u in await stack.store.usage()}
        assert (usage["rag"]["leases"], usage["default"]["leases"]) == (3, 2)
        for tenant in ("rag", "default"):
            assert usage[tenant]["gpu_seconds"] == pytest.approx(
                sum(r["gpu_seconds"] for r in rows if r["tenant"] == tenant)
            )


async def test_snapshots_carry_what_status_shows(time_skipping_env: WorkflowEnvironment, database_url: str) -> None:
    async with running_stack(
        time_skipping_env.client, database_url, telemetry_interval_s=1.0, snapshot_interval_s=1.0
    ) as stack:
        await (await stack.start_request("rag.embedding@1", tenant="rag")).result()

        async def settled() -> list[dict[str, Any]]:
            # The newest snapshot of gpu-node/0 after the embedding model is resident.
            rows = await stack.store.snapshots(accelerator="gpu-node/0", limit=1)
            return rows if rows and rows[0]["resident_bytes"] > 0 and rows[0]["fresh"] else []

        [row] = await _until(settled)
        gpu = next(a for a in (await stack.status()).accelerators if a.id == "gpu-node/0")
        # Nothing moves on the card now: the snapshot and `status` must agree byte for byte.
        for column in ("total_bytes", "external_bytes", "resident_bytes", "leased_bytes", "reserve_bytes"):
            assert row[column] == getattr(gpu, column), column
        assert row["schedulable_bytes"] == gpu.schedulable_bytes
        # schedulable = total - external - resident - leased - reserve
        assert (
            row["schedulable_bytes"]
            == (row["total_bytes"] - row["external_bytes"] - row["resident_bytes"] - row["leased_bytes"])
            - row["reserve_bytes"]
        )
        assert row["external_bytes"] == 6 * GiB and row["simulated"] is True
        assert row["received_at"] is not None and row["received_at"] <= row["at"]
        trend = await stack.store.capacity(since_s=600, buckets=1)
        # Every accelerator of the example catalog, the declared CPU device included.
        assert {r["accelerator"] for r in trend} == {"gpu-node/0", "gpu-node/cpu", "desktop/0"}


async def _alerts(stack: Stack, kind: str, deployment: str) -> list[dict[str, Any]]:
    return [e for e in await stack.store.list_events(kind=kind) if e["deployment"] == deployment]


async def test_capacity_and_pressure_alerts_follow_an_external_burst(
    time_skipping_env: WorkflowEnvironment, database_url: str
) -> None:
    config = PolicyConfig(volatility_window_s=3.0, pressure_hold_s=2.0)
    async with running_stack(time_skipping_env.client, database_url, config=config, telemetry_interval_s=1.0) as stack:
        await (await stack.start_request("chat.small@1", tenant="rag")).result()
        assert await stack.store.list_events(alert="*") == []
        # A 15 GiB transcode on the 24 GiB card that already carries Ollama's 6 GiB: at most
        # 24 - 6 - 15 - 1 (reserve) = 2 GiB is left, less than chat.small@1's 4 GiB envelope.
        transcode = ExternalProcess(device_index=0, pid=4242, name="tdarr", used_bytes=15 * GiB)
        stack.backends["gpu-node"].add_external(transcode)
        [raised] = await _until(lambda: _alerts(stack, "capacity_alert_raised", "chat.small@1"))
        assert raised["alert"] == "CAPABILITY_CAPACITY"
        assert raised["payload"]["envelope_bytes"] == 4 * GiB
        assert raised["payload"]["headroom_bytes"] < 4 * GiB
        [pressure] = await stack.events("gpu_pressure_entered", at_least=1)
        assert pressure["alert"] == "GPU_PRESSURE" and pressure["accelerator"] == "gpu-node/0"
        # The transcode ends: once the volatility window has passed, the envelope fits again.
        stack.backends["gpu-node"].remove_external(4242)
        [cleared] = await _until(lambda: _alerts(stack, "capacity_alert_cleared", "chat.small@1"))
        assert cleared["alert"] == "CAPABILITY_CAPACITY"
        assert await stack.events("gpu_pressure_left", at_least=1)
        # Transitions only: one raise, one clear, however many samples were taken.
        assert len(await _alerts(stack, "capacity_alert_raised", "chat.small@1")) == 1
        # No alert touched the external process: it was the test that ended it.
        status = await stack.status()
        assert next(a for a in status.accelerators if a.id == "gpu-node/0").external_bytes == 6 * GiB


async def test_refused_admissions_are_in_the_event_log(
    time_skipping_env: WorkflowEnvironment, database_url: str
) -> None:
    async with running_stack(time_skipping_env.client, database_url) as stack:
        unknown_tenant = await stack.start_request("rag.embedding@1", tenant="mallory", request_id="bad-tenant")
        with pytest.raises(WorkflowFailureError) as refused:
            await unknown_tenant.result()
        assert isinstance(refused.value.cause, ApplicationError)
        assert refused.value.cause.type == "REQUEST_INVALID"
        # A pool whose scheduler is not running: the scheduler cannot tell, the requester does.
        nowhere = await stack.start_request("rag.embedding@1", tenant="rag", request_id="no-pool", pool="nowhere")
        with pytest.raises(WorkflowFailureError) as unavailable:
            await nowhere.result()
        assert isinstance(unavailable.value.cause, ApplicationError)
        assert unavailable.value.cause.type == "CAPABILITY_UNAVAILABLE"
        # Operators find both in the UI by outcome (a failed admission set none before the record-admit-failures patch).
        for handle, outcome in ((unknown_tenant, "REQUEST_INVALID"), (nowhere, "CAPABILITY_UNAVAILABLE")):
            described = await handle.describe()
            assert described.typed_search_attributes.get(sa.OUTCOME) == outcome

        [invalid] = await stack.events("request_refused", at_least=1)
        assert (invalid["request_id"], invalid["failure_class"]) == ("bad-tenant", "REQUEST_INVALID")
        assert "mallory" in invalid["message"]
        [lost] = await stack.events("admission_failed", at_least=1)
        assert (lost["request_id"], lost["failure_class"]) == ("no-pool", "CAPABILITY_UNAVAILABLE")
        assert lost["payload"]["pool"] == "nowhere"


async def test_a_fresh_scheduler_starts_fair_share_from_the_ledger_and_reloads_the_catalog(
    time_skipping_env: WorkflowEnvironment, database_url: str
) -> None:
    client = time_skipping_env.client
    async with running_stack(client, database_url) as stack:
        await (await stack.start_request("chat.small@1", tenant="default", input={"simulate_invoke_s": 2})).result()
        [row] = await _until(lambda: _ended(stack))
        # The pool's scheduler is replaced by a fresh one (a new cluster, a reset): its fair share
        # starts from the ledger, not from zero.
        await stack.scheduler.terminate("test: a fresh scheduler")
        fresh = await ensure_scheduler(client, "default", SchedulerInput(pool="default"))
        state = await _until(lambda: _state_with_catalog(fresh))
        assert state.usage["default"].gpu_seconds == pytest.approx(row["gpu_seconds"], rel=0.05)

        # A catalog change reaches the running scheduler without a restart.
        catalog, _ = load_catalog_file(example_catalog_path())
        added = Deployment(capability="ocr.small@1", envelope_bytes=GiB, measured_on=["Simulated RTX 3090 24GB"])
        await stack.store.apply_catalog(replace(catalog, deployments=[*catalog.deployments, added]))
        await fresh.signal(PoolSchedulerWorkflow.catalog_changed)
        stack.scheduler = fresh
        result = await (await stack.start_request("ocr.small@1", tenant="rag")).result()
        assert result.lease.deployment == "ocr.small@1"


async def _ended(stack: Stack) -> list[dict[str, Any]]:
    return [r for r in await stack.store.ledger() if r["ended_at"] is not None]


async def _state_with_catalog(handle: Any) -> PoolState | None:
    state: PoolState = await handle.query(PoolSchedulerWorkflow.state)
    return state if state.catalog.accelerators else None
