"""Warm-path delegation, without Temporal: the scheduler's rules for lending, closing and taking
back slots (modelforge/policy/_delegation.py) and the node's side of them
(activities/_delegation.py), joined by the pure policy in place of the `delegation_sync` update.

The properties the design promises: never more requests in flight on a resident than its
concurrency (the node's slots and the scheduler's own leases together); requests waiting at the
scheduler for the same model close one free slot each at the next sync (every slot, when one
waits for another model or more wait than slots are free); no slot is used by two requests,
also after a node worker restarts."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from activities._delegation import CLAIM_START_S, ROUTINE_SYNC_FACTOR, NodeSlots
from modelforge.domain import Priority, Residency
from modelforge.messages import SlotClaim
from modelforge.policy import (
    PolicyConfig,
    PoolState,
    ResidentPhase,
    SlotRun,
    SlotSync,
    apply_decisions,
    decide,
    enqueue,
    keep_warm_check,
    pool_status,
    reclaim_stale_leases,
    release_lease,
    sync_slots,
    tenant_view,
)
from modelforge.policy._delegation import MAX_ENDED_AGO_S
from modelforge.policy._transitions import SLOTS_ONLY_RECHECK_S
from tests.builders import NOW, ask, deployment, gpu, observe, resident, state, tenant
from tests.tiers import examples

CAP = "emb@1"
KEY = f"{CAP}@n/0"


def pool(concurrency: int = 4, production_card: bool = True, **kw: object) -> PoolState:
    s = state(
        [gpu("n/0", production=production_card)],
        [deployment(CAP, gib=2, concurrency=concurrency, **kw)],
        tenants=[tenant("t", max_priority=Priority.PRODUCTION, default_priority=Priority.INTERACTIVE)],
    )
    observe(s, "n/0", managed_gib=2, loaded=[KEY])
    resident(s, CAP, "n/0", 2)
    return s


def asking(s: PoolState, now: float = NOW, boot: str = "b1", held: list[str] | None = None) -> list[str]:
    reply, _ = sync_slots(s, SlotSync(node="n", boot=boot, held=held or [], wanted=[CAP]), now)
    return [
        lease_id
        for lease_id in [*reply.kept, *(lease.lease_id for lease in reply.lent)]
        if lease_id not in reply.closing
    ]


def test_a_node_is_lent_the_free_slots_but_one_and_they_count_as_leases() -> None:
    s = pool(concurrency=4)
    lent = asking(s)
    assert len(lent) == 3  # one kept back for requests that do not reach the node's worker
    assert s.residents[KEY].active_leases == 3
    assert all(s.leases[lease_id].bytes == 0 for lease_id in lent)
    # The scheduler's own admissions get the spare one, then wait.
    for n in range(2):
        enqueue(s, ask(f"r{n}", CAP), Priority.INTERACTIVE, NOW)
    decisions = decide(s, NOW)
    apply_decisions(s, decisions, NOW, {})
    assert [g.request_id for g in decisions.grants] == ["r0"]
    assert [q.request_id for q in s.queue] == ["r1"]


@pytest.mark.parametrize(
    ("change", "lent"),
    [
        (lambda s: None, 3),
        (lambda s: enqueue(s, ask("waiting", CAP), Priority.BACKGROUND, NOW), 0),
        (lambda s: setattr(s.accelerators["n/0"], "pressure", True), 0),
        (lambda s: setattr(s.residents[KEY], "phase", ResidentPhase.LOADING), 0),
        (lambda s: s.draining.__setitem__(KEY, NOW), 0),
        (lambda s: observe(s, "n/0", managed_gib=2, loaded=[KEY], at=NOW - 60), 0),  # stale telemetry
    ],
)
def test_nothing_is_lent_while_the_scheduler_needs_the_resident(change: object, lent: int) -> None:
    s = pool()
    change(s)  # type: ignore[operator]
    assert len(asking(s)) == lent


def test_only_a_request_that_may_want_the_slot_the_card_or_the_memory_closes_the_slots() -> None:
    s = state(
        [gpu("n/0"), gpu("m/0", production=False)],
        [
            deployment(CAP, gib=2, concurrency=4),
            deployment("other@1", gib=2, accelerators=["m/0"]),  # placed on another card only
            deployment("here@1", gib=2),  # may land on n/0 too
        ],
        tenants=[tenant("t", max_priority=Priority.PRODUCTION, default_priority=Priority.INTERACTIVE)],
    )
    observe(s, "n/0", managed_gib=2, loaded=[KEY])
    observe(s, "m/0")
    resident(s, CAP, "n/0", 2)
    lent = asking(s)
    assert len(lent) == 3

    def closing() -> dict[str, str]:
        reply, _ = sync_slots(s, SlotSync(node="n", boot="b1", held=lent), NOW + 1)
        return reply.closing

    enqueue(s, ask("elsewhere", "other@1"), Priority.INTERACTIVE, NOW)
    waiting = enqueue(s, ask("loading", "here@1"), Priority.INTERACTIVE, NOW)
    waiting.assigned_to = "here@1@m/0"  # waits on another resident's load
    assert closing() == {}, "a request that cannot use this card or slot overtakes nobody here"
    enqueue(s, ask("may-land", "here@1"), Priority.BACKGROUND, NOW)
    reasons = closing()
    assert set(reasons) == set(lent) and all("here@1" in why for why in reasons.values())


def test_deployments_whose_leases_add_bytes_or_that_unload_after_use_are_never_lent() -> None:
    assert asking(pool(idle_bytes=1 << 30)) == []  # a lease adds (envelope - idle) bytes
    s = pool()
    s.residents[KEY].residency = Residency.NONE
    s.catalog = state([gpu("n/0")], [deployment(CAP, gib=2, concurrency=4, residency="none")]).catalog
    assert asking(s) == []


def test_more_requests_waiting_at_the_scheduler_than_free_slots_close_every_slot_at_the_next_sync() -> None:
    s = pool()
    lent = asking(s)
    for n in range(3):  # two of the three slots are free
        enqueue(s, ask(f"waiting-{n}", CAP, priority=Priority.PRODUCTION), Priority.PRODUCTION, NOW)
    reply, events = sync_slots(s, SlotSync(node="n", boot="b1", held=lent, in_use={lent[0]: "wf-a"}), NOW + 1)
    assert set(reply.closing) == set(lent)
    assert all("waits at the scheduler" in why for why in reply.closing.values())
    assert [e.kind for e in events].count("slot_closed") == 3
    # The free ones are given back at the next sync (not held); the one in use when it ends.
    reply, events = sync_slots(s, SlotSync(node="n", boot="b1", held=[lent[0]], in_use={lent[0]: "wf-a"}), NOW + 2)
    assert reply.kept == [lent[0]] and not reply.lent
    assert s.residents[KEY].active_leases == 1
    assert s.leases[lent[0]].workflow_id == "wf-a"  # a preemption would reach the request on it
    sync_slots(s, SlotSync(node="n", boot="b1", held=[]), NOW + 3)
    assert s.residents[KEY].active_leases == 0 and not s.slots


def sync(s: PoolState, held: list[str], in_use: dict[str, str], at: float) -> tuple[dict[str, str], list[str]]:
    """A sync: what closes, what is kept."""
    reply, _ = sync_slots(s, SlotSync(node="n", boot="b1", held=held, in_use=in_use), at)
    return reply.closing, reply.kept


def test_requests_waiting_for_the_same_model_close_one_free_slot_each_and_the_node_keeps_the_rest() -> None:
    s = pool(concurrency=8)
    lent = asking(s)
    assert len(lent) == 7
    in_use = {lease_id: f"wf-{lease_id}" for lease_id in lent[:3]}
    for n in range(3):  # the spare slot serves the first; two wait
        enqueue(s, ask(f"w{n}", CAP), Priority.INTERACTIVE, NOW)
    apply_decisions(s, decide(s, NOW), NOW, {})
    assert len(s.queue) == 2
    closing, kept = sync(s, lent, in_use, NOW + 1)
    assert len(closing) == 2 and not set(closing) & set(in_use), "two free slots, none in use"
    assert all("waits at the scheduler" in why for why in closing.values())
    # The node gives those two back at once; the scheduler grants them to the two waiting.
    held = [lease_id for lease_id in lent if lease_id not in closing]
    sync(s, held, in_use, NOW + 1.1)
    apply_decisions(s, decide(s, NOW + 1.1), NOW + 1.1, {})
    assert not s.queue
    # The node still holds five open slots (three in use), and no closing is left.
    closing, kept = sync(s, held, in_use, NOW + 2)
    assert closing == {} and sorted(kept) == sorted(held)


def test_every_slot_still_closes_for_another_model_or_when_too_few_are_free() -> None:
    # Another model that may land on the card may need the memory: every slot closes.
    s = state(
        [gpu("n/0")],
        [deployment(CAP, gib=2, concurrency=8), deployment("here@1", gib=2)],
        tenants=[tenant("t", max_priority=Priority.PRODUCTION, default_priority=Priority.INTERACTIVE)],
    )
    observe(s, "n/0", managed_gib=2, loaded=[KEY])
    resident(s, CAP, "n/0", 2)
    lent = asking(s)
    enqueue(s, ask("may-land", "here@1"), Priority.BACKGROUND, NOW)
    closing, _ = sync(s, lent, {}, NOW + 1)
    assert set(closing) == set(lent)
    # More requests wait for the model than slots are free: every slot closes, as before (the
    # first one to end goes back).
    s = pool(concurrency=4)
    lent = asking(s)
    in_use = {lease_id: f"wf-{lease_id}" for lease_id in lent[:2]}
    for n in range(3):
        enqueue(s, ask(f"w{n}", CAP), Priority.INTERACTIVE, NOW)
    apply_decisions(s, decide(s, NOW), NOW, {})
    assert len(s.queue) == 2  # and one slot free
    closing, _ = sync(s, lent, in_use, NOW + 1)
    assert set(closing) == set(lent)


def test_a_closed_slot_the_node_took_meanwhile_does_not_count_and_another_free_one_closes() -> None:
    s = pool(concurrency=8)
    lent = asking(s)
    enqueue(s, ask("w0", CAP), Priority.INTERACTIVE, NOW)
    enqueue(s, ask("w1", CAP), Priority.INTERACTIVE, NOW)
    apply_decisions(s, decide(s, NOW), NOW, {})
    assert len(s.queue) == 1
    closing, _ = sync(s, lent, {}, NOW + 1)
    [first] = closing
    # The node had claimed that slot before the reply came: it is in use at the next sync.
    closing, _ = sync(s, lent, {first: "wf-long"}, NOW + 2)
    assert first in closing and len(closing) == 2, "the request waits behind no long one"


def test_a_restarted_node_worker_holds_nothing_of_its_previous_life() -> None:
    s = pool()
    old = asking(s, boot="old")
    # The new life syncs (it holds nothing): every slot of the old one is back in the pool, then
    # lent afresh; an old slot id it might name is never taken as its own.
    reply, _ = sync_slots(s, SlotSync(node="n", boot="new", held=old[:1], wanted=[CAP]), NOW + 1)
    assert not reply.kept and not set(old) & {lease.lease_id for lease in reply.lent}
    assert not set(old) & set(s.slots)
    assert len(reply.lent) == 3 and s.residents[KEY].active_leases == 3


def test_requests_served_on_slots_are_charged_to_their_tenant_and_recorded() -> None:
    s = pool()
    lent = asking(s)
    run = SlotRun(lent[0], "r1", "wf-r1", "t", "interactive", CAP, "ok", 2.5, end_user="webui-user-7")
    # An end user no entrance would have let through is not recorded (a node is not trusted more).
    failed = SlotRun(lent[1], "r2", "wf-r2", "t", "interactive", CAP, "INVALID_OUTPUT", 0.1, "bad", end_user="\x00x")
    _, events = sync_slots(s, SlotSync(node="n", boot="b1", held=lent, runs=[run, failed]), NOW + 1)
    assert s.usage["t"].gpu_seconds == pytest.approx(2.6)
    assert s.capability_health[CAP].consecutive_failures == 1
    released = [e for e in events if e.kind == "lease_released"]
    assert [e.request_id for e in released] == ["r1", "r2"]
    assert released[0].payload["tenant"] == "t" and released[0].payload["held_s"] == 2.5
    # The same story as a scheduler-granted request: granted (with its wait, which the admission
    # metric counts), invoked, released, under one lease id and with the same ledger fields.
    r1 = [(e.kind, e.lease_id) for e in events if e.request_id == "r1"]
    assert [kind for kind, _ in r1] == ["lease_granted", "invoke", "lease_released"]
    assert len({lease_id for _, lease_id in r1}) == 1
    granted = next(e for e in events if e.kind == "lease_granted" and e.request_id == "r1")
    assert granted.payload["delegated"] is True and granted.payload["waited_s"] == 0.0
    assert granted.payload["granted_at"] == pytest.approx(NOW + 1 - 2.5)
    scheduler_granted = {"bytes", "tenant", "capability", "priority", "pool", "accelerators", "granted_at"}
    assert scheduler_granted <= set(granted.payload) and scheduler_granted <= set(released[0].payload)
    # Who the application said asked, on both ends of the lease, as on a scheduler-granted one.
    assert granted.payload["end_user"] == released[0].payload["end_user"] == "webui-user-7"
    assert "end_user" not in released[1].payload


def test_runs_of_one_slot_reported_together_keep_their_own_times_in_the_ledger() -> None:
    # One slot served three requests one after the other (2 s each, the last ended 1 s before
    # the sync): their ledger rows follow each other, they do not all end at the sync (which
    # read as three leases at once on a slot of one).
    s = pool()
    lent = asking(s)
    runs = [
        SlotRun(lent[0], f"r{n}", f"wf-r{n}", "t", "interactive", CAP, "ok", 2.0, ended_ago_s=ago)
        for n, ago in ((1, 5.0), (2, 3.0), (3, 1.0))
    ]
    _, events = sync_slots(s, SlotSync(node="n", boot="b1", held=lent, runs=runs), NOW + 10)
    rows = {
        e.request_id: (e.payload["granted_at"], e.payload["ended_at"]) for e in events if e.kind == "lease_released"
    }
    assert rows == {
        "r1": (pytest.approx(NOW + 3), pytest.approx(NOW + 5)),
        "r2": (pytest.approx(NOW + 5), pytest.approx(NOW + 7)),
        "r3": (pytest.approx(NOW + 7), pytest.approx(NOW + 9)),
    }
    # A node's report cannot move a row further back than MAX_ENDED_AGO_S.
    late = SlotRun(lent[1], "r4", "wf-r4", "t", "interactive", CAP, "ok", 1.0, ended_ago_s=1e9)
    _, events = sync_slots(s, SlotSync(node="n", boot="b1", held=lent, runs=[late]), NOW + 20)
    [released] = [e for e in events if e.kind == "lease_released"]
    assert released.payload["ended_at"] == pytest.approx(NOW + 20 - MAX_ENDED_AGO_S)


def test_a_keep_warm_models_ttl_counts_from_its_last_request_not_from_lending_or_giving_back() -> None:
    # The model's last request ran on a slot lent to its node and ended at NOW + 3; the node
    # gave its free slots back at NOW + 15. Its keep-warm TTL runs out TTL after NOW + 3, not
    # after the give-back (which slipped the unload by the node's idle hold, about 10 s), and a
    # TTL timer that fires while only free lent slots hold it looks again within seconds.
    s = pool()
    model = s.residents[KEY]
    ttl = model.ttl_s
    assert ttl > 10
    lent = asking(s, now=NOW + 1)
    assert model.last_used == NOW, "lending a slot is not a use"
    run = SlotRun(lent[0], "r1", "wf-r1", "t", "interactive", CAP, "ok", 1.5, ended_ago_s=1.0)
    sync_slots(s, SlotSync(node="n", boot="b1", held=lent, runs=[run]), NOW + 4)
    assert model.last_used == pytest.approx(NOW + 3), "its TTL counts from when the request ended"
    assert keep_warm_check(s, KEY, NOW + 8) == pytest.approx(NOW + 8 + min(ttl, SLOTS_ONLY_RECHECK_S))
    sync_slots(s, SlotSync(node="n", boot="b1", held=[]), NOW + 15)
    assert model.active_leases == 0 and model.last_used == pytest.approx(NOW + 3), "a slot given back is no use"
    assert keep_warm_check(s, KEY, NOW + 16) == pytest.approx(NOW + 3 + ttl)
    assert keep_warm_check(s, KEY, NOW + 3 + ttl) is None, "unloaded TTL after its last request"


def test_a_ttl_timer_that_finds_a_request_running_looks_again_a_whole_ttl_later() -> None:
    s = pool()
    model = s.residents[KEY]
    enqueue(s, ask("r0", CAP), Priority.INTERACTIVE, NOW)
    apply_decisions(s, decide(s, NOW), NOW, {})
    assert model.active_leases == 1
    assert keep_warm_check(s, KEY, NOW + 1) == pytest.approx(NOW + 1 + model.ttl_s)


def test_a_request_on_a_lent_slot_counts_under_its_tenant_from_the_next_sync() -> None:
    # Before, it counted under no tenant ("") until its run was reported after it ended: its own
    # tenant's view of the pool did not show it running.
    s = pool()
    lent = asking(s)
    claimed = SlotSync(node="n", boot="b1", held=lent, in_use={lent[0]: "wf-r1"}, in_use_tenants={lent[0]: "t"})
    sync_slots(s, claimed, NOW + 1)
    status = pool_status(s, NOW + 1)
    assert status.tenant_leases == {"t": 1} and status.lent_slots == len(lent) - 1
    mine = tenant_view(status, "t")
    assert mine.active_leases == 1 and [r.active_leases for r in mine.residents] == [1]
    assert tenant_view(status, "other").active_leases == 0
    # A tenant the catalog does not know is not taken from a node's report.
    sync_slots(s, replace(claimed, in_use_tenants={lent[0]: "made-up"}), NOW + 2)
    assert pool_status(s, NOW + 2).tenant_leases == {"": 1}
    # Free again: no tenant, a lent slot.
    sync_slots(s, SlotSync(node="n", boot="b1", held=lent), NOW + 3)
    again = pool_status(s, NOW + 3)
    assert again.tenant_leases == {} and again.lent_slots == len(lent)


def test_a_silent_node_loses_its_slots_after_stale_lease_s_and_no_tenant_is_charged() -> None:
    s = pool()
    s.config = PolicyConfig(stale_lease_s=10.0, unheard_lease_s=50.0)
    lent = asking(s)
    for at in (NOW + 5, NOW + 9):
        reclaim_stale_leases(s, at)
    assert set(lent) <= set(s.leases)
    reclaim_stale_leases(s, NOW + 10.5)
    assert not set(lent) & set(s.leases) and not s.slots
    assert s.residents[KEY].active_leases == 0
    assert not s.usage, "a slot is never charged, only the requests that ran on it"


def test_a_node_sees_the_tenants_and_classes_once_per_catalog() -> None:
    s = pool()
    reply, _ = sync_slots(s, SlotSync(node="n", boot="b1", wanted=[CAP], view_epoch=-1), NOW)
    assert reply.view is not None and [d.capability for d in reply.view.deployments] == [CAP]
    reply, _ = sync_slots(s, SlotSync(node="n", boot="b1", view_epoch=reply.view_epoch), NOW)
    assert reply.view is None


# --- the node's side ------------------------------------------------------------------------


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Scheduler:
    """The `delegation_sync` update, as the scheduler runs it, on a plain PoolState."""

    s: PoolState
    clock: Clock
    syncs: list[SlotSync] = field(default_factory=list)

    async def __call__(self, sync: SlotSync) -> object:
        self.syncs.append(sync)
        reply, _ = sync_slots(self.s, sync, NOW + self.clock.now)
        return reply


def node(s: PoolState, clock: Clock) -> tuple[NodeSlots, Scheduler]:
    scheduler = Scheduler(s, clock)
    return NodeSlots(None, "n", "default", clock=clock, send=scheduler), scheduler  # type: ignore[arg-type]


def claim(request_id: str, priority: str | None = None, tenant_name: str = "t") -> SlotClaim:
    return SlotClaim("default", request_id, f"wf-{request_id}", CAP, tenant_name, priority)


def lent_node(concurrency: int = 4, **kw: object) -> tuple[NodeSlots, Scheduler, Clock]:
    clock = Clock()
    slots, scheduler = node(pool(concurrency, **kw), clock)
    assert slots.claim(claim("first")) is None  # nothing lent yet: it asks at its next sync
    asyncio.run(slots.sync_once())
    return slots, scheduler, clock


def test_a_claim_gets_the_requests_own_lease_on_a_lent_slot_and_the_slot_serves_one_at_a_time() -> None:
    slots, _, _ = lent_node(concurrency=3)
    a, b = slots.claim(claim("a")), slots.claim(claim("b"))
    assert a is not None and b is not None and a.lease_id != b.lease_id
    assert (a.request_id, a.tenant, a.priority) == ("a", "t", "interactive")
    assert slots.claim(claim("c")) is None, "2 slots lent (concurrency 3, one spare): the third goes to the scheduler"
    assert slots.started(a.lease_id, "a")
    slots.finish(a.lease_id, "a", "ok", 0.2)
    again = slots.claim(claim("c"))
    assert again is not None and again.lease_id == a.lease_id


def test_a_claim_that_finds_no_slot_takes_the_one_its_sync_brings_and_else_goes_to_the_scheduler() -> None:
    async def scenario(concurrency: int, send_hangs: bool = False) -> tuple[object, int, float]:
        clock = Clock()
        slots, scheduler = node(pool(concurrency), clock)
        if send_hangs:

            async def never(sync: SlotSync) -> object:
                await asyncio.Event().wait()

            slots._send = never  # type: ignore[method-assign]
        else:

            async def slow(sync: SlotSync) -> object:
                clock.now += 0.25  # the sync's round trip: what the request waits for its slot
                return await scheduler(sync)

            slots._send = slow  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        syncing = asyncio.create_task(slots.run())
        began = loop.time()
        try:
            lease = await slots.claim_or_ask(claim("first"), wait_s=2.0)
        finally:
            syncing.cancel()
        if lease is not None:  # its run reports the wait for the slot, as a grant's waited_s
            slots.finish(lease.lease_id, "first", "ok", 0.1)  # type: ignore[attr-defined]
            assert slots._runs[-1].waited_s == pytest.approx(0.25)
        return lease, len(scheduler.syncs), loop.time() - began

    # A warm model with free slots: the claim's own sync brings one, and the request runs on it.
    lease, syncs, took = asyncio.run(scenario(concurrency=1))
    assert lease is not None and lease.request_id == "first" and lease.tenant == "t"  # type: ignore[attr-defined]
    assert syncs == 1 and took < 1.0, "answered by the one sync it asked for, not the periodic one"
    # A scheduler that answers lends nothing: the request goes to the scheduler after one sync.
    s = pool(1)
    s.residents.clear()  # nothing warm to lend
    clock = Clock()
    slots, scheduler = node(s, clock)

    async def unwarm() -> object:
        task = asyncio.create_task(slots.run())
        try:
            return await slots.claim_or_ask(claim("cold"), wait_s=2.0)
        finally:
            task.cancel()

    assert asyncio.run(unwarm()) is None and len(scheduler.syncs) == 1
    # Not lent when asked: the next claims of it within UNLENT_S go to the scheduler at once.

    async def again() -> tuple[object, float]:
        task = asyncio.create_task(slots.run())
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            return await slots.claim_or_ask(claim("cold2"), wait_s=2.0), loop.time() - began
        finally:
            task.cancel()

    lease, took = asyncio.run(again())
    assert lease is None and took < 0.05
    # A scheduler that does not answer: no longer than the wait.
    lease, _, took = asyncio.run(scenario(concurrency=1, send_hangs=True))
    assert lease is None and 1.9 <= took < 3.0
    # A claim the scheduler would refuse asks nothing and waits for nothing.
    clock = Clock()
    slots, scheduler = node(pool(1), clock)
    asyncio.run(slots.sync_once())  # the view: who the tenants are

    async def stranger() -> object:
        return await slots.claim_or_ask(claim("x", tenant_name="stranger"), wait_s=2.0)

    syncs_before = len(scheduler.syncs)
    assert asyncio.run(stranger()) is None and len(scheduler.syncs) == syncs_before


def test_a_slot_on_a_model_this_worker_has_not_loaded_is_never_claimed() -> None:
    # A restarted worker reaped its model servers; the scheduler lends before a sample says so.
    slots, _, _ = lent_node()
    loaded: set[str] = set()
    slots.serve_only(loaded.__contains__)
    assert slots.claim(claim("a")) is None
    assert slots._claim(claim("a"))[1] is False, "a sync would not help: the claim does not wait for one"
    loaded.update(slot.lease.resident_key for slot in slots._slots.values())
    assert slots.claim(claim("a")) is not None


def test_a_node_gives_closed_slots_back_by_a_sync_at_once_not_a_period_later() -> None:
    slots, scheduler, clock = lent_node(concurrency=3)
    busy = slots.claim(claim("busy"))
    assert busy is not None and slots.started(busy.lease_id, "busy")
    for n in range(2):  # more wait than slots are free: every slot closes
        enqueue(scheduler.s, ask(f"waiting-{n}", CAP, priority=Priority.PRODUCTION), Priority.PRODUCTION, NOW)
    slots._wake.clear()
    asyncio.run(slots.sync_once())  # the reply closes both: the idle one goes back at once
    assert slots._wake.is_set(), "an idle slot closed: the node syncs again without waiting"
    slots._wake.clear()
    clock.now += 0.2
    asyncio.run(slots.sync_once())
    assert scheduler.syncs[-1].held == [busy.lease_id]
    assert not slots._wake.is_set()
    slots.finish(busy.lease_id, "busy", "ok", 0.1)  # the closed slot in use ends: back at once too
    assert slots._wake.is_set()


def test_a_claim_the_scheduler_would_refuse_is_left_to_the_scheduler() -> None:
    slots, _, _ = lent_node()
    assert slots.claim(claim("x", tenant_name="stranger")) is None  # unknown tenant
    assert slots.claim(claim("y", priority="no-such-class")) is None
    # Production only where the card and the deployment pass the production rules.
    assert slots.claim(claim("p", priority="production")) is not None
    slots2, _, _ = lent_node(production_card=False)
    assert slots2.claim(claim("p", priority="production")) is None
    assert slots2.claim(claim("i")) is not None


def test_a_node_that_cannot_reach_its_scheduler_stops_using_its_slots_before_they_are_reclaimed() -> None:
    slots, scheduler, clock = lent_node()
    valid_s = scheduler.s.config.stale_lease_s / 2
    clock.now = valid_s - 0.1
    lease = slots.claim(claim("in-time"))
    assert lease is not None
    slots.finish(lease.lease_id, "in-time", "ok", 0.1)
    clock.now = valid_s + 0.1  # no sync answered since: the scheduler may reclaim them soon
    assert slots.claim(claim("late")) is None


def test_a_claim_whose_invoke_never_starts_is_voided_and_that_invoke_refused() -> None:
    slots, scheduler, clock = lent_node(concurrency=2)
    lease = slots.claim(claim("lost"))
    assert lease is not None
    clock.now = CLAIM_START_S + 1
    asyncio.run(slots.sync_once())
    assert not slots.started(lease.lease_id, "lost")
    # Voided long ago and idle since: given back; lent again when asked for.
    assert slots.claim(claim("next")) is None
    observe(scheduler.s, "n/0", managed_gib=2, loaded=[KEY], at=NOW + clock.now)  # telemetry is fresh
    asyncio.run(slots.sync_once())
    again = slots.claim(claim("next"))
    assert again is not None and again.lease_id != lease.lease_id


def test_an_idle_node_gives_its_slots_back_and_then_stops_syncing() -> None:
    slots, scheduler, clock = lent_node()
    clock.now = 11.0
    asyncio.run(slots.sync_once())
    assert scheduler.syncs[-1].held == [] and not scheduler.s.slots
    assert scheduler.s.residents[KEY].active_leases == 0
    count = len(scheduler.syncs)
    asyncio.run(slots.sync_once())
    assert len(scheduler.syncs) == count, "a node holding nothing and with nothing to say does not sync"


def test_a_node_with_nothing_new_to_say_syncs_less_often_and_at_the_usual_pace_once_it_has() -> None:
    slots, scheduler, _ = lent_node()  # its first sync asked for slots: news
    assert slots.interval == slots.sync_s == 1.0
    intervals = []
    for _ in range(4):  # the same slots held, nothing served, nothing wanted
        asyncio.run(slots.sync_once())
        intervals.append(slots.interval)
    assert intervals == [2.0, 4.0, 4.0, 4.0], "doubling, up to 4 sync intervals"
    assert slots.due_in() == pytest.approx(4.0)
    lease = slots.claim(claim("a"))
    assert lease is not None and slots.started(lease.lease_id, "a")
    slots.finish(lease.lease_id, "a", "ok", 0.1)
    assert slots.due_in() == pytest.approx(ROUTINE_SYNC_FACTOR), "a request served: within 2 sync intervals"
    asyncio.run(slots.sync_once())
    assert scheduler.syncs[-1].runs and slots.interval == ROUTINE_SYNC_FACTOR
    # A failed request is reported at the usual pace, and brings it back.
    lease = slots.claim(claim("b"))
    assert lease is not None and slots.started(lease.lease_id, "b")
    slots.finish(lease.lease_id, "b", "RUNTIME_CRASH", 0.1, "the runtime died")
    assert slots.due_in() == pytest.approx(1.0)
    asyncio.run(slots.sync_once())
    assert scheduler.syncs[-1].runs[0].outcome == "RUNTIME_CRASH" and slots.interval == 1.0
    # The slots stay valid: never longer than a third of the answer's validity.
    short, short_scheduler, _ = lent_node()
    short.sync_s = 0.5
    short_scheduler.s.config = PolicyConfig(stale_lease_s=6.0)
    for _ in range(4):
        asyncio.run(short.sync_once())
    assert short.interval == 1.0, "valid_s 3: at most 1 s between syncs, not 2"


def test_each_sync_says_how_long_the_node_may_stay_silent_and_it_never_waits_longer() -> None:
    """The routing counts a node's lent slots for as long as its last sync said it may stay
    silent (modelforge/routing.py): at MODELFORGE_DELEGATION_SYNC_S = 2, an idle node waits up
    to 8 s, longer than the 5 s a node that does not say is given."""
    slots, scheduler, _ = lent_node()  # valid_s 30 s: a third of it is past 8 s
    slots.sync_s = 2.0
    waits = []
    for served in (False, False, False, True, False, False, False, False):
        if served:
            lease = slots.claim(claim("a"))
            assert lease is not None and slots.started(lease.lease_id, "a")
            slots.finish(lease.lease_id, "a", "ok", 0.1)
        asyncio.run(slots.sync_once())
        said = scheduler.syncs[-1].within_s
        assert said == 8.0
        assert slots.due_in() <= said and slots.interval <= said
        waits.append(slots.interval)
    assert max(waits) == 8.0, waits  # it does wait that long, idle
    # At 5 s the idle ceiling is a third of the slots' validity (30 s): 10 s, not 4 x 5.
    slots.sync_s = 5.0
    asyncio.run(slots.sync_once())
    assert scheduler.syncs[-1].within_s == 10.0


def test_an_idle_node_holding_slots_syncs_a_few_times_where_it_synced_every_interval() -> None:
    async def idle(run_s: float) -> tuple[int, float]:
        slots, scheduler = node(pool(4), Clock())
        slots._clock = time.monotonic  # type: ignore[method-assign]
        slots.sync_s = 0.05
        assert slots.claim(claim("first")) is None
        await slots.sync_once()
        before = len(scheduler.syncs)
        task = asyncio.create_task(slots.run())
        try:
            await asyncio.sleep(run_s)
            idle_syncs = len(scheduler.syncs) - before
            # A request served: reported by the next sync, within about ROUTINE_SYNC_FACTOR intervals.
            lease = slots.claim(claim("a"))
            assert lease is not None and slots.started(lease.lease_id, "a")
            slots.finish(lease.lease_id, "a", "ok", 0.01)
            ended = time.monotonic()
            while not scheduler.syncs[-1].runs:
                await asyncio.sleep(0.005)
            return idle_syncs, time.monotonic() - ended
        finally:
            task.cancel()

    idle_syncs, reported_after = asyncio.run(idle(1.0))
    # Every 0.05 s: 20 syncs. Backing off (0.1, 0.2, 0.2, ...): 5 or 6.
    assert idle_syncs <= 8, idle_syncs
    assert reported_after < 0.05 * ROUTINE_SYNC_FACTOR + 0.1, reported_after


# --- the property -----------------------------------------------------------------------------


class Delegation(RuleBasedStateMachine):
    """Claims, finishes, syncs, scheduler admissions and releases, a queue forming and draining,
    node restarts, in any order: the resident never has more requests in flight than its
    concurrency, and no slot serves two requests at once."""

    CONCURRENCY = 4

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.s = pool(self.CONCURRENCY)
        self.node, self.scheduler = node(self.s, self.clock)
        self.old_nodes: list[NodeSlots] = []
        self.running: dict[str, str] = {}  # request -> slot, on the node
        self.n = 0

    @rule()
    def claim_on_the_node(self) -> None:
        self.n += 1
        request = f"n{self.n}"
        lease = self.node.claim(claim(request))
        if lease is not None:
            assert self.node.started(lease.lease_id, request)
            assert lease.lease_id not in self.running.values(), "a slot serves one request at a time"
            self.running[request] = lease.lease_id

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish_on_the_node(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(sorted(self.running)))
        self.node.finish(self.running.pop(request), request, "ok", 0.1)

    @rule(seconds=st.sampled_from([0.1, 1.0, 5.0]))
    def sync(self, seconds: float) -> None:
        self.clock.now += seconds
        asyncio.run(self.node.sync_once())

    @rule()
    def telemetry(self) -> None:
        observe(self.s, "n/0", managed_gib=2, loaded=[KEY], at=NOW + self.clock.now)

    @rule()
    def admit_at_the_scheduler(self) -> None:
        self.n += 1
        enqueue(self.s, ask(f"s{self.n}", CAP), Priority.INTERACTIVE, NOW + self.clock.now)
        apply_decisions(self.s, decide(self.s, NOW + self.clock.now), NOW + self.clock.now, {})

    @precondition(lambda self: any(not lid.startswith("slot-") for lid in self.s.leases))
    @rule(data=st.data())
    def release_at_the_scheduler(self, data: st.DataObject) -> None:
        own = sorted(lid for lid in self.s.leases if not lid.startswith("slot-"))
        now = NOW + self.clock.now
        release_lease(self.s, data.draw(st.sampled_from(own)), now, "ok")
        apply_decisions(self.s, decide(self.s, now), now, {})

    @rule()
    def restart_the_node_worker(self) -> None:
        # The old life's requests died with it; the new one holds nothing.
        self.old_nodes.append(self.node)
        self.running.clear()
        self.node, self.scheduler = node(self.s, self.clock)

    @invariant()
    def never_more_in_flight_than_the_concurrency(self) -> None:
        leases = self.s.leases.items()
        own = sum(1 for lid, lease in leases if not lid.startswith("slot-") and lease.resident_key == KEY)
        assert len(self.running) + own <= self.CONCURRENCY
        # And the scheduler counts every lease, lent or its own, on the resident.
        resident = self.s.residents[KEY]
        assert resident.active_leases <= self.CONCURRENCY
        assert resident.active_leases == sum(1 for lease in self.s.leases.values() if lease.resident_key == KEY)

    @invariant()
    def a_node_uses_only_slots_the_scheduler_counts_as_its_own(self) -> None:
        for slot in self.running.values():
            assert slot in self.s.leases and self.s.slots[slot].boot == self.node.boot


TestDelegation = Delegation.TestCase
TestDelegation.settings = settings(max_examples=examples(150), stateful_step_count=40, deadline=None)


class DelegationWider(Delegation):
    """The same with six slots: more requests waiting for the model close only as many free
    slots as they are, and the node keeps admitting on the rest."""

    CONCURRENCY = 6


TestDelegationWider = DelegationWider.TestCase
TestDelegationWider.settings = settings(max_examples=examples(150), stateful_step_count=40, deadline=None)


def test_a_busy_node_reporting_only_served_requests_syncs_every_other_interval() -> None:
    """Requests served without failure, one after another on the lent slots: the node reports
    them every ROUTINE_SYNC_FACTOR sync intervals (each sync is about five scheduler history
    events), every request reported once."""
    slots, scheduler, _ = lent_node()
    assert ROUTINE_SYNC_FACTOR == 2.0
    intervals = []
    for n in range(4):
        lease = slots.claim(claim(f"r{n}"))
        assert lease is not None and slots.started(lease.lease_id, f"r{n}")
        slots.finish(lease.lease_id, f"r{n}", "ok", 0.01)
        assert slots.due_in() <= ROUTINE_SYNC_FACTOR + 1e-9
        asyncio.run(slots.sync_once())
        intervals.append(slots.interval)
    assert intervals == [2.0, 2.0, 2.0, 2.0]
    assert [run.request_id for sync in scheduler.syncs for run in sync.runs] == ["r0", "r1", "r2", "r3"]


def test_the_node_reports_when_each_run_ended_by_its_own_clock() -> None:
    slots, scheduler, clock = lent_node(concurrency=3)
    for request_id, ended_at in (("a", 1.0), ("b", 2.5)):
        lease = slots.claim(claim(request_id))
        assert lease is not None and slots.started(lease.lease_id, request_id)
        clock.now = ended_at
        slots.finish(lease.lease_id, request_id, "ok", 0.5)
    clock.now = 4.0
    asyncio.run(slots.sync_once())
    runs = {run.request_id: run.ended_ago_s for run in scheduler.syncs[-1].runs}
    assert runs == {"a": pytest.approx(3.0), "b": pytest.approx(1.5)}


def test_a_model_the_scheduler_last_heard_idle_here_is_reported_serving_within_one_sync_interval() -> None:
    """Between a claim and the node's next sync, `status` and `ps` show a lent slot free: after
    the idle back-off that was up to IDLE_SYNC_FACTOR sync intervals (4 s) of a model serving a
    request shown idle. A claim of a model none of whose slots was in use at the last sync brings
    the next sync within `sync_s`; further claims of a model already shown busy do not."""
    slots, scheduler, _ = lent_node(concurrency=3)
    for _ in range(4):
        asyncio.run(slots.sync_once())
    assert slots.due_in() == pytest.approx(4.0), "idle: backed off"
    first = slots.claim(claim("a"))
    assert first is not None and slots.started(first.lease_id, "a")
    assert slots.due_in() == pytest.approx(1.0), "the model now serves, the scheduler thinks it idle"
    before = pool_status(scheduler.s, NOW)
    assert before.tenant_leases == {} and before.lent_slots == 2, "what status shows until that sync"
    asyncio.run(slots.sync_once())
    assert scheduler.syncs[-1].in_use == {first.lease_id: "wf-a"}
    after = pool_status(scheduler.s, NOW)
    assert after.tenant_leases == {"t": 1} and after.lent_slots == 1
    second = slots.claim(claim("b"))
    assert second is not None and slots.started(second.lease_id, "b")
    assert slots.due_in() == pytest.approx(ROUTINE_SYNC_FACTOR), "already shown busy: the routine pace"
