"""The fast pass's gang placement looks only at the cards where a gang's bytes could ever be
found in the pass (`_gang._live`), and works out once per pass what is the same for every gang
(grouping, whether it could ever fit, leases per card). Over random sequences on a small
topology (NVLink groups, nodes, racks, work with and without end times, preemptible work), it
must decide exactly what the reference pass decides, which looks at every card for every gang."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelforge.domain import GiB, Priority, Residency
from modelforge.policy import (
    AdmissionRejected,
    PolicyConfig,
    PoolState,
    ResidentPhase,
    _gang,
    _pass,
    apply_decisions,
    decide,
    enqueue,
    release_lease,
    resident_ready,
    resident_unloaded,
    validate_request,
)
from modelforge.policy._pass import start_pass
from modelforge.policy._placement import decide_each
from tests.builders import NOW, ask, deployment, gpu, observe, resident, state, tenant
from tests.tiers import examples

CARDS = [f"{node}/{i}" for node, n in (("a", 4), ("b", 4), ("c", 2)) for i in range(n)]
CAPABILITIES = ["emb@1", "llm@1", "job@1", "nv2@1", "nv4@1", "spread@1", "pair@1"]

operation = st.one_of(
    st.tuples(
        st.just("request"),
        st.integers(0, len(CAPABILITIES) - 1),
        st.sampled_from(list(Priority)[:4]),
        st.integers(1, 4),
        st.sampled_from([None, 30.0, 300.0]),
    ),
    st.tuples(st.just("external"), st.integers(0, len(CARDS) - 1), st.integers(0, 20)),
    st.tuples(st.just("release"), st.integers(0, 50)),
    st.tuples(st.just("loaded"), st.integers(0, 50)),
    st.tuples(st.just("unloaded"), st.integers(0, 50)),
    st.tuples(st.just("unhealthy"), st.integers(0, len(CARDS) - 1)),
    st.tuples(st.just("wait"), st.integers(1, 400)),
)


# (card, GiB, NVLink group, rack)
Topology = list[tuple[str, int, str, str]]
SMALL: Topology = [
    (
        card,
        24 if card.startswith("a") else 16,
        card.split("/")[0] if not card.startswith("c") else "",
        "r1" if card.startswith("c") else "r0",
    )
    for card in CARDS
]
# Many NVLink groups of two and three cards of both sizes: an NVLink gang's search compares
# groups by a bound of what they leave over and stops early (`_gang._groups_by_bound`); here
# the first groups by bound are often refused or beaten, and ties are broken by group name.
WIDE: Topology = [
    (f"{group}/{i}", size, group, f"r{n % 2}")
    for n, (group, cards, size) in enumerate(
        [("g0", 2, 16), ("g1", 4, 24), ("g2", 2, 24), ("g3", 3, 16), ("g4", 2, 16), ("g5", 3, 24)]
    )
    for i in range(cards)
]


def build(gang_reservations: bool, topology: Topology = SMALL, min_runtime_s: float = 0.0) -> PoolState:
    accelerators = [gpu(card, total=size, nvlink_group=group, rack=rack) for card, size, group, rack in topology]
    return state(
        accelerators,
        [
            deployment("emb@1", gib=1.2, queue_limit=100),
            deployment("llm@1", gib=9, idle_bytes=7 * GiB, concurrency=2, queue_limit=100),
            deployment("job@1", gib=6, residency=Residency.LOAD_ON_DEMAND, queue_limit=100, preemptible=True),
            deployment(
                "nv2@1",
                gib=5,
                residency=Residency.NONE,
                idle_bytes=0,
                gpu_count=2,
                nvlink_required=True,
                queue_limit=100,
            ),
            deployment(
                "nv4@1",
                gib=8,
                residency=Residency.NONE,
                idle_bytes=0,
                gpu_count=4,
                nvlink_required=True,
                queue_limit=100,
            ),
            deployment(
                "spread@1",
                gib=4,
                residency=Residency.NONE,
                idle_bytes=0,
                gpu_count=3,
                anti_affinity="node",
                queue_limit=100,
                preemptible=True,
            ),
            deployment(
                "pair@1", gib=10, residency=Residency.NONE, idle_bytes=0, gpu_count=2, gpu_per_node=2, queue_limit=100
            ),
        ],
        tenants=[tenant("t", weight=2.0), tenant("u")],
        config=PolicyConfig(preempt_min_runtime_s=min_runtime_s, gang_reservations=gang_reservations),
    )


def run(
    operations: list[tuple[object, ...]],
    gang_reservations: bool,
    topology: Topology = SMALL,
    min_runtime_s: float = 0.0,
) -> None:
    s = build(gang_reservations, topology, min_runtime_s)
    cards = [card for card, _, _, _ in topology]
    now = NOW
    external = dict.fromkeys(cards, 0.0)
    for card in cards:
        observe(s, card, at=now)
    for n, op in enumerate(operations):
        kind = op[0]
        if kind == "request":
            for k in range(int(op[3])):  # type: ignore[call-overload]
                capability = CAPABILITIES[(int(op[1]) + k * 3) % len(CAPABILITIES)]  # type: ignore[call-overload]
                request = ask(f"r{n}.{k}", capability, tenant_name="tu"[k % 2], priority=op[2], max_duration_s=op[4])
                try:
                    _, priority = validate_request(s, request, gangs=True)
                    enqueue(s, request, priority, now)
                except AdmissionRejected:
                    pass
        elif kind == "external":
            external[cards[int(op[1]) % len(cards)]] = float(op[2])  # type: ignore[call-overload]
        elif kind == "release" and s.leases:
            release_lease(s, list(s.leases)[int(op[1]) % len(s.leases)], now, "ok")  # type: ignore[call-overload]
        elif kind == "loaded":
            loading = [k for k, r in s.residents.items() if r.phase == ResidentPhase.LOADING]
            if loading:
                resident_ready(s, loading[int(op[1]) % len(loading)], 0, now)  # type: ignore[call-overload]
        elif kind == "unloaded":
            unloading = [k for k, r in s.residents.items() if r.phase == ResidentPhase.UNLOADING]
            if unloading:
                resident_unloaded(s, unloading[int(op[1]) % len(unloading)], True, "")  # type: ignore[call-overload]
        elif kind == "unhealthy":
            observe(s, cards[int(op[1]) % len(cards)], healthy=False, at=now)  # type: ignore[call-overload]
        elif kind == "wait":
            now += float(op[1])  # type: ignore[arg-type]
        for card, ext in external.items():
            managed = (
                sum(r.bytes for r in s.residents.values() if r.accelerator == card and r.phase != ResidentPhase.LOADING)
                + sum(lease.bytes for lease in s.leases.values() if card in lease.accelerators)
            ) / GiB
            observe(s, card, external_gib=ext, managed_gib=managed, at=now)
        decisions = decide(s, now)
        reference = decide_each(s, now, reuse_settled=False)
        assert (
            decisions.grants,
            decisions.rejects,
            decisions.loads,
            decisions.assigns,
            decisions.unloads,
            decisions.sleeps,
            decisions.wakes,
            decisions.preemptions,
        ) == (
            reference.grants,
            reference.rejects,
            reference.loads,
            reference.assigns,
            reference.unloads,
            reference.sleeps,
            reference.wakes,
            reference.preemptions,
        )
        # A gang's wait reason names the cards it reserved: the same with and without the index.
        gang_waits = {w.request_id: w.reason for w in decisions.waits if "gang of" in w.reason}
        reference_waits = {w.request_id: w.reason for w in reference.waits}
        for request_id, reason in gang_waits.items():
            assert reference_waits.get(request_id) == reason
        apply_decisions(s, decisions, now, {})


@settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(operation, min_size=1, max_size=40), st.booleans())
def test_indexed_gang_placement_decides_what_the_reference_decides(
    operations: list[tuple[object, ...]], gang_reservations: bool
) -> None:
    run(operations, gang_reservations)


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(operation, min_size=1, max_size=40), st.booleans())
def test_indexed_gang_placement_over_many_nvlink_groups_decides_what_the_reference_decides(
    operations: list[tuple[object, ...]], gang_reservations: bool
) -> None:
    run(operations, gang_reservations, WIDE)


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(operation, min_size=1, max_size=40), st.booleans())
def test_the_cards_a_gang_could_use_kept_across_passes_are_those_worked_out_afresh(
    operations: list[tuple[object, ...]], gang_reservations: bool
) -> None:
    """`_gang._KeptLive`: each pass brings the cards a gang's bytes could be found on, and their
    NVLink groups, up to date from the cards the fit index re-read and the let-go bytes that
    changed; with the check on, the pass compares each with the ones worked out afresh (the
    same cards; the same groups, in the same order)."""
    _gang.CHECK_KEPT_LIVE = True
    try:
        run(operations, gang_reservations, WIDE)
        run(operations, gang_reservations)
    finally:
        _gang.CHECK_KEPT_LIVE = False


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(operation, min_size=1, max_size=40), st.booleans())
def test_the_leases_a_pass_may_preempt_kept_across_passes_are_those_listed_afresh(
    operations: list[tuple[object, ...]], gang_reservations: bool
) -> None:
    """`_pass._KeptPreemptible`: each pass brings each card's preemptible leases up to date from
    the leases that came or went, those past their minimum runtime (60 s here; the sequences
    wait up to 400 s between passes) and those being preempted; with the check on, the pass
    compares every card's list, in preemption order, with the one listed afresh."""
    _pass.CHECK_KEPT_PREEMPTIBLE = True
    try:
        run(operations, gang_reservations, WIDE, min_runtime_s=60.0)
    finally:
        _pass.CHECK_KEPT_PREEMPTIBLE = False


