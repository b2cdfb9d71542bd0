"""What each ingredient of the delegated request path costs next to a bare one-activity
workflow: the same workflow with one ingredient added at a time, interleaved in rounds on one
Temporal dev server, in one process (p50 ms and the ratio to bare).

    flock /tmp/modelforge-bench.lock .venv/bin/python bench/path_ingredients.py [ROUNDS]

- la: a local activity before the activity (the delegated request's `claim_slot`);
- hb: the activity heartbeats once as it starts (the invoke's "started" heartbeat);
- up: two search-attribute upserts, before and after (accelerator, outcome);
- patch: one `workflow.patched` marker (with the SDK's TemporalChangeVersion upsert);
- la+hb+up+patch: all of them, what a delegated request adds to a bare workflow's commands.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio import activity, workflow
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modelforge import temporal as sa
from modelforge.dev import temporal_binary
from modelforge.temporal import register_search_attributes

MODES = ("bare", "la", "hb", "up", "patch", "la+hb+up+patch")


@activity.defn(name="echo")
async def echo(p: dict[str, Any]) -> dict[str, Any]:
    return p


@activity.defn(name="echo_hb")
async def echo_hb(p: dict[str, Any]) -> dict[str, Any]:
    activity.heartbeat("started")
    return p


@activity.defn(name="claim")
async def claim(p: dict[str, Any]) -> dict[str, Any]:
    return {"lease": "x"}


@workflow.defn(name="IngredientsWorkflow", sandboxed=False)
class W:
    @workflow.run
    async def run(self, p: dict[str, Any]) -> dict[str, Any]:
        mode = p["mode"]
        if "patch" in mode:
            workflow.patched("some-patch")
        if "la" in mode:
            await workflow.execute_local_activity("claim", p, start_to_close_timeout=timedelta(seconds=5))
        if "up" in mode:
            workflow.upsert_search_attributes([sa.ACCELERATOR.value_set("n/0")])
        act = "echo_hb" if "hb" in mode else "echo"
        r: dict[str, Any] = await workflow.execute_activity(act, p, start_to_close_timeout=timedelta(seconds=30))
        if "up" in mode:
            workflow.upsert_search_attributes([sa.OUTCOME.value_set("ok")])
        return r


async def main(n: int) -> None:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), dev_server_log_level="error"
    )
    try:
        await register_search_attributes(env.client)
        client = env.client
        async with Worker(client, task_queue="bench-ingredients", workflows=[W], activities=[echo, echo_hb, claim]):
            modes = MODES
            for m in modes:  # warm-up
                for _ in range(5):
                    await client.execute_workflow(
                        W.run, {"mode": m}, id=uuid.uuid4().hex, task_queue="bench-ingredients"
                    )
            times: dict[str, list[float]] = {m: [] for m in modes}
            for _ in range(n):
                for m in modes:
                    t = time.perf_counter()
                    await client.execute_workflow(
                        W.run, {"mode": m}, id=uuid.uuid4().hex, task_queue="bench-ingredients"
                    )
                    times[m].append((time.perf_counter() - t) * 1000)
            base = statistics.median(times["bare"])
            for m in modes:
                med = statistics.median(times[m])
                print(f"{m:18s} p50 {med:6.1f} ms  {med / base:.3f}x")
    finally:
        await env.shutdown()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 60))
