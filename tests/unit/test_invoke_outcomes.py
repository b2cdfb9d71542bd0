"""The node's record of each invoke's outcome (activities/_invoke_outcomes.py): found by its
lease and request while it runs and for KEEP_S after it ends, then forgotten; bounded in number;
and what `collect_invoke` answers from it (the answer, the failure, or TIMEOUT)."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities._invoke_outcomes import InvokeOutcomes
from activities.node import NodeActivities
from modelforge.domain import Deployment, GiB
from modelforge.gpu import NodeDevices, SimulatedDevice, SimulatedGpuBackend
from modelforge.messages import NO_INVOKE_RECORD, CollectInvokeInput, InvokeInput, InvokeResult, LoadInput
from modelforge.runtimes import SimulatedRuntime


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_outcome_is_found_by_its_lease_and_request_while_it_runs_and_after_it_ends() -> None:
    clock = Clock()
    outcomes = InvokeOutcomes(keep_s=600, keep=10, clock=clock)
    running = outcomes.begin("lease-1", "req-1")
    assert outcomes.find("lease-1", "req-1") is running and not running.ended.is_set()
    assert outcomes.find("lease-1", "someone-else") is None  # another request never sees it
    assert outcomes.find("lease-2", "req-1") is None
    answer = InvokeResult(output={"ok": True}, invoke_s=0.1)
    outcomes.end("lease-1", "req-1", result=answer)
    # A slot lent to the node serves the next request under the same lease id: both are kept.
    outcomes.end("lease-1", "req-2", failure=("GPU_OOM", "out of memory", True))  # never begun: ignored
    outcomes.begin("lease-1", "req-2")
    outcomes.end("lease-1", "req-2", failure=("GPU_OOM", "out of memory", True))
    clock.now = 599.0
    found, other = outcomes.find("lease-1", "req-1"), outcomes.find("lease-1", "req-2")
    assert found is not None and found.ended.is_set() and found.result == answer
    assert other is not None and other.failure == ("GPU_OOM", "out of memory", True) and other.result is None
    clock.now = 601.0
    assert outcomes.find("lease-1", "req-1") is None  # forgotten KEEP_S after it ended
    assert len(outcomes) == 0


def test_the_earliest_ended_go_first_past_the_bound_and_a_long_running_one_holds_nothing_back() -> None:
    clock = Clock()
    outcomes = InvokeOutcomes(keep_s=600, keep=3, clock=clock)
    long_one = outcomes.begin("long", "req-long")
    for i in range(5):
        outcomes.begin(f"lease-{i}", f"req-{i}")
        clock.now += 1
        outcomes.end(f"lease-{i}", f"req-{i}", result=InvokeResult(output={}, invoke_s=1))
    # Three ended kept, the earliest ended gone; the one still running is kept, whatever the bound.
    assert [outcomes.find(f"lease-{i}", f"req-{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert outcomes.find("long", "req-long") is long_one and len(outcomes) == 4
    clock.now += 601
    outcomes.end("long", "req-long", cancelled=True)
    assert len(outcomes) == 1  # the others aged out as it ended; it is kept KEEP_S from its end
    ended = outcomes.find("long", "req-long")
    assert ended is not None and ended.cancelled


KEY = "emb@1@n/0"
DEPLOYMENT = Deployment(capability="emb@1", envelope_bytes=GiB, runtime="simulated")


async def _node() -> tuple[NodeActivities, ActivityEnvironment]:
    devices = NodeDevices(SimulatedGpuBackend([SimulatedDevice(0, "GPU-0", "Simulated L4", 24 * GiB)]), None)
    node = NodeActivities("n", devices, {"simulated": SimulatedRuntime(devices)})
    env = ActivityEnvironment()
    await env.run(node.load_model, LoadInput(KEY, DEPLOYMENT, "n/0", 0, "GPU-0"))
    return node, env


def _invoke(lease_id: str, payload: dict[str, object]) -> InvokeInput:
    return InvokeInput(key=KEY, lease_id=lease_id, payload=payload, request_id=f"req-{lease_id}")


async def test_the_node_answers_for_an_invoke_it_ran_as_it_ended_and_for_no_other_request() -> None:
    node, env = await _node()
    answered = await env.run(node.invoke, _invoke("L1", {"text": "hello"}))
    collected = await env.run(node.collect_invoke, CollectInvokeInput("L1", "req-L1"))
    assert collected == answered  # the same answer, not a second run
    with pytest.raises(ApplicationError) as failed:
        await env.run(node.invoke, _invoke("L2", {"text": "x", "simulate_fault": "GPU_OOM"}))
    with pytest.raises(ApplicationError) as kept:
        await env.run(node.collect_invoke, CollectInvokeInput("L2", "req-L2"))
    assert kept.value.type == failed.value.type == "GPU_OOM"
    with pytest.raises(ApplicationError) as unknown:
        await env.run(node.collect_invoke, CollectInvokeInput("L1", "someone-else"))
    assert unknown.value.type == NO_INVOKE_RECORD and "no record" in unknown.value.message


async def test_an_invoke_still_running_is_waited_for_and_one_stopped_midway_stays_a_timeout() -> None:
    node, env = await _node()
    running = asyncio.create_task(env.run(node.invoke, _invoke("L1", {"text": "x", "simulate_invoke_s": 0.5})))
    await asyncio.sleep(0.1)
    collected = await env.run(node.collect_invoke, CollectInvokeInput("L1", "req-L1"))
    assert collected == await running
    stopped = asyncio.create_task(env.run(node.invoke, _invoke("L2", {"text": "x", "simulate_invoke_s": 5})))
    await asyncio.sleep(0.1)
    stopped.cancel()  # as the SDK stops an activity whose heartbeat the server timed out
    with pytest.raises(asyncio.CancelledError):
        await stopped
    with pytest.raises(ApplicationError) as told:
        await env.run(node.collect_invoke, CollectInvokeInput("L2", "req-L2"))
    assert told.value.type == "TIMEOUT" and "stopped" in told.value.message
