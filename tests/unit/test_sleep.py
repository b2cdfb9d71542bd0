"""Making room, cost-aware: a model whose runtime can sleep (vLLM's sleep mode) gives back most of
its memory far more cheaply than an unload and a reload, so the policy puts it to sleep when
that frees enough, unloads when it does not, and wakes it rather than loading it again."""

from __future__ import annotations

import pytest

from modelforge.catalog import CatalogError, parse_catalog
from modelforge.domain import GiB, Priority
from modelforge.policy import (
    Decisions,
    PoolState,
    ResidentPhase,
    apply_decisions,
    decide,
    enqueue,
    keep_warm_check,
    release_lease,
    resident_ready,
    resident_slept,
    resident_unloaded,
    resident_woke,
)
from tests.builders import NOW, ask, deployment, gpu, observe, resident, state

SLEEPY = {"sleep_bytes": 2 * GiB, "sleep_s": 1.0, "wake_s": 2.0, "load_s": 30.0, "unload_s": 2.0}


def card_with_idle(sleepy: dict[str, object], other_gib: float) -> PoolState:
    """One 24 GiB card (1 GiB reserve: 23 usable) with `a@1` (16 GiB, keep_warm) idle on it;
    `b@1` (`other_gib`) asked for: 23 - 16 = 7 GiB free."""
    s = state(
        [gpu("n/0")],
        [deployment("a@1", gib=16, **sleepy), deployment("b@1", gib=other_gib, load_s=5.0)],
    )
    resident(s, "a@1", "n/0", 16)
    observe(s, "n/0", managed_gib=16, loaded=["a@1@n/0"])
    enqueue(s, ask("rb", "b@1"), Priority.INTERACTIVE, NOW)
    return s


@pytest.mark.parametrize(
    ("sleepy", "other_gib", "expected"),
    [
        # Sleeping a@1 keeps 2 of its 16 GiB: 7 + 14 = 21 >= 12. Sleep (1 + 2 s) < unload + reload
        # (2 + 30 s): it sleeps.
        (SLEEPY, 12, "sleep"),
        # 22 GiB needed: sleeping frees 21 at most, so a@1 is unloaded instead (7 + 16 = 23).
        (SLEEPY, 22, "unload"),
        # A runtime that cannot sleep (no sleep_bytes) is unloaded, as always.
        ({"load_s": 30.0, "unload_s": 2.0}, 12, "unload"),
        # Sleeping and waking (20 + 20 s) would cost more than an unload and a reload (2 + 30 s).
        ({**SLEEPY, "sleep_s": 20.0, "wake_s": 20.0}, 12, "unload"),
    ],
)
def test_making_room_puts_a_model_to_sleep_when_that_is_enough_and_cheaper(
    sleepy: dict[str, object], other_gib: float, expected: str
) -> None:
    s = card_with_idle(sleepy, other_gib)
    decisions = decide(s, NOW)
    assert decisions.loads == [] and decisions.grants == []
    if expected == "sleep":
        assert [x.resident_key for x in decisions.sleeps] == ["a@1@n/0"] and decisions.unloads == []
        assert "making room: putting to sleep a@1@n/0" in decisions.waits[0].reason
    else:
        assert [x.resident_key for x in decisions.unloads] == ["a@1@n/0"] and decisions.sleeps == []


def test_a_model_asleep_is_woken_for_its_next_request_instead_of_loaded() -> None:
    s = card_with_idle(SLEEPY, 12)
    apply_decisions(s, decide(s, NOW), NOW, {})
    assert s.residents["a@1@n/0"].phase == ResidentPhase.SLEEPING
    # Its 16 GiB stay counted until the node says it slept: b@1 still waits.
    assert decide(s, NOW).loads == []
    resident_slept(s, "a@1@n/0", True, 2 * GiB, "", NOW + 1)
    asleep = s.residents["a@1@n/0"]
    assert (asleep.phase, asleep.bytes, asleep.awake_bytes) == (ResidentPhase.ASLEEP, 2 * GiB, 16 * GiB)
    observe(s, "n/0", managed_gib=2, loaded=["a@1@n/0"])
    decisions = decide(s, NOW + 1)
    [load] = decisions.loads  # 23 - 2 = 21 >= 12: b@1 loads next to the sleeping model
    assert load.resident_key == "b@1@n/0"
    apply_decisions(s, decisions, NOW + 1, {})
    resident_ready(s, "b@1@n/0", 12 * GiB, NOW + 6)
    observe(s, "n/0", managed_gib=14, loaded=["a@1@n/0", "b@1@n/0"], at=NOW + 6)
    apply_decisions(s, decide(s, NOW + 6), NOW + 6, {})  # b@1's request is granted
    for lease_id in list(s.leases):
        release_lease(s, lease_id, NOW + 7, "ok")

    # a@1 asked for again: waking takes back 14 GiB, but 23 - 2 - 12 = 9 are free; b@1 is idle
    # and cannot sleep, so it is unloaded to make room for the wake (no load of a@1 at all).
    enqueue(s, ask("ra", "a@1"), Priority.INTERACTIVE, NOW + 8)
    decisions = decide(s, NOW + 8)
    assert [u.resident_key for u in decisions.unloads] == ["b@1@n/0"] and decisions.loads == []
    apply_decisions(s, decisions, NOW + 8, {})
    resident_unloaded(s, "b@1@n/0", True, "")
    observe(s, "n/0", managed_gib=2, loaded=["a@1@n/0"], at=NOW + 9)
    decisions = decide(s, NOW + 9)
    [wake] = decisions.wakes
    assert (wake.resident_key, wake.bytes, wake.for_requests) == ("a@1@n/0", 16 * GiB, ["ra"])
    assert decisions.loads == []
    apply_decisions(s, decisions, NOW + 9, {})
    assert s.residents["a@1@n/0"].phase == ResidentPhase.WAKING
    assert s.residents["a@1@n/0"].bytes == 16 * GiB  # promised before the node has them back
    assert "waiting for a@1@n/0 to wake" in decide(s, NOW + 10).waits[0].reason
    resident_woke(s, "a@1@n/0", 16 * GiB, NOW + 11)
    observe(s, "n/0", managed_gib=16, loaded=["a@1@n/0"], at=NOW + 11)
    [grant] = decide(s, NOW + 11).grants
    assert grant.request_id == "ra" and grant.lease.resident_key == "a@1@n/0"