def test_a_lease_being_preempted_comes_first_on_its_card_in_the_next_pass() -> None:
    """Two leases on one resident of a preemptible model (granted at NOW and NOW + 10): past
    their minimum runtime the younger is preempted first. Once the older is being preempted,
    it comes first (its card's list is made again though no lease came or went), as the
    reference pass lists them."""
    s = state(
        [gpu("n/0")],
        [deployment("chat@1", gib=4, concurrency=2, preemptible=True, residency=Residency.KEEP_WARM, queue_limit=10)],
    )
    observe(s, "n/0")
    enqueue(s, ask("a", "chat@1"), Priority.INTERACTIVE, NOW)
    apply_decisions(s, decide(s, NOW), NOW, {})
    resident_ready(s, "chat@1@n/0", 4 * GiB, NOW)
    observe(s, "n/0", managed_gib=4, loaded=["chat@1@n/0"])
    apply_decisions(s, decide(s, NOW), NOW, {})
    enqueue(s, ask("b", "chat@1"), Priority.INTERACTIVE, NOW + 10)
    apply_decisions(s, decide(s, NOW + 10), NOW + 10, {})
    assert sorted(lease.request_id for lease in s.leases.values()) == ["a", "b"]

    def listed(now: float, indexed: bool) -> list[str]:
        return [lease.request_id for lease in start_pass(s, now, indexed=indexed).preemptible.get("n/0", [])]

    _pass.CHECK_KEPT_PREEMPTIBLE = True
    try:
        assert listed(NOW + 5, True) == listed(NOW + 5, False) == []  # under the minimum runtime
        assert listed(NOW + 100, True) == listed(NOW + 100, False) == ["b", "a"]
        older = next(lease for lease in s.leases.values() if lease.request_id == "a")
        s.preempting[older.lease_id] = "making room"
        assert listed(NOW + 101, True) == listed(NOW + 101, False) == ["a", "b"]
    finally:
        _pass.CHECK_KEPT_PREEMPTIBLE = False


