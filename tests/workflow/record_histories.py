"""Record the histories that tests/workflow/test_replay.py replays.

    .venv/bin/python -m tests.workflow.record_histories v10

Runs the keep-warm story (cold request, warm request, a warm request started on the node's queue,
keep-warm eviction, an unknown capability), a
request to a pool whose scheduler is not running (its failure recorded by RecordEventsWorkflow), a
request whose runtime crashes (retried once on a fresh load) and a request that holds its lease
across lease heartbeats, on the time-skipping server with real Postgres, and writes one history
per workflow type into tests/histories/<version>/; then, each on a server of its own, a model put
to sleep for another and woken again (scheduler and residency histories) and a two-node gang job
(its request history), then one preempted, checkpointed on both nodes and resumed (v6 on), and a
warm request admitted on its node from a delegated slot, with the scheduler's syncs (v9 on).
Record a new version after each change to the workflows (guarded with `workflow.patched`); never
rewrite an old one: they prove old runs replay."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from modelforge.policy import PolicyConfig, PoolState
from modelforge.settings import node_task_queue
from modelforge.temporal import register_search_attributes
from tests.harness import Stack, running_stack

HISTORIES = Path(__file__).resolve().parents[1] / "histories"


async def main(version: str) -> None:
    import pgserver  # type: ignore[import-untyped]

    server = pgserver.get_server(str(Path("/tmp") / "modelforge-record-pg"), cleanup_mode="stop")
    binary = str(Path(sys.executable).parent / "temporal-test-server")
    env = await WorkflowEnvironment.start_time_skipping(test_server_existing_path=binary)
    try:
        await register_search_attributes(env.client)
        config = PolicyConfig(stale_lease_s=6.0)  # heartbeats every 2 s, so a 5 s invoke records some
        async with running_stack(env.client, server.get_uri(), config=config) as stack:
            cold = await stack.start_request("rag.embedding@1", tenant="rag", request_id="cold")
            await cold.result()
            warm = await stack.start_request("rag.embedding@1", tenant="rag", request_id="warm")
            await warm.result()
            # v6 on: a request started on the node's queue, its invoke dispatched eagerly there.
            routed = await stack.start_request(
                "rag.embedding@1", tenant="rag", request_id="routed", task_queue=node_task_queue("gpu-node")
            )
            await routed.result()
            unknown = await stack.start_request("vision.ocr@9", request_id="unknown")
            with contextlib.suppress(WorkflowFailureError):
                await unknown.result()
            crash = await stack.start_request(
                "rag.embedding@1", tenant="rag", request_id="crash", input={"simulate_fault": "RUNTIME_CRASH"}
            )
            with contextlib.suppress(WorkflowFailureError):
                await crash.result()
            held = await stack.start_request(
                "rag.embedding@1", tenant="rag", request_id="held", input={"simulate_invoke_s": 5}
            )
            await held.result()
            state = await stack.scheduler.query("state", result_type=PoolState)
            [resident_id] = [r.workflow_id for r in state.residents.values()]
            for _ in range(20):  # in steps: one long skip outlasts the RPC timeout
                await env.sleep(50)
            # Last: after it, the time-skipping server no longer skipped time here (env.sleep timed out).
            # A pool without a scheduler: the request records its failure through RecordEventsWorkflow.
            orphan = await stack.start_request("rag.embedding@1", tenant="rag", request_id="orphan", pool="nowhere")
            with contextlib.suppress(WorkflowFailureError):
                await orphan.result()
            handles = {
                "request_cold": cold,
                "request_warm": warm,
                "request_routed": routed,
                "request_unknown_capability": unknown,
                "request_runtime_crash": crash,
                "request_heartbeats": held,
                "request_no_scheduler": orphan,
                "record_events": env.client.get_workflow_handle(f"events:{orphan.id}:0"),
                "scheduler": stack.scheduler,
                "residency": env.client.get_workflow_handle(resident_id),
                "telemetry": env.client.get_workflow_handle("telemetry:gpu-node"),
            }
            (HISTORIES / version).mkdir(parents=True, exist_ok=False)
            await _write(version, handles)
    finally:
        await env.shutdown()
        server.cleanup()
    await record_sleep(version)


async def _write(version: str, handles: dict[str, WorkflowHandle[Any, Any]]) -> None:
    for name, handle in handles.items():
        history = await handle.fetch_history()
        (HISTORIES / version / f"{name}.json").write_text(history.to_json())
        print(f"{name}: {len(history.events)} events")


async def record_sleep(version: str) -> None:
    """On a server and database of their own (other catalogs, other schedulers): a model put to
    sleep for another and woken for its next request (v5 on), and a two-node gang job (v5 on)."""
    root = Path(__file__).resolve().parents[1] / "catalogs"
    await _record_catalog(version, root / "sleep.toml", _sleep_story)
    await _record_catalog(
        version, root / "gang.toml", _gang_story, PolicyConfig(preempt_min_runtime_s=1.0, preempt_grace_s=0.5)
    )
    await _record_catalog(version, root / "routing.toml", _delegation_story, delegation_sync_s=0.3)


async def _delegation_story(env: WorkflowEnvironment, stack: Stack) -> dict[str, WorkflowHandle[Any, Any]]:
    """v9 on: a warm request admitted on its node from a slot the scheduler lent the node, and the
    scheduler's `delegation_sync` updates (lent, reported, given back)."""
    await (await stack.start_request("route.embed@1", tenant="app", request_id="load")).result()
    state = await stack.scheduler.query("state", result_type=PoolState)
    [node] = [r.node for r in state.residents.values()]
    queue = node_task_queue(node)
    for n in range(50):
        handle = await stack.start_request("route.embed@1", tenant="app", request_id=f"routed-{n}", task_queue=queue)
        result = await handle.result()
        if result.timings.get("delegated"):
            break
        await asyncio.sleep(0.2)
    else:
        raise RuntimeError("no request was delegated")
    while stack.slots[node].in_use() or stack.slots[node].free_slots("route.embed@1"):
        await asyncio.sleep(0.5)  # idle: the node gives its slots back
    await asyncio.sleep(1.0)
    return {"request_delegated": handle, "scheduler_delegation": stack.scheduler}


