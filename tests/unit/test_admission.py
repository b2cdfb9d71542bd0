"""Admission rules of the pure policy, each on a small hand-built pool."""

from __future__ import annotations

import pytest

from modelforge.domain import Accelerator, Catalog, GiB, Priority, Residency
from modelforge.failures import FailureClass
from modelforge.policy import (
    AdmissionRejected,
    PolicyConfig,
    ResidentPhase,
    apply_decisions,
    decide,
    enqueue,
    filter_accelerators,
    keep_warm_check,
    queue_order,
    relabel,
    release_lease,
    validate_request,
)
from tests.builders import NOW, ask, deployment, gpu, observe, resident, state, tenant


def admit(s, request, now=NOW):  # type: ignore[no-untyped-def]
    _, priority = validate_request(s, request)
    enqueue(s, request, priority, now)
    return decide(s, now)


def test_cold_request_loads_on_the_best_fitting_eligible_gpu() -> None:
    s = state([gpu("big/0", total=80), gpu("small/0", total=24)], [deployment("emb@1", gib=1)])
    observe(s, "big/0")
    observe(s, "small/0")
    decisions = admit(s, ask("r1"))
    # Best fit: the 24 GiB card leaves 24 - 1 reserve - 1 = 22 GiB, the 80 GiB one 78 GiB.
    [load] = decisions.loads
    assert (load.accelerator, load.bytes, load.for_requests) == ("small/0", GiB, ["r1"])
    assert decisions.grants == []


def test_ready_resident_is_granted_at_once_and_released() -> None:
    s = state([gpu("n/0")], [deployment("emb@1", gib=1, concurrency=1)])
    observe(s, "n/0", managed_gib=1)
    resident(s, "emb@1", "n/0", 1)
    decisions = admit(s, ask("r1"))
    [grant] = decisions.grants
    assert grant.lease.accelerator == "n/0" and grant.lease.bytes == 0
    apply_decisions(s, decisions, NOW, {})
    assert s.residents["emb@1@n/0"].active_leases == 1
    # concurrency 1: a second request waits for the first release.
    second = admit(s, ask("r2"))
    assert second.grants == [] and "concurrency 1" in second.waits[0].reason
    apply_decisions(s, second, NOW, {})
    release_lease(s, grant.lease.lease_id, NOW + 2, "ok")
    assert [g.request_id for g in decide(s, NOW + 2).grants] == ["r2"]


@pytest.mark.parametrize(
    ("ended_at", "ledger_end"),
    [(None, 10.0), (NOW + 4.0, 4.0), (NOW + 30.0, 10.0), (NOW - 50.0, 0.0)],
    ids=["heard", "earlier", "after-heard", "before-grant"],
)
def test_a_lease_ends_in_the_ledger_when_its_holder_let_go(ended_at: float | None, ledger_end: float) -> None:
    """A release heard late (applied again after a reset of the scheduler's run, or held up in a
    Temporal backlog) ends the lease's ledger row when its holder let go, within its grant and
    the moment it was heard: its room was given again only after it was heard, so the ledger
    never shows the two leases at once."""
    s = state([gpu("n/0")], [deployment("emb@1", gib=1, concurrency=1)])
    observe(s, "n/0", managed_gib=1)
    resident(s, "emb@1", "n/0", 1)
    decisions = admit(s, ask("r1"))
    [grant] = decisions.grants
    apply_decisions(s, decisions, NOW, {})
    events = release_lease(s, grant.lease.lease_id, NOW + 10.0, "ok", ended_at=ended_at)
    [released] = [e for e in events if e.kind == "lease_released"]
    assert released.payload["ended_at"] == NOW + ledger_end
    assert released.payload["held_s"] == ledger_end


def test_production_never_lands_on_a_non_eligible_accelerator() -> None:
    s = state([gpu("desktop/0", production=False)], [deployment("emb@1")])
    observe(s, "desktop/0")
    [reject] = admit(s, ask("r1", priority=Priority.PRODUCTION)).rejects
    assert reject.failure == FailureClass.CAPABILITY_UNAVAILABLE
    assert "desktop/0: production_eligible=false" in reject.message
    # The same request at interactive priority may use the desktop.
    assert admit(s, ask("r2", priority=Priority.INTERACTIVE)).loads


def test_production_needs_an_envelope_measured_on_that_model() -> None:
    s = state([gpu("n/0", model="A100")], [deployment("emb@1", measured_on=["RTX 3090"])])
    observe(s, "n/0")
    [reject] = admit(s, ask("r1", priority=Priority.PRODUCTION)).rejects
    assert "not measured on A100" in reject.message


