"""Verdicts of the pure policy: each waiting request's position, typed reason and ETA, and the
dry run, on small hand-built pools (the policy decides; the verdict reads what it decided)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from modelforge.domain import GiB, Priority
from modelforge.failures import FailureClass
from modelforge.policy import (
    AdmissionRequest,
    Decisions,
    PoolState,
    WaitReason,
    admission_check,
    apply_decisions,
    decide,
    enqueue,
    release_lease,
    resident_ready,
    stamp_predictions,
    validate_request,
    verdicts,
)
from modelforge.policy._state import measured, note_service
from tests.builders import NOW, deployment, gpu, observe, pool_with_running_job, resident, state, tenant
from tests.builders import ask as ask_for


def ask(request_id: str, capability: str = "llm@1", **kw: Any) -> AdmissionRequest:
    return ask_for(request_id, capability, **kw)


def admit(s: PoolState, request: AdmissionRequest, now: float = NOW) -> Decisions:
    _, priority = validate_request(s, request)
    enqueue(s, request, priority, now)
    decisions = decide(s, now)
    apply_decisions(s, decisions, now, {})
    stamp_predictions(s, now, decisions)
    return decisions


def test_a_busy_resident_queue_gets_positions_and_etas_from_measured_service() -> None:
    s = state([gpu("n/0")], [deployment("llm@1", gib=4, concurrency=1)])
    observe(s, "n/0", managed_gib=4)
    resident(s, "llm@1", "n/0", 4)
    for _ in range(8):
        note_service(s, "llm@1", 10.0)
    [grant] = admit(s, ask("r0")).grants
    for n in (1, 2, 3):
        admit(s, ask(f"r{n}"), NOW + n)
    found = verdicts(s, NOW + 4)
    assert [v.request_id for v in found] == ["r1", "r2", "r3"]
    assert [(v.position_in_class, v.class_depth, v.position_in_deployment) for v in found] == [
        (1, 3, 1),
        (2, 3, 2),
        (3, 3, 3),
    ]
    assert {v.reason for v in found} == {WaitReason.CONCURRENCY_FULL.value}
    # r0 holds the one slot until NOW + 10 (mean service); each after it takes 10 s more.
    assert [v.eta_s for v in found] == pytest.approx([6.0, 16.0, 26.0])
    assert {(v.eta_basis, v.eta_quality, v.eta_samples) for v in found} == {("queue_service", "measured", 8)}
    # The first ETA each got is kept, and its grant says how far off it was.
    assert s.queue[0].eta_at == pytest.approx(NOW + 10.0)
    release_lease(s, grant.lease.lease_id, NOW + 12, "ok")
    decisions = decide(s, NOW + 12)
    events = apply_decisions(s, decisions, NOW + 12, {})
    [granted] = [e for e in events if e.kind == "lease_granted"]
    assert granted.request_id == "r1"
    assert granted.payload["eta_error_s"] == pytest.approx(-2.0)  # predicted NOW + 10, started NOW + 12
    assert granted.payload["eta_reason"] == WaitReason.CONCURRENCY_FULL.value


def test_a_request_waiting_on_a_load_in_flight_gets_the_loads_expected_end() -> None:
    s = state([gpu("n/0")], [deployment("llm@1", gib=4, load_s=30.0)])
    observe(s, "n/0")
    decisions = admit(s, ask("r1"))
    [load] = decisions.loads
    [v] = verdicts(s, NOW + 5)
    assert v.reason == WaitReason.LOAD_IN_FLIGHT.value
    assert v.load is not None and v.load.resident_key == load.resident_key
    assert v.load.expected_end_at == pytest.approx(NOW + 30.0)
    assert v.eta_s == pytest.approx(25.0) and (v.eta_basis, v.eta_quality) == ("load_in_flight", "catalog")
    # Once the deployment's load time was measured here, that is the basis.
    measured(s, "llm@1", "load", 12.0)
    [v] = verdicts(s, NOW + 5)
    assert v.eta_s == pytest.approx(7.0) and v.eta_quality == "measured"
    resident_ready(s, load.resident_key, 4 * GiB, NOW + 12)
    assert [g.request_id for g in decide(s, NOW + 12).grants] == ["r1"]


def test_memory_held_names_who_holds_it_and_waits_for_their_end_plus_a_load() -> None:
    s = state(
        [gpu("n/0", total=24, reserve=1)],
        [deployment("big@1", gib=16, concurrency=1), deployment("other@1", gib=10, load_s=20.0)],
    )
    observe(s, "n/0", external_gib=2, managed_gib=16)
    resident(s, "big@1", "n/0", 16)
    for _ in range(4):
        note_service(s, "big@1", 60.0)
    admit(s, ask("held", capability="big@1"))  # holds big@1's only slot: the resident cannot be unloaded
    admit(s, ask("r1", capability="other@1"), NOW + 1)
    [v] = verdicts(s, NOW + 10)
    assert v.reason == WaitReason.MEMORY_HELD.value, v.message
    kinds = {(h.kind, h.who.split(" ")[0]) for h in v.held_by}
    assert ("resident", "big@1") in kinds and ("external", "ollama") in kinds
    # big@1's lease ends at NOW + 60 (mean service); then other@1 loads for 20 s.
    assert (v.eta_basis, v.eta_quality) == ("release_then_load", "catalog")
    assert v.eta_s == pytest.approx(70.0)
    assert json.loads(json.dumps(v.to_json()))["held_by"][0]["bytes"] == 16 * GiB


def test_a_lower_class_request_says_which_class_it_is_behind() -> None:
    s = state(
        [gpu("n/0")],
        [deployment("llm@1", gib=4, concurrency=1)],
        [tenant("t", max_priority=Priority.PRODUCTION)],
    )
    observe(s, "n/0", managed_gib=4)
    resident(s, "llm@1", "n/0", 4)
    admit(s, ask("running"))
    admit(s, ask("low", priority=Priority.BACKGROUND), NOW + 1)
    admit(s, ask("high", priority=Priority.PRODUCTION), NOW + 2)
    by_id = {v.request_id: v for v in verdicts(s, NOW + 3)}
    assert [v.request_id for v in verdicts(s, NOW + 3)] == ["high", "low"]
    assert by_id["low"].behind_class == "production" and by_id["low"].ahead_in_higher_classes == 1
    assert (by_id["low"].position_in_class, by_id["low"].position_in_deployment) == (1, 2)
    assert by_id["high"].behind_class == "" and by_id["high"].position_in_deployment == 1
    # Nothing measured yet: no ETA is claimed.
    assert by_id["high"].eta_quality == "none"


def test_a_new_waiters_first_eta_counts_only_the_work_ordered_ahead_of_it() -> None:
    # One slot, 10 s of measured service. Two tenants of one class interleave by submission;
    # a production request arriving last is ordered first, so its stamped ETA is the slot's end.
    s = state(
        [gpu("n/0")],
        [deployment("llm@1", gib=4, concurrency=1), deployment("other@1", gib=4, concurrency=1)],
        [tenant("t", max_priority=Priority.PRODUCTION), tenant("u")],
    )
    observe(s, "n/0", managed_gib=4)
    resident(s, "llm@1", "n/0", 4)
    for _ in range(4):
        note_service(s, "llm@1", 10.0)
    admit(s, ask("running"))
    admit(s, ask("t1", priority=Priority.BACKGROUND), NOW + 1)
    admit(s, ask("u1", tenant_name="u", priority=Priority.BACKGROUND), NOW + 2)
    admit(s, ask("t2", priority=Priority.BACKGROUND), NOW + 3)
    admit(s, ask("high", priority=Priority.PRODUCTION), NOW + 4)
    stamped = {q.request_id: q.eta_at for q in s.queue}
    # Each stamp is the full verdict's ETA at the moment that request first waited.
    assert stamped["high"] == pytest.approx(NOW + 10.0)
    assert stamped["t1"] == pytest.approx(NOW + 10.0)
    # Equal fair shares (nothing used up yet): the two tenants' lanes interleave by submission.
    assert stamped["u1"] == pytest.approx(NOW + 20.0)
    assert stamped["t2"] == pytest.approx(NOW + 30.0)
    fair = {v.request_id: v.eta_at for v in verdicts(s, NOW + 4)}
    assert fair["high"] == stamped["high"]
    assert next(v.request_id for v in verdicts(s, NOW + 4)) == "high"


def test_a_lease_past_the_mean_is_expected_to_run_as_long_as_the_runs_that_outlasted_it() -> None:
    # Measured runs of 5 s and 25 s (mean 15). A lease 10 s in is one of the long ones: it is
    # expected to end at 25 s, not "now" (the mean is behind it).
    s = state([gpu("n/0")], [deployment("llm@1", gib=4, concurrency=1)])
    observe(s, "n/0", managed_gib=4)
    resident(s, "llm@1", "n/0", 4)
    for seconds in (5.0, 25.0):
        note_service(s, "llm@1", seconds)
    admit(s, ask("running"))
    admit(s, ask("next"), NOW + 10)
    [waiting] = verdicts(s, NOW + 10)
    assert waiting.eta_at == pytest.approx(NOW + 25.0)
    # Past every measured run: no figure to base it on, and none is claimed.
    [late] = verdicts(s, NOW + 30)
    assert late.eta_s is None and late.eta_basis == "unknown"


def test_a_request_that_expires_before_its_turn_leaves_its_slot_to_the_next() -> None:
    # One slot, 10 s runs. `short` (ahead, lease timeout 5 s) cannot start before it expires:
    # the policy will refuse it then, so `patient` behind it gets the slot when it frees.
    s = state([gpu("n/0")], [deployment("llm@1", gib=4, concurrency=1)])
    observe(s, "n/0", managed_gib=4)
    resident(s, "llm@1", "n/0", 4)
    for _ in range(4):
        note_service(s, "llm@1", 10.0)
    admit(s, ask("running"))
    admit(s, ask("short", lease_timeout_s=5.0), NOW + 1)
    admit(s, ask("patient", lease_timeout_s=600.0), NOW + 2)
    by_id = {v.request_id: v for v in verdicts(s, NOW + 3)}
    assert by_id["short"].eta_at == pytest.approx(NOW + 10.0)  # after it expires (NOW + 6)
    assert by_id["patient"].eta_at == pytest.approx(NOW + 10.0)
    # `short` is told so: its ETA is past its expiry.
    assert by_id["short"].starts_after_expiry and by_id["short"].to_json()["eta"]["after_expiry"] is True
    assert by_id["short"].eta_text() == "ETA 7 s (queue_service, measured), past its expiry in 3 s"
    assert not by_id["patient"].starts_after_expiry and "expiry" not in by_id["patient"].line()


def test_unmeasured_work_never_claims_an_eta_it_cannot_base() -> None:
    s = state([gpu("n/0")], [deployment("llm@1", gib=4, concurrency=1)])
    observe(s, "n/0", managed_gib=4)
    resident(s, "llm@1", "n/0", 4)
    admit(s, ask("running"))  # no service measured, no max_duration: its end is unknown
    admit(s, ask("r1"), NOW + 1)
    [v] = verdicts(s, NOW + 2)
    assert (v.reason, v.eta_s, v.eta_basis, v.eta_quality) == ("concurrency_full", None, "unknown", "none")
    # A max_duration bounds it: no ETA is claimed (a bound is no estimate), the bound is given.
    s2 = state([gpu("n/0")], [deployment("llm@1", gib=4, concurrency=1)])
    observe(s2, "n/0", managed_gib=4)
    resident(s2, "llm@1", "n/0", 4)
    admit(s2, ask("running", max_duration_s=100.0))
    admit(s2, ask("r1"), NOW + 1)
    [v] = verdicts(s2, NOW + 2)
    assert (v.eta_s, v.eta_at, v.eta_basis, v.eta_quality) == (None, None, "queue_service", "bound")
    assert v.eta_at_most_s == pytest.approx(98.0) and v.eta_at_least_s is None
    assert v.to_json()["eta"]["at_most_s"] == pytest.approx(98.0)
    assert v.eta_text() == "ETA at most 1.6 min (queue_service, bound)"
    # The first ETA kept for the ETA-error figures (stamped when r1 first waited) is no bound
    # either, and a later pass keeps it.
    assert (s2.queue[-1].eta_at, s2.queue[-1].eta_reason) == (None, "concurrency_full")
    admit(s2, ask("r2"), NOW + 3)
    assert [(q.request_id, q.eta_at, q.eta_reason) for q in s2.queue] == [
        ("r1", None, "concurrency_full"),
        ("r2", None, "concurrency_full"),
    ]


def test_an_upper_bound_counts_the_requests_ahead_at_their_own_max_duration() -> None:
    # One slot. Measured runs of 5 s and 10 s; `running` (max_duration 100 s) is 20 s in, past
    # every measured run, so its end has no estimate: at most NOW + 100. `ahead` would then hold
    # the slot: for its mean (7.5 s) as expected, for its max_duration (50 s) at the latest. So
    # `mine` starts by NOW + 150 at the latest, not by NOW + 107.5 (which it would miss were
    # `ahead` to run long).
    s = state([gpu("n/0")], [deployment("llm@1", gib=4, concurrency=1)])
    observe(s, "n/0", managed_gib=4)
    resident(s, "llm@1", "n/0", 4)
    for seconds in (5.0, 10.0):
        note_service(s, "llm@1", seconds)
    admit(s, ask("running", max_duration_s=100.0))
    admit(s, ask("ahead", max_duration_s=50.0), NOW + 1)
    admit(s, ask("mine"), NOW + 2)
    by_id = {v.request_id: v for v in verdicts(s, NOW + 20)}
    assert (by_id["ahead"].eta_quality, by_id["ahead"].eta_at_most_s) == ("bound", pytest.approx(80.0))
    assert (by_id["mine"].eta_s, by_id["mine"].eta_quality) == (None, "bound")
    assert by_id["mine"].eta_at_most_s == pytest.approx(130.0)
    # Work ahead with no max_duration can hold the slot for good: no bound is claimed then.
    s = state([gpu("n/0")], [deployment("llm@1", gib=4, concurrency=1)])
    observe(s, "n/0", managed_gib=4)
    resident(s, "llm@1", "n/0", 4)
    for seconds in (5.0, 10.0):
        note_service(s, "llm@1", seconds)
    admit(s, ask("running", max_duration_s=100.0))
    admit(s, ask("ahead"), NOW + 1)
    admit(s, ask("mine"), NOW + 2)
    by_id = {v.request_id: v for v in verdicts(s, NOW + 20)}
    assert by_id["ahead"].eta_at_most_s == pytest.approx(80.0)
    mine = by_id["mine"]
    assert (mine.eta_s, mine.eta_at_most_s, mine.eta_at_least_s, mine.eta_quality) == (None, None, None, "none")


def test_a_request_past_a_loads_concurrency_with_no_service_measured_gets_the_load_end_as_a_lower_bound() -> None:
    # A loading resident with two slots and four requests assigned to it: the first two start
    # when the load ends (the catalog's 20 s); the other two wait for a slot after that, held
    # by work never measured: no ETA, at least the load's end.
    s = state([gpu("n/0")], [deployment("llm@1", gib=4, concurrency=2, load_s=20.0)])
    observe(s, "n/0")
    for k in range(4):
        admit(s, ask(f"r{k}"), NOW + k * 0.1)
    by_id = {v.request_id: v for v in verdicts(s, NOW + 5)}
    first = [(by_id[f"r{k}"].eta_s, by_id[f"r{k}"].eta_quality) for k in range(2)]
    assert first == [(pytest.approx(15.0), "catalog")] * 2
    for k in (2, 3):
        v = by_id[f"r{k}"]
        assert (v.eta_s, v.eta_basis, v.eta_quality) == (None, "load_in_flight", "bound")
        assert v.eta_at_least_s == pytest.approx(15.0) and v.load is not None
    # Once the service is measured, they get an ETA: the load's end plus a mean service.
    for _ in range(3):
        note_service(s, "llm@1", 8.0)
    by_id = {v.request_id: v for v in verdicts(s, NOW + 5)}
    assert (by_id["r2"].eta_s, by_id["r2"].eta_quality) == (pytest.approx(23.0), "measured")


# --- the dry run --------------------------------------------------------------------------------


def _pool() -> PoolState:
    s = state(
        [gpu("n/0", total=24, reserve=1)],
        [
            deployment("llm@1", gib=4, concurrency=1, load_s=10.0),
            deployment("huge@1", gib=30),
            deployment("wide@1", gib=18),
        ],
    )
    observe(s, "n/0", external_gib=6, managed_gib=4)
    resident(s, "llm@1", "n/0", 4)
    return s


def test_dry_run_answers_now_later_never_and_holds_nothing() -> None:
    s = _pool()
    queue, leases, counter = len(s.queue), dict(s.leases), s.lease_counter
    now = admission_check(s, ask("a"), NOW)
    assert (now.answer, now.action, now.accelerator) == ("now", "grant", "n/0")
    assert (len(s.queue), s.leases, s.lease_counter) == (queue, leases, counter)
    admit(s, ask("holder"))
    later = admission_check(s, ask("b"), NOW + 1)
    assert later.answer == "later" and later.verdict is not None
    assert later.verdict.reason == WaitReason.CONCURRENCY_FULL.value and later.verdict.position_in_class == 1
    never = admission_check(s, ask("c", capability="huge@1"), NOW + 1)
    assert (never.answer, never.failure) == ("never", FailureClass.INSUFFICIENT_SCHEDULABLE_VRAM.value)
    assert "needs 30.0 GiB, the largest eligible card (n/0) can give 17.0 GiB" in never.detail
    assert "external processes hold 6.0 GiB" in never.detail
    external = admission_check(s, ask("d", capability="wide@1"), NOW + 1)
    assert (external.answer, external.failure) == ("never", FailureClass.EXTERNAL_GPU_PRESSURE.value)
    invalid = admission_check(s, ask("e", tenant_name="nobody"), NOW + 1)
    assert (invalid.answer, invalid.failure) == ("never", FailureClass.REQUEST_INVALID.value)
    assert [q.request_id for q in s.queue] == []  # none of it queued
    for check in (now, later, never, external, invalid):
        assert json.loads(json.dumps(check.to_json()))["answer"] == check.answer


def test_dry_run_is_placed_behind_a_request_queued_at_the_same_moment() -> None:
    # A query answers at the time of the scheduler's last task: the request that task queued
    # has exactly that submission time. The probe still goes behind it, as a real request would.
    s = state([gpu("n/0")], [deployment("llm@1", gib=4, concurrency=1)])
    observe(s, "n/0", managed_gib=4)
    resident(s, "llm@1", "n/0", 4)
    admit(s, ask("running"))
    admit(s, ask("waiting"), NOW + 1)
    check = admission_check(s, ask("a"), NOW + 1)
    assert check.answer == "later" and check.verdict is not None
    assert (check.verdict.position_in_class, check.verdict.class_depth) == (2, 2)


def test_dry_run_of_a_cold_model_says_later_with_its_load_time() -> None:
    s = state([gpu("n/0")], [deployment("llm@1", gib=4, load_s=25.0)])
    observe(s, "n/0")
    check = admission_check(s, ask("a"), NOW)
    assert (check.answer, check.action, check.accelerator) == ("later", "load", "n/0")
    assert (check.eta_s, check.eta_basis, check.eta_quality) == (25.0, "load_in_flight", "catalog")
    assert s.residents == {} and s.load_counter == 0


def test_dry_run_refuses_hopeless_deadlines_as_the_real_decision_does() -> None:
    s = state([gpu("n/0")], [deployment("llm@1", gib=4, load_s=60.0)])
    observe(s, "n/0")
    check = admission_check(s, ask("a", deadline_s=5.0), NOW)
    assert (check.answer, check.failure) == ("never", FailureClass.DEADLINE_CANNOT_BE_MET.value)
    real = admit(s, ask("a", deadline_s=5.0))
    assert [r.failure for r in real.rejects] == [FailureClass.DEADLINE_CANNOT_BE_MET]


def test_a_bound_reads_as_a_bound_on_every_surface() -> None:
    # The Ollama progress line and the queue's JSON say "at most"/"at least", never an ETA.
    from modelforge.gateway._verdict_source import verdict_status

    s = state([gpu("n/0")], [deployment("llm@1", gib=4, concurrency=1)])
    observe(s, "n/0", managed_gib=4)
    resident(s, "llm@1", "n/0", 4)
    admit(s, ask("running", max_duration_s=100.0))
    check = admission_check(s, ask("probe"), NOW + 1)
    assert (check.answer, check.eta_s, check.eta_at_most_s) == ("later", None, pytest.approx(99.0))
    assert "ETA at most 1.6 min" in check.line() and check.to_json()["eta"]["at_most_s"] == pytest.approx(99.0)
    admit(s, ask("r1"), NOW + 1)
    [v] = verdicts(s, NOW + 2)
    shown = json.loads(json.dumps(v.to_json()))
    assert shown["eta"]["seconds"] is None and shown["eta"]["at_least_s"] is None
    assert "; at most 98 s (queue_service)" in verdict_status(shown)
    shown["eta"] = {**shown["eta"], "at_most_s": None, "at_least_s": 12.0}
    assert "; at least 12 s (queue_service)" in verdict_status(shown)
    # Behind r1, a second waiter's slot is held by work never measured: nothing, not even a bound.
    second = admission_check(s, ask("probe"), NOW + 2)
    assert (second.eta_s, second.eta_at_most_s, second.eta_basis) == (None, None, "unknown")


def test_a_waiting_gang_is_told_its_reservation_at_most_and_without_one_when_it_could_start_at_least() -> None:
    # Reserved: the job's max_duration (NOW + 100) is when the gang's cards are free at the latest.
    s = pool_with_running_job(job_max_duration_s=100.0)
    apply_decisions(s, decide(s, NOW + 2), NOW + 2, {})
    [v] = verdicts(s, NOW + 2)
    assert (v.request_id, v.eta_s, v.eta_basis, v.eta_quality) == ("gang", None, "reservation", "bound")
    assert v.eta_at_most_s == pytest.approx(98.0)
    # Its own load comes after the cards are free: at most that much later.
    s.catalog = replace(
        s.catalog,
        deployments=[replace(d, load_s=20.0) if d.capability == "gang@1" else d for d in s.catalog.deployments],
    )
    [v] = verdicts(s, NOW + 2)
    assert v.eta_at_most_s == pytest.approx(118.0)
    # Not reserved (no max_duration to promise on), the job's service measured (40 s runs): room
    # on n/0 when the job is expected to end; freed room may go to others first, so a lower bound.
    s = pool_with_running_job(job_max_duration_s=None)
    for _ in range(3):
        note_service(s, "job@1", 40.0)
    apply_decisions(s, decide(s, NOW + 2), NOW + 2, {})
    [v] = verdicts(s, NOW + 2)
    assert (v.eta_s, v.eta_basis, v.eta_quality) == (None, "gang_release", "bound")
    assert v.eta_at_least_s == pytest.approx(38.0)  # the job's mean 40 s, 2 s of it gone


def test_why_says_a_request_is_expected_to_expire_before_its_turn(capsys: pytest.CaptureFixture[str]) -> None:
    from modelforge import cli_queue

    s = state([gpu("n/0")], [deployment("llm@1", gib=4, concurrency=1)])
    observe(s, "n/0", managed_gib=4)
    resident(s, "llm@1", "n/0", 4)
    for _ in range(4):
        note_service(s, "llm@1", 10.0)
    admit(s, ask("running"))
    admit(s, ask("short", lease_timeout_s=5.0), NOW + 1)
    [short] = verdicts(s, NOW + 3)
    cli_queue.render_why(short)
    cli_queue.render_queue([short])
    shown = capsys.readouterr().out
    assert "expires in 3 s, before that" in shown and "7s queue_service" in shown, shown
