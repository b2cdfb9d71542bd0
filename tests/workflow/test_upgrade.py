"""An upgrade from the released build, and a rollback to it, by Worker Versioning with work in
flight, on the real Temporal dev server. Release 0.1.0's own code (tests/releases/0.1.0.tar.gz,
`git archive` of the tag `v0.1.0`: docs/RELEASING.md) runs the release's control worker, a
process of its own, serving a busy pool, a job (a real process, subprocess_job) and a streamed
chat answer; this commit's control worker starts beside it and becomes current; the scheduler and
telemetry move to it at a continue-as-new, the release's runs finish on the release's build, and
the release's worker is retired. Then the same back: the release's worker again, made current,
this commit's runs finishing on this commit's build. The node workers are this commit's and
unversioned, as in production (modelforge/versioning.py): a release's requests call this commit's
activities there. Their devices are simulated."""

from __future__ import annotations

import asyncio
import json
import sys
import tarfile
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle, WorkflowQueryFailedError
from temporalio.common import WorkerDeploymentVersion
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

import modelforge
from modelforge.catalog import example_catalog_path, load_catalog_file
from modelforge.client import job_input
from modelforge.messages import RequestResult, StreamTarget
from modelforge.names import telemetry_id
from modelforge.store import Store
from modelforge.versioning import adopt_stranded, set_current
from tests.asgi_server import serve_app
from tests.release_process import (
    NEXT,
    RELEASE,
    RELEASE_CODE,
    RELEASED,
    ReleaseWorker,
    build_of,
    drain,
    in_process_control_worker,
    invokes,
    move,
    residents_follow,
    wait_build,
)
from workers.control import ControlWorker
from workers.stack import Stack, running_stack

pytestmark = pytest.mark.workflow

EMBEDDING = "rag.embedding@1"  # concurrency 1: one holds the card's slot, the others queue
JOB = "upgrade.job@1"  # a real job process on the desktop card (subprocess_job), 10 s long
CHAT = "chat.small@1"
# The example catalog and the job: a Python process that sleeps as long as its argument says,
# then writes an output file, so a run cut short or run twice shows in its answer.
_JOB_CODE = (
    "import os, sys, time; time.sleep(float(sys.argv[1])); "
    "open(os.path.join(os.environ['MODELFORGE_OUTPUT_DIR'], 'done'), 'w').write(sys.argv[1])"
)
JOB_DEPLOYMENT = f"""
[[deployments]]
capability = "{JOB}"
envelope_bytes = 1073741824
residency = "none"
runtime = "subprocess_job"
command = {json.dumps([sys.executable, "-c", _JOB_CODE])}
runtime_config = {{ input_args = "true" }}
accelerators = ["desktop/0"]
"""


def _gateway(received: dict[str, list[dict[str, Any]]]) -> FastAPI:
    """Stands for the gateway's stream endpoint: keeps each stream's pushed chunks."""
    app = FastAPI()

    @app.post("/internal/streams/{stream_id}")
    async def receive(stream_id: str, request: Request) -> JSONResponse:
        for line in (await request.body()).splitlines():
            received.setdefault(stream_id, []).append(json.loads(line))
        return JSONResponse({"received": len(received[stream_id])})

    return app


async def _in_flight(stack: Stack, streams: str) -> list[WorkflowHandle[Any, Any]]:
    """A long invoke holding its lease (the job), a streamed chat answer being pushed to
    `streams`, and a busy pool (one embedding invoke holding the concurrency-1 slot, four queued
    behind it). The job first."""
    job = await stack.start_request(JOB, tenant="lab", input=job_input(["10"]), max_duration_s=120, lease_timeout_s=120)
    request_id = f"chat-{time.monotonic_ns()}"
    chat = await stack.start_request(
        CHAT,
        request_id=request_id,
        input={"messages": [{"role": "user", "content": "one two three four five six"}], "simulate_invoke_s": 6},
        stream=StreamTarget(url=streams, stream_id=request_id),
        lease_timeout_s=120,
    )
    busy = [
        await stack.start_request(EMBEDDING, tenant="rag", input={"simulate_invoke_s": 1.5}, lease_timeout_s=120)
        for _ in range(5)
    ]
    deadline = time.monotonic() + 30
    while not {JOB, CHAT, EMBEDDING} <= {r.capability for r in (await stack.status()).residents if r.active_leases}:
        assert time.monotonic() < deadline, "the job, the chat and the busy pool did not hold leases within 30 s"
        await asyncio.sleep(0.2)
    return [job, chat, *busy]


