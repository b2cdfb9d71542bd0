"""A residency heard loaded that the scheduler's state does not hold is adopted (`adopt_resident`),
without Temporal: a reset of the scheduler's run hears the reports of the part it discarded
again, and a model its card holds must count there, serve, and never be loaded a second time
beside itself. What cannot be adopted (its deployment or card gone from the pool's catalog, its
key held by another life) is refused, and the scheduler unloads or lets it go."""

from __future__ import annotations

from modelforge.domain import GiB, Priority, resident_key
from modelforge.policy import (
    PoolState,
    ResidentPhase,
    adopt_resident,
    apply_decisions,
    decide,
    enqueue,
    resident_ready,
)
from tests.builders import NOW, ask, deployment, gpu, observe, state, tenant

CARD = "n/0"
CHAT = "chat@1"
KEY = resident_key(CHAT, CARD)


def pool() -> PoolState:
    s = state(
        [gpu(CARD, total=24, reserve=1), gpu("other/0", pool="other")],
        [deployment(CHAT, gib=8, concurrency=2)],
        tenants=[tenant("t", max_priority=Priority.PRODUCTION, default_priority=Priority.INTERACTIVE)],
    )
    observe(s, CARD, managed_gib=0, at=NOW)
    return s


def test_an_adopted_residency_is_ready_counts_its_bytes_and_serves_without_a_load() -> None:
    s = pool()
    s.incarnations = 7  # lives given out before the reset point
    events = adopt_resident(s, KEY, CHAT, CARD, f"resident:{CHAT}:{CARD}:3", int(9 * GiB), NOW)
    assert events is not None and [e.kind for e in events] == ["residency_adopted"]
    adopted = s.residents[KEY]
    assert adopted.phase == ResidentPhase.READY
    assert adopted.workflow_id == f"resident:{CHAT}:{CARD}:3"
    assert adopted.bytes == 9 * GiB  # what it measured, over its 8 GiB envelope
    assert adopted.incarnation == 8  # a life of its own
    observe(s, CARD, managed_gib=9, loaded=[KEY], at=NOW + 1)
    enqueue(s, ask("r1", CHAT), Priority.INTERACTIVE, NOW + 1)
    decisions = decide(s, NOW + 1)
    assert decisions.loads == []  # never loaded a second time beside itself
    assert [g.lease.resident_key for g in decisions.grants] == [KEY]
    apply_decisions(s, decisions, NOW + 1, {})
    assert s.residents[KEY].active_leases == 1


def test_what_cannot_be_adopted_is_refused_and_changes_nothing() -> None:
    s = pool()
    wid = f"resident:{CHAT}:{CARD}:3"
    assert adopt_resident(s, KEY, "gone@1", CARD, wid, GiB, NOW) is None  # deployment not in the catalog
    assert adopt_resident(s, KEY, CHAT, "nowhere/0", wid, GiB, NOW) is None  # card not in the catalog
    assert adopt_resident(s, resident_key(CHAT, "other/0"), CHAT, "other/0", wid, GiB, NOW) is None  # another pool's
    assert s.residents == {} and s.incarnations == 0
    # Its key held by another life (loaded again since): that one stays as it is.
    enqueue(s, ask("r1", CHAT), Priority.INTERACTIVE, NOW)
    decisions = decide(s, NOW)
    apply_decisions(s, decisions, NOW, {KEY: f"resident:{CHAT}:{CARD}:9"})
    resident_ready(s, KEY, 0, NOW + 1)
    before = (s.residents[KEY].workflow_id, s.residents[KEY].incarnation, s.incarnations)
    assert adopt_resident(s, KEY, CHAT, CARD, wid, GiB, NOW + 2) is None
    assert (s.residents[KEY].workflow_id, s.residents[KEY].incarnation, s.incarnations) == before
