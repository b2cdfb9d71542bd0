"""The real-GPU check, for a machine with an NVIDIA GPU (no Temporal or Postgres needed):

    .venv/bin/python scripts/gpu_check.py [--out gpu_check.json]

NVML inventory (cards, memory, processes, NVLink groups, health), the built-in embedding model
loaded on card 0 through the node's own activities, its functional health check, its envelope
profiled, unloaded, and the reclaim of its memory verified through NVML. Prints one JSON object."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from temporalio.testing import ActivityEnvironment

from activities.node import NodeActivities
from modelforge.domain import Deployment, GiB
from modelforge.gpu import NodeDevices, NvmlGpuBackend
from modelforge.messages import PROFILE_OPERATION, InvokeInput, LoadInput, ReclaimInput
from workers.node import node_runtimes


async def check() -> dict[str, Any]:
    backend = NvmlGpuBackend()
    devices = NodeDevices(backend)
    report: dict[str, Any] = {
        "inventory": [
            {
                "index": s.index,
                "uuid": s.uuid,
                "name": s.name,
                "total_bytes": s.total_bytes,
                "used_bytes": s.used_bytes,
                "processes": [(p.pid, p.used_bytes) for p in s.processes],
                "nvlink_group": s.nvlink_group,
                "healthy": s.healthy,
                "health_reason": s.health_reason,
                "temperature_c": s.temperature_c,
            }
            for s in backend.sample()
        ]
    }
    card = report["inventory"][0]
    node = NodeActivities("gpu-check", devices, node_runtimes(devices, Path("/tmp/modelforge-gpu-check"), "gpu-check"))
    environment = ActivityEnvironment()
    deployment = Deployment(capability="rag.embedding@1", envelope_bytes=2 * GiB, runtime="sentence_transformers")
    key = "rag.embedding@1@gpu-check/0"
    started = time.monotonic()
    loaded = await environment.run(node.load_model, LoadInput(key, deployment, "gpu-check/0", 0, card["uuid"]))
    report["load"] = {"seconds": round(time.monotonic() - started, 3), "measured_bytes": loaded.measured_bytes}
    await environment.run(node.health_check, key)
    spec = {"batch_sizes": [1, 32, 256], "context_words": [16, 256]}
    profiled = await environment.run(
        node.invoke, InvokeInput(key=key, lease_id="gpu-check", payload=spec, operation=PROFILE_OPERATION)
    )
    report["envelope"] = profiled.output["profile"]
    report["unload_s"] = await environment.run(node.unload_model, key)
    reclaim = await environment.run(node.verify_reclaim, ReclaimInput(key, "gpu-check/0", timeout_s=30))
    report["reclaim"] = {"reclaimed": reclaim.reclaimed, "message": reclaim.message}
    report["after"] = [(s.index, s.used_bytes) for s in backend.sample()]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    options = parser.parse_args()
    report = asyncio.run(check())
    text = json.dumps(report, indent=2)
    print(text)
    if options.out:
        options.out.write_text(text)


if __name__ == "__main__":
    main()
