"""A node loads a model once however many residencies ask for it at the same time: a scheduler
reset past the start of a load can decide that load again under another residency while the
first is still loading. Two loads of one key under way at once loaded it twice before (the
check for a loaded key came before the runtime's load, the mark after it): two copies on the
card, one of them known to nobody. The second now waits for the first and shares it; a first
that fails is tried again by the one waiting."""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.node import NodeActivities
from modelforge.catalog import example_catalog_path, load_catalog_file
from modelforge.domain import Deployment
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.messages import LoadInput
from modelforge.runtimes import SimulatedRuntime
from workers.node import simulated_backend

KEY = "emb@1@gpu-node/0"


class _Counted(SimulatedRuntime):
    """The simulated card's runtime, counting the loads it was asked for; the first `failing`
    of them fail as a runtime whose model will not load."""

    def __init__(self, backend: Any, failing: int = 0) -> None:
        super().__init__(backend)
        self.loads = 0
        self._failing = failing

    async def load(self, key: str, deployment: Deployment, *args: Any, **kwargs: Any) -> Any:
        self.loads += 1
        if self.loads <= self._failing:
            await asyncio.sleep(0.2)
            raise ModelForgeError(FailureClass.MODEL_LOAD_FAILED, "the weights would not load")
        return await super().load(key, deployment, *args, **kwargs)


def _node(failing: int = 0) -> tuple[NodeActivities, _Counted]:
    catalog, external = load_catalog_file(example_catalog_path())
    backend = simulated_backend("gpu-node", catalog, external)
    runtime = _Counted(backend, failing)
    return NodeActivities("gpu-node", backend, {"simulated": runtime}), runtime


def _load() -> LoadInput:
    deployment = Deployment(capability="emb@1", envelope_bytes=1 << 30, load_s=0.5)
    return LoadInput(key=KEY, deployment=deployment, accelerator_id="gpu-node/0", device_index=0, device_uuid="")


async def test_two_loads_of_one_model_at_once_load_it_once_and_share_it() -> None:
    node, runtime = _node()
    first, second = await asyncio.gather(
        ActivityEnvironment().run(node.load_model, _load()), ActivityEnvironment().run(node.load_model, _load())
    )
    assert runtime.loads == 1
    assert first == second  # the same process, the same measured bytes
    assert node.serves(KEY)


async def test_a_load_that_fails_fails_every_caller_once_and_the_next_load_tries_again() -> None:
    node, runtime = _node(failing=1)
    outcomes = await asyncio.gather(
        ActivityEnvironment().run(node.load_model, _load()),
        ActivityEnvironment().run(node.load_model, _load()),
        return_exceptions=True,
    )
    assert all(isinstance(o, ApplicationError) and o.type == FailureClass.MODEL_LOAD_FAILED.value for o in outcomes)
    assert runtime.loads == 1  # one attempt, its failure shared
    assert not node.serves(KEY)
    await ActivityEnvironment().run(node.load_model, _load())
    assert runtime.loads == 2 and node.serves(KEY)


async def test_a_caller_cancelled_stops_waiting_not_the_load_the_other_shares() -> None:
    """The first caller's activity is cancelled (its heartbeat timed out) while it loads: the
    load goes on for the second caller, which gets it, and nothing is loaded twice."""
    node, runtime = _node()
    first_env = ActivityEnvironment()
    first = asyncio.ensure_future(first_env.run(node.load_model, _load()))
    await asyncio.sleep(0.1)
    second = asyncio.ensure_future(ActivityEnvironment().run(node.load_model, _load()))
    await asyncio.sleep(0.1)
    first_env.cancel()
    outcomes = await asyncio.gather(first, second, return_exceptions=True)
    assert isinstance(outcomes[0], BaseException)  # the cancelled caller stopped waiting
    assert not isinstance(outcomes[1], BaseException)
    assert runtime.loads == 1 and node.serves(KEY)