async def _one_build_to_the_next(
    stack: Stack,
    retire_old: Callable[[], Awaitable[None]],
    old_version: WorkerDeploymentVersion,
    new: WorkerDeploymentVersion,
    streams: tuple[str, dict[str, list[dict[str, Any]]]],
) -> tuple[list[WorkflowHandle[Any, Any]], float]:
    """Work in flight on `old_version`; `new` becomes current and the long-lived workflows move;
    new work runs on `new`, the old work finishes on `old_version`, then `old` is retired."""
    url, received = streams
    before = await _in_flight(stack, url)
    job, chat = before[0], before[1]
    moved_s = await move(stack, new)
    await residents_follow(stack, old_version, new)
    after = [
        await stack.start_request(EMBEDDING, tenant="rag", input={"simulate_invoke_s": 0.2}, lease_timeout_s=120)
        for _ in range(3)
    ]
    assert not (await job.describe()).close_time, "the job still runs after the scheduler moved"
    results = await asyncio.gather(*(handle.result() for handle in [*before, *after]))
    # Every request ended, with its answer (a typed failure would have raised here).
    assert all(isinstance(r, RequestResult) and r.output for r in results)
    # The job's process ran once, to its end: one attempt, its output written.
    ran = results[0].output
    assert ran["exit_code"] == 0 and [a["outcome"] for a in ran["attempts"]] == ["succeeded"], ran
    assert [o["path"] for o in ran["outputs"]] == ["done"], ran["outputs"]
    # The chat's answer reached the client as it was generated, every piece once, in order.
    pieces = received[chat.id.split(":", 2)[-1]]
    assert len(pieces) >= 3 and "".join(p.get("delta", "") for p in pieces) == results[1].output["text"]
    # Pinned: the old build's runs finished on it, the new ones ran on the new build.
    assert {await build_of(stack.client, h.id) for h in before} == {old_version.build_id}
    assert {await build_of(stack.client, h.id) for h in after} == {new.build_id}
    await drain(stack, old_version.build_id)  # its runs ended or moved: none left for it
    await retire_old()
    return [*before, *after], moved_s


def test_the_recorded_release_is_the_release_it_names_and_main_is_past_it() -> None:
    """tests/releases/ holds the code of the release named here, whose histories are kept beside
    it, and main carries a later version (docs/RELEASING.md, step 6)."""
    with tarfile.open(RELEASE_CODE) as archive:
        init = archive.extractfile("modelforge/__init__.py")
        assert init is not None
        assert f'__version__ = "{RELEASED}"' in init.read().decode()
        assert {"workflows/scheduler.py", "workflows/request.py", "workers/control.py"} <= set(archive.getnames())
    assert (RELEASE_CODE.parents[1] / "histories" / RELEASED).is_dir()
    assert modelforge.__version__ != RELEASED


