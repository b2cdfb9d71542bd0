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
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle, WorkflowQueryFailedError
from temporalio.common import WorkerDeploymentVersion
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

import modelforge
from modelforge.catalog import example_catalog_path, load_catalog_file
from modelforge.client import job_input
from modelforge.messages import RequestResult, StreamTarget
from modelforge.names import telemetry_id
from modelforge.store import Store
from modelforge.versioning import adopt_stranded, deployment_config, roll, set_current
from tests.asgi_server import serve_app
from tests.worker_process import control_worker_env, start_control_worker
from workers.control import ControlWorker, build_control_worker
from workers.stack import Stack, running_stack

pytestmark = pytest.mark.workflow

RELEASED = "0.1.0"  # the release whose code tests/releases/ holds (docs/RELEASING.md)
RELEASE_CODE = Path(__file__).resolve().parents[1] / "releases" / f"{RELEASED}.tar.gz"
RELEASE = WorkerDeploymentVersion("modelforge", RELEASED)
NEXT = WorkerDeploymentVersion("modelforge", modelforge.__version__)
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


async def _own_client(client: Client) -> Client:
    """A connection of its own, as a control worker on its own host has (one worker per task
    queue and connection)."""
    config = client.service_client.config
    return await Client.connect(config.target_host, namespace=client.namespace, data_converter=client.data_converter)


async def _control_worker(client: Client, store: Store, version: WorkerDeploymentVersion) -> ControlWorker:
    """This commit's control worker, in this process."""
    worker = build_control_worker(
        await _own_client(client),
        store,
        pools=["default"],
        replay_check_s=0,
        deployment=deployment_config(version, versioned=True),
    )
    await worker.__aenter__()
    return worker


class _Release:
    """The released build's control worker: `modelforge worker control` run from the release's
    own code (its archive unpacked; PYTHONPATH and the working directory put it before this
    checkout's packages), stopped as an operator stops it (SIGTERM, exit status 0)."""

    def __init__(self, client: Client, database_url: str, where: Path) -> None:
        self.code = where / "code"
        if not self.code.exists():
            with tarfile.open(RELEASE_CODE) as archive:
                archive.extractall(self.code, filter="data")
        target = client.service_client.config.target_host
        self.environ = control_worker_env(
            target, database_url, where / "home", PYTHONPATH=str(self.code), MODELFORGE_WORKER_BUILD_ID=RELEASE.build_id
        )
        self.log = where / "control.log"
        self.process = start_control_worker(self.environ, self.log, cwd=self.code)

    def imports_its_own_code(self) -> bool:
        ran = subprocess.run(
            [sys.executable, "-c", "import modelforge, workflows; print(modelforge.__file__, workflows.__file__)"],
            cwd=self.code,
            env=self.environ,
            capture_output=True,
            text=True,
            check=True,
        )
        return all(Path(f).is_relative_to(self.code) for f in ran.stdout.split())

    async def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 60
            while self.process.poll() is None:
                if time.monotonic() > deadline:
                    self.process.kill()
                    raise AssertionError(f"the release's control worker did not stop: {self.log.read_text()[-3000:]}")
                await asyncio.sleep(0.2)
        assert self.process.returncode == 0, self.log.read_text()[-3000:]


async def _build_of(client: Client, workflow_id: str) -> str:
    described = await client.get_workflow_handle(workflow_id).describe()
    return described.raw_description.workflow_execution_info.versioning_info.deployment_version.build_id


