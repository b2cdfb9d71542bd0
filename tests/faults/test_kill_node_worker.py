"""`kill -9` of a node worker during an invoke: the lease comes back within
the invoke's heartbeat timeout plus 15 s, the request ends with a typed failure, and once the
node is back its resident is reconciled and the card's schedulable bytes are what they were
before the request."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from modelforge.catalog import example_catalog_path
from tests.harness import Stack, running_stack
from workflows.request import INVOKE_HEARTBEAT

pytestmark = pytest.mark.workflow

NODE = "gpu-node"


def _node_process(env: WorkflowEnvironment, home: Path) -> subprocess.Popen[bytes]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    environ.update(
        MODELFORGE_TEMPORAL_ADDRESS=env.client.service_client.config.target_host,
        MODELFORGE_GPU_BACKEND="simulated",
        MODELFORGE_HOME=str(home),
    )
    argv = [sys.executable, "-m", "modelforge", "worker", "node", "--node", NODE]
    argv += ["--simulate-from", str(example_catalog_path())]
    with (home / "node.log").open("ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen(argv, env=environ, stdout=log, stderr=subprocess.STDOUT)


async def _gpu(stack: Stack) -> tuple[int, int, int]:
    status = await stack.status()
    gpu = next(a for a in status.accelerators if a.id == f"{NODE}/0")
    residents = len([r for r in status.residents if r.accelerator == gpu.id])
    return gpu.schedulable_bytes, status.active_leases, residents


async def _wait(probe, within_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if await probe():
            return True
        await asyncio.sleep(0.5)
    return False


async def test_kill_9_of_the_node_worker_during_an_invoke(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    async with running_stack(dev_server_env.client, database_url, telemetry_interval_s=2.0) as stack:
        # This node runs as a process of its own, so it can be killed like a crashed host.
        await stack.node_workers[NODE].shutdown()
        node = _node_process(dev_server_env, tmp_path)
        try:
            assert await _wait(lambda: _fresh(stack), 60), "the node process never sampled"
            before, _, _ = await _gpu(stack)

            handle = await stack.start_request("rag.embedding@1", tenant="rag", input={"simulate_invoke_s": 600})
            assert await _wait(lambda: _holding(stack), 60), "the request never got its lease"
            node.send_signal(signal.SIGKILL)
            node.wait(timeout=10)
            killed_at = time.monotonic()

            # The node comes back (a restarted host): it holds no model now.
            node = _node_process(dev_server_env, tmp_path)
            with pytest.raises(WorkflowFailureError) as failed:
                await asyncio.wait_for(handle.result(), timeout=INVOKE_HEARTBEAT.total_seconds() + 30)
            ended_after = time.monotonic() - killed_at
            assert isinstance(failed.value.cause, ApplicationError)
            assert failed.value.cause.type in ("TIMEOUT", "RUNTIME_CRASH")  # typed, whichever the node saw

            async def settled() -> bool:
                schedulable, leases, residents = await _gpu(stack)
                return leases == 0 and residents == 0 and schedulable == before

            assert await _wait(settled, INVOKE_HEARTBEAT.total_seconds() + 15 - ended_after), await _gpu(stack)
            assert time.monotonic() - killed_at <= INVOKE_HEARTBEAT.total_seconds() + 15
            lost = await stack.events("resident_lost", at_least=1, within_s=15)
            assert lost and lost[0]["deployment"] == "rag.embedding@1"
        finally:
            node.kill()
            node.wait(timeout=10)


async def _fresh(stack: Stack) -> bool:
    status = await stack.status()
    return any(a.id == f"{NODE}/0" and a.fresh for a in status.accelerators)


async def _holding(stack: Stack) -> bool:
    return (await stack.status()).active_leases == 1