def test_stale_observations_grant_no_new_memory() -> None:
    s = state([gpu("n/0")], [deployment("emb@1")], config=PolicyConfig(freshness_s=30))
    observe(s, "n/0", at=NOW - 31)
    decisions = admit(s, ask("r1"))
    assert decisions.loads == [] and decisions.grants == []
    assert "SCHEDULER_STATE_STALE" in decisions.waits[0].reason


def test_idle_keep_warm_resident_is_evicted_to_make_room_but_never_always_warm_or_busy() -> None:
    residents = [deployment(name, gib=2) for name in ("pinned", "busy", "idle")]  # in the catalog: none leaves it
    s = state([gpu("n/0", total=10)], [deployment("big@1", gib=5), *residents])
    observe(s, "n/0", managed_gib=7)
    resident(s, "pinned", "n/0", 2, residency=Residency.ALWAYS_WARM)
    resident(s, "busy", "n/0", 2, leases=1)
    resident(s, "idle", "n/0", 3)
    # 10 - 0 - 7 - 0 - 1 = 2 GiB schedulable; 5 needed; only "idle" (3 GiB) may go: 2 + 3 = 5.
    decisions = admit(s, ask("r1", "big@1"))
    assert [u.resident_key for u in decisions.unloads] == ["idle@n/0"]
    assert decisions.loads == []


def test_nothing_evictable_and_external_blocks_gives_external_gpu_pressure() -> None:
    s = state([gpu("n/0", total=24)], [deployment("llm@1", gib=10)])
    observe(s, "n/0", external_gib=16)
    # 24 - 16 external - 1 reserve = 7 GiB even with every ModelForge byte freed; 10 needed.
    [reject] = admit(s, ask("r1", "llm@1")).rejects
    assert reject.failure == FailureClass.EXTERNAL_GPU_PRESSURE


def test_a_request_larger_than_any_card_is_refused() -> None:
    s = state([gpu("n/0", total=24)], [deployment("huge@1", gib=30)])
    observe(s, "n/0")
    [reject] = admit(s, ask("r1", "huge@1")).rejects
    assert reject.failure == FailureClass.INSUFFICIENT_SCHEDULABLE_VRAM


def test_blocked_by_busy_modelforge_work_waits_then_times_out() -> None:
    s = state([gpu("n/0", total=10)], [deployment("big@1", gib=5)])
    observe(s, "n/0", managed_gib=6)
    resident(s, "busy", "n/0", 6, leases=1)
    decisions = admit(s, ask("r1", "big@1", lease_timeout_s=60))
    assert decisions.rejects == [] and decisions.waits
    apply_decisions(s, decisions, NOW, {})
    observe(s, "n/0", managed_gib=6, at=NOW + 60)
    [reject] = decide(s, NOW + 60).rejects
    assert reject.failure == FailureClass.LEASE_TIMEOUT


def test_a_load_longer_than_the_deadline_is_refused_early() -> None:
    s = state([gpu("n/0")], [deployment("llm@1", load_s=20.0)])
    observe(s, "n/0")
    [reject] = admit(s, ask("r1", "llm@1", deadline_s=5.0)).rejects
    assert reject.failure == FailureClass.DEADLINE_CANNOT_BE_MET


@pytest.mark.parametrize(
    ("request_kwargs", "failure", "fragment"),
    [
        ({"capability": "nope@1"}, FailureClass.CAPABILITY_UNAVAILABLE, "no deployment serves"),
        ({"tenant_name": "ghost"}, FailureClass.REQUEST_INVALID, "unknown tenant"),
        (
            {"tenant_name": "shadow", "priority": Priority.PRODUCTION},
            FailureClass.REQUEST_INVALID,
            "at most 'background'",
        ),
        ({"deadline_s": -1.0}, FailureClass.REQUEST_INVALID, "deadline_s"),
        # The last entrance checks the end user as every entrance does: nothing unprintable or
        # unbounded goes into the state or the event log.
        ({"end_user": "a\x00b"}, FailureClass.REQUEST_INVALID, "end_user 'a\\\\x00b' is not valid"),
        ({"end_user": "u" * 129}, FailureClass.REQUEST_INVALID, "end_user is 129 characters"),
    ],
)
def test_validation(request_kwargs: dict[str, object], failure: FailureClass, fragment: str) -> None:
    s = state(
        [gpu("n/0")],
        [deployment("emb@1")],
        tenants=[tenant("t"), tenant("shadow", max_priority=Priority.BACKGROUND, default_priority=Priority.BACKGROUND)],
    )
    with pytest.raises(AdmissionRejected) as raised:
        validate_request(s, ask("r1", **request_kwargs))  # type: ignore[arg-type]
    assert raised.value.failure == failure and fragment in raised.value.message


