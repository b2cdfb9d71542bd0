"""Faults from the (simulated) NVML backend, on one running stack: a Tdarr
transcode that jumps by 12 GiB while a model loads, driver errors, a silent node (stale samples)
and memory that is not reclaimed after an unload. Each shows as typed events; no grant is made
on stale data; and no capacity snapshot ever shows the card over-committed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from modelforge.domain import GiB
from modelforge.gpu import ExternalProcess
from modelforge.policy import PolicyConfig
from tests.polling import until
from workers.stack import Stack, running_stack

pytestmark = pytest.mark.workflow

GPU = "gpu-node/0"


async def _failure(stack: Stack, capability: str, **kwargs: Any) -> ApplicationError:
    handle = await stack.start_request(capability, **kwargs)
    with pytest.raises(WorkflowFailureError) as failed:
        await handle.result()
    assert isinstance(failed.value.cause, ApplicationError)
    return failed.value.cause


async def _gpu(stack: Stack) -> Any:
    return next(a for a in (await stack.status()).accelerators if a.id == GPU)


async def test_nvml_faults_are_typed_and_never_over_commit(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    config = PolicyConfig(freshness_s=3.0, volatility_window_s=4.0, pressure_hold_s=1.0)
    async with running_stack(
        dev_server_env.client, database_url, config=config, telemetry_interval_s=1.0, snapshot_interval_s=1.0
    ) as stack:
        # 1. A 12 GiB transcode starts while rag.embedding@1 loads (4 s). The load had its bytes
        # promised, so it completes; nothing ever over-commits the card.
        loading = await stack.start_request("rag.embedding@1", tenant="rag")
        await asyncio.sleep(1.5)
        stack.backends["gpu-node"].add_external(ExternalProcess(0, 4242, "tdarr", 12 * GiB))
        assert (await loading.result()).lease.accelerator == GPU
        # With the transcode's swing in the reserve, a 4 GiB model cannot land on the card now.
        blocked = await _failure(stack, "chat.small@1", tenant="rag", lease_timeout_s=4)
        assert blocked.type in ("LEASE_TIMEOUT", "EXTERNAL_GPU_PRESSURE", "INSUFFICIENT_SCHEDULABLE_VRAM"), blocked
        stack.backends["gpu-node"].remove_external(4242)

        # 2. Three driver errors in a row: UNHEALTHY, then healthy after three good checks.
        stack.backends["gpu-node"].inject_driver_errors(3)
        unhealthy = await stack.events("gpu_unhealthy", at_least=1, within_s=15)
        assert unhealthy and unhealthy[0]["accelerator"] == GPU
        failed_checks = [
            e for e in await stack.store.list_events(kind="health_check_failed") if e["accelerator"] == GPU
        ]
        assert len(failed_checks) >= 3 and all(e["failure_class"] == "DRIVER_ERROR" for e in failed_checks)
        assert await stack.events("gpu_healthy", at_least=1, within_s=15)

        # 3. A silent node: its card goes stale and nothing that needs new memory is granted on it.
        await stack.node_workers["gpu-node"].shutdown()
        assert await until(lambda: _stale(stack), 15)
        stale = await _failure(stack, "chat.small@1", tenant="rag", lease_timeout_s=3)
        assert stale.type == "LEASE_TIMEOUT" and "SCHEDULER_STATE_STALE" in stale.message, stale.message
        await stack.restart_node("gpu-node")
        assert await until(lambda: _fresh(stack), 15)

        # 4. An unload whose memory the driver never gives back: GPU_MEMORY_NOT_RECLAIMED, and the
        # bytes stay counted (unreclaimed) instead of being granted again.
        stack.backends["gpu-node"].inject_unreclaimed(1)
        result = await (await stack.start_request("chat.small@1", tenant="rag")).result()
        assert result.lease.accelerator == GPU
        [failed] = await stack.events("reclaim_failed", at_least=1, within_s=45)
        assert failed["failure_class"] == "GPU_MEMORY_NOT_RECLAIMED" and failed["deployment"] == "chat.small@1"
        status = await stack.status()
        [kept] = [r for r in status.residents if r.capability == "chat.small@1"]
        assert kept.state == "unreclaimed" and kept.bytes == 4 * GiB
        assert (await _gpu(stack)).resident_bytes >= 4 * GiB

        # No snapshot of the whole run shows NVML usage, or ModelForge's bytes plus external
        # usage, above the card's total.
        snapshots = await stack.store.snapshots(accelerator=GPU, limit=10_000)
        assert len(snapshots) >= 20
        for row in snapshots:
            assert row["observed_used_bytes"] is None or row["observed_used_bytes"] <= row["total_bytes"], row
            held = row["external_bytes"] + row["resident_bytes"] + row["leased_bytes"]
            assert held <= row["total_bytes"], row


async def _stale(stack: Stack) -> bool:
    return not (await _gpu(stack)).fresh


async def _fresh(stack: Stack) -> bool:
    return bool((await _gpu(stack)).fresh)
