"""Record the histories of a release, which tests/workflow/test_replay.py replays.

    flock /tmp/mf-test.lock .venv/bin/python -m tests.workflow.record_histories [--replace] [VERSION]

VERSION defaults to the version in pyproject.toml; the set goes to tests/histories/<VERSION>/
(written into a scratch folder first and moved there once complete; --replace swaps out a set
already there, for re-recording before the release is tagged: a tagged release's set is never
rewritten). Every workflow type writes at least one history. docs/RELEASING.md says when.

Runs the keep-warm story (cold request, warm request, a warm request started on the node's queue,
keep-warm eviction, an unknown capability), a
request to a pool whose scheduler is not running (its failure recorded by RecordEventsWorkflow), a
request whose runtime crashes (retried once on a fresh load) and a request that holds its lease
across lease heartbeats, on the time-skipping server with real Postgres, and writes one history
per workflow type into tests/histories/<version>/; then, each on a server of its own, a model put
to sleep for another and woken again (scheduler and residency histories) and a two-node gang job
(its request history), then one preempted, checkpointed on both nodes and resumed, and a warm
request admitted on its node from a delegated slot, with the scheduler's syncs."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import tempfile
import tomllib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from modelforge.policy import PolicyConfig, PoolState
from modelforge.settings import node_task_queue
from modelforge.temporal import register_search_attributes
from workers.stack import Stack, running_stack

HISTORIES = Path(__file__).resolve().parents[1] / "histories"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def project_version() -> str:
    version: str = tomllib.loads(PYPROJECT.read_text())["project"]["version"]
    return version


def record(version: str, replace: bool = False) -> Path:
    """Record the set into a scratch folder, then move it to tests/histories/<version>/."""
    target = HISTORIES / version
    if target.exists() and not replace:
        raise SystemExit(f"{target} exists: a release's histories are not rewritten (--replace before its tag)")
    scratch = Path(tempfile.mkdtemp(prefix=f"modelforge-histories-{version}-"))
    try:
        asyncio.run(main(scratch))
        if target.exists():
            shutil.rmtree(target)
        shutil.move(scratch, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


async def main(folder: Path) -> None:
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
            # A request started on the node's queue, its invoke dispatched eagerly there.
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
            await _write(folder, handles)
    finally:
        await env.shutdown()
        server.cleanup()
    await record_sleep(folder)


async def _write(folder: Path, handles: dict[str, WorkflowHandle[Any, Any]]) -> None:
    for name, handle in handles.items():
        history = await handle.fetch_history()
        (folder / f"{name}.json").write_text(history.to_json())
        print(f"{name}: {len(history.events)} events")


async def record_sleep(folder: Path) -> None:
    """On a server and database of their own (other catalogs, other schedulers): a model put to
    sleep for another and woken for its next request, a two-node gang job, and delegation."""
    root = Path(__file__).resolve().parents[1] / "catalogs"
    await _record_catalog(folder, root / "sleep.toml", _sleep_story)
    await _record_catalog(
        folder, root / "gang.toml", _gang_story, PolicyConfig(preempt_min_runtime_s=1.0, preempt_grace_s=0.5)
    )
    await _record_catalog(folder, root / "routing.toml", _delegation_story, delegation_sync_s=0.3)


async def _delegation_story(env: WorkflowEnvironment, stack: Stack) -> dict[str, WorkflowHandle[Any, Any]]:
    """A warm request admitted on its node from a slot the scheduler lent the node, and the
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
    # A gang preempted by a higher class, checkpointed on both nodes, resumed.
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
    folder: Path,
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
            await _write(folder, await story(env, stack))
    finally:
        await env.shutdown()
        server.cleanup()


if __name__ == "__main__":
    args = sys.argv[1:]
    replace = "--replace" in args
    rest = [arg for arg in args if arg != "--replace"]
    if len(rest) > 1 or any(arg.startswith("-") for arg in rest):
        raise SystemExit("usage: python -m tests.workflow.record_histories [--replace] [version]")
    print(f"recorded {record(rest[0] if rest else project_version(), replace)}")