def test_shadow_identity_is_stamped_background() -> None:
    s = state(
        [gpu("n/0")],
        [deployment("emb@1")],
        tenants=[tenant("shadow", max_priority=Priority.BACKGROUND, default_priority=Priority.BACKGROUND)],
    )
    _, priority = validate_request(s, ask("r1", tenant_name="shadow"))
    assert priority == Priority.BACKGROUND


def test_queue_limit() -> None:
    s = state([gpu("n/0")], [deployment("emb@1", queue_limit=2)])
    for n in range(2):
        request = ask(f"r{n}")
        enqueue(s, request, Priority.INTERACTIVE, NOW)
    with pytest.raises(AdmissionRejected) as raised:
        validate_request(s, ask("r9"))
    assert raised.value.failure == FailureClass.QUEUE_FULL


def test_reserved_residencies_are_refused_with_a_reason() -> None:
    s = state([gpu("n/0")], [deployment("x@1", residency=Residency.EXCLUSIVE)])
    with pytest.raises(AdmissionRejected) as raised:
        validate_request(s, ask("r1", "x@1"))
    assert raised.value.failure == FailureClass.RESIDENCY_CONFLICT


def test_queue_order_is_class_then_fair_share_then_time_then_id() -> None:
    s = state([gpu("n/0")], [deployment("emb@1")], tenants=[tenant("a", weight=1.0), tenant("b", weight=1.0)])
    enqueue(s, ask("late-bg", tenant_name="a"), Priority.BACKGROUND, NOW)
    enqueue(s, ask("prod", tenant_name="a"), Priority.PRODUCTION, NOW + 5)
    enqueue(s, ask("i-2", tenant_name="a"), Priority.INTERACTIVE, NOW + 1)
    enqueue(s, ask("i-1", tenant_name="a"), Priority.INTERACTIVE, NOW + 1)
    assert [q.request_id for q in queue_order(s, NOW + 5)] == ["prod", "i-1", "i-2", "late-bg"]
    # Tenant a has used the GPU, b has not: within a class, b goes first.
    from modelforge.policy import TenantUsage

    s.usage["a"] = TenantUsage(gpu_seconds=100.0, updated_at=NOW)
    enqueue(s, ask("b-1", tenant_name="b"), Priority.INTERACTIVE, NOW + 2)
    assert [q.request_id for q in queue_order(s, NOW + 5)][1] == "b-1"


def test_health_hysteresis_three_failures_then_three_good_checks() -> None:
    s = state([gpu("n/0")], [deployment("emb@1")])
    for n in range(2):
        observe(s, "n/0", healthy=False, at=NOW + n)
    assert s.accelerators["n/0"].healthy
    observe(s, "n/0", healthy=False, at=NOW + 2)
    assert not s.accelerators["n/0"].healthy
    assert admit(s, ask("r1"), NOW + 2).loads == []
    for n in range(3):
        assert not s.accelerators["n/0"].healthy
        observe(s, "n/0", at=NOW + 3 + n)
    assert s.accelerators["n/0"].healthy


def test_pressure_hysteresis_enters_low_leaves_high_after_hold() -> None:
    config = PolicyConfig(
        pressure_enter_fraction=0.05, pressure_exit_fraction=0.10, pressure_hold_s=60, volatility_window_s=300
    )
    s = state([gpu("n/0", total=100, reserve=1)], [], config=config)
    observe(s, "n/0", external_gib=96, at=NOW)  # 100 - 96 - 0 - 0 - 1 = 3 GiB = 3% < 5%: enter
    assert s.accelerators["n/0"].pressure
    observe(s, "n/0", external_gib=92, at=NOW + 10)  # 7%: between the watermarks, stays
    assert s.accelerators["n/0"].pressure
    # External drops to 80 GiB, but the 96 -> 80 swing is volatility: the dynamic reserve is
    # 16 GiB, so 100 - 80 - 16 = 4%: still under pressure.
    observe(s, "n/0", external_gib=80, at=NOW + 20)
    assert s.accelerators["n/0"].pressure
    # Past the 300 s window the swing is forgotten: 100 - 80 - 1 = 19% > 10%, the hold starts.
    observe(s, "n/0", external_gib=80, at=NOW + 400)
    assert s.accelerators["n/0"].pressure
    observe(s, "n/0", external_gib=80, at=NOW + 459)  # 59 s above the high watermark
    assert s.accelerators["n/0"].pressure
    observe(s, "n/0", external_gib=80, at=NOW + 460)  # 60 s: leaves
    assert not s.accelerators["n/0"].pressure


def test_keep_warm_check_resets_with_each_use() -> None:
    s = state([gpu("n/0")], [deployment("emb@1")])
    r = resident(s, "emb@1", "n/0", 1, last_used=NOW)
    assert keep_warm_check(s, r.key, NOW + 600) == NOW + 901
    r.last_used = NOW + 600
    assert keep_warm_check(s, r.key, NOW + 901) == NOW + 1501
    assert keep_warm_check(s, r.key, NOW + 1501) is None
    assert s.residents[r.key].phase == ResidentPhase.UNLOADING