async def _sleep_story(env: WorkflowEnvironment, stack: Stack) -> dict[str, WorkflowHandle[Any, Any]]:
    for request_id, capability in (("big1", "big.chat@1"), ("small", "small.chat@1"), ("big2", "big.chat@1")):
        await (await stack.start_request(capability, tenant="app", request_id=request_id)).result()
    state = await stack.scheduler.query("state", result_type=PoolState)
    [big] = [r.workflow_id for r in state.residents.values() if r.deployment == "big.chat@1"]
    return {"scheduler_sleep_wake": stack.scheduler, "residency_sleep_wake": env.client.get_workflow_handle(big)}


async def _gang_story(env: WorkflowEnvironment, stack: Stack) -> dict[str, WorkflowHandle[Any, Any]]:
    gang = await stack.start_request("train.wide@1", tenant="lab", request_id="gang", input={"simulate_invoke_s": 2})
    await gang.result()
    # v6 on: a gang preempted by a higher class, checkpointed on both nodes, resumed.
    preempted = await stack.start_request(
        "train.wide@1", tenant="lab", request_id="gang-preempted", input={"simulate_invoke_s": 4}
    )
    while not (await stack.status()).active_leases:
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.5)
    await (await stack.start_request("chat.big@1", tenant="app", request_id="chat", lease_timeout_s=60)).result()
    await preempted.result()
    return {"request_gang": gang, "request_gang_preempted": preempted}


async def _record_catalog(
    version: str,
    catalog: Path,
    story: Callable[[WorkflowEnvironment, Stack], Awaitable[dict[str, WorkflowHandle[Any, Any]]]],
    config: PolicyConfig | None = None,
    delegation_sync_s: float = 0.0,
) -> None:
    import pgserver

    server = pgserver.get_server(str(Path("/tmp") / f"modelforge-record-pg-{catalog.stem}"), cleanup_mode="stop")
    binary = str(Path(sys.executable).parent / "temporal-test-server")
    env = await WorkflowEnvironment.start_time_skipping(test_server_existing_path=binary)
    try:
        await register_search_attributes(env.client)
        async with running_stack(
            env.client, server.get_uri(), catalog_path=catalog, config=config, delegation_sync_s=delegation_sync_s
        ) as stack:
            await _write(version, await story(env, stack))
    finally:
        await env.shutdown()
        server.cleanup()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m tests.workflow.record_histories <version>")
    asyncio.run(main(sys.argv[1]))
