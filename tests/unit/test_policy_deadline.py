"""Deadline-aware admission (service time measured and counted, hopeless work refused early,
classes that run late) and lower classes packed into what a slot wait leaves free."""

from __future__ import annotations

from modelforge.domain import DEFAULT_QUEUE, Catalog, Priority, PriorityLevel, Queue, Residency
from modelforge.failures import FailureClass
from modelforge.policy import apply_decisions, decide, enqueue, release_lease, validate_request
from modelforge.policy._placement import decide_each
from modelforge.policy._state import SERVICE_SAMPLES, note_service, service_figures
from tests.builders import NOW, ask, deployment, gpu, observe, resident, state, tenant


def admit(s, request, now=NOW):  # type: ignore[no-untyped-def]
    _, priority = validate_request(s, request)
    enqueue(s, request, priority, now)
    decisions = decide(s, now)
    apply_decisions(s, decisions, now, {})
    return decisions


def served(s, deployment_id: str, seconds: float, count: int = 20) -> None:  # type: ignore[no-untyped-def]
    for _ in range(count):
        note_service(s, deployment_id, seconds)


def test_released_leases_are_the_service_samples_and_the_estimate_is_a_high_percentile() -> None:
    s = state([gpu("n/0")], [deployment("llm@1", gib=1, concurrency=1)])
    observe(s, "n/0", managed_gib=1)
    resident(s, "llm@1", "n/0", 1)
    [grant] = admit(s, ask("r1", "llm@1")).grants
    release_lease(s, grant.lease.lease_id, NOW + 3.0, "ok")
    assert s.measured["llm@1"].service_s == [3.0]
    [again] = admit(s, ask("r2", "llm@1"), NOW + 4).grants
    release_lease(s, again.lease.lease_id, NOW + 5.0, "RUNTIME_CRASH")  # only successes count
    assert s.measured["llm@1"].service_s == [3.0]
    for n in range(200):
        note_service(s, "llm@1", float(n % 100))
    samples = s.measured["llm@1"].service_s
    assert len(samples) == SERVICE_SAMPLES and samples[-1] == 99.0
    mean, high = service_figures(s, "llm@1")
    assert high == sorted(samples)[60] and mean == sum(samples) / len(samples)


def test_a_load_and_the_service_together_past_the_deadline_are_refused_at_once() -> None:
    s = state([gpu("n/0")], [deployment("llm@1", load_s=20.0)])
    observe(s, "n/0")
    assert admit(s, ask("r1", "llm@1", deadline_s=25.0)).loads  # nothing measured: the load alone counts
    s = state([gpu("n/0")], [deployment("llm@1", load_s=20.0)])
    observe(s, "n/0")
    served(s, "llm@1", 10.0)
    [reject] = admit(s, ask("r1", "llm@1", deadline_s=25.0)).rejects
    assert reject.failure == FailureClass.DEADLINE_CANNOT_BE_MET and "10.0 s of service" in reject.message


def test_a_waiting_request_leaves_as_soon_as_it_could_no_longer_finish_in_time() -> None:
    s = state([gpu("n/0")], [deployment("llm@1", gib=1, concurrency=1)])
    observe(s, "n/0", managed_gib=1)
    resident(s, "llm@1", "n/0", 1)
    assert admit(s, ask("r1", "llm@1")).grants
    served(s, "llm@1", 10.0)
    s.measured["llm@1"].service_s = [1.0] * 18 + [10.0] * 2  # p95 10 s, a short mean
    waiting = admit(s, ask("r2", "llm@1", deadline_s=60.0))
    assert waiting.waits and not waiting.rejects
    assert not decide(s, NOW + 49.0).rejects  # 49 + 10 <= 60: it could still finish
    [reject] = decide(s, NOW + 50.5).rejects  # 9.5 s before its deadline, a 10 s service
    assert reject.failure == FailureClass.DEADLINE_CANNOT_BE_MET and "cannot finish by its deadline" in reject.message


def test_a_request_that_would_start_too_late_behind_the_work_ahead_is_refused_at_submission() -> None:
    s = state([gpu("n/0")], [deployment("llm@1", gib=1, concurrency=2)])
    observe(s, "n/0", managed_gib=1)
    resident(s, "llm@1", "n/0", 1)
    served(s, "llm@1", 10.0)
    for n in range(2):
        assert admit(s, ask(f"run{n}", "llm@1")).grants
    # Two slots busy for 10 s each; requests without a deadline queue behind them.
    for n in range(8):
        assert admit(s, ask(f"w{n}", "llm@1")).waits
    # A second later, ahead: 2 x 9 s still running + 8 x 10 s waiting over 2 slots = 49 s; plus
    # its own 10 s > 45 s.
    [reject] = admit(s, ask("late", "llm@1", deadline_s=45.0), NOW + 1).rejects
    assert reject.failure == FailureClass.DEADLINE_CANNOT_BE_MET and "would start in about 49.0 s" in reject.message
    # 49 + 10 <= 60: it waits.
    decisions = admit(s, ask("fits", "llm@1", deadline_s=60.0), NOW + 1)
    assert decisions.waits and not decisions.rejects