def test_decisions_are_deterministic() -> None:
    def build():  # type: ignore[no-untyped-def]
        s = state([gpu("a/0", total=24), gpu("b/0", total=24)], [deployment("x@1", gib=3), deployment("y@1", gib=5)])
        observe(s, "a/0", external_gib=4)
        observe(s, "b/0", external_gib=2)
        for n in range(6):
            enqueue(s, ask(f"r{n}", "x@1" if n % 2 else "y@1"), Priority.INTERACTIVE, NOW + n)
        return s

    assert decide(build(), NOW + 10) == decide(build(), NOW + 10)


def test_admission_is_idempotent_for_the_same_requester() -> None:
    from modelforge.policy import existing_admission

    s = state([gpu("n/0")], [deployment("emb@1", gib=1, concurrency=1)])
    observe(s, "n/0", managed_gib=1, loaded=["emb@1@n/0"])
    resident(s, "emb@1", "n/0", 1)
    first = ask("r1")
    apply_decisions(s, admit(s, first), NOW, {})
    # The same call retried (its local activity timed out): it gets the lease it already has.
    again = existing_admission(s, first)
    assert again is not None and again.request_id == "r1" and again in s.leases.values()
    # Another workflow reusing the id is a conflict, not a duplicate.
    from dataclasses import replace

    with pytest.raises(AdmissionRejected) as raised:
        validate_request(s, replace(first, workflow_id="someone-else"))
    assert raised.value.failure == FailureClass.LEASE_CONFLICT
    assert existing_admission(s, replace(first, workflow_id="someone-else")) is None


def test_a_capability_that_keeps_failing_shows_as_degraded_until_a_success() -> None:
    from modelforge.policy import pool_status

    s = state([gpu("n/0")], [deployment("emb@1", gib=1, concurrency=1)])
    observe(s, "n/0", managed_gib=1, loaded=["emb@1@n/0"])
    resident(s, "emb@1", "n/0", 1)

    def one_request(n: int, outcome: str) -> None:
        apply_decisions(s, admit(s, ask(f"r{n}")), NOW, {})
        [lease_id] = s.leases
        release_lease(s, lease_id, NOW, outcome, "bad vector")

    for n, outcome in enumerate(["INVALID_OUTPUT", "preempted", "INVALID_OUTPUT"]):
        one_request(n, outcome)
    [health] = pool_status(s, NOW).capabilities
    assert (health.consecutive_failures, health.degraded) == (2, False)  # preemption is not its fault
    one_request(3, "INVALID_OUTPUT")
    [health] = pool_status(s, NOW).capabilities
    assert (health.degraded, health.last_failure, health.last_message) == (True, "INVALID_OUTPUT", "bad vector")
    one_request(4, "ok")
    assert pool_status(s, NOW).capabilities == []


def test_a_resident_granted_on_in_a_pass_is_not_evicted_by_a_later_request_of_that_pass() -> None:
    # 24 GiB card, 1 GiB reserve: chat (12 GiB) idle and warm, 11 GiB free; a job needs 16 GiB.
    s = state([gpu("n/0", total=24)], [deployment("chat@1", gib=12), deployment("job@1", gib=16)])
    observe(s, "n/0", managed_gib=12, loaded=["chat@1@n/0"])
    resident(s, "chat@1", "n/0", 12)
    enqueue(s, ask("chat-req", "chat@1"), Priority.INTERACTIVE, NOW)
    enqueue(s, ask("job-req", "job@1"), Priority.BACKGROUND, NOW)
    decisions = decide(s, NOW)
    [grant] = decisions.grants
    assert grant.lease.resident_key == "chat@1@n/0"
    # Evicting chat would make room for the job, but chat is in use from this very pass.
    assert decisions.unloads == []


def test_a_resident_evicted_in_a_pass_is_not_joined_by_a_later_request_of_that_pass() -> None:
    # Found by the simulator on the Azure trace: a production request evicted the idle eval
    # runner while a requeued background job of that pass joined it, so the job ran on a model
    # that was being unloaded. 24 GiB card, 1 GiB reserve, eval (6 GiB) idle: 17 GiB free;
    # llm needs 20 GiB, so eval goes (17 + 6 = 23 >= 20) and the background job must wait.
    s = state([gpu("n/0", total=24)], [deployment("llm@1", gib=20), deployment("eval@1", gib=6)])
    observe(s, "n/0", managed_gib=6, loaded=["eval@1@n/0"])
    resident(s, "eval@1", "n/0", 6, residency=Residency.NONE)
    enqueue(s, ask("prod", "llm@1"), Priority.PRODUCTION, NOW)
    enqueue(s, ask("job", "eval@1"), Priority.BACKGROUND, NOW)
    decisions = decide(s, NOW)
    assert [u.resident_key for u in decisions.unloads] == ["eval@1@n/0"]
    assert decisions.grants == []
    assert [w.request_id for w in decisions.waits] == ["prod", "job"]
    assert "being unloaded" in decisions.waits[1].reason