async def test_an_upgrade_from_the_release_and_a_rollback_to_it_with_work_in_flight(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    began = time.monotonic()
    client = dev_server_env.client
    store = await Store.open(database_url)
    await store.migrate()
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(example_catalog_path().read_text() + JOB_DEPLOYMENT)
    await store.apply_catalog(load_catalog_file(catalog)[0])
    release = ReleaseWorker(client, database_url, tmp_path / "release")
    assert release.imports_its_own_code(), "the release's worker would run this checkout's code"
    releases = [release]
    await set_current(client, RELEASE)  # the release's worker is polling once this returns
    workers: list[ControlWorker] = []
    received: dict[str, list[dict[str, Any]]] = {}
    server, serving, port = await serve_app(_gateway(received))
    streams = (f"http://127.0.0.1:{port}/internal/streams", received)
    try:
        async with running_stack(client, database_url, catalog, control_in_process=False) as stack:
            assert await build_of(client, stack.scheduler.id) == RELEASE.build_id
            first_run = (await stack.scheduler.describe()).run_id

            # The upgrade: this commit's control worker beside the release's.
            workers.append(await in_process_control_worker(client, store, NEXT))
            upgraded, upgrade_moved_s = await _one_build_to_the_next(stack, release.stop, RELEASE, NEXT, streams)
            assert (await stack.scheduler.describe()).run_id != first_run

            # The rollback: the release's control worker back, made current again.
            releases.append(ReleaseWorker(client, database_url, tmp_path / "release"))

            async def retire_next() -> None:
                await workers[0].__aexit__(None, None, None)

            rolled_back, rollback_moved_s = await _one_build_to_the_next(stack, retire_next, NEXT, RELEASE, streams)
            await wait_build(client, [stack.scheduler.id], RELEASE.build_id)

            requests = upgraded + rolled_back
            # Nothing ran twice: each invoke scheduled once, each lease granted and released once.
            assert [await invokes(h) for h in requests] == [1] * len(requests)
            ids = {h.id.split(":", 2)[-1] for h in requests}  # request:<capability>:<request id>
            granted = await stack.events("lease_granted", at_least=len(requests), within_s=20)
            released = await stack.events("lease_released", at_least=len(requests), within_s=20)
            for events in (granted, released):
                mine = [e["request_id"] for e in events if e["request_id"] in ids]
                assert sorted(mine) == sorted(ids), "a lease granted or released twice, or an event lost"
            # No lease lost across the moves: the pool holds none, queues nothing.
            status = await stack.status()
            assert sum(status.queue_depth.values()) == 0
            assert all(a.leased_bytes == 0 for a in status.accelerators)
            assert all(r.active_leases == 0 for r in status.residents)
            # Neither build failed a scheduler task (a nondeterminism error would show here).
            history = await stack.scheduler.fetch_history()
            assert not [e for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED]
            print(
                f"\nupgrade with work in flight: scheduler+telemetry moved in {upgrade_moved_s:.1f} s,"
                f" rollback in {rollback_moved_s:.1f} s; {len(requests)} requests;"
                f" whole test {time.monotonic() - began:.1f} s"
            )
    finally:
        server.should_exit = True
        await serving
        for worker in workers:
            if any(w.is_running for w in worker.workers):
                await worker.__aexit__(None, None, None)
        for process in releases:
            await process.stop()
        await store.close()


async def test_runs_left_pinned_to_a_release_whose_workers_are_gone_follow_the_new_build(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    """The whole host stopped and started on the next release (`modelforge dev` after an
    upgrade): the scheduler and telemetry runs stay pinned to the release until they continue
    as new, a request in flight stays pinned to it until it ends, and no worker of it is left to
    run their next task. `adopt_stranded` sets them to follow the current build: the scheduler
    answers again on it, and the request ends with its answer, its invoke run once and its
    lease released."""
    client = dev_server_env.client
    store = await Store.open(database_url)
    await store.migrate()
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(example_catalog_path().read_text())
    await store.apply_catalog(load_catalog_file(catalog)[0])
    release = ReleaseWorker(client, database_url, tmp_path / "release")
    workers: list[ControlWorker] = []
    try:
        await set_current(client, RELEASE)
        async with running_stack(client, database_url, catalog, control_in_process=False) as stack:
            long_lived = [stack.scheduler.id, *(telemetry_id(node) for node in stack.backends)]
            await wait_build(client, long_lived, RELEASE.build_id)
            in_flight = await stack.start_request(
                EMBEDDING, tenant="rag", input={"simulate_invoke_s": 4}, lease_timeout_s=120
            )
            deadline = time.monotonic() + 30
            while not any(r.active_leases for r in (await stack.status()).residents if r.capability == EMBEDDING):
                assert time.monotonic() < deadline, "the request did not hold its lease within 30 s"
                await asyncio.sleep(0.2)
            assert await build_of(client, in_flight.id) == RELEASE.build_id
            loaded = "ExecutionStatus = 'Running' AND WorkflowId STARTS_WITH 'resident:'"
            resident_runs = [w.id async for w in client.list_workflows(loaded)]
            assert resident_runs, "the embedding model's residency run"
            await release.stop()  # every worker of the release gone, the request's invoke running
            workers.append(await in_process_control_worker(client, store, NEXT))
            await set_current(client, NEXT)  # the next release's worker, current, as it makes itself
            with pytest.raises(
                (RPCError, WorkflowQueryFailedError)
            ):  # stranded: its next task waits for a 0.1.0 worker
                await stack.scheduler.query("status", rpc_timeout=timedelta(seconds=3))
            await asyncio.sleep(5)  # the invoke ended: the request's next task waits for a 0.1.0 worker too
            assert not (await in_flight.describe()).close_time
            moved = await adopt_stranded(client, NEXT, long_lived)
            # The long-lived runs, the request, and the loaded model's residency run (pinned too).
            assert moved[: len(long_lived)] == long_lived
            assert sorted(moved[len(long_lived) :]) == sorted([in_flight.id, *resident_runs])
            await wait_build(client, long_lived, NEXT.build_id, within_s=30)
            assert (await stack.status()).accelerators  # it answers, on the new build
            answer = await asyncio.wait_for(in_flight.result(), 60)
            assert answer.output and await invokes(in_flight) == 1
            assert await build_of(client, in_flight.id) == NEXT.build_id
            assert await adopt_stranded(client, NEXT, long_lived) == []  # nothing left to move
            status = await stack.status()
            assert all(r.active_leases == 0 for r in status.residents), "the stranded request's lease is still held"
            request = await stack.start_request(EMBEDDING, tenant="rag", input={"simulate_invoke_s": 3})
            deadline = time.monotonic() + 30
            while await build_of(client, request.id) != NEXT.build_id:
                assert time.monotonic() < deadline, "the request did not start on the new build"
                await asyncio.sleep(0.2)
            # Started again on the older release, a host would not pin this build's runs to it:
            # an older release is not promised to replay a newer one's runs. They are left.
            assert await adopt_stranded(client, RELEASE, []) == []
            assert await build_of(client, request.id) == NEXT.build_id
            assert (await request.result()).output
    finally:
        for worker in workers:
            await worker.__aexit__(None, None, None)
        await release.stop()
        await store.close()
