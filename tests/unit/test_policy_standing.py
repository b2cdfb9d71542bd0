"""The groupings a decision pass starts from are kept across passes (`policy/_standing.py`) and
the leases are indexed by request (`policy/_lease_index.py`): whatever changes behind their
back, a pass and an admission see exactly what a walk over the state sees."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from modelforge.domain import GiB, Priority
from modelforge.policy import (
    AdmissionRejected,
    PoolState,
    ResidentPhase,
    _pass,
    apply_decisions,
    cancel_request,
    decide,
    enqueue,
    existing_admission,
    release_lease,
    validate_request,
)
from modelforge.policy._pass import start_pass
from modelforge.policy._placement import decide_each
from modelforge.policy._standing import kept_groups, leases_on
from tests.builders import NOW, ask, deployment, gpu, observe, resident, state, tenant


@pytest.fixture(autouse=True, scope="module", params=[0, _pass.FIT_INDEX_FROM], ids=["fit-index", "no-fit-index"])
def fit_index_on_small_pools(request: pytest.FixtureRequest) -> Iterator[None]:
    """These pools have two cards, fewer than a pass keeps a fit index for
    (`_pass.FIT_INDEX_FROM`): each test runs with the index kept for them too, so the fast pass
    these tests compare with the reference reads it, as on a large pool, and as it runs here."""
    kept = _pass.FIT_INDEX_FROM
    _pass.FIT_INDEX_FROM = request.param
    try:
        yield
    finally:
        _pass.FIT_INDEX_FROM = kept


def build() -> PoolState:
    s = state(
        [gpu("a/0", total=24), gpu("b/0", total=16)],
        [
            deployment("emb@1", gib=1, queue_limit=100),
            deployment("llm@1", gib=9, idle_bytes=7 * GiB, concurrency=2, queue_limit=100),
            deployment("job@1", gib=4, queue_limit=100, preemptible=True),
        ],
        tenants=[tenant("t")],
    )
    for acc in ("a/0", "b/0"):
        observe(s, acc, at=NOW)
    return s


def same_start(s: PoolState, now: float) -> None:
    """The kept groupings agree with a walk, and the fast pass with the reference."""
    kept, walked = start_pass(s, now, indexed=True), start_pass(s, now, indexed=False)
    for name in ("resident_sum", "leased_sum", "pinned", "slots", "residents_of", "evictable", "preemptible"):
        assert getattr(kept, name) == getattr(walked, name), name
    assert [a.id for a in kept.pool_accelerators] == [a.id for a in walked.pool_accelerators]
    kept_on, walked_on = leases_on(s), leases_on(s, kept=False)
    assert kept_on.on == walked_on.on  # brought up to date, not rebuilt
    groups = kept_groups(s)
    assert groups is not None
    residents, leases = groups
    assert residents.unloading == [r for r in s.residents.values() if r.phase == ResidentPhase.UNLOADING]
    assert residents.removed == [
        r
        for r in s.residents.values()
        if s.catalog.deployment(r.deployment) is None or s.catalog.accelerator(r.accelerator) is None
    ]
    assert sorted(leases.of_timed) == sorted(i for i, lease in s.leases.items() if lease.ends_by is not None)
    timed_on: dict[str, int] = {}
    for lease in s.leases.values():
        for card in lease.accelerators if lease.ends_by is not None else ():
            timed_on[card] = timed_on.get(card, 0) + 1
    assert leases.timed_on == timed_on
    fast, reference = decide(s, now), decide_each(s, now, reuse_settled=False)
    assert (fast.grants, fast.rejects, fast.loads, fast.assigns, fast.unloads, fast.preemptions) == (
        reference.grants,
        reference.rejects,
        reference.loads,
        reference.assigns,
        reference.unloads,
        reference.preemptions,
    )


def sample(s: PoolState, now: float) -> None:
    for acc in ("a/0", "b/0"):
        observe(s, acc, at=now, loaded=[r.key for r in s.residents.values() if r.accelerator == acc])


def admit(s: PoolState, request_id: str, capability: str, now: float, **kw: object) -> None:
    request = ask(request_id, capability, priority=Priority.BACKGROUND, **kw)
    _, priority = validate_request(s, request)
    enqueue(s, request, priority, now)


def test_groupings_follow_changes_made_behind_their_back() -> None:
    s = build()
    llm = resident(s, "llm@1", "a/0", 7)
    resident(s, "emb@1", "b/0", 1, leases=1)
    same_start(s, NOW)
    # Fields changed in place, as transitions and tests do.
    llm.active_leases = 2
    same_start(s, NOW)
    llm.phase = ResidentPhase.UNLOADING
    same_start(s, NOW)
    llm.bytes = 3 * GiB
    llm.phase = ResidentPhase.READY
    llm.active_leases = 0
    same_start(s, NOW)
    # A resident replaced by an equal copy, and one removed.
    s.residents[llm.key] = dataclasses.replace(llm)
    same_start(s, NOW)
    del s.residents["emb@1@b/0"]
    same_start(s, NOW)
    # The residents replaced whole (a new run of the scheduler starts from a copy).
    s.residents = dict(s.residents)
    same_start(s, NOW)
    # The catalog without the model that is resident: it goes once idle, in both passes.
    s.catalog = dataclasses.replace(
        s.catalog, deployments=[d for d in s.catalog.deployments if d.capability != "llm@1"]
    )
    same_start(s, NOW)
    assert [u.resident_key for u in decide(s, NOW).unloads] == [llm.key]
    s.residents[llm.key].active_leases = 1  # busy: kept until its lease ends
    same_start(s, NOW)
    assert decide(s, NOW).unloads == []


def test_groupings_follow_grants_releases_and_preemptible_work() -> None:
    s = build()
    now = NOW
    for n in range(3):
        # One job with a max_duration: its lease ends by a known time.
        admit(s, f"j{n}", "job@1", now, **({"max_duration_s": 600.0} if n == 1 else {}))
    admit(s, "l0", "llm@1", now)
    for _ in range(3):
        sample(s, now)
        same_start(s, now)
        apply_decisions(s, decide(s, now), now, {})
        for r in list(s.residents.values()):
            if r.phase == ResidentPhase.LOADING:
                r.phase = ResidentPhase.READY
        now += 40.0  # past the minimum runtime: the jobs become preemptible
    sample(s, now)
    assert s.leases
    assert any(lease.ends_by is not None for lease in s.leases.values())
    same_start(s, now)
    # A production request preempts a job: leases under preemption change the pass.
    request = ask("p0", "llm@1", priority=Priority.PRODUCTION)
    _, priority = validate_request(s, request)
    enqueue(s, request, priority, now)
    same_start(s, now)
    apply_decisions(s, decide(s, now), now, {})
    same_start(s, now)
    s.preempting[next(iter(s.leases))] = "making room"  # a lease being preempted
    same_start(s, now)
    release_lease(s, next(iter(s.leases)), now, "ok")
    same_start(s, now)
    s.leases.pop(next(iter(s.leases)))  # behind the policy's back
    same_start(s, now)
    # A lease replaced by a copy moved to the other card, and the leases replaced whole.
    lease_id, lease = next(iter(s.leases.items()))
    s.leases[lease_id] = dataclasses.replace(lease, accelerator="b/0" if lease.accelerator == "a/0" else "a/0")
    same_start(s, now)
    s.leases = dict(s.leases)
    same_start(s, now)


def test_admission_sees_leases_by_request() -> None:
    s = build()
    resident(s, "emb@1", "a/0", 1)
    admit(s, "r1", "emb@1", NOW)
    apply_decisions(s, decide(s, NOW), NOW, {})
    lease = next(iter(s.leases.values()))
    assert lease.request_id == "r1"
    # The same requester asking again gets its lease; another asker with that id a conflict.
    assert existing_admission(s, ask("r1", "emb@1")) is lease
    assert existing_admission(s, dataclasses.replace(ask("r1", "emb@1"), workflow_id="other")) is None
    try:
        validate_request(s, ask("r1", "emb@1"))
        raise AssertionError("a second admission of r1 was accepted")
    except AdmissionRejected as refused:
        assert "already admitted" in refused.message
    # Released through the policy: the id is free again.
    release_lease(s, lease.lease_id, NOW, "ok")
    assert existing_admission(s, ask("r1", "emb@1")) is None
    validate_request(s, ask("r1", "emb@1"))
    # Added and removed behind the index's back: still seen.
    s.leases[lease.lease_id] = lease
    assert existing_admission(s, ask("r1", "emb@1")) is lease
    del s.leases[lease.lease_id]
    assert existing_admission(s, ask("r1", "emb@1")) is None
    s.leases[lease.lease_id] = lease
    # Cancelled: its lease goes, found by request.
    cancel_request(s, "r1", NOW, "gone")
    assert not s.leases
    # A queued request is found again by its requester.
    admit(s, "r2", "emb@1", NOW)
    queued = existing_admission(s, ask("r2", "emb@1"))
    assert queued is not None and queued.request_id == "r2"


def fit_agrees(s: PoolState, now: float) -> None:
    """The fit index holds every card's budget of now, in best-fit order, and the fast pass
    decides what the reference does."""
    kept = start_pass(s, now, indexed=True)
    assert kept.fit is not None
    for card in kept.pool_accelerators:
        assert kept.fit.schedulable[card.id] == kept.budgets[card.id].schedulable_bytes, card.id
    assert kept.fit.order == sorted((v, k) for k, v in kept.fit.schedulable.items())
    walked = start_pass(s, now, indexed=False)
    assert kept.unhealthy == walked.unhealthy
    same_start(s, now)


def test_a_load_lands_on_the_best_fit_of_a_large_pool_and_the_index_follows_every_change() -> None:
    # 40 cards of four sizes; a 5 GiB model loads where the least is left over, then id order.
    cards = [gpu(f"n{i:02d}/0", total=[8, 24, 12, 6][i % 4], reserve=0) for i in range(40)]
    s = state(cards, [deployment("emb@1", gib=5, queue_limit=1000)], tenants=[tenant("t")])
    now = NOW
    for card in cards:
        observe(s, card.id, at=now)
    fit_agrees(s, now)
    admit(s, "r0", "emb@1", now)
    first = decide(s, now)
    assert [load.accelerator for load in first.loads] == ["n03/0"]  # 6 GiB: 1 left over, lowest id
    # External usage lands on the card it chose and on the next 6 GiB one: the load goes to the third.
    observe(s, "n03/0", external_gib=2, at=now)
    observe(s, "n07/0", external_gib=2, at=now)
    fit_agrees(s, now)
    assert [load.accelerator for load in decide(s, now).loads] == ["n11/0"]
    # Usage that swings keeps a reserve that moves with time alone (the volatility window).
    for at, ext in ((now + 1, 0.5), (now + 2, 1.5)):
        observe(s, "n00/0", external_gib=ext, at=at)
    now += 2
    fit_agrees(s, now)
    # With no new sample, the first reading leaves the window: the spread, so the reserve, shrinks.
    now = NOW + s.config.volatility_window_s + 0.5
    fit_agrees(s, now)
    now += s.config.volatility_window_s + 1
    for card in cards:
        observe(s, card.id, at=now, external_gib=2 if card.id in ("n03/0", "n07/0") else 0)
    fit_agrees(s, now)
    # A card turns UNHEALTHY and recovers; a resident and a lease come and go.
    observe(s, "n04/0", healthy=False, at=now)
    fit_agrees(s, now)
    observe(s, "n04/0", at=now)
    fit_agrees(s, now)
    apply_decisions(s, decide(s, now), now, {})
    fit_agrees(s, now)
    admit(s, "r1", "emb@1", now)
    fit_agrees(s, now)
    apply_decisions(s, decide(s, now), now, {})
    for r in list(s.residents.values()):
        r.phase = ResidentPhase.READY  # behind the policy's back
    fit_agrees(s, now)
    for lease in list(s.leases):
        release_lease(s, lease, now, "ok")
    fit_agrees(s, now)
    # The state replaced by a copy (a new run of the scheduler) builds the index anew.
    copy = dataclasses.replace(s)
    fit_agrees(copy, now)


def test_lease_groupings_follow_any_mix_of_leases_come_gone_and_replaced() -> None:
    """The kept lease groupings find what came and went from the ends of the leases' dict and a
    difference of keys; a lease replaced under its id, removed and added again (to the dict's
    end), or the dict rebuilt in another order is found too: after every step they equal ones
    built afresh."""
    import random

    from modelforge.policy._standing import LeaseGroups, LeasesOn
    from modelforge.policy._state import Lease

    s = build()
    rng = random.Random(11)
    kept_groups_, kept_on = LeaseGroups(s.catalog), LeasesOn()
    cards = ["a/0", "b/0"]
    deployments = ["emb@1", "llm@1", "job@1"]
    leases: dict[str, Lease] = {}
    made = 0

    def new_lease() -> Lease:
        nonlocal made
        made += 1
        first = rng.choice(cards)
        return Lease(
            lease_id=f"l{made}",
            request_id=f"r{made}",
            workflow_id=f"w{made}",
            capability=deployments[made % 3],
            deployment=deployments[made % 3],
            accelerator=first,
            node=first.split("/")[0],
            resident_key=f"{deployments[made % 3]}@{first}",
            bytes=rng.randint(1, 4) * GiB,
            granted_at=NOW,
            priority="background",
            tenant="t",
            gang=[c for c in cards if c != first] if rng.random() < 0.3 else [],
            ends_by=NOW + 60 if rng.random() < 0.3 else None,
        )

    for _ in range(400):
        for _ in range(rng.randint(0, 3)):
            lease = new_lease()
            leases[lease.lease_id] = lease
        ids = list(leases)
        move = rng.random()
        if ids and move < 0.5:
            for lease_id in rng.sample(ids, min(len(ids), rng.randint(1, 3))):
                del leases[lease_id]
        elif ids and move < 0.65:
            lease_id = rng.choice(ids)  # replaced in place, moved to the other card
            lease = leases[lease_id]
            other = "b/0" if lease.accelerator == "a/0" else "a/0"
            leases[lease_id] = dataclasses.replace(lease, accelerator=other, gang=[])
        elif ids and move < 0.75:
            lease_id = rng.choice(ids)  # removed and added again: now at the dict's end
            leases[lease_id] = leases.pop(lease_id)
        elif move < 0.8:
            shuffled = list(leases.items())
            rng.shuffle(shuffled)
            leases = dict(shuffled)
        kept_groups_.update(leases)
        kept_on.update(leases)
        fresh_groups, fresh_on = LeaseGroups(s.catalog), LeasesOn()
        fresh_groups.update(leases)
        fresh_on.update(leases)
        assert kept_groups_.held == leases
        for name in ("leased_sum", "holding", "timed_on"):
            assert getattr(kept_groups_, name) == getattr(fresh_groups, name), name
        # (their readers sum or sort them: the order within is not kept)
        assert kept_groups_.of_preemptible == fresh_groups.of_preemptible
        assert kept_groups_.of_timed == fresh_groups.of_timed
        assert kept_on.on == fresh_on.on
