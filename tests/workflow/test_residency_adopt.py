"""A residency adopted by a reset scheduler (`adopt`): the scheduler, reset past the start of a
load, decides it again and finds the residency running (its start refused), so it asks that
residency for the load it waits for. Here the residency runs on the workflow's own code with its
runtime's activities stood in (the card is what is simulated) and a stand-in scheduler that keeps
the signals it hears, so each state the residency can be in when adopted is reached exactly:

- ready: it reports its load again, with the bytes it measured at the load;
- asleep (put to sleep to make room before the reset): it is woken for the request the load was
  decided for, and reports the wake as the load the scheduler waits for; a wake that fails is
  reported as a failed load, after the model is unloaded.

The end-to-end reset (a real scheduler reset past a load's start, a model still loading) is in
tests/workflow/test_replay_guard.py."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from temporalio import activity, workflow
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from modelforge.messages import (
    LoadInput,
    LoadResult,
    ReclaimInput,
    ReclaimResult,
    ResidencyInput,
    ResidentCommand,
    ResidentReport,
    RuntimeOpResult,
)
from modelforge.names import scheduler_id
from modelforge.settings import node_task_queue
from tests.builders import GiB, deployment, gpu
from workflows import ResidencyWorkflow

pytestmark = pytest.mark.workflow

LOADED = int(10 * GiB)
ASLEEP = int(1 * GiB)
AWAKE = int(9 * GiB)


@workflow.defn(name="AdoptTestScheduler", sandboxed=False)
class _Scheduler:
    """Stands in for the pool scheduler: keeps what the residency tells it, in order."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, ResidentReport]] = []

    @workflow.signal
    def resident_loaded(self, report: ResidentReport) -> None:
        self.heard.append(("resident_loaded", report))

    @workflow.signal
    def resident_slept(self, report: ResidentReport) -> None:
        self.heard.append(("resident_slept", report))

    @workflow.signal
    def resident_woke(self, report: ResidentReport) -> None:
        self.heard.append(("resident_woke", report))

    @workflow.signal
    def resident_unloaded(self, report: Any) -> None:
        self.heard.append(("resident_unloaded", report))

    @workflow.query
    def signals(self) -> list[tuple[str, bool, int]]:
        return [(name, report.ok, report.measured_bytes) for name, report in self.heard]

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: False)


class _Card:
    """The runtime's activities on a simulated card: what was asked of it, in order."""

    def __init__(self, wake_fails: bool) -> None:
        self.asked: list[str] = []
        self._wake_fails = wake_fails

    @activity.defn(name="load_model")
    async def load_model(self, request: LoadInput) -> LoadResult:
        self.asked.append("load")
        return LoadResult(measured_bytes=LOADED, load_s=0.1, pid=1)

    @activity.defn(name="health_check")
    async def health_check(self, key: str) -> None:
        self.asked.append("health_check")

    @activity.defn(name="sleep_model")
    async def sleep_model(self, key: str) -> RuntimeOpResult:
        self.asked.append("sleep")
        return RuntimeOpResult(key=key, operation="sleep", seconds=0.1, bytes_after=ASLEEP)

    @activity.defn(name="wake_model")
    async def wake_model(self, key: str) -> RuntimeOpResult:
        self.asked.append("wake")
        if self._wake_fails:
            raise ApplicationError("the runtime could not wake", type="RUNTIME_CRASH", non_retryable=True)
        return RuntimeOpResult(key=key, operation="wake", seconds=0.1, bytes_after=AWAKE)

    @activity.defn(name="unload_model")
    async def unload_model(self, key: str) -> None:
        self.asked.append("unload")

    @activity.defn(name="verify_reclaim")
    async def verify_reclaim(self, request: ReclaimInput) -> ReclaimResult:
        return ReclaimResult(reclaimed=True, message="reclaimed")


async def _adopted(env: WorkflowEnvironment, asleep: bool, wake_fails: bool = False) -> tuple[list[Any], list[str]]:
    """A residency loaded (and put to sleep when `asleep`), then adopted: what its scheduler
    heard and what its card was asked."""
    client = env.client
    pool = f"adopt-{uuid.uuid4().hex[:8]}"
    card = _Card(wake_fails)
    accelerator = gpu("adopt-node/0")
    control = f"adopt-control-{uuid.uuid4().hex[:8]}"
    activities = [
        card.load_model,
        card.health_check,
        card.sleep_model,
        card.wake_model,
        card.unload_model,
        card.verify_reclaim,
    ]
    async with (
        Worker(client, task_queue=control, workflows=[ResidencyWorkflow, _Scheduler]),
        Worker(client, task_queue=node_task_queue(accelerator.node), activities=activities),
    ):
        scheduler = await client.start_workflow(_Scheduler.run, id=scheduler_id(pool), task_queue=control)
        residency = await client.start_workflow(
            ResidencyWorkflow.run,
            ResidencyInput(
                pool=pool,
                key="chat@1@adopt-node/0",
                deployment=deployment("chat@1", gib=10),
                accelerator=accelerator,
                device_index=0,
            ),
            id=f"resident:chat@1:adopt-node/0:{uuid.uuid4().hex[:8]}",
            task_queue=control,
        )

        async def heard(count: int) -> list[Any]:
            for _ in range(200):
                signals = await scheduler.query(_Scheduler.signals)
                if len(signals) >= count:
                    return signals
                await env.sleep(0.05)
            raise AssertionError(f"the scheduler heard {await scheduler.query(_Scheduler.signals)}")

        await heard(1)
        if asleep:
            await residency.signal(ResidencyWorkflow.command, ResidentCommand("sleep"))
            await heard(2)
        before = len(await scheduler.query(_Scheduler.signals))
        await residency.signal(ResidencyWorkflow.command, ResidentCommand("adopt", reason="a test"))
        signals = await heard(before + 1)
        await scheduler.terminate()
        if not wake_fails:  # a residency whose wake failed has ended ("wake failed")
            await residency.terminate()
        return signals, card.asked


async def test_a_ready_residency_adopted_reports_its_load_again(dev_server_env: WorkflowEnvironment) -> None:
    signals, asked = await _adopted(dev_server_env, asleep=False)
    assert signals == [("resident_loaded", True, LOADED), ("resident_loaded", True, LOADED)]
    assert asked == ["load", "health_check"]  # nothing loaded a second time


async def test_an_asleep_residency_adopted_wakes_and_reports_the_wake_as_its_load(
    dev_server_env: WorkflowEnvironment,
) -> None:
    signals, asked = await _adopted(dev_server_env, asleep=True)
    assert signals == [
        ("resident_loaded", True, LOADED),
        ("resident_slept", True, ASLEEP),
        ("resident_loaded", True, AWAKE),
    ]
    assert asked == ["load", "health_check", "sleep", "wake"]


async def test_an_adopted_residency_whose_wake_fails_is_unloaded_and_reports_a_failed_load(
    dev_server_env: WorkflowEnvironment,
) -> None:
    signals, asked = await _adopted(dev_server_env, asleep=True, wake_fails=True)
    assert signals[-1][:2] == ("resident_loaded", False)
    assert asked == ["load", "health_check", "sleep", "wake", "unload"]