@pytest.mark.parametrize(
    ("last_served", "asking", "evicted"),
    [
        # (class of the idle model's last lease, class of the request needing room, evicted?)
        (Priority.PRODUCTION, Priority.BENCHMARK, False),  # experiments never unload production
        (Priority.PRODUCTION, Priority.INTERACTIVE, False),  # nor does any other class
        (Priority.PRODUCTION, Priority.PRODUCTION, True),  # production may make room for itself
        (Priority.INTERACTIVE, Priority.PRODUCTION, True),
        (Priority.INTERACTIVE, Priority.BACKGROUND, True),  # below production: cheapest first
        (Priority.BACKGROUND, Priority.BACKGROUND, True),
        (None, Priority.MAINTENANCE, True),  # never used since it loaded: anyone's to evict
    ],
)
def test_only_production_evicts_an_idle_model_that_last_served_production(
    last_served: Priority | None, asking: Priority, evicted: bool
) -> None:
    # 24 GiB card, 1 GiB reserve, a warm 9 GiB model idle: 14 GiB free; the request needs 16.
    s = state([gpu("n/0", total=24)], [deployment("llm@1", gib=9), deployment("lab@1", gib=16)])
    observe(s, "n/0", managed_gib=9, loaded=["llm@1@n/0"])
    resident(s, "llm@1", "n/0", 9).last_priority = last_served
    enqueue(s, ask("r1", "lab@1"), asking, NOW)
    decisions = decide(s, NOW)
    assert [u.resident_key for u in decisions.unloads] == (["llm@1@n/0"] if evicted else [])
    if not evicted:
        [wait] = decisions.waits
        assert "needs 17179869184 B" in wait.reason


def test_a_grant_records_the_class_the_resident_last_served() -> None:
    s = state([gpu("n/0")], [deployment("emb@1")])
    observe(s, "n/0", managed_gib=1, loaded=["emb@1@n/0"])
    resident(s, "emb@1", "n/0", 1)
    enqueue(s, ask("r1"), Priority.PRODUCTION, NOW)
    apply_decisions(s, decide(s, NOW), NOW, {})
    assert s.residents["emb@1@n/0"].last_priority == Priority.PRODUCTION


def test_lease_bytes_of_a_request_waiting_on_a_load_are_promised_to_it() -> None:
    # Found by the simulator on the Alibaba trace (220,015 loads for 6,129 jobs): a batch job's
    # model holds nothing idle (idle_bytes 0), so its lease carries all 10 GiB; the load promised
    # only the model's 0 bytes, others took the 10 GiB while it loaded, and the job could not be
    # granted when it was ready. 24 GiB card, 1 GiB reserve: 23 GiB; the job takes 10, so a
    # 14 GiB model must wait, in the same pass and in the next one while the job's model loads.
    deployments = [deployment("job@1", gib=10, idle_bytes=0, residency=Residency.NONE), deployment("big@1", gib=14)]
    s = state([gpu("n/0", total=24)], deployments)
    observe(s, "n/0")
    enqueue(s, ask("job", "job@1"), Priority.BACKGROUND, NOW)
    enqueue(s, ask("big", "big@1"), Priority.BACKGROUND, NOW + 1)
    decisions = decide(s, NOW + 1)
    assert [load.deployment for load in decisions.loads] == ["job@1"]
    apply_decisions(s, decisions, NOW + 1, {})
    # Next pass: the job's model is still loading; big still may not take the promised bytes.
    later = decide(s, NOW + 2)
    assert later.loads == []
    assert [w.request_id for w in later.waits] == ["job", "big"]
    assert "needs 15032385536 B, 13958643712 B schedulable" in later.waits[1].reason


def nvlink_pool() -> list:  # type: ignore[type-arg]
    # Two nodes of two 24 GiB cards, each node one NVLink group, and a loose card.
    return [
        gpu("a/0", nvlink_group="nvl-a"),
        gpu("a/1", nvlink_group="nvl-a"),
        gpu("b/0", nvlink_group="nvl-b"),
        gpu("b/1", nvlink_group="nvl-b"),
        gpu("c/0"),
    ]


