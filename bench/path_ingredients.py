"""What each ingredient of the delegated request path costs next to a bare one-activity
workflow: the same workflow with one ingredient added at a time, interleaved in rounds on one
Temporal dev server, in one process (p50 ms and the ratio to bare).

    flock /tmp/modelforge-bench.lock .venv/bin/python -m bench.path_ingredients [ROUNDS] [--burst N]

With `--burst N`: bursts of N concurrent workflows of each kind instead, interleaved, three
rounds: completed per second and the CPU each workflow cost this process (the workflow and the
client, with the SDK's core threads) and the Temporal dev server, from /proc. On a machine whose
cores are all busy in a burst, the throughput ratio follows the CPU per workflow.

- la: a local activity before the activity (the delegated request's `claim_slot`);
- hb: the activity heartbeats once as it starts (the invoke's "started" heartbeat);
- up: two search-attribute upserts, before and after (accelerator, outcome);
- patch: one `workflow.patched` marker (with the SDK's TemporalChangeVersion upsert);
- la+hb+up+patch: all of them, what a delegated request adds to a bare workflow's commands;
- eager: the bare workflow started with the SDK's `request_eager_start` (the server hands the
  first workflow task back in the start's reply when this process's worker polls the queue): what
  a gateway that also ran a worker for request workflows would gain. It prints how many starts the
  server made eager; where none was, the figure is the ordinary start's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from datetime import timedelta
from typing import Any

from temporalio import activity, workflow
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from bench._proc import CpuMeter
from modelforge import temporal as sa
from modelforge.dev import temporal_binary
from modelforge.temporal import register_search_attributes

MODES = ("bare", "la", "hb", "up", "patch", "la+hb+up+patch", "eager")
EAGER_STARTS: dict[str, int] = {}  # mode -> starts the server made eager


async def run_one(client: Any, mode: str) -> None:
    """One workflow of `mode`, start to result (`eager`: the bare workflow, eagerly started)."""
    eager = "eager" in mode
    handle = await client.start_workflow(
        W.run, {"mode": mode}, id=uuid.uuid4().hex, task_queue="bench-ingredients", request_eager_start=eager
    )
    if getattr(handle, "__temporal_eagerly_started", False):
        EAGER_STARTS[mode] = EAGER_STARTS.get(mode, 0) + 1
    await handle.result()


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


async def bursts(client: Any, n: int, modes: tuple[str, ...]) -> None:
    meters = {m: CpuMeter() for m in modes}
    walls = dict.fromkeys(modes, 0.0)
    rounds = 3
    for _ in range(rounds):
        for m in modes:
            meters[m].start()
            started = time.perf_counter()
            await asyncio.gather(*(run_one(client, m) for _ in range(n)))
            walls[m] += time.perf_counter() - started
            meters[m].stop()
    k = n * rounds
    base_rate = k / walls["bare"]
    base_cpu = (meters["bare"].mine + meters["bare"].theirs) / k
    print(f"bursts of {n}, {rounds} rounds each (CPU ms per workflow: this process + the dev server)")
    if EAGER_STARTS:
        print(f"starts made eager: {EAGER_STARTS}")
    for m in modes:
        mine, theirs = meters[m].mine, meters[m].theirs
        rate, per = k / walls[m], (mine + theirs) / k
        print(
            f"{m:18s} {rate:6.1f}/s {rate / base_rate:5.2f}x   CPU {mine / k * 1000:5.1f} + {theirs / k * 1000:5.1f}"
            f" = {per * 1000:5.1f} ms  {per / base_cpu:5.2f}x"
        )


async def main(n: int, burst: int = 0, modes: tuple[str, ...] = MODES) -> None:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), dev_server_log_level="error"
    )
    try:
        await register_search_attributes(env.client)
        client = env.client
        async with Worker(client, task_queue="bench-ingredients", workflows=[W], activities=[echo, echo_hb, claim]):
            for m in modes:  # warm-up
                for _ in range(5):
                    await run_one(client, m)
            EAGER_STARTS.clear()
            if burst:
                await bursts(client, burst, modes)
                return
            times: dict[str, list[float]] = {m: [] for m in modes}
            for _ in range(n):
                for m in modes:
                    t = time.perf_counter()
                    await run_one(client, m)
                    times[m].append((time.perf_counter() - t) * 1000)
            base = statistics.median(times["bare"])
            for m in modes:
                med = statistics.median(times[m])
                eager = f"  ({EAGER_STARTS.get(m, 0)} of {n} started eagerly)" if "eager" in m else ""
                print(f"{m:18s} p50 {med:6.1f} ms  {med / base:.3f}x{eager}")
    finally:
        await env.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("rounds", type=int, nargs="?", default=60)
    parser.add_argument("--burst", type=int, default=0, help="bursts of this many workflows instead")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, each a '+' of ingredients")
    args = parser.parse_args()
    modes = tuple(m for m in args.modes.split(",") if m)
    if "bare" not in modes:
        modes = ("bare", *modes)
    asyncio.run(main(args.rounds, args.burst, modes))
