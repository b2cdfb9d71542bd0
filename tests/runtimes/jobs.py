"""A node's job runtime as the job tests drive it: a simulated card and the host's memory, the
node's activities over a `SubprocessJobRuntime`, and the activity context a request workflow's
invoke gives them. A helper module: the job tests import it, never each other."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.testing import ActivityEnvironment

from activities.node import NodeActivities
from modelforge.domain import Deployment, GiB
from modelforge.gpu import CPU_DEVICE_INDEX, HostMemoryDevice, NodeDevices, SimulatedDevice, SimulatedGpuBackend
from modelforge.messages import InvokeInput, LoadInput
from modelforge.runtimes import SubprocessJobRuntime

ROOT = Path(__file__).resolve().parents[2]
MERGE = ROOT / "examples" / "jobs" / "merge_slerp.py"
UUID = "GPU-5a1e0000-0000-4000-8000-00000000abcd"
RUN = "run-1"
CPU_KEY = "merge.job@1@n/cpu"


def job(command: list[str], **config: str) -> Deployment:
    return Deployment(
        capability="merge.job@1",
        envelope_bytes=1 * GiB,
        runtime="subprocess_job",
        command=command,
        runtime_config={"input_args": "true", "preempt_grace_s": "5", **config},
    )


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@dataclasses.dataclass
class Node:
    activities: NodeActivities
    runtime: SubprocessJobRuntime
    store: Path
    home: Path
    beats: list[str]

    def env(self, run: str = RUN, max_duration_s: float = 120.0) -> ActivityEnvironment:
        """An activity context as the request workflow's invoke has one: its run and max_duration."""
        environment = ActivityEnvironment()
        environment.info = dataclasses.replace(
            ActivityEnvironment.default_info(),
            workflow_run_id=run,
            scheduled_time=datetime.now(UTC),
            schedule_to_close_timeout=timedelta(seconds=max_duration_s),
        )
        environment.on_heartbeat = lambda *details: self.beats.extend(str(d) for d in details)
        return environment

    async def load(self, deployment: Deployment, key: str = CPU_KEY) -> None:
        accelerator, index = ("n/cpu", CPU_DEVICE_INDEX) if key.endswith("/cpu") else ("n/0", 0)
        await self.env().run(self.activities.load_model, LoadInput(key, deployment, accelerator, index, UUID))

    async def invoke(self, request_id: str, payload: dict[str, Any], key: str = CPU_KEY, **kw: Any) -> dict[str, Any]:
        env = kw.pop("env", None) or self.env()
        request = InvokeInput(key=key, lease_id=f"lease-{request_id}", payload=payload, request_id=request_id, **kw)
        result = await env.run(self.activities.invoke, request)
        output: dict[str, Any] = result.output
        return output


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    devices = NodeDevices(
        SimulatedGpuBackend([SimulatedDevice(0, UUID, "Simulated L4", 24 * GiB)]), HostMemoryDevice("n", 8 * GiB)
    )
    runtime = SubprocessJobRuntime(devices, tmp_path / "home", "n")
    store = tmp_path / "store"
    activities = NodeActivities("n", devices, {"subprocess_job": runtime}, checkpoint_root=store)
    try:
        yield Node(activities, runtime, store, tmp_path / "home", [])
    finally:
        await runtime.close()  # no job outlives a test, failed or not
        assert not runtime.running_pids()


MERGE_ARGS = ["--layers", "6", "--dim", "64", "--t", "0.3"]