@pytest.mark.parametrize(
    ("busy_gib", "gpus", "nvlink", "expected"),
    [
        # (GiB already used on a/0, b/0, c/0; gang size; NVLink required; accelerators granted)
        # 23 GiB usable per card; 10 GiB per GPU. a/0 has 3 left: group a cannot; group b can.
        ({"a/0": 20}, 2, True, ["b/0", "b/1"]),
        # Both groups short of room: it waits, all or nothing (no half-placed gang).
        ({"a/0": 20, "b/1": 20}, 2, True, None),
        # Without NVLink the two cards with most room left over fewest: best fit across nodes.
        ({"a/0": 20, "b/1": 20}, 2, False, ["a/1", "b/0"]),
        # Three GPUs in one NVLink group never exist here: refused at once.
        ({}, 3, True, "INSUFFICIENT_SCHEDULABLE_VRAM"),
    ],
)
def test_gang_placement_is_all_or_nothing_inside_one_nvlink_group(
    busy_gib: dict[str, float], gpus: int, nvlink: bool, expected: list[str] | str | None
) -> None:
    job = deployment("train@1", gib=10, residency=Residency.NONE, idle_bytes=0, gpu_count=gpus, nvlink_required=nvlink)
    s = state(nvlink_pool(), [job])
    for accelerator in ("a/0", "a/1", "b/0", "b/1", "c/0"):
        observe(s, accelerator, external_gib=busy_gib.get(accelerator, 0))
    _, priority = validate_request(s, ask("r1", "train@1"), gangs=True)
    enqueue(s, ask("r1", "train@1"), priority, NOW)
    decisions = decide(s, NOW)
    if isinstance(expected, list):
        [grant] = decisions.grants
        assert grant.lease.accelerators == expected
        assert grant.lease.bytes == 10 * GiB and grant.lease.resident_key == ""
        apply_decisions(s, decisions, NOW, {})
        assert s.leases[grant.lease.lease_id].gang == expected[1:]
    elif expected is None:
        assert decisions.grants == [] and decisions.rejects == []
        assert "gang of 2" in decisions.waits[0].reason
    else:
        [reject] = decisions.rejects
        assert reject.failure.value == expected


def test_nvlink_groups_the_nodes_advertise_replace_the_catalogs_and_survive_a_reload() -> None:
    # Four cards on one host; the catalog knows no NVLink. NVML on the node finds 0-1 and 2-3.
    cards = [gpu(f"h/{n}") for n in range(4)]
    job = deployment("train@1", gib=10, residency=Residency.NONE, idle_bytes=0, gpu_count=2, nvlink_required=True)
    s = state(cards, [job])
    for n in range(4):
        observe(s, f"h/{n}")
    enqueue(s, ask("r1", "train@1"), validate_request(s, ask("r1", "train@1"), gangs=True)[1], NOW)
    [reject] = decide(s, NOW).rejects
    assert reject.failure.value == "CAPABILITY_UNAVAILABLE"  # no group known: refused, not guessed

    s = state(cards, [job])
    for n in range(4):
        group = "nvlink:GPU-0" if n < 2 else "nvlink:GPU-2"
        labels = {"nvlink_group_id": group, "rack_id": "r1", "network_bandwidth_gbps": "200"}
        observe(s, f"h/{n}", external_gib=15 if n == 0 else 0, labels=labels)
    acc = s.catalog.accelerator("h/3")
    assert acc is not None and (acc.nvlink_group, acc.rack, acc.network_bandwidth_gbps) == ("nvlink:GPU-2", "r1", 200)
    enqueue(s, ask("r1", "train@1"), validate_request(s, ask("r1", "train@1"), gangs=True)[1], NOW)
    [grant] = decide(s, NOW).grants
    # h/0 has 15 GiB of external use (8 left < 10): the 2-3 group takes the job.
    assert grant.lease.accelerators == ["h/2", "h/3"]
    # A catalog reload (an operator's apply) brings the catalog's description back; the
    # advertised labels are applied again at once, with an event per changed accelerator.
    s.catalog = Catalog(accelerators=cards, deployments=[job], tenants=s.catalog.tenants)
    relabelled = relabel(s)
    assert [e.accelerator for e in relabelled] == ["h/0", "h/1", "h/2", "h/3"]
    assert "nvlink_group='nvlink:GPU-0'" in relabelled[0].message
    assert s.catalog.accelerator("h/1").nvlink_group == "nvlink:GPU-0"  # type: ignore[union-attr]
    assert relabel(s) == []  # nothing new: no event


def test_gangs_are_batch_jobs_and_a_model_server_over_several_gpus_is_refused() -> None:
    job = deployment("train@1", gib=10, residency=Residency.NONE, gpu_count=2)
    s = state(nvlink_pool(), [job])
    validate_request(s, ask("r1", "train@1"))  # admitted: the request workflow runs gangs
    server = deployment("tp@1", gib=10, gpu_count=2)
    s = state(nvlink_pool(), [server])
    with pytest.raises(AdmissionRejected, match="gangs are batch jobs"):
        validate_request(s, ask("r1", "tp@1"))


