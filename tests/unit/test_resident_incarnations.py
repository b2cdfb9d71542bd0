"""Leases belong to one incarnation of a resident, without Temporal.

A resident lost with leases in flight (its node worker killed and restarted, its runtime
crashed) and loaded again under the same key (deployment + accelerator) is another resident: a
lease granted on the lost one that ends later (released, reclaimed, a lent slot given back)
must not touch the new one's count of active leases, or the scheduler grants more than the
concurrency (the chaos bench saw five to seven invokes at once on a concurrency-4 model). Its
own end still closes its ledger row (`lease_released`) and is recorded (`stale_lease_ended`).

The stateful test tracks on its own which resident object each lease was granted on (never the
policy's incarnation field), so it checks the policy's counts against the truth."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from modelforge.domain import GiB, Priority, resident_key
from modelforge.failures import FailureClass
from modelforge.policy import (
    PolicyConfig,
    PolicyEvent,
    PoolState,
    ResidentPhase,
    ResidentState,
    SlotSync,
    apply_decisions,
    decide,
    enqueue,
    reclaim_stale_leases,
    release_lease,
    resident_crashed,
    resident_ready,
    sync_slots,
)
from tests.builders import NOW, ask, deployment, gpu, observe, state, tenant
from tests.tiers import examples

CARD = "n/0"
# Leases carry bytes (1 GiB idle, 2 GiB more per lease): never lent to a node.
BYTES = "bytes@1"
# Leases carry none: its slots are lent to the node (warm-path delegation).
LENT = "lent@1"
CONCURRENCY = 4
KEYS = {BYTES: resident_key(BYTES, CARD), LENT: resident_key(LENT, CARD)}


def pool() -> PoolState:
    s = state(
        [gpu(CARD, total=48, reserve=0)],
        [
            deployment(BYTES, gib=3, idle_bytes=1 * GiB, concurrency=CONCURRENCY, queue_limit=1000),
            deployment(LENT, gib=1, concurrency=CONCURRENCY, queue_limit=1000),
        ],
        tenants=[tenant("t", max_priority=Priority.PRODUCTION, default_priority=Priority.INTERACTIVE)],
        config=PolicyConfig(stale_lease_s=60.0),
    )
    sample(s, NOW)
    return s


def sample(s: PoolState, now: float) -> None:
    """A fresh sample in which the node holds every resident the scheduler has."""
    managed = sum(r.bytes for r in s.residents.values()) / GiB
    observe(s, CARD, managed_gib=managed, loaded=list(s.residents), at=now)


def admit(s: PoolState, request_ids: list[str], capability: str, now: float) -> list[str]:
    """Queue the requests and run one pass: the ids of the leases granted."""
    for request_id in request_ids:
        enqueue(s, ask(request_id, capability), Priority.INTERACTIVE, now)
    return run_pass(s, now)


def run_pass(s: PoolState, now: float) -> list[str]:
    decisions = decide(s, now)
    apply_decisions(s, decisions, now, {})
    return [grant.lease.lease_id for grant in decisions.grants]


def load_ready(s: PoolState, now: float) -> list[str]:
    """Every loading resident is ready; the next pass grants on them."""
    for key, r in list(s.residents.items()):
        if r.phase == ResidentPhase.LOADING:
            resident_ready(s, key, 0, now)
    sample(s, now)
    return run_pass(s, now)


def lose(s: PoolState, key: str, lease_id: str, now: float) -> list[PolicyEvent]:
    """What the scheduler does when an invoke finds the runtime gone: the lease is released with
    RUNTIME_CRASH and the resident it ran on is dropped."""
    lease = s.leases[lease_id]
    events = release_lease(s, lease_id, now, FailureClass.RUNTIME_CRASH.value, "runtime gone")
    return events + resident_crashed(s, key, lease.granted_at, "runtime gone", now)


def test_a_release_from_a_lost_resident_leaves_the_new_residents_count_alone() -> None:
    s = pool()
    now = NOW
    assert admit(s, [f"a{n}" for n in range(CONCURRENCY)], BYTES, now) == []  # a load first
    now += 1
    old = load_ready(s, now)
    key = KEYS[BYTES]
    first = s.residents[key]
    assert len(old) == CONCURRENCY and first.active_leases == CONCURRENCY
    # The node worker is killed: one invoke reports the runtime gone, the resident is dropped,
    # and the other three leases on that life end with it (nothing can run under them), though
    # their holders have not heard yet: their ledger rows close now, not when they are heard of.
    now += 1
    crashed_at = now
    lost = lose(s, key, old[0], now)
    assert key not in s.residents
    assert sorted(e.lease_id for e in lost if e.kind == "lease_reclaimed") == sorted(old[1:])
    rows = [e for e in lost if e.kind == "lease_released"]
    assert sorted(e.lease_id for e in rows) == sorted(old) and {e.payload["ended_at"] for e in rows} == {crashed_at}
    assert not set(old) & set(s.leases)
    # Requests queue, the model is loaded again under the same key and fills up.
    assert admit(s, [f"b{n}" for n in range(CONCURRENCY + 2)], BYTES, now) == []
    now += 1
    new = load_ready(s, now)
    second = s.residents[key]
    assert second is not first
    assert len(new) == CONCURRENCY and second.active_leases == CONCURRENCY
    # The lost resident's holders report late: nothing of theirs is held, no slot of the new one frees.
    now += 1
    ended: list[PolicyEvent] = []
    for lease_id in old[1:]:
        ended += release_lease(s, lease_id, now, FailureClass.TIMEOUT.value, "invoke heartbeat timed out")
    assert ended == []
    assert second.active_leases == CONCURRENCY
    assert run_pass(s, now) == [], "no grant beyond the concurrency"
    assert second.incarnation != first.incarnation
    # Their rows ended at the crash, each recorded as a lease of a life that is gone.
    stale = [e for e in lost if e.kind == "stale_lease_ended"]
    assert sorted(e.lease_id for e in stale) == sorted(old[1:])
    assert all(e.payload["incarnation"] == first.incarnation for e in stale)
    # The new resident's own leases free its slots as before.
    release_lease(s, new[0], now, "ok")
    assert second.active_leases == CONCURRENCY - 1
    assert len(run_pass(s, now)) == 1


def test_a_reclaimed_lease_of_a_lost_resident_and_its_crash_report_leave_the_new_one_alone() -> None:
    s = pool()
    now = NOW
    admit(s, ["a0", "a1"], BYTES, now)
    old = load_ready(s, now + 1)
    key = KEYS[BYTES]
    now += 2
    old_life = s.leases[old[1]].incarnation
    lose(s, key, old[0], now)
    assert old[1] not in s.leases  # ended with its resident
    admit(s, ["b0"], BYTES, now)
    new = load_ready(s, now + 1)
    second = s.residents[key]
    assert len(new) == 1 and second.active_leases == 1
    # A late RUNTIME_CRASH report about the old life does not drop the new resident.
    assert resident_crashed(s, key, now + 5, "runtime gone", now + 5, old_life) == []
    assert s.residents[key] is second
    # Nothing of the old life is left to reclaim; the new lease's holder heartbeats.
    s.lease_seen[new[0]] = now + 200
    assert reclaim_stale_leases(s, now + 100) == []
    assert second.active_leases == 1


def test_slots_lent_on_a_lost_resident_never_count_on_the_new_one() -> None:
    s = pool()
    now = NOW
    admit(s, ["a0"], LENT, now)
    load_ready(s, now + 1)
    key = KEYS[LENT]
    first = s.residents[key]
    now += 2
    reply, _ = sync_slots(s, SlotSync(node="n", boot="b1", wanted=[LENT]), now)
    lent = [lease.lease_id for lease in reply.lent]
    assert len(lent) == CONCURRENCY - 2 and first.active_leases == CONCURRENCY - 1  # one spare, one held
    # The runtime crashes under the scheduler's own lease: the resident is lost, loaded again.
    lose(s, key, next(iter(lid for lid in s.leases if lid not in s.slots)), now)
    admit(s, ["b0", "b1"], LENT, now)
    load_ready(s, now + 1)
    second = s.residents[key]
    assert second is not first and second.active_leases == 2
    # The same worker syncs: its slots of the old life are closed, never used on the new one.
    reply, _ = sync_slots(s, SlotSync(node="n", boot="b1", held=lent), now + 2)
    assert set(reply.closing) == set(lent)
    assert second.active_leases == 2
    # It gives them back: the new resident's count stays its own.
    _, events = sync_slots(s, SlotSync(node="n", boot="b1", held=[]), now + 3)
    assert [e.kind for e in events].count("slot_returned") == len(lent)
    assert [e.kind for e in events].count("stale_lease_ended") == len(lent)
    assert second.active_leases == 2 and not s.slots


class Incarnations(RuleBasedStateMachine):
    """Bursts, passes, loads, releases, crashes of a resident with leases in flight, silence
    (reclaims), node syncs and node restarts, in any order: each resident's count of active
    leases is exactly the leases granted (or slots lent) on that resident object, never more
    than its concurrency."""

    def __init__(self) -> None:
        super().__init__()
        self.s = pool()
        self.now = NOW
        self.n = 0
        self.boot = 0
        self.granted_on: dict[str, ResidentState] = {}  # lease id -> the resident it went to
        self.node_holds: list[str] = []

    def _granted(self, lease_ids: list[str]) -> None:
        for lease_id in lease_ids:
            self.granted_on[lease_id] = self.s.residents[self.s.leases[lease_id].resident_key]

    @rule(capability=st.sampled_from([BYTES, LENT]), count=st.integers(1, 6), loaded=st.booleans())
    def burst(self, capability: str, count: int, loaded: bool) -> None:
        ids = [f"r{self.n + k}" for k in range(count)]
        self.n += count
        self._granted(admit(self.s, ids, capability, self.now))
        if loaded:  # and the load it started is done
            self._granted(load_ready(self.s, self.now))

    @rule()
    def loads_finish(self) -> None:
        self._granted(load_ready(self.s, self.now))

    @precondition(lambda self: any(lid not in self.s.slots for lid in self.s.leases))
    @rule(data=st.data(), crashed=st.booleans())
    def a_holder_releases(self, data: st.DataObject, crashed: bool) -> None:
        lease_id = data.draw(st.sampled_from(sorted(lid for lid in self.s.leases if lid not in self.s.slots)))
        lease = self.s.leases[lease_id]
        if crashed:  # its invoke found the runtime gone
            release_lease(self.s, lease_id, self.now, FailureClass.RUNTIME_CRASH.value, "runtime gone")
            resident_crashed(self.s, lease.resident_key, lease.granted_at, "runtime gone", self.now)
        else:
            release_lease(self.s, lease_id, self.now, "ok")
        self._granted(run_pass(self.s, self.now))

    @precondition(lambda self: any(r.phase == ResidentPhase.READY for r in self.s.residents.values()))
    @rule(data=st.data())
    def a_resident_is_lost_with_leases_in_flight(self, data: st.DataObject) -> None:
        ready = sorted(k for k, r in self.s.residents.items() if r.phase == ResidentPhase.READY)
        resident_crashed(self.s, data.draw(st.sampled_from(ready)), self.now, "runtime gone", self.now)

    @rule(seconds=st.sampled_from([1.0, 30.0, 61.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        sample(self.s, self.now)
        reclaim_stale_leases(self.s, self.now)
        self._granted(run_pass(self.s, self.now))

    @rule(restart=st.booleans())
    def the_node_syncs(self, restart: bool) -> None:
        if restart:  # a new life of the node worker: it holds nothing
            self.boot += 1
            self.node_holds = []
        sync = SlotSync(node="n", boot=f"b{self.boot}", held=self.node_holds, wanted=[LENT])
        reply, _ = sync_slots(self.s, sync, self.now)
        lent = [lease.lease_id for lease in reply.lent]
        self._granted(lent)
        self.node_holds = [lid for lid in [*reply.kept, *lent] if lid not in reply.closing]

    @invariant()
    def each_resident_counts_exactly_its_own_leases(self) -> None:
        for key, r in self.s.residents.items():
            mine = [lid for lid in self.s.leases if self.granted_on.get(lid) is r]
            assert r.active_leases == len(mine), (key, r.active_leases, mine)
            assert r.active_leases <= CONCURRENCY


TestIncarnations = Incarnations.TestCase
TestIncarnations.settings = settings(max_examples=examples(300), stateful_step_count=25, deadline=None)
