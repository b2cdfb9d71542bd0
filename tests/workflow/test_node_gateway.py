"""`modelforge worker node --gateway-port`: a GPU host's node worker serving the HTTP gateway from
its own process, on its own Temporal client. A request routed to this node (the node that served
its capability last) starts eagerly: the server hands its first workflow task back in the start's
reply to this process's worker, where a gateway of its own process waits for the server's
dispatch. Run as the real process, against a real stack: the answers are the gateway's as ever,
its /metrics counts the eager starts, and SIGTERM stops both."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.catalog import example_catalog_path
from tests.worker_process import free_port
from workers.stack import Stack, running_stack

pytestmark = [pytest.mark.workflow, pytest.mark.subprocess]

NODE = "gpu-node"  # the example catalog's node
CAPABILITY, TENANT = "rag.embedding@1", "rag"


def _node_with_gateway(env: WorkflowEnvironment, home: Path, database_url: str, port: int) -> subprocess.Popen[bytes]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    environ.update(
        MODELFORGE_TEMPORAL_ADDRESS=env.client.service_client.config.target_host,
        MODELFORGE_GPU_BACKEND="simulated",
        MODELFORGE_HOME=str(home),
        MODELFORGE_DATABASE_URL=database_url,
    )
    argv = [sys.executable, "-m", "modelforge", "worker", "node", "--node", NODE]
    argv += ["--simulate-from", str(example_catalog_path()), "--gateway-port", str(port)]
    with (home / "node.log").open("ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen(argv, env=environ, stdout=log, stderr=subprocess.STDOUT)


async def _fresh(stack: Stack) -> bool:
    status = await stack.status()
    return any(a.id == f"{NODE}/0" and a.fresh for a in status.accelerators)


async def _answers(http: httpx.AsyncClient) -> bool:
    try:
        return (await http.get("/v1/models")).status_code == 200
    except httpx.TransportError:
        return False


async def _within(probe, seconds: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if await probe():
            return True
        await asyncio.sleep(0.5)
    return False


def _gauge(metrics: str, eager: str) -> float:
    found = re.search(rf'^modelforge_gateway_workflow_starts\{{eager="{eager}"\}} (\S+)$', metrics, re.MULTILINE)
    assert found is not None, metrics
    return float(found.group(1))


async def test_a_node_worker_serving_the_gateway_starts_its_routed_requests_eagerly(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    async with running_stack(dev_server_env.client, database_url, telemetry_interval_s=2.0) as stack:
        await stack.node_workers[NODE].shutdown()  # this node runs as a process of its own
        port = free_port()
        node = _node_with_gateway(dev_server_env, tmp_path, database_url, port)
        try:
            headers = {"X-ModelForge-Tenant": TENANT}
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=60) as http:
                assert await _within(lambda: _answers(http), 90), (tmp_path / "node.log").read_text()
                assert await _within(lambda: _fresh(stack), 60), "the node process never sampled"
                for n in range(4):
                    call = {"capability": CAPABILITY, "input": {"text": f"chunk {n}"}, "request_id": f"node-gw-{n}"}
                    answered = await http.post("/v1/requests", json=call)
                    assert answered.status_code == 200, answered.text
                metrics = (await http.get("/metrics")).text
            # The first may start on the control queue (no node known to serve it yet: the
            # control worker, in another process, runs it); once the node has served the
            # capability, its requests start here, from the start's reply.
            eager, plain = _gauge(metrics, "true"), _gauge(metrics, "false")
            assert eager + plain == 4, metrics
            assert eager >= 3, metrics
            node.send_signal(signal.SIGTERM)
            assert node.wait(timeout=60) == 0, (tmp_path / "node.log").read_text()
            log = (tmp_path / "node.log").read_text()
            assert "gateway_started" in log and "Traceback" not in log, log
        finally:
            if node.poll() is None:
                node.kill()
                node.wait(timeout=10)
