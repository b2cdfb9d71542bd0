"""The test stack's teardown (workers/stack.py): a node worker whose shutdown does not finish
fails the test with what holds it, and the rest of the stack is still stopped."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta

import pytest
from temporalio import activity, workflow
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from modelforge.domain import Catalog
from workers import stack as harness
from workers.control import ControlWorker

started = asyncio.Event()
release = asyncio.Event()


@activity.defn(name="ignores_cancellation")
async def ignores_cancellation() -> None:
    started.set()
    while not release.is_set():  # a cancellation is swallowed: only `release` ends it
        with contextlib.suppress(asyncio.CancelledError):
            await release.wait()


@workflow.defn(name="HoldsTheWorker", sandboxed=False)
class HoldsTheWorker:
    @workflow.run
    async def run(self) -> None:
        await workflow.execute_activity(ignores_cancellation, start_to_close_timeout=timedelta(seconds=120))


async def test_a_node_worker_that_does_not_stop_fails_the_teardown_naming_what_holds_it(
    dev_server_env: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(harness, "WORKER_SHUTDOWN_S", 2.0)
    started.clear()
    release.clear()
    client = dev_server_env.client
    worker = Worker(client, task_queue="teardown-n1", workflows=[HoldsTheWorker], activities=[ignores_cancellation])
    other = Worker(client, task_queue="teardown-n2", activities=[ignores_cancellation])
    tasks = [asyncio.create_task(worker.run()), asyncio.create_task(other.run())]
    stack = harness.Stack(
        client=client,
        store=None,  # type: ignore[arg-type]  # the teardown of node workers does not use it
        catalog=Catalog(),
        scheduler=None,  # type: ignore[arg-type]
        node_workers={"n1": worker, "n2": other},
        node_tasks=tasks,
    )
    try:
        await client.start_workflow(HoldsTheWorker.run, id="holds-n1", task_queue="teardown-n1")
        await asyncio.wait_for(started.wait(), timeout=30)
        with pytest.raises(RuntimeError) as raised:
            await harness._shutdown_all(stack)
        message = str(raised.value)
        assert message.startswith("node n1's worker did not shut down in 2 s: ignores_cancellation of holds-n1 at ")
        assert "ignores_cancellation:" in message  # the activity's own frame: where it waits
        assert "n2" not in message
        assert other.is_shutdown  # the other node's worker was stopped all the same
    finally:
        release.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=30)
        with contextlib.suppress(Exception):  # ended already, or never started
            await client.get_workflow_handle("holds-n1").terminate("the test is over")


async def test_a_control_worker_that_does_not_stop_fails_the_teardown_naming_its_side_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The in-process control worker's stop is bounded the same way: a side task (the replay
    guard's, the adopter's) that swallows its cancellation is named, with where it waits."""
    monkeypatch.setattr(harness, "CONTROL_SHUTDOWN_S", 0.5)
    let_go = asyncio.Event()

    async def swallows_cancellation() -> None:
        while not let_go.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await let_go.wait()

    control = ControlWorker(workers=[])
    stuck = asyncio.create_task(swallows_cancellation())
    control._tasks.append(stuck)
    await asyncio.sleep(0)
    try:
        with pytest.raises(RuntimeError) as raised:
            await harness._stop_control(control)
        message = str(raised.value)
        assert message.startswith("the control worker did not stop in 0.5 s: side task at swallows_cancellation:")
    finally:
        let_go.set()
        await asyncio.wait_for(stuck, timeout=5)
    # Without a stuck task it stops quietly.
    await harness._stop_control(ControlWorker(workers=[]))