def test_new_requests_amid_a_long_waiting_queue_are_judged_by_the_work_ahead_of_each() -> None:
    """The fast pass passes over runs of a lane whose requests already carry their reason, and
    visits each request not told it yet where it stands: one put back in the middle of the
    queue (submitted earlier) counts only the work before it, one at the end all of it."""
    s = state([gpu("n/0")], [deployment("llm@1", gib=1, concurrency=1, queue_limit=100)])
    observe(s, "n/0", managed_gib=1)
    resident(s, "llm@1", "n/0", 1)
    served(s, "llm@1", 10.0)
    [running] = admit(s, ask("run", "llm@1")).grants
    for n in range(30):
        observe(s, "n/0", managed_gib=2, at=NOW + 1 + n, loaded=["llm@1@n/0"])
        assert admit(s, ask(f"w{n:02d}", "llm@1"), NOW + 1 + n).waits
    now = NOW + 40
    release_lease(s, running.lease.lease_id, now, "ok")
    s.measured["llm@1"].service_s = [10.0] * 20  # its 40 s aside: every run took 10 s
    observe(s, "n/0", managed_gib=1, at=now, loaded=["llm@1@n/0"])
    # Behind w00 (granted now) and w01..w14, 10 s each on one slot: it starts in 150 s and
    # finishes by its deadline (NOW + 14.5 + 200 s); behind all thirty it would not.
    for request, submitted in [
        (ask("mid", "llm@1", deadline_s=200.0), NOW + 14.5),
        (ask("late", "llm@1", deadline_s=400.0), now),  # 31 ahead: starts in 310 s, done by 320
        (ask("later", "llm@1", deadline_s=300.0), now),  # 32 ahead: done by 330 s, after 300
    ]:
        _, priority = validate_request(s, request)
        enqueue(s, request, priority, submitted)
    fast = decide(s, now)
    reference = decide_each(s, now, reuse_settled=False)
    assert (fast.grants, fast.rejects) == (reference.grants, reference.rejects)
    told = {w.request_id: w.reason for w in reference.waits}  # the reference tells every one again
    assert all(told[w.request_id] == w.reason for w in fast.waits)
    assert [g.request_id for g in fast.grants] == ["w00"]
    assert [(r.request_id, r.failure) for r in fast.rejects] == [("later", FailureClass.DEADLINE_CANNOT_BE_MET)]
    assert "behind 320 s of llm@1 work" in fast.rejects[0].message
    # The rest were told their reason before; w01 is the one placed to find it.
    assert {w.request_id for w in fast.waits} == {"w01", "mid", "late"}


def test_a_new_request_amid_another_tenants_waiting_lane_counts_only_the_work_submitted_before_it() -> None:
    """Two tenants of one class with the same fair share: their lanes are walked as one, in
    submission order. A run of one lane already told its reason is passed over only up to the
    other lane's next request, so a new request of the other tenant counts as ahead of it only
    what was submitted before it, as the reference pass that visits each does."""
    s = state(
        [gpu("n/0")],
        [deployment("llm@1", gib=1, concurrency=1, queue_limit=100)],
        tenants=[tenant("t"), tenant("u"), tenant("v")],
    )
    observe(s, "n/0", managed_gib=1)
    resident(s, "llm@1", "n/0", 1)
    served(s, "llm@1", 10.0)
    [running] = admit(s, ask("run", "llm@1", tenant_name="v")).grants  # t and u: no usage, one score
    # t's twenty: ten at NOW + 1..10 and ten at NOW + 21..30.
    for n in range(20):
        at = NOW + 1 + n + (10 if n >= 10 else 0)
        observe(s, "n/0", managed_gib=2, at=at, loaded=["llm@1@n/0"])
        assert admit(s, ask(f"t{n:02d}", "llm@1", tenant_name="t"), at).waits
    now = NOW + 40
    release_lease(s, running.lease.lease_id, now, "ok")
    s.measured["llm@1"].service_s = [10.0] * 20
    observe(s, "n/0", managed_gib=1, at=now, loaded=["llm@1@n/0"])
    # u's request, submitted at NOW + 15 (put back after a retry): behind t's first ten (t00
    # granted now) it starts in 100 s and is done 110 s after now, by its deadline (NOW + 15 +
    # 140 s = now + 115 s); counting t's later ten as well it would not be.
    between = ask("between", "llm@1", tenant_name="u", deadline_s=140.0)
    _, priority = validate_request(s, between)
    enqueue(s, between, priority, NOW + 15)
    fast = decide(s, now)
    reference = decide_each(s, now, reuse_settled=False)
    assert (fast.grants, fast.rejects) == (reference.grants, reference.rejects)
    assert [g.request_id for g in fast.grants] == ["t00"] and not fast.rejects
    assert "between" in {w.request_id for w in fast.waits}


