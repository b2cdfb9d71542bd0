"""Stale allocations (README, "How it works"): a lease whose holder stops heart-beating for 60 s is reclaimed,
a holder that keeps heart-beating keeps it, and a scheduler that was itself away reclaims
nothing until holders had a fair chance to speak."""

from __future__ import annotations

import pytest

from modelforge.domain import GiB, Priority
from modelforge.policy import (
    PoolState,
    apply_decisions,
    decide,
    enqueue,
    lease_heartbeat,
    reclaim_stale_leases,
    stale_leases_due,
)
from tests.builders import NOW, ask, deployment, gpu, observe, resident, state


def holding_one_lease() -> tuple[PoolState, str]:
    # 9 GiB envelope, 7 GiB idle: the lease adds 2 GiB while held.
    s = state([gpu("n/0")], [deployment("llm@1", gib=9, idle_bytes=7 * GiB, concurrency=1)])
    observe(s, "n/0", managed_gib=7, loaded=["llm@1@n/0"])
    resident(s, "llm@1", "n/0", 7)
    enqueue(s, ask("holder", "llm@1"), Priority.INTERACTIVE, NOW)
    decisions = decide(s, NOW)
    apply_decisions(s, decisions, NOW, {})
    [lease_id] = s.leases
    return s, lease_id


@pytest.mark.parametrize(
    ("heartbeats_at", "checked_at", "reclaimed"),
    [
        ([], NOW + 59, False),  # 59 s of silence: still held
        ([], NOW + 60, True),  # 60 s: reclaimed
        ([NOW + 30], NOW + 60, False),  # silent 30 s since its last heartbeat
        ([NOW + 30], NOW + 90, True),  # silent 60 s since its last heartbeat
    ],
)
def test_a_silent_holder_loses_its_lease_after_60_s(
    heartbeats_at: list[float], checked_at: float, reclaimed: bool
) -> None:
    s, lease_id = holding_one_lease()
    reclaim_stale_leases(s, NOW + 1)  # the scheduler ticks regularly
    for at in heartbeats_at:
        reclaim_stale_leases(s, at - 1)
        assert lease_heartbeat(s, lease_id, at)
    reclaim_stale_leases(s, checked_at - 10)
    events = reclaim_stale_leases(s, checked_at)
    assert (lease_id not in s.leases) is reclaimed
    if reclaimed:
        kinds = [e.kind for e in events]
        assert kinds == ["lease_reclaimed", "lease_released"]
        assert "silent for 60 s" in events[0].message
        assert s.residents["llm@1@n/0"].active_leases == 0
        # The 2 GiB the lease held are schedulable again and its slot is free for the next request.
        assert not lease_heartbeat(s, lease_id, checked_at + 1), "a reclaimed lease is not revived"


def test_the_timer_is_due_when_the_oldest_holder_would_go_stale() -> None:
    s, lease_id = holding_one_lease()
    assert stale_leases_due(s) == NOW + 60
    lease_heartbeat(s, lease_id, NOW + 20)
    assert stale_leases_due(s) == NOW + 80


def test_a_scheduler_that_was_away_gives_holders_a_full_period_first() -> None:
    s, lease_id = holding_one_lease()
    reclaim_stale_leases(s, NOW + 1)
    # No tick for 10 minutes: the scheduler's worker was down, so were the holders' signals.
    events = reclaim_stale_leases(s, NOW + 600)
    assert lease_id in s.leases and [e.kind for e in events] == ["stale_lease_grace"]
    assert reclaim_stale_leases(s, NOW + 630) == []
    assert [e.kind for e in reclaim_stale_leases(s, NOW + 660)] == ["lease_reclaimed", "lease_released"]
