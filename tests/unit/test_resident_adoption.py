"""A residency heard loaded that the scheduler's state does not hold is adopted (`adopt_resident`),
and a load whose residency says nothing in time is found (`overdue_loads`: the scheduler asks
the residency, and fails the load when it is gone), without Temporal.

A reset of the scheduler's run hears the reports of the part it discarded again: a model its card
holds must count there, and never be loaded a second time beside itself. It is adopted loading
(not grantable) until its residency answers the scheduler's `adopt` with what it is now (the
discarded part may have put it to sleep, or begun its unload); its answer is no load time. What
cannot be adopted (its deployment or card gone from the pool's catalog, its key held by another
life) is refused, and the scheduler unloads or lets it go. A load that no residency will ever
report (its workflow ended without a word, or an adopted one was closing) must not hold its
bytes and its waiters for ever; one whose residency is there but slow is never failed."""

from __future__ import annotations

from modelforge.domain import GiB, Priority, resident_key
from modelforge.failures import FailureClass
from modelforge.policy import (
    PoolState,
    ResidentPhase,
    adopt_resident,
    apply_decisions,
    decide,
    enqueue,
    overdue_loads,
    resident_failed,
    resident_ready,
)
from tests.builders import NOW, ask, deployment, gpu, observe, state, tenant

CARD = "n/0"
CHAT = "chat@1"
KEY = resident_key(CHAT, CARD)
RESIDENCY = f"resident:{CHAT}:{CARD}:3"


def pool() -> PoolState:
    s = state(
        [gpu(CARD, total=24, reserve=1), gpu("other/0", pool="other")],
        # 6 GiB idle, 8 at a lease's peak; loads in 20 s by the catalog.
        [deployment(CHAT, gib=8, idle_bytes=6 * GiB, concurrency=2, load_s=20)],
        tenants=[tenant("t", max_priority=Priority.PRODUCTION, default_priority=Priority.INTERACTIVE)],
    )
    observe(s, CARD, managed_gib=0, at=NOW)
    return s


def test_an_adopted_residency_loads_until_it_answers_then_serves_without_a_second_load() -> None:
    s = pool()
    s.incarnations = 7  # lives given out before the reset point
    events = adopt_resident(s, KEY, CHAT, CARD, RESIDENCY, int(6.5 * GiB), NOW)
    assert events is not None and [e.kind for e in events] == ["residency_adopted"]
    adopted = s.residents[KEY]
    assert (adopted.phase, adopted.workflow_id, adopted.incarnation) == (ResidentPhase.LOADING, RESIDENCY, 8)
    assert adopted.bytes == int(6.5 * GiB)  # what it measured, over its 6 GiB idle (a lease adds 2 more)
    enqueue(s, ask("r1", CHAT), Priority.INTERACTIVE, NOW)
    waiting = decide(s, NOW)
    assert waiting.loads == [] and waiting.grants == []  # it waits on the adopted one, no second load
    apply_decisions(s, waiting, NOW, {})
    # Its answer, 30 s on: ready, and no load time measured from the adoption.
    resident_ready(s, KEY, int(6.5 * GiB), NOW + 30, measure=False)
    assert s.residents[KEY].phase == ResidentPhase.READY
    assert CHAT not in s.measured
    observe(s, CARD, managed_gib=6.5, loaded=[KEY], at=NOW + 30)
    served = decide(s, NOW + 30)
    assert served.loads == []
    assert [g.lease.resident_key for g in served.grants] == [KEY]


def test_what_cannot_be_adopted_is_refused_and_changes_nothing() -> None:
    s = pool()
    assert adopt_resident(s, KEY, "gone@1", CARD, RESIDENCY, GiB, NOW) is None  # deployment not in the catalog
    assert adopt_resident(s, KEY, CHAT, "nowhere/0", RESIDENCY, GiB, NOW) is None  # card not in the catalog
    other = resident_key(CHAT, "other/0")
    assert adopt_resident(s, other, CHAT, "other/0", RESIDENCY, GiB, NOW) is None  # another pool's card
    assert s.residents == {} and s.incarnations == 0
    # Its key held by another life (loaded again since): that one stays as it is.
    enqueue(s, ask("r1", CHAT), Priority.INTERACTIVE, NOW)
    apply_decisions(s, decide(s, NOW), NOW, {KEY: f"resident:{CHAT}:{CARD}:9"})
    resident_ready(s, KEY, 0, NOW + 1)
    before = (s.residents[KEY].workflow_id, s.residents[KEY].incarnation, s.incarnations)
    assert adopt_resident(s, KEY, CHAT, CARD, RESIDENCY, GiB, NOW + 2) is None
    assert (s.residents[KEY].workflow_id, s.residents[KEY].incarnation, s.incarnations) == before


def test_a_load_no_residency_reports_in_time_is_overdue_and_its_waiter_told() -> None:
    s = pool()
    enqueue(s, ask("r1", CHAT), Priority.INTERACTIVE, NOW)
    apply_decisions(s, decide(s, NOW), NOW, {KEY: RESIDENCY})
    assert s.residents[KEY].phase == ResidentPhase.LOADING
    # Two attempts of its load activity (200 s each: ten times 20 s) and of its health check.
    limit = 2 * 200 + 180
    assert overdue_loads(s, NOW + limit - 1) == ([], NOW + limit)
    assert overdue_loads(s, NOW + limit) == ([KEY], None)
    # The scheduler asks its residency whether it is there: one that is, is given another limit.
    assert overdue_loads(s, NOW + limit + 5, {KEY: NOW + limit}) == ([], NOW + 2 * limit)
    # One that is gone fails the load: its waiter is refused, its bytes go back.
    rejects, _ = resident_failed(s, KEY, FailureClass.MODEL_LOAD_FAILED, "no word from its residency", NOW + limit)
    assert [(r.request_id, r.failure) for r in rejects] == [("r1", FailureClass.MODEL_LOAD_FAILED)]
    assert KEY not in s.residents
    # A ready resident is never overdue, however long ago its load was asked.
    adopt_resident(s, KEY, CHAT, CARD, RESIDENCY, GiB, NOW)
    resident_ready(s, KEY, GiB, NOW + 1, measure=False)
    assert overdue_loads(s, NOW + 10 * limit) == ([], None)