def test_a_class_that_runs_late_is_never_refused_for_its_deadline() -> None:
    queues = [
        Queue(
            name=DEFAULT_QUEUE,
            levels=[
                PriorityLevel(name="production", priority=50, production=True),
                PriorityLevel(name="batch", priority=10, run_late=True),
            ],
        )
    ]
    s = state([gpu("n/0")], [deployment("llm@1", gib=1, concurrency=1)])
    s.catalog = Catalog(
        accelerators=s.catalog.accelerators,
        deployments=s.catalog.deployments,
        tenants=[tenant(max_priority=Priority.PRODUCTION, default_priority="batch")],
        queues=queues,
    )
    observe(s, "n/0", managed_gib=1)
    resident(s, "llm@1", "n/0", 1)
    served(s, "llm@1", 10.0)
    assert admit(s, ask("r1", "llm@1", priority="batch")).grants
    decisions = admit(s, ask("r2", "llm@1", priority="batch", deadline_s=5.0))
    assert decisions.waits and not decisions.rejects
    assert s.queue[0].deadline_at is None
    assert not decide(s, NOW + 100.0).rejects  # past its deadline: it waits to run late


def test_a_request_waiting_only_for_a_slot_keeps_no_memory_from_lower_work() -> None:
    s = state(
        [gpu("n/0")],
        [
            deployment("llm@1", gib=4, concurrency=1, residency=Residency.KEEP_WARM),
            deployment("eval@1", gib=6, residency=Residency.NONE, production_eligible=False, measured_on=[]),
        ],
        [tenant()],
    )
    observe(s, "n/0", managed_gib=4)
    resident(s, "llm@1", "n/0", 4)
    assert admit(s, ask("p1", "llm@1", priority=Priority.PRODUCTION)).grants
    assert admit(s, ask("p2", "llm@1", priority=Priority.PRODUCTION)).waits  # at concurrency 1
    decisions = admit(s, ask("bg", "eval@1", priority=Priority.BACKGROUND))
    assert [load.deployment for load in decisions.loads] == ["eval@1"]


def test_the_catalog_declares_a_level_that_runs_late() -> None:
    from modelforge.catalog import parse_catalog

    levels = [
        {"name": "live", "priority": 50, "production": True},
        {"name": "batch", "priority": 10, "on_deadline": "run_late"},
    ]
    catalog, _ = parse_catalog({"queues": [{"name": "default", "levels": levels}]})
    assert catalog.classes["batch"].run_late and not catalog.classes["live"].run_late
    try:
        parse_catalog({"queues": [{"name": "default", "levels": [{**levels[1], "on_deadline": "later"}]}]})
    except Exception as error:
        assert "on_deadline" in str(error)
    else:
        raise AssertionError("an unknown on_deadline was accepted")


def test_a_batch_job_waiting_behind_another_is_refused_the_moment_its_deadline_cannot_be_met() -> None:
    """A lane of batch jobs that only wait is passed over in runs (their capability settled on
    waiting); a job in the run with a deadline leaves it as soon as its load and service could
    no longer finish in time: refused, as placing it on its own would, not left waiting."""
    s = state(
        [gpu("n/0")],
        [
            deployment("llm@1", gib=20, concurrency=1),
            deployment("job@1", gib=10, residency=Residency.NONE, idle_bytes=0, load_s=30.0),
        ],
    )
    observe(s, "n/0", managed_gib=20)
    resident(s, "llm@1", "n/0", 20)
    assert admit(s, ask("chat", "llm@1")).grants  # 20 of 23 usable GiB held while it runs
    served(s, "job@1", 60.0)
    assert admit(s, ask("first", "job@1")).waits
    assert admit(s, ask("second", "job@1", deadline_s=300.0)).waits
    # The load (30 s) and the service (60 s) still fit before the deadline: both only wait,
    # told nothing new (the second was passed over).
    observe(s, "n/0", managed_gib=20, at=NOW + 200.0, loaded=["llm@1@n/0"])
    quiet = decide(s, NOW + 200.0)
    assert quiet.empty() and [wait.request_id for wait in quiet.waits] == ["first"]
    # 30 + 60 s from NOW + 215 ends past NOW + 300: the second job is refused, the first waits.
    observe(s, "n/0", managed_gib=20, at=NOW + 215.0, loaded=["llm@1@n/0"])
    decisions = decide(s, NOW + 215.0)
    [reject] = decisions.rejects
    assert reject.request_id == "second" and reject.failure == FailureClass.DEADLINE_CANNOT_BE_MET
    assert decide_each(s, NOW + 215.0, reuse_settled=False).rejects == decisions.rejects
