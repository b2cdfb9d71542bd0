"""Making room beyond idle residents (README, "How it works"): strictly lower, preemptible work is preempted
after its minimum runtime, requeued at its original class with preempted=true; work that cannot
be interrupted is waited for; an UNHEALTHY accelerator's work is preempted whatever its class."""

from __future__ import annotations

import pytest

from modelforge.domain import GiB, Priority, Residency
from modelforge.policy import (
    AdmissionRequest,
    PolicyConfig,
    PoolState,
    apply_decisions,
    decide,
    enqueue,
    queue_order,
    release_lease,
    resident_unloaded,
)
from tests.builders import NOW, ask, deployment, gpu, observe, state

CONFIG = PolicyConfig(preempt_min_runtime_s=30, preempt_grace_s=20)


def busy_card(*, preemptible: bool = True, job_priority: Priority = Priority.BACKGROUND) -> PoolState:
    """A 24 GiB card: 1 GiB reserve, a 16 GiB batch job running since NOW; llm@1 needs 12 GiB."""
    s = state(
        [gpu("n/0", total=24)],
        [
            deployment("job@1", gib=16, residency=Residency.NONE, preemptible=preemptible),
            deployment("llm@1", gib=12),
        ],
        config=CONFIG,
    )
    observe(s, "n/0", at=NOW)
    enqueue(s, ask("job", "job@1"), job_priority, NOW)
    apply_decisions(s, decide(s, NOW), NOW, {})  # starts the load
    from modelforge.policy import resident_ready

    resident_ready(s, "job@1@n/0", 16 * GiB, NOW)
    observe(s, "n/0", managed_gib=16, at=NOW, loaded=["job@1@n/0"])
    apply_decisions(s, decide(s, NOW), NOW, {})  # grants the job its lease
    assert len(s.leases) == 1
    return s


def ask_llm(s: PoolState, priority: Priority, at: float) -> None:
    enqueue(s, ask("llm", "llm@1"), priority, at)


@pytest.mark.parametrize(
    ("preemptible", "job_priority", "llm_priority", "at", "preempted"),
    [
        # 24 - 1 reserve - 16 job = 7 GiB free < 12 needed; the job is lower and ran 60 s >= 30 s.
        (True, Priority.BACKGROUND, Priority.INTERACTIVE, NOW + 60, True),
        (True, Priority.BACKGROUND, Priority.BACKGROUND, NOW + 60, False),  # same class: never
        (True, Priority.INTERACTIVE, Priority.BACKGROUND, NOW + 60, False),  # lower asks higher: never
        (True, Priority.BACKGROUND, Priority.INTERACTIVE, NOW + 10, False),  # ran 10 s < 30 s minimum
        (False, Priority.BACKGROUND, Priority.PRODUCTION, NOW + 60, False),  # cannot be interrupted: drain
    ],
)
def test_only_strictly_lower_preemptible_work_past_its_minimum_runtime_is_preempted(
    preemptible: bool, job_priority: Priority, llm_priority: Priority, at: float, preempted: bool
) -> None:
    s = busy_card(preemptible=preemptible, job_priority=job_priority)
    observe(s, "n/0", managed_gib=16, at=at, loaded=["job@1@n/0"])
    ask_llm(s, llm_priority, at)
    decisions = decide(s, at)
    assert decisions.grants == [] and decisions.loads == []
    if preempted:
        [preempt] = decisions.preemptions
        assert (preempt.request_id, preempt.grace_s) == ("job", 20)
        assert "interactive llm@1 needs room on n/0" in preempt.reason
        assert "preempting lower-class work" in decisions.waits[-1].reason
    else:
        assert decisions.preemptions == []


def test_preempted_work_frees_its_room_and_is_requeued_in_its_old_place() -> None:
    s = busy_card()
    at = NOW + 60
    observe(s, "n/0", managed_gib=16, at=at, loaded=["job@1@n/0"])
    ask_llm(s, Priority.INTERACTIVE, at)
    apply_decisions(s, decide(s, at), at, {})
    [lease_id] = s.preempting
    # Asked once: while the holder checkpoints, the next passes wait instead of asking again.
    again = decide(s, at + 1)
    assert again.preemptions == [] and again.loads == []
    assert "preempting" in again.waits[0].reason

    # The holder releases and requeues at its original class and submission time.
    release_lease(s, lease_id, at + 5, "preempted")
    enqueue(
        s,
        AdmissionRequest("job", "request:job@1:job", "job@1", "t", preempted=True, submitted_at=NOW),
        Priority.BACKGROUND,
        at + 5,
    )
    requeued = next(q for q in s.queue if q.request_id == "job")
    assert requeued.preempted and requeued.submitted_at == NOW
    assert [q.request_id for q in queue_order(s, at + 5)] == ["llm", "job"]  # class first

    # The batch resident (residency none) goes once idle, then the interactive model loads.
    freed = decide(s, at + 5)
    assert [u.resident_key for u in freed.unloads] == ["job@1@n/0"]
    apply_decisions(s, freed, at + 5, {})
    resident_unloaded(s, "job@1@n/0", True, "")
    observe(s, "n/0", at=at + 6)
    [load] = decide(s, at + 6).loads
    assert (load.deployment, load.accelerator) == ("llm@1", "n/0")


def test_an_unhealthy_accelerator_has_all_its_work_preempted() -> None:
    s = busy_card(preemptible=False, job_priority=Priority.PRODUCTION)
    for n in range(3):  # three consecutive failed checks
        observe(s, "n/0", managed_gib=16, at=NOW + n, healthy=False, loaded=["job@1@n/0"])
    decisions = decide(s, NOW + 3)
    [preempt] = decisions.preemptions
    assert preempt.request_id == "job" and "UNHEALTHY" in preempt.reason


@pytest.mark.parametrize(
    ("last_sample_ago_s", "preemptible", "preempted"),
    [
        # node_silent_s is 120 s: the node's last sample came 119 s ago, the lease stays.
        (119, True, False),
        # 121 s of silence: the lease is preempted, whatever the deployment says (as UNHEALTHY).
        (121, True, True),
        (121, False, True),
    ],
)
def test_leases_on_a_silent_node_are_preempted(last_sample_ago_s: float, preemptible: bool, preempted: bool) -> None:
    s = busy_card(preemptible=preemptible)  # the job holds its lease since NOW; last sample at NOW
    [lease] = s.leases.values()
    decisions = decide(s, NOW + last_sample_ago_s)
    assert decisions.grants == []
    if preempted:
        [preempt] = decisions.preemptions
        assert preempt.lease_id == lease.lease_id
        assert preempt.reason == f"n/0: node silent for {last_sample_ago_s} s"
        apply_decisions(s, decisions, NOW + last_sample_ago_s, {})
        assert decide(s, NOW + last_sample_ago_s + 1).preemptions == []  # asked once
    else:
        assert decisions.preemptions == []
