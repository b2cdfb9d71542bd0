"""A waiting gang reserves the accelerators where it starts soonest; later work backfills them
only if it ends before the reservation starts, or fits in what the gang will not need."""

from __future__ import annotations

import pytest

from modelforge.domain import GiB, Priority, Residency
from modelforge.policy import (
    apply_decisions,
    decide,
    enqueue,
    release_lease,
    resident_ready,
    validate_request,
)
from tests.builders import NOW, ask, deployment, gpu, observe, pool_with_running_job, state


@pytest.mark.parametrize(
    ("capability", "max_duration_s", "placed"),
    [
        # The gang starts at NOW + 100. n/1: 23 free - 16 for the gang = 7 GiB spare.
        ("small@1", 50.0, True),  # 10 GiB, ends by NOW + 2 + 50 < NOW + 100: backfills
        ("small@1", 500.0, False),  # would still hold 10 GiB at NOW + 100, more than the 7 spare
        ("small@1", None, False),  # no end time: may not be counted on
        ("tiny@1", 500.0, True),  # 6 GiB fits in the 7 GiB spare whatever its duration
        ("warm@1", 5.0, False),  # a warm model stays after its lease: 10 GiB > 7 spare
    ],
)
def test_later_work_backfills_a_gangs_reservation_only_if_it_is_gone_by_then(
    capability: str, max_duration_s: float | None, placed: bool
) -> None:
    s = pool_with_running_job(job_max_duration_s=100.0)
    at = NOW + 2
    enqueue(s, ask("later", capability, max_duration_s=max_duration_s), Priority.BACKGROUND, at)
    decisions = decide(s, at)
    [gang_wait] = [w for w in decisions.waits if w.request_id == "gang"]
    assert "reserved n/0, n/1 from 98 s on" in gang_wait.reason  # NOW + 100 - (NOW + 2)
    loads = [load for load in decisions.loads if load.for_requests == ["later"]]
    if placed:
        assert [load.accelerator for load in loads] == ["n/1"]
    else:
        assert loads == []
        [wait] = [w for w in decisions.waits if w.request_id == "later"]
        assert "n/1: reserved for gang gang starting in 98 s" in wait.reason


def test_without_end_times_nothing_is_reserved_and_later_work_goes_ahead() -> None:
    """Nothing can be promised when the running work has no max_duration: the gang waits as
    before and the small job takes n/1 (draining for an unknown time would starve the pool)."""
    s = pool_with_running_job(job_max_duration_s=None)
    at = NOW + 2
    enqueue(s, ask("later", "small@1", max_duration_s=500.0), Priority.BACKGROUND, at)
    decisions = decide(s, at)
    [gang_wait] = [w for w in decisions.waits if w.request_id == "gang"]
    assert "reserved" not in gang_wait.reason
    assert [load.accelerator for load in decisions.loads] == ["n/1"]


def test_a_reservation_that_starts_after_the_gangs_lease_timeout_is_not_made() -> None:
    s = pool_with_running_job(job_max_duration_s=100.0)
    s.queue[-1].lease_timeout_at = NOW + 50  # gives up before the job ends at NOW + 100
    enqueue(s, ask("later", "small@1", max_duration_s=500.0), Priority.BACKGROUND, NOW + 2)
    decisions = decide(s, NOW + 2)
    assert [load.accelerator for load in decisions.loads] == ["n/1"]


def test_the_gang_starts_when_the_reserved_work_ends_and_backfill_never_delayed_it() -> None:
    s = pool_with_running_job(job_max_duration_s=100.0)
    at = NOW + 2
    enqueue(s, ask("short", "small@1", max_duration_s=50.0), Priority.BACKGROUND, at)
    enqueue(s, ask("long", "small@1", max_duration_s=5000.0), Priority.BACKGROUND, at)
    decisions = decide(s, at)
    assert [load.for_requests for load in decisions.loads] == [["short"]]  # the long one waits
    apply_decisions(s, decisions, at, {})
    resident_ready(s, "small@1@n/1", 0, at)
    observe(s, "n/0", managed_gib=12, at=at, loaded=["job@1@n/0"])
    observe(s, "n/1", managed_gib=10, at=at, loaded=["small@1@n/1"])
    decisions = decide(s, at)
    assert [g.request_id for g in decisions.grants] == ["short"]
    apply_decisions(s, decisions, at, {})
    # Both end (the short job at +40, the job at +90): the batch residents go, the gang starts.
    at = NOW + 90
    for lease_id in list(s.leases):
        release_lease(s, lease_id, at, "ok")
    for key in list(s.residents):
        s.residents.pop(key)
    observe(s, "n/0", at=at)
    observe(s, "n/1", at=at)
    decisions = decide(s, at)
    [grant] = decisions.grants
    assert grant.request_id == "gang" and grant.lease.accelerators == ["n/0", "n/1"]


@pytest.mark.parametrize(("gang_class", "preempted"), [(Priority.INTERACTIVE, True), (Priority.BACKGROUND, False)])
def test_a_gang_preempts_lower_preemptible_work_on_the_cards_it_needs(gang_class: Priority, preempted: bool) -> None:
    """Two 24 GiB cards, each running a preemptible background job of 16 GiB (23 - 16 = 7 GiB
    free, < 12). A 2 x 12 GiB gang of a higher class preempts both (after their 30 s minimum
    runtime); one of the same class waits."""
    s = state(
        [gpu("n/0"), gpu("n/1")],
        [
            deployment("job@1", gib=16, residency=Residency.NONE, preemptible=True, concurrency=1),
            deployment("gang@1", gib=12, residency=Residency.NONE, idle_bytes=0, gpu_count=2),
        ],
    )
    for card in ("n/0", "n/1"):
        observe(s, card)
    for name in ("j0", "j1"):
        enqueue(s, ask(name, "job@1"), Priority.BACKGROUND, NOW)
    apply_decisions(s, decide(s, NOW), NOW, {})
    for card in ("n/0", "n/1"):
        resident_ready(s, f"job@1@{card}", 16 * GiB, NOW)
        observe(s, card, managed_gib=16, loaded=[f"job@1@{card}"])
    apply_decisions(s, decide(s, NOW), NOW, {})
    assert len(s.leases) == 2
    at = NOW + 60
    for card in ("n/0", "n/1"):
        observe(s, card, managed_gib=16, loaded=[f"job@1@{card}"], at=at)
    _, _ = validate_request(s, ask("gang", "gang@1"), gangs=True)
    enqueue(s, ask("gang", "gang@1"), gang_class, at)
    decisions = decide(s, at)
    assert decisions.grants == []
    if preempted:
        assert sorted(p.request_id for p in decisions.preemptions) == ["j0", "j1"]
        assert "interactive gang@1 (a gang) needs room on n/0, n/1" in decisions.preemptions[0].reason
    else:
        assert decisions.preemptions == []