@pytest.mark.parametrize(
    ("concurrency", "joined", "waiting"),
    [
        # Three cold requests in one pass (one admission batch) for a model with 2 slots: one
        # load, the second request joins it, the third waits for a slot. Never a second load
        # of the same model on the same card (its resident key would collide).
        (2, ["r2"], ["r3"]),
        (1, [], ["r2", "r3"]),
        (3, ["r2", "r3"], []),
    ],
)
def test_cold_requests_of_one_pass_share_one_load(concurrency: int, joined: list[str], waiting: list[str]) -> None:
    s = state([gpu("n/0")], [deployment("emb@1", gib=1, concurrency=concurrency)])
    observe(s, "n/0")
    for request_id in ("r1", "r2", "r3"):
        _, priority = validate_request(s, ask(request_id))
        enqueue(s, ask(request_id), priority, NOW)
    decisions = decide(s, NOW)
    [load] = decisions.loads
    assert (load.accelerator, load.for_requests) == ("n/0", ["r1"])
    assert [a.request_id for a in decisions.assigns] == joined
    assert all(a.resident_key == load.resident_key for a in decisions.assigns)
    assert [w.request_id for w in decisions.waits] == waiting


def rack_pool() -> list[Accelerator]:
    """Two racks of two nodes of two 24 GiB cards: r1 = {a, b}, r2 = {c, d}; d is on 10 Gb/s."""
    cards = []
    for rack, nodes in (("r1", "ab"), ("r2", "cd")):
        for node in nodes:
            for n in range(2):
                bandwidth = 10.0 if node == "d" else 100.0
                cards.append(gpu(f"{node}/{n}", rack=rack, network_bandwidth_gbps=bandwidth))
    return cards


@pytest.mark.parametrize(
    ("shape", "busy", "expected"),
    [
        # (gang shape; GiB used by others per card; cards granted, or the refusal class)
        # 23 GiB usable per card, 10 GiB per card wanted. Two cards fit on node a: one node.
        ({"gpu_count": 2}, {}, ["a/0", "a/1"]),
        # a/0 full: no node has two free cards but b does; b's pair is chosen (one node still).
        ({"gpu_count": 2}, {"a/0": 20}, ["b/0", "b/1"]),
        # Four cards: no node has four, rack r1 does (a and b): kept inside one rack.
        ({"gpu_count": 4}, {}, ["a/0", "a/1", "b/0", "b/1"]),
        # One card busy in each rack: no rack has four: across the pool, best fit.
        ({"gpu_count": 4}, {"a/0": 20, "c/0": 20}, ["a/1", "b/0", "b/1", "c/1"]),
        # ...unless the rack is required: it waits (None), all or nothing.
        ({"gpu_count": 4, "rack_affinity": "required"}, {"a/0": 20, "c/0": 20}, None),
        # Two per node on two nodes: a and b (rack r1 first).
        ({"gpu_count": 4, "gpu_per_node": 2}, {}, ["a/0", "a/1", "b/0", "b/1"]),
        # Spread: no two cards on one node, inside one rack when possible.
        ({"gpu_count": 2, "anti_affinity": "node"}, {}, ["a/0", "b/0"]),
        # Spread across racks: one card in each.
        ({"gpu_count": 2, "anti_affinity": "rack"}, {}, ["a/0", "c/0"]),
        # Three racks do not exist: refused at once, with the shape in the reason.
        ({"gpu_count": 3, "anti_affinity": "rack"}, {}, "INSUFFICIENT_SCHEDULABLE_VRAM"),
        # 50 Gb/s floor: node d (10 Gb/s) is out; four per... two per node on c and d cannot be.
        (
            {"gpu_count": 4, "gpu_per_node": 2, "min_network_bandwidth_gbps": 50.0},
            {"a/0": 20},
            ["b/0", "b/1", "c/0", "c/1"],
        ),
    ],
)
def test_gang_topology_shapes(
    shape: dict[str, object], busy: dict[str, float], expected: list[str] | str | None
) -> None:
    job = deployment("train@1", gib=10, residency=Residency.NONE, idle_bytes=0, **shape)
    s = state(rack_pool(), [job])
    for card in s.catalog.accelerators:
        observe(s, card.id, external_gib=busy.get(card.id, 0))
    _, priority = validate_request(s, ask("r1", "train@1"), gangs=True)
    enqueue(s, ask("r1", "train@1"), priority, NOW)
    decisions = decide(s, NOW)
    if isinstance(expected, list):
        [grant] = decisions.grants
        assert sorted(grant.lease.accelerators) == expected
    elif expected is None:
        assert decisions.grants == [] and decisions.rejects == []
    else:
        [reject] = decisions.rejects
        assert reject.failure.value == expected and "no two on one rack" in reject.message


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"gpu_count": 4, "gpu_per_node": 3}, "gpu_per_node: 3 does not divide gpu_count 4"),
        ({"gpu_count": 4, "gpu_per_node": 2, "anti_affinity": "node"}, "cannot hold with more than one card"),
        ({"gpu_count": 2, "anti_affinity": "rack", "rack_affinity": "required"}, "contradict"),
    ],
)
def test_impossible_gang_shapes_are_refused_by_the_catalog(fields: dict[str, object], problem: str) -> None:
    from modelforge.catalog import CatalogError, parse_catalog

    data = {
        "accelerators": [{"id": "a/0", "node": "a", "total_bytes": 24 * GiB}],
        "deployments": [{"capability": "t@1", "envelope_bytes": GiB, "residency": "none", **fields}],
    }
    with pytest.raises(CatalogError, match=problem):
        parse_catalog(data)


