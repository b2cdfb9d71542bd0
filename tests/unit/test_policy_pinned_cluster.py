"""A cluster whose served models are pinned to a few cards each, with many tenants' lanes of the
same capabilities and gangs waiting (`bench/policy_decide.py`'s cluster, small): the fast pass
decides what the reference decides and tells every waiting request the reason the reference
gives, pass after pass, as telemetry lands and requests arrive. The fast pass looks only at a
pinned deployment's own cards for a free one, and cuts the runs of lanes it passes over at the
next request of another lane of the same capability from a heap per capability."""

from __future__ import annotations

import pytest

import bench.policy_decide as cluster_bench
from modelforge.domain import Accelerator
from modelforge.policy import PoolState, apply_decisions, apply_observations, decide, enqueue
from modelforge.policy._placement import decide_each
from modelforge.policy._queue_index import queue_index


def _agree(state: PoolState, now: float) -> int:
    """Asserts the fast pass and the reference agree; applies the fast one; returns the waits."""
    fast, reference = decide(state, now), decide_each(state, now, reuse_settled=False)
    assert (fast.grants, fast.rejects, fast.loads, fast.assigns, fast.unloads, fast.preemptions) == (
        reference.grants,
        reference.rejects,
        reference.loads,
        reference.assigns,
        reference.unloads,
        reference.preemptions,
    )
    # The fast pass tells a request its reason only when it changed: the rest carry it already.
    told = {wait.request_id: (wait.reason, wait.codes) for wait in fast.waits}
    queued = queue_index(state).by_id
    for wait in reference.waits:
        if wait.request_id in told:
            assert told[wait.request_id] == (wait.reason, wait.codes), wait.request_id
        else:
            assert queued[wait.request_id].waiting_reason == wait.reason, wait.request_id
    apply_decisions(state, fast, now, {})
    return len(reference.waits)


@pytest.mark.parametrize("unmanaged", [False, True], ids=["free cards", "an unmanaged process on every card"])
def test_pinned_models_and_shared_lanes_decide_what_the_reference_decides(unmanaged: bool) -> None:
    filled: dict[str, int] | None = {} if unmanaged else None
    state = cluster_bench.cluster(20, 60, 4, 300, filled)
    cards: dict[str, list[Accelerator]] = {}
    for accelerator in state.catalog.accelerators:
        cards.setdefault(accelerator.node, []).append(accelerator)
    nodes = list(cards.values())
    capabilities = sorted({q.capability for q in state.queue if not q.capability.startswith("train")})
    now = cluster_bench.NOW + 1.0
    waits = 0
    for k in range(12):
        now += 0.001
        apply_observations(state, cluster_bench._observations(state, nodes[k % len(nodes)], now, filled), now)
        waits += _agree(state, now)
        request = cluster_bench._request(80_000 + k, capabilities[k % len(capabilities)])
        enqueue(state, request, cluster_bench.PRIORITIES[k % 4], now)
        waits += _agree(state, now)
    assert waits > 24 * 300  # every queued request waits, every pass
