"""The project's toy model server as the `subprocess_http` runtime tests start it: a deployment
of it, a node with a simulated card, a model loaded and what the server says of itself. A
helper module: the runtime tests import it, never each other."""

from __future__ import annotations

import sys
from typing import Any

from modelforge.domain import Deployment, GiB
from modelforge.gpu import HostMemoryDevice, NodeDevices, SimulatedDevice, SimulatedGpuBackend
from modelforge.runtimes import LoadedModel, SubprocessHttpRuntime

UUID = "GPU-5a1e0000-0000-4000-8000-00000000abcd"


def toy(*extra: str, api: str = "openai_embeddings", **config: str) -> Deployment:
    return Deployment(
        capability="toy.embedding@1",
        envelope_bytes=2 * GiB,
        idle_bytes=1 * GiB,
        runtime="subprocess_http",
        command=[sys.executable, "-m", "modelforge.runtimes.toy_server", "--port", "{port}", *extra],
        runtime_config={"api": api, "ready_timeout_s": "20", "stop_grace_s": "2", **config},
    )


def devices(host: bool = False) -> NodeDevices:
    gpus = SimulatedGpuBackend([SimulatedDevice(0, UUID, "Simulated L4", 24 * GiB)])
    return NodeDevices(gpus, HostMemoryDevice("n", 8 * GiB) if host else None)


def quiet(_: str) -> None:
    return None


async def loaded(runtime: SubprocessHttpRuntime, deployment: Deployment, device: int = 0) -> LoadedModel:
    return await runtime.load(f"{deployment.capability}@n/{device}", deployment, device, UUID, quiet)


async def info(runtime: SubprocessHttpRuntime, model: LoadedModel) -> dict[str, Any]:
    server = runtime._servers[model.resident_key]
    answer = await server.client.get("/info")
    result: dict[str, Any] = answer.json()
    return result
