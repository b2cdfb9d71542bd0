"""A slot lent to a node for warm requests that serves nobody is not an active lease:
`status` and `ps` count it apart (`lent_slots`), and an unload of a model whose only
"leases" are such slots takes them back and goes ahead instead of EVICTION_NOT_ALLOWED. The
slots still count on the resident in the scheduler's state (nothing is lent twice, nothing
evicted under the node's feet), and one is only taken back once its node gives it up."""

from __future__ import annotations

from modelforge.domain import Priority
from modelforge.failures import FailureClass
from modelforge.policy import (
    PolicyConfig,
    PoolState,
    ResidentPhase,
    SlotSync,
    apply_decisions,
    control_residents,
    decide,
    drained,
    enqueue,
    pool_status,
    sync_slots,
)
from tests.builders import NOW, ask, deployment, gpu, observe, resident, state, tenant

CAP = "emb@1"
KEY = f"{CAP}@n/0"


def lent_pool(concurrency: int = 4) -> tuple[PoolState, list[str]]:
    """A ready keep_warm resident whose node was lent every slot but the spare one."""
    s = state(
        [gpu("n/0")],
        [deployment(CAP, gib=2, concurrency=concurrency)],
        tenants=[tenant("t"), tenant("u")],
        config=PolicyConfig(),
    )
    observe(s, "n/0", managed_gib=2, loaded=[KEY])
    resident(s, CAP, "n/0", 2)
    reply, _ = sync_slots(s, SlotSync(node="n", boot="b1", wanted=[CAP]), NOW)
    lent = [lease.lease_id for lease in reply.lent]
    assert len(lent) == concurrency - 1 and s.residents[KEY].active_leases == concurrency - 1
    return s, lent


def test_an_idle_model_with_lent_slots_shows_no_active_lease_and_its_ttl() -> None:
    s, lent = lent_pool()
    status = pool_status(s, NOW + 1)
    [shown] = status.residents
    assert (shown.active_leases, shown.lent_slots, shown.tenant_leases) == (0, 3, {})
    assert (status.active_leases, status.lent_slots, status.tenant_leases) == (0, 3, {})
    assert shown.expires_at == shown.last_used + shown.ttl_s, "an idle keep_warm model counts down"
    # A request on one slot (by its node's sync) and one the scheduler granted are active.
    sync_slots(s, SlotSync(node="n", boot="b1", held=lent, in_use={lent[0]: "request:emb@1:on-node"}), NOW + 2)
    enqueue(s, ask("granted", CAP, tenant_name="u"), Priority.INTERACTIVE, NOW + 2)
    apply_decisions(s, decide(s, NOW + 2), NOW + 2, {})
    status = pool_status(s, NOW + 2)
    [shown] = status.residents
    assert (shown.active_leases, shown.lent_slots) == (2, 2)
    assert shown.tenant_leases == {"": 1, "u": 1}  # the node reports its request's tenant later
    assert shown.expires_at is None
    assert (status.active_leases, status.lent_slots, status.tenant_leases) == (2, 2, {"": 1, "u": 1})
    # The scheduler's own count still holds every slot: nothing is lent twice.
    assert s.residents[KEY].active_leases == 4


def test_an_unload_of_a_model_holding_only_free_lent_slots_takes_them_back_and_unloads_it() -> None:
    s, lent = lent_pool()
    outcome = control_residents(s, "unload", CAP, "", False, "ops", NOW + 1)
    assert outcome.failure is None, outcome.message
    assert outcome.reclaiming == {KEY: 3} and outcome.unload == {}, "not before the node gives them back"
    assert s.residents[KEY].phase == ResidentPhase.UNLOADING and KEY in s.draining
    # The node's next sync closes them (the node may have just taken one: it gives it back when done).
    reply, _ = sync_slots(s, SlotSync(node="n", boot="b1", held=lent), NOW + 2)
    assert set(reply.closing) == set(lent) and not reply.lent
    assert all("unloading" in why for why in reply.closing.values())
    assert drained(s) == {}
    # ...and it gives them back at once: the model is unloaded now.
    sync_slots(s, SlotSync(node="n", boot="b1", held=[]), NOW + 2.1)
    assert drained(s) == {KEY: s.residents[KEY].workflow_id}
    assert not s.slots and s.residents[KEY].active_leases == 0


def test_a_request_on_a_lent_slot_is_an_active_lease_an_unload_without_drain_refuses() -> None:
    s, lent = lent_pool()
    sync_slots(s, SlotSync(node="n", boot="b1", held=lent, in_use={lent[1]: "request:emb@1:busy"}), NOW + 1)
    outcome = control_residents(s, "unload", CAP, "", False, "ops", NOW + 1)
    assert outcome.failure == FailureClass.EVICTION_NOT_ALLOWED
    assert "holds 1 active lease(s)" in outcome.message, outcome.message
    assert s.residents[KEY].phase == ResidentPhase.READY and not s.draining  # a refusal changes nothing
    # With drain it goes as before: unloaded once the request ends and the slots are back.
    drain = control_residents(s, "unload", CAP, "", True, "ops", NOW + 1)
    assert drain.failure is None and drain.reclaiming == {} and KEY in s.draining
    sync_slots(s, SlotSync(node="n", boot="b1", held=[lent[1]], in_use={lent[1]: "request:emb@1:busy"}), NOW + 2)
    assert drained(s) == {}
    sync_slots(s, SlotSync(node="n", boot="b1", held=[]), NOW + 3)
    assert KEY in drained(s)