def test_a_waiting_gang_sees_models_that_became_idle_though_no_sample_landed_since() -> None:
    """Two NVLink groups of two 24 GiB cards (1 GiB reserve) and a group of one. A 10 GiB model
    is loading on x/0 and x/1 (13 GiB free each), an unmanaged process fills y/0 and y/1, z/0 is
    free. A gang of two 16 GiB cards in one group waits: z has one card, and nothing on x could
    be let go. Both models then
    finish loading and are idle (their bytes were counted already: no sample lands, so the fit
    index re-reads no card), and the next pass unloads them to make room for the gang, as the
    reference pass decides: the cards a gang could use, kept across passes, are brought up to
    date by the let-go bytes that changed, not only by the cards observed, and group x comes
    before z among the groups holding such cards, as it does afresh."""
    accelerators = [gpu(card, nvlink_group=card.split("/")[0]) for card in ("x/0", "x/1", "y/0", "y/1", "z/0")]
    s = state(
        accelerators,
        [
            deployment("m@1", gib=10, residency=Residency.KEEP_WARM, queue_limit=100),
            deployment(
                "nv2@1",
                gib=16,
                residency=Residency.NONE,
                idle_bytes=0,
                gpu_count=2,
                nvlink_required=True,
                queue_limit=100,
            ),
        ],
        config=PolicyConfig(gang_reservations=False),
    )
    for card in ("x/0", "x/1"):
        resident(s, "m@1", card, 10, phase=ResidentPhase.LOADING).requested_at = NOW - 5
        observe(s, card, managed_gib=10)
    for card in ("y/0", "y/1"):
        observe(s, card, external_gib=20)
    observe(s, "z/0")
    request = ask("gang", "nv2@1", priority=Priority.BACKGROUND)
    _, priority = validate_request(s, request, gangs=True)
    enqueue(s, request, priority, NOW)
    _gang.CHECK_KEPT_LIVE = True
    try:
        first = decide(s, NOW)
        assert [w.request_id for w in first.waits] == ["gang"] and not first.unloads
        apply_decisions(s, first, NOW, {})
        for card in ("x/0", "x/1"):
            resident_ready(s, f"m@1@{card}", 0, NOW + 1)
        second = decide(s, NOW + 2)
        reference = decide_each(s, NOW + 2, reuse_settled=False)
    finally:
        _gang.CHECK_KEPT_LIVE = False
    assert sorted(u.resident_key for u in second.unloads) == ["m@1@x/0", "m@1@x/1"]
    assert second.unloads == reference.unloads


