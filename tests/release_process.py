"""The released build's control worker, run from the release's own code, and the steps of an
upgrade between it and this checkout's build: for the upgrade test (tests/workflow/
test_upgrade.py) and its bench round (bench/upgrade.py). A helper module: tests import it, never
each other."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkerDeploymentVersion

import modelforge
from modelforge.client import ModelForgeClient
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.names import telemetry_id
from modelforge.store import Store
from modelforge.versioning import deployment_config, newer, pinned_runs, roll, set_current, upgrade_residents
from tests.worker_process import control_worker_env, start_control_worker
from workers.control import ControlWorker, build_control_worker
from workers.stack import Stack

RELEASED = "0.1.0"  # the release whose code tests/releases/ holds (docs/RELEASING.md)
RELEASE_CODE = Path(__file__).resolve().parent / "releases" / f"{RELEASED}.tar.gz"
RELEASE = WorkerDeploymentVersion("modelforge", RELEASED)
NEXT = WorkerDeploymentVersion("modelforge", modelforge.__version__)


class ReleaseWorker:
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


async def build_of(client: Client, workflow_id: str) -> str:
    """The build a run is on (its own versioning info)."""
    described = await client.get_workflow_handle(workflow_id).describe()
    return described.raw_description.workflow_execution_info.versioning_info.deployment_version.build_id


async def wait_build(client: Client, workflow_ids: Sequence[str], build: str, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        builds = {workflow_id: await build_of(client, workflow_id) for workflow_id in workflow_ids}
        if all(b == build for b in builds.values()):
            return
        assert time.monotonic() < deadline, f"not on build {build} within {within_s} s: {builds}"
        await asyncio.sleep(0.3)


async def invokes(handle: WorkflowHandle[Any, Any]) -> int:
    """How many times the request's invoke was scheduled: once, whatever moved around it."""
    history = await handle.fetch_history()
    return sum(
        1
        for event in history.events
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and event.activity_task_scheduled_event_attributes.activity_type.name == "invoke"
    )


async def move(stack: Stack, to: WorkerDeploymentVersion) -> float:
    """`modelforge upgrade`'s steps: the build becomes current, the scheduler and every node's
    telemetry continue as new onto it. Returns the seconds until all of them run on it."""
    started = time.monotonic()
    await set_current(stack.client, to)
    nodes = sorted(stack.backends)
    signalled = await roll(stack.client, ["default"], nodes, f"upgrade to build {to.build_id}")
    assert sorted(signalled) == sorted([stack.scheduler.id, *(telemetry_id(n) for n in nodes)])
    await wait_build(stack.client, signalled, to.build_id)
    return time.monotonic() - started


async def in_process_control_worker(client: Client, store: Store, version: WorkerDeploymentVersion) -> ControlWorker:
    """This checkout's control worker, in this process, versioned as `version`, on a connection
    of its own (as a control worker on its own host has: one worker per task queue and
    connection). Left by `__aexit__`."""
    config = client.service_client.config
    own = await Client.connect(config.target_host, namespace=client.namespace, data_converter=client.data_converter)
    worker = build_control_worker(
        own, store, pools=["default"], replay_check_s=0, deployment=deployment_config(version, versioned=True)
    )
    await worker.__aenter__()
    return worker


async def open_runs_on(client: Client, build: str, but: Sequence[str] = ()) -> list[str]:
    """The running runs pinned to `build` (of the deployment `modelforge`), but those named."""
    query = "ExecutionStatus = 'Running' AND TemporalWorkerDeployment = 'modelforge'"
    return [w async for w, pinned_to in pinned_runs(client, query) if w not in but and pinned_to.build_id == build]


async def drain(stack: Stack, build: str, within_s: float = 120.0) -> float:
    """Seconds until no request, job or residency run is left pinned to `build` (the scheduler
    and telemetry runs aside: they moved)."""
    long_lived = [stack.scheduler.id, *(telemetry_id(node) for node in stack.backends)]
    started = time.monotonic()
    while left := await open_runs_on(stack.client, build, but=long_lived):
        assert time.monotonic() - started < within_s, f"build {build} still runs {left} after {within_s} s"
        await asyncio.sleep(0.5)
    return time.monotonic() - started


async def residents_follow(stack: Stack, old: WorkerDeploymentVersion, new: WorkerDeploymentVersion) -> int:
    """The loaded models' residency runs after the build moved from `old` to `new`, as
    `modelforge upgrade` and the README say: an upgrade pins them to `new`
    (`upgrade_residents`); a rollback leaves them on `old`, and the operator unloads those
    models (`modelforge residency unload ... --drain`) so `old`'s worker can retire; they load
    again on demand on `new`. Returns how many runs moved or were unloaded."""
    moved, staying = await upgrade_residents(stack.client, new)
    if newer(new.build_id, old.build_id):
        assert not staying, staying
        return len(moved)
    assert not moved, moved
    client = ModelForgeClient(stack.client, pools=["default"])
    residents = {r.workflow_id: r for r in (await stack.status()).residents}
    for workflow_id in staying:
        resident = residents.get(workflow_id)
        deadline = time.monotonic() + 60
        while resident is not None:
            try:
                await client.residency("unload", resident.deployment, accelerator=resident.accelerator, drain=True)
                break
            except ModelForgeError as error:
                if error.failure == FailureClass.REQUEST_INVALID:  # unloaded meanwhile
                    break
                # RESIDENCY_CONFLICT: loading, or waking: asked again once it is ready.
                assert error.failure == FailureClass.RESIDENCY_CONFLICT and time.monotonic() < deadline, error
                await asyncio.sleep(0.5)
    return len(staying)