def test_node_count_by_gpu_per_node_and_gpu_memory_min() -> None:
    from modelforge.catalog import CatalogError, parse_catalog

    accelerators = [
        {"id": f"{node}/{n}", "node": node, "total_bytes": (48 if node != "small" else 16) * GiB, "rack": "r1"}
        for node in ("a", "b", "small")
        for n in range(2)
    ]
    job = {"capability": "t@1", "envelope_bytes": 10 * GiB, "idle_bytes": 0, "residency": "none"}
    catalog, _ = parse_catalog(
        {"accelerators": accelerators, "deployments": [{**job, "node_count": 2, "gpu_per_node": 2}]}
    )
    [dep] = catalog.deployments
    assert dep.gpu_count == 4  # 2 nodes x 2 cards
    with pytest.raises(CatalogError, match="node_count: needs gpu_per_node"):
        parse_catalog({"accelerators": accelerators, "deployments": [{**job, "node_count": 2}]})
    with pytest.raises(CatalogError, match="gpu_count: 3 is not node_count x gpu_per_node = 4"):
        parse_catalog(
            {"accelerators": accelerators, "deployments": [{**job, "node_count": 2, "gpu_per_node": 2, "gpu_count": 3}]}
        )
    # 32 GiB minimum: the two 16 GiB cards on `small` are filtered out with their reason, so the
    # 2 x 2 gang lands on a and b even though `small` is empty.
    catalog, _ = parse_catalog(
        {
            "accelerators": accelerators,
            "deployments": [{**job, "node_count": 2, "gpu_per_node": 2, "gpu_memory_min": 32 * GiB}],
        }
    )
    s = state(catalog.accelerators, catalog.deployments)
    for card in ("a/0", "b/0"):
        observe(s, card, external_gib=5)
    for card in ("a/1", "b/1", "small/0", "small/1"):
        observe(s, card)
    _, priority = validate_request(s, ask("r1", "t@1"), gangs=True)
    enqueue(s, ask("r1", "t@1"), priority, NOW)
    [grant] = decide(s, NOW).grants
    assert sorted(grant.lease.accelerators) == ["a/0", "a/1", "b/0", "b/1"]
    refused = {
        f.accelerator: f.reason for f in filter_accelerators(s, catalog.deployments[0], Priority.BACKGROUND, NOW)
    }
    assert refused["small/0"].endswith(f"below gpu_memory_min {32 * GiB} B")


def test_a_ready_resident_on_a_stale_card_gets_no_new_lease_and_a_fresh_card_loads_instead() -> None:
    s = state([gpu("a/0"), gpu("b/0")], [deployment("emb@1")], config=PolicyConfig(freshness_s=30))
    observe(s, "a/0", at=NOW - 31, managed_gib=1, loaded=["emb@1@a/0"])
    resident(s, "emb@1", "a/0", 1)
    # Only the stale card holds the model: the request waits, and says why.
    only_stale = state([gpu("a/0")], [deployment("emb@1")], config=PolicyConfig(freshness_s=30))
    observe(only_stale, "a/0", at=NOW - 31, managed_gib=1, loaded=["emb@1@a/0"])
    resident(only_stale, "emb@1", "a/0", 1)
    waiting = admit(only_stale, ask("r1"))
    assert waiting.grants == [] and waiting.loads == []
    assert "a/0: SCHEDULER_STATE_STALE (observation 31 s old)" in waiting.waits[0].reason
    # A fresh card beside it: the model is loaded there rather than joined on the silent node.
    observe(s, "b/0")
    decisions = admit(s, ask("r2"))
    assert decisions.grants == [] and [load.accelerator for load in decisions.loads] == ["b/0"]