async def _wait_build(client: Client, workflow_ids: Sequence[str], build: str, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        builds = {workflow_id: await _build_of(client, workflow_id) for workflow_id in workflow_ids}
        if all(b == build for b in builds.values()):
            return
        assert time.monotonic() < deadline, f"not on build {build} within {within_s} s: {builds}"
        await asyncio.sleep(0.3)


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


async def _invokes(handle: WorkflowHandle[Any, Any]) -> int:
    """How many times the request's invoke was scheduled: once, whatever moved around it."""
    history = await handle.fetch_history()
    return sum(
        1
        for event in history.events
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and event.activity_task_scheduled_event_attributes.activity_type.name == "invoke"
    )


async def _move(stack: Stack, to: WorkerDeploymentVersion) -> float:
    """`modelforge upgrade`'s steps: the build becomes current, the scheduler and every node's
    telemetry continue as new onto it. Returns the seconds until all of them run on it."""
    started = time.monotonic()
    await set_current(stack.client, to)
    nodes = sorted(stack.backends)
    signalled = await roll(stack.client, ["default"], nodes, f"upgrade to build {to.build_id}")
    assert sorted(signalled) == sorted([stack.scheduler.id, *(telemetry_id(n) for n in nodes)])
    await _wait_build(stack.client, signalled, to.build_id)
    return time.monotonic() - started


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
    moved_s = await _move(stack, new)
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
    assert {await _build_of(stack.client, h.id) for h in before} == {old_version.build_id}
    assert {await _build_of(stack.client, h.id) for h in after} == {new.build_id}
    await retire_old()  # none of its runs is left open
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
    release = _Release(client, database_url, tmp_path / "release")
    assert release.imports_its_own_code(), "the release's worker would run this checkout's code"
    releases = [release]
    await set_current(client, RELEASE)  # the release's worker is polling once this returns
    workers: list[ControlWorker] = []
    received: dict[str, list[dict[str, Any]]] = {}
    server, serving, port = await serve_app(_gateway(received))
    streams = (f"http://127.0.0.1:{port}/internal/streams", received)
    try:
        async with running_stack(client, database_url, catalog, control_in_process=False) as stack:
            assert await _build_of(client, stack.scheduler.id) == RELEASE.build_id
            first_run = (await stack.scheduler.describe()).run_id

            # The upgrade: this commit's control worker beside the release's.
            workers.append(await _control_worker(client, store, NEXT))
            upgraded, upgrade_moved_s = await _one_build_to_the_next(stack, release.stop, RELEASE, NEXT, streams)
            assert (await stack.scheduler.describe()).run_id != first_run

            # The rollback: the release's control worker back, made current again.
            releases.append(_Release(client, database_url, tmp_path / "release"))

            async def retire_next() -> None:
                await workers[0].__aexit__(None, None, None)

            rolled_back, rollback_moved_s = await _one_build_to_the_next(stack, retire_next, NEXT, RELEASE, streams)
            await _wait_build(client, [stack.scheduler.id], RELEASE.build_id)

            requests = upgraded + rolled_back
            # Nothing ran twice: each invoke scheduled once, each lease granted and released once.
            assert [await _invokes(h) for h in requests] == [1] * len(requests)
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


async def test_a_scheduler_left_pinned_to_a_release_whose_workers_are_gone_follows_the_new_build(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    """The whole host stopped and started on the next release (`modelforge dev` after an
    upgrade): the scheduler and telemetry runs stay pinned to the release until they continue
    as new, and no worker of it is left to run their next task. `adopt_stranded` sets them to
    follow the current build, and they answer again on it."""
    client = dev_server_env.client
    store = await Store.open(database_url)
    await store.migrate()
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(example_catalog_path().read_text())
    await store.apply_catalog(load_catalog_file(catalog)[0])
    release = _Release(client, database_url, tmp_path / "release")
    workers: list[ControlWorker] = []
    try:
        await set_current(client, RELEASE)
        async with running_stack(client, database_url, catalog, control_in_process=False) as stack:
            long_lived = [stack.scheduler.id, *(telemetry_id(node) for node in stack.backends)]
            await _wait_build(client, long_lived, RELEASE.build_id)
            await release.stop()  # every worker of the release gone
            workers.append(await _control_worker(client, store, NEXT))
            await set_current(client, NEXT)  # the next release's worker, current, as it makes itself
            with pytest.raises(
                (RPCError, WorkflowQueryFailedError)
            ):  # stranded: its next task waits for a 0.1.0 worker
                await stack.scheduler.query("status", rpc_timeout=timedelta(seconds=3))
            assert sorted(await adopt_stranded(client, NEXT, long_lived)) == sorted(long_lived)
            await _wait_build(client, long_lived, NEXT.build_id, within_s=30)
            assert (await stack.status()).accelerators  # it answers, on the new build
            assert await adopt_stranded(client, NEXT, long_lived) == []  # nothing left to move
            request = await stack.start_request(EMBEDDING, tenant="rag", input={"simulate_invoke_s": 0.1})
            assert (await request.result()).output
    finally:
        for worker in workers:
            await worker.__aexit__(None, None, None)
        await release.stop()
        await store.close()