def test_a_gang_makes_room_where_the_least_is_left_over_with_only_the_residents_it_may_unload_gone() -> None:
    """Two NVLink groups where a background gang fits only once idle residents go. On group x an
    idle model last used by production stays (a background asker may not unload it), so x has
    4 GiB a card left over once its other idle model goes; group a has 10 GiB a card left over.
    The gang makes room on x. (The search's bound for a group once counted every idle resident
    as gone, so x looked as roomy as a, a was looked at first, and x never was.)"""
    s = state(
        [gpu(f"{group}/{i}", total=21, nvlink_group=group, rack="r0") for group in ("a", "x") for i in range(2)],
        [
            deployment("kept@1", gib=6, queue_limit=100),
            deployment("idle@1", gib=8, queue_limit=100),
            deployment("wide@1", gib=11, queue_limit=100),
            deployment(
                "nv2@1",
                gib=10,
                residency=Residency.NONE,
                idle_bytes=0,
                gpu_count=2,
                nvlink_required=True,
                queue_limit=100,
            ),
        ],
        tenants=[tenant("t")],
    )
    for i in range(2):
        kept = resident(s, "kept@1", f"x/{i}", 6)
        kept.last_priority = Priority.PRODUCTION
        resident(s, "idle@1", f"x/{i}", 8).last_priority = Priority.BACKGROUND
        resident(s, "wide@1", f"a/{i}", 11).last_priority = Priority.BACKGROUND
        observe(s, f"x/{i}", managed_gib=14, loaded=[f"kept@1@x/{i}", f"idle@1@x/{i}"])
        observe(s, f"a/{i}", managed_gib=11, loaded=[f"wide@1@a/{i}"])
    request = ask("g", "nv2@1", priority=Priority.BACKGROUND)
    _, priority = validate_request(s, request, gangs=True)
    enqueue(s, request, priority, NOW)
    decisions = decide(s, NOW)
    assert sorted(u.resident_key for u in decisions.unloads) == ["idle@1@x/0", "idle@1@x/1"], decisions.unloads
    reference = decide_each(s, NOW, reuse_settled=False)
    assert decisions.unloads == reference.unloads