def test_a_failed_sleep_leaves_the_model_awake_and_making_room_unloads_it_next() -> None:
    s = card_with_idle(SLEEPY, 12)
    apply_decisions(s, decide(s, NOW), NOW, {})
    [event] = resident_slept(s, "a@1@n/0", False, 0, "sleep: runtime cannot", NOW + 1)
    assert event.kind == "sleep_failed" and s.residents["a@1@n/0"].phase == ResidentPhase.READY


def test_an_asleep_model_goes_when_its_keep_warm_ttl_runs_out() -> None:
    s = card_with_idle(SLEEPY, 12)
    apply_decisions(s, decide(s, NOW), NOW, {})
    resident_slept(s, "a@1@n/0", True, 2 * GiB, "", NOW + 1)
    ttl = s.residents["a@1@n/0"].ttl_s  # 901 s since its last use at NOW
    assert keep_warm_check(s, "a@1@n/0", NOW + 10) == NOW + ttl
    assert keep_warm_check(s, "a@1@n/0", NOW + ttl + 1) is None
    assert s.residents["a@1@n/0"].phase == ResidentPhase.UNLOADING


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"sleep_bytes": 16 * GiB}, "frees nothing"),
        ({"sleep_bytes": GiB, "residency": "load_on_demand"}, "only keep_warm models sleep"),
        ({"sleep_bytes": GiB, "runtime": "subprocess_http", "command": ["srv", "{port}"]}, "sleep_path and wake_path"),
    ],
)
def test_sleep_settings_a_model_cannot_honour_are_refused(fields: dict[str, object], problem: str) -> None:
    with pytest.raises(CatalogError) as caught:
        parse_catalog({"deployments": [{"capability": "a@1", "envelope_bytes": 16 * GiB, **fields}]})
    assert problem in caught.value.message


def test_measured_times_replace_the_catalogs_in_the_choice_to_sleep() -> None:
    """The catalog says sleeping and waking take 1 + 2 s; this pool measured a wake of 40 s, so
    sleep + wake (1 + 40) no longer beats unload + reload (2 + 30): the next time room is needed
    the model is unloaded."""
    s = card_with_idle(SLEEPY, 12)
    apply_decisions(s, decide(s, NOW), NOW, {})
    resident_slept(s, "a@1@n/0", True, 2 * GiB, "", NOW + 1)
    s.queue.clear()
    from modelforge.policy import Wake

    apply_decisions(s, Decisions(wakes=[Wake("a@1@n/0", 16 * GiB, [])]), NOW + 10, {})
    resident_woke(s, "a@1@n/0", 16 * GiB, NOW + 50)  # woke 40 s after it was asked
    times = s.measured["a@1"]
    assert (times.sleep_s, times.wake_s) == (1.0, 40.0)
    observe(s, "n/0", managed_gib=16, loaded=["a@1@n/0"], at=NOW + 60)
    enqueue(s, ask("rb2", "b@1"), Priority.INTERACTIVE, NOW + 60)
    decisions = decide(s, NOW + 60)
    assert [u.resident_key for u in decisions.unloads] == ["a@1@n/0"] and decisions.sleeps == []


def test_measured_unload_times_order_what_is_evicted_first() -> None:
    """Two idle models that together block a load; either one suffices. The catalog gives both
    a 2 s unload; c@1 was measured at 20 s, d@1 at 1 s: d@1 goes."""
    s = state(
        [gpu("n/0")],
        [
            deployment("c@1", gib=8, unload_s=2.0),
            deployment("d@1", gib=8, unload_s=2.0),
            deployment("e@1", gib=12),
        ],
    )
    resident(s, "c@1", "n/0", 8)
    resident(s, "d@1", "n/0", 8)
    observe(s, "n/0", managed_gib=16, loaded=["c@1@n/0", "d@1@n/0"])
    from modelforge.policy import MeasuredTimes

    s.measured["c@1"] = MeasuredTimes(unload_s=20.0)
    s.measured["d@1"] = MeasuredTimes(unload_s=1.0)
    enqueue(s, ask("re", "e@1"), Priority.INTERACTIVE, NOW)
    # 23 - 16 = 7 GiB free < 12; one unload frees 8: 15 >= 12.
    assert [u.resident_key for u in decide(s, NOW).unloads] == ["d@1@n/0"]
    s.measured["c@1"] = MeasuredTimes(unload_s=0.5)
    assert [u.resident_key for u in decide(s, NOW).unloads] == ["c@1@n/0"]
