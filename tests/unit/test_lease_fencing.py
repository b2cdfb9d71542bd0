"""Lease fencing in the policy: a lease is never reclaimed before its holder could have heard of
it. A holder heard from (a heartbeat, a confirmation) is held to stale_lease_s of silence; one
never heard from since the grant (its worker, or Temporal, may have been away when the grant
went out) only to unheard_lease_s. A reclaimed lease is never revived by a late holder.

And: a resident whose deployment left the catalog is unloaded once idle, always_warm too."""

from __future__ import annotations

import pytest

from modelforge.domain import Priority, Residency
from modelforge.policy import (
    PolicyConfig,
    PoolState,
    apply_decisions,
    decide,
    enqueue,
    lease_heartbeat,
    reclaim_stale_leases,
    stale_leases_due,
)
from tests.builders import NOW, ask, deployment, gpu, observe, resident, state

FENCED = PolicyConfig(stale_lease_s=60.0, unheard_lease_s=300.0)


def holding_one_lease(config: PolicyConfig = FENCED) -> tuple[PoolState, str]:
    s = state([gpu("n/0")], [deployment("llm@1", gib=9, concurrency=1)], config=config)
    observe(s, "n/0", managed_gib=7, loaded=["llm@1@n/0"])
    resident(s, "llm@1", "n/0", 7)
    enqueue(s, ask("holder", "llm@1"), Priority.INTERACTIVE, NOW)
    apply_decisions(s, decide(s, NOW), NOW, {})
    [lease_id] = s.leases
    return s, lease_id


@pytest.mark.parametrize(
    ("heard_at", "checked_at", "reclaimed"),
    [
        (None, NOW + 61, False),  # the 61 s of the kill -9 repro: never heard from, still held
        (None, NOW + 299, False),
        (None, NOW + 300, True),  # a holder never heard from for unheard_lease_s: gone
        (NOW + 20, NOW + 79, False),  # heard at +20: the ordinary 60 s from there
        (NOW + 20, NOW + 80, True),
    ],
)
def test_a_holder_is_not_judged_silent_before_it_could_have_heard_of_its_grant(
    heard_at: float | None, checked_at: float, reclaimed: bool
) -> None:
    s, lease_id = holding_one_lease()
    at = NOW + 1.0
    while at < checked_at:  # the scheduler ticks regularly (it was present all along)
        reclaim_stale_leases(s, at)
        if heard_at is not None and at <= heard_at < at + 5:
            assert lease_heartbeat(s, lease_id, heard_at)
        at += 5.0
    reclaim_stale_leases(s, checked_at)
    assert (lease_id not in s.leases) is reclaimed
    if reclaimed:
        assert not lease_heartbeat(s, lease_id, checked_at + 1), "a reclaimed lease is never revived"


def test_the_timer_wakes_the_scheduler_when_the_unheard_lease_goes_stale() -> None:
    s, lease_id = holding_one_lease()
    assert stale_leases_due(s) == NOW + 300
    lease_heartbeat(s, lease_id, NOW + 10)
    assert stale_leases_due(s) == NOW + 70


def test_without_fencing_the_old_rule_holds_for_replay() -> None:
    s, lease_id = holding_one_lease(PolicyConfig(stale_lease_s=60.0))
    reclaim_stale_leases(s, NOW + 30)
    reclaim_stale_leases(s, NOW + 61)
    assert lease_id not in s.leases


@pytest.mark.parametrize("residency", [Residency.ALWAYS_WARM, Residency.KEEP_WARM, Residency.LOAD_ON_DEMAND])
def test_a_resident_whose_deployment_left_the_catalog_is_unloaded_once_idle(residency: Residency) -> None:
    s = state([gpu("n/0")], [deployment("kept@1")])
    observe(s, "n/0", managed_gib=4)
    resident(s, "gone", "n/0", 2, residency=residency, leases=1)
    resident(s, "kept@1", "n/0", 2, residency=residency)
    # Still serving a lease: it stays until the lease ends.
    assert [u.resident_key for u in decide(s, NOW).unloads if u.reason == "removed from the catalog"] == []
    s.residents["gone@n/0"].active_leases = 0
    unloads = decide(s, NOW).unloads
    assert [(u.resident_key, u.reason) for u in unloads if u.resident_key == "gone@n/0"] == [
        ("gone@n/0", "removed from the catalog")
    ]
    # Its neighbour still in the catalog is not touched by the rule (load_on_demand goes when
    # idle anyway, for its own reason).
    assert all(u.reason != "removed from the catalog" for u in unloads if u.resident_key == "kept@1@n/0")


def test_a_scheduler_that_wakes_when_its_timer_says_is_not_away() -> None:
    # Waking only when the next lease is due (the quiet loop's timer) is not being away: the
    # unheard lease is reclaimed on time, with no grace period granted again and again.
    s, _ = holding_one_lease()
    assert [e.kind for e in reclaim_stale_leases(s, NOW + 0.1)] == []
    due = stale_leases_due(s)
    assert due == NOW + 300
    kinds = [e.kind for e in reclaim_stale_leases(s, due)]
    assert kinds == ["lease_reclaimed", "lease_released"]


def test_a_scheduler_that_looks_long_after_its_timer_was_away_and_gives_grace() -> None:
    s, lease_id = holding_one_lease()
    lease_heartbeat(s, lease_id, NOW + 1)
    reclaim_stale_leases(s, NOW + 1)  # due at NOW + 61
    # Its worker was down: it looks again at NOW + 200, far past the due moment. The holder's
    # heartbeats could not land either, so nobody is judged: every holder gets a period.
    events = reclaim_stale_leases(s, NOW + 200)
    assert [e.kind for e in events] == ["stale_lease_grace"] and lease_id in s.leases
    assert lease_id not in [e.lease_id for e in reclaim_stale_leases(s, NOW + 259)]
    assert lease_id in s.leases
    assert [e.kind for e in reclaim_stale_leases(s, NOW + 260)] == ["lease_reclaimed", "lease_released"]
