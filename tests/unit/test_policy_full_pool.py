"""The hard shapes for the fast pass: a full pool (every card holding a resident at its
concurrency with real leases, an unmanaged process filling the rest, nothing fits, everything
waits) and many gangs waiting at once. Over random arrivals, releases, unmanaged processes
growing and shrinking, health failures and passing time, the fast pass (the groupings and fit
index it keeps across passes, gang waits that settle their deployment, gangs meeting blocked
cards first) must decide exactly what the reference pass decides, which places every request
on its own and looks at every card for every gang."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelforge.domain import GiB, Priority, Residency
from modelforge.policy import (
    AdmissionRejected,
    Decisions,
    PolicyConfig,
    PoolState,
    ResidentPhase,
    WaitReason,
    apply_decisions,
    decide,
    enqueue,
    release_lease,
    resident_ready,
    resident_unloaded,
    stamp_predictions,
    validate_request,
    verdicts,
)
from modelforge.policy._placement import decide_each
from modelforge.policy._queue_index import QueueIndex, queue_index
from modelforge.policy._state import note_service
from tests.builders import NOW, ask, deployment, gpu, observe, resident, state, tenant
from tests.tiers import examples

# Three NVLink groups of four cards (two nodes, two racks).
CARDS = [f"{group}/{i}" for group in ("a", "b", "c") for i in range(4)]
SERVED = ["svc@1", "chat@1"]
# nv2p@1 has nv2@1's shape, preemptible: gangs of two deployments share what their placement reads.
GANGS = ["nv2@1", "nv4@1", "nv2be@1", "spread@1", "nv2p@1"]
SINGLE = [*SERVED, "job@1"]


def build(gang_reservations: bool) -> PoolState:
    accelerators = [
        gpu(
            card,
            total=16 if card.startswith("c") else 24,
            nvlink_group=card.split("/")[0],
            rack="r1" if card.startswith("c") else "r0",
        )
        for card in CARDS
    ]
    gang = {"residency": Residency.NONE, "idle_bytes": 0, "queue_limit": 200}
    return state(
        accelerators,
        [
            deployment("svc@1", gib=6, idle_bytes=2 * GiB, concurrency=2, queue_limit=200),
            deployment("chat@1", gib=5, idle_bytes=3 * GiB, concurrency=2, queue_limit=200),
            deployment("job@1", gib=4, residency=Residency.LOAD_ON_DEMAND, queue_limit=200, preemptible=True),
            deployment("nv2@1", gib=5, gpu_count=2, nvlink_required=True, **gang),
            deployment("nv2p@1", gib=5, gpu_count=2, nvlink_required=True, preemptible=True, **gang),
            deployment("nv4@1", gib=8, gpu_count=4, nvlink_required=True, **gang),
            deployment("nv2be@1", gib=3, gpu_count=2, nvlink_required=True, preemptible=True, **gang),
            deployment("spread@1", gib=4, gpu_count=3, anti_affinity="node", preemptible=True, **gang),
        ],
        tenants=[tenant("t", weight=2.0), tenant("u")],
        config=PolicyConfig(preempt_min_runtime_s=0.0, gang_reservations=gang_reservations),
    )


def managed_gib(s: PoolState, card: str) -> float:
    held = sum(r.bytes for r in s.residents.values() if r.accelerator == card and r.phase != ResidentPhase.LOADING)
    return (held + sum(lease.bytes for lease in s.leases.values() if card in lease.accelerators)) / GiB


def sample(s: PoolState, card: str, unmanaged_gib: float, at: float, healthy: bool = True) -> None:
    """One NVML sample of `card`: ModelForge's residents and leases, and the unmanaged process."""
    loaded = [r.key for r in s.residents.values() if r.accelerator == card and r.phase != ResidentPhase.LOADING]
    observe(
        s, card, external_gib=unmanaged_gib, managed_gib=managed_gib(s, card), at=at, healthy=healthy, loaded=loaded
    )


def fill(s: PoolState, max_duration_s: float | None) -> dict[str, float]:
    """Every card: a ready resident at its concurrency, its leases granted by the policy itself;
    an unmanaged process fills the rest (all but the 1 GiB reserve). Returns the unmanaged GiB."""
    for n, card in enumerate(CARDS):
        capability = SERVED[n % 2]
        resident(s, capability, card, 2 if capability == "svc@1" else 3, residency=Residency.KEEP_WARM)
        sample(s, card, 0.0, NOW)
    for n in range(len(CARDS)):
        for k in range(2):
            request = ask(f"fill{n}.{k}", SERVED[n % 2], tenant_name="tu"[k], max_duration_s=max_duration_s)
            _, priority = validate_request(s, request, gangs=True)
            enqueue(s, request, priority, NOW)
    apply_decisions(s, decide(s, NOW), NOW, {})
    assert len(s.leases) == 2 * len(CARDS) and not s.queue
    unmanaged = {}
    for card in CARDS:
        total = 16 if card.startswith("c") else 24
        unmanaged[card] = total - 1 - managed_gib(s, card)
        sample(s, card, unmanaged[card], NOW)
    return unmanaged


def assert_fast_is_reference(fast: Decisions, reference: Decisions) -> None:
    assert (
        fast.grants,
        fast.rejects,
        fast.loads,
        fast.assigns,
        fast.unloads,
        fast.sleeps,
        fast.wakes,
        fast.preemptions,
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
    # A gang's wait names the cards it reserved: the same in both passes.
    reference_waits = {w.request_id: w.reason for w in reference.waits}
    for wait in fast.waits:
        if "gang of" in wait.reason:
            assert reference_waits.get(wait.request_id) == wait.reason


operation = st.one_of(
    # Single-card requests and gangs arriving between two passes.
    st.tuples(
        st.just("request"),
        st.integers(0, len(SINGLE) + len(GANGS) - 1),
        st.sampled_from(list(Priority)[:4]),
        st.integers(1, 4),
        st.sampled_from([None, 30.0, 300.0]),
    ),
    # Many gangs at once, of every shape and the lower classes.
    st.tuples(st.just("gangs"), st.integers(4, 16), st.sampled_from([None, 60.0, 600.0])),
    st.tuples(st.just("unmanaged"), st.integers(0, len(CARDS) - 1), st.integers(-12, 4)),
    st.tuples(st.just("release"), st.integers(0, 100)),
    st.tuples(st.just("loaded"), st.integers(0, 50)),
    st.tuples(st.just("unloaded"), st.integers(0, 50)),
    st.tuples(st.just("unhealthy"), st.integers(0, len(CARDS) - 1)),
    st.tuples(st.just("tick"), st.integers(0, len(CARDS) - 1)),
    st.tuples(st.just("wait"), st.integers(1, 400)),
)


def run(
    operations: list[tuple[object, ...]],
    gang_reservations: bool,
    max_duration_s: float | None,
    stamps: bool = False,
) -> None:
    """With `stamps`, also: the first ETA and reason each pass stamps on its new waiters (the
    fast walk over their deployments' lanes) are what the full verdicts say of them."""
    s = build(gang_reservations)
    unmanaged = fill(s, max_duration_s)
    if stamps:  # measured service: each waiter's place in its deployment's timeline shows in its ETA
        for capability, seconds in zip(SINGLE, (20.0, 45.0, 90.0), strict=True):
            note_service(s, capability, seconds)
    now = NOW
    for n, op in enumerate(operations):
        kind = op[0]
        arrivals = []
        if kind == "request":
            every = [*SINGLE, *GANGS]
            for k in range(int(op[3])):  # type: ignore[call-overload]
                capability = every[(int(op[1]) + k * 3) % len(every)]  # type: ignore[call-overload]
                arrivals.append(ask(f"r{n}.{k}", capability, "tu"[k % 2], priority=op[2], max_duration_s=op[4]))
        elif kind == "gangs":
            for k in range(int(op[1])):  # type: ignore[call-overload]
                priority = list(Priority)[1 + k % 3]
                arrivals.append(ask(f"g{n}.{k}", GANGS[k % len(GANGS)], "tu"[k % 2], priority, max_duration_s=op[2]))
        elif kind == "unmanaged":
            card = CARDS[int(op[1])]  # type: ignore[call-overload]
            unmanaged[card] = max(0.0, unmanaged[card] + float(op[2]))  # type: ignore[arg-type]
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
            sick = CARDS[int(op[1])]  # type: ignore[call-overload]
            sample(s, sick, unmanaged[sick], now, healthy=False)
        elif kind == "wait":
            now += float(op[1])  # type: ignore[arg-type]
        for request in arrivals:
            try:
                _, priority = validate_request(s, request, gangs=True)
                enqueue(s, request, priority, now)
            except AdmissionRejected:
                pass
        # Telemetry: every card after a change of ModelForge's own or of the unmanaged process;
        # one card (unchanged) on a tick.
        cards = [CARDS[int(op[1])]] if kind == "tick" else CARDS  # type: ignore[call-overload]
        for card in cards:
            if s.accelerators[card].healthy:
                sample(s, card, unmanaged[card], now)
        fast = decide(s, now)
        assert_fast_is_reference(fast, decide_each(s, now, reuse_settled=False))
        apply_decisions(s, fast, now, {})
        if stamps:
            unstamped = {q.request_id for q in s.queue if not q.eta_reason}
            expected = {v.request_id: (v.eta_at, v.reason) for v in verdicts(s, now)}
            stamp_predictions(s, now, fast)
            stamped = {q.request_id: (q.eta_at, q.eta_reason) for q in s.queue if q.request_id in unstamped}
            assert all(stamped[w.request_id][1] for w in fast.waits if w.request_id in unstamped)
            assert {k: v for k, v in stamped.items() if v[1]} == {k: expected[k] for k, v in stamped.items() if v[1]}
            # What the upkeep reads from the queue index, kept as requests come and go, is what
            # an index built afresh from the queue says.
            kept, fresh = queue_index(s), QueueIndex(s.queue)
            assert {c: {id(lane) for lane in lanes} for c, lanes in kept.lanes_of.items()} == {
                c: {id(kept.lanes[(lane.priority, lane.tenant, lane.capability)]) for lane in lanes}
                for c, lanes in fresh.lanes_of.items()
            }
            assert kept.unstamped.keys() == fresh.unstamped.keys()


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(operation, min_size=1, max_size=30),
    st.booleans(),
    st.sampled_from([None, 120.0]),
)
def test_a_full_pool_with_many_gangs_waiting_decides_what_the_reference_decides(
    operations: list[tuple[object, ...]], gang_reservations: bool, max_duration_s: float | None
) -> None:
    run(operations, gang_reservations, max_duration_s)


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(operation, min_size=1, max_size=30), st.booleans())
def test_the_first_eta_stamped_on_each_new_waiter_is_its_full_verdicts(
    operations: list[tuple[object, ...]], gang_reservations: bool
) -> None:
    run(operations, gang_reservations, 120.0, stamps=True)


def test_in_a_full_pool_a_new_request_waits_and_so_do_the_gangs() -> None:
    """The shape itself: with every card full, a new request and a burst of gangs all wait
    (nothing granted, loaded, preempted or refused), in the fast pass as in the reference."""
    s = build(gang_reservations=True)
    unmanaged = fill(s, None)
    for k in range(12):
        request = ask(f"g{k}", GANGS[k % 2], "tu"[k % 2], Priority.INTERACTIVE)
        _, priority = validate_request(s, request, gangs=True)
        enqueue(s, request, priority, NOW)
    request = ask("new", "svc@1", "t", Priority.PRODUCTION)
    _, priority = validate_request(s, request, gangs=True)
    enqueue(s, request, priority, NOW)
    for card in CARDS:
        sample(s, card, unmanaged[card], NOW + 1)
    fast = decide(s, NOW + 1)
    assert_fast_is_reference(fast, decide_each(s, NOW + 1, reuse_settled=False))
    assert not (fast.grants or fast.loads or fast.preemptions or fast.rejects)
    assert {w.request_id for w in fast.waits} == {"new", *(f"g{k}" for k in range(12))}


# A pool full of preemptible work: more cards than a walk reads one by one (`_SHUT_FROM`), each
# holding lower-class batch jobs that a higher class may stop. Most requests then find no card
# with room and make some by preemption; the fast pass looks only where making room could help
# before it walks every card, and prefers cards whose work is already being stopped.
BE_CARDS = [f"n{node:02d}/{i}" for node in range(18) for i in range(4)]


def build_preemptible() -> PoolState:
    gang = {"residency": Residency.NONE, "idle_bytes": 0, "queue_limit": 400}
    return state(
        [gpu(card, total=16 if card.startswith("n0") else 24, nvlink_group=card.split("/")[0]) for card in BE_CARDS],
        [
            deployment("be@1", gib=5, preemptible=True, concurrency=8, **gang),
            deployment("batch@1", gib=9, **gang),
            deployment("svc@1", gib=6, idle_bytes=2 * GiB, concurrency=2, queue_limit=400),
            deployment("nv2be@1", gib=7, gpu_count=2, nvlink_required=True, preemptible=True, **gang),
            deployment("nv2@1", gib=7, gpu_count=2, nvlink_required=True, **gang),  # nv2be@1's shape
        ],
        tenants=[tenant("t", weight=2.0), tenant("u")],
        config=PolicyConfig(preempt_min_runtime_s=0.0),
    )


def sample_be(s: PoolState, at: float, unmanaged: dict[str, float], cards: list[str] | None = None) -> None:
    for card in cards or BE_CARDS:
        if s.accelerators.get(card) is None or s.accelerators[card].healthy:
            sample(s, card, unmanaged.get(card, 0.0), at)


preemptible_operation = st.one_of(
    st.tuples(
        st.just("request"),
        st.sampled_from(["be@1", "batch@1", "svc@1", "nv2be@1", "nv2@1"]),
        st.sampled_from(list(Priority)[:3]),
        st.integers(1, 6),
        st.sampled_from([None, 30.0, 300.0]),
    ),
    st.tuples(st.just("release"), st.integers(0, 1000)),
    st.tuples(st.just("stopped"), st.integers(0, 1000)),  # preempted work ends
    st.tuples(st.just("unmanaged"), st.integers(0, len(BE_CARDS) - 1), st.integers(-8, 8)),
    st.tuples(st.just("loaded"), st.integers(0, 1000)),
    st.tuples(st.just("wait"), st.integers(1, 120)),
)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(preemptible_operation, min_size=1, max_size=25), st.integers(0, 3))
def test_a_pool_full_of_preemptible_work_decides_what_the_reference_decides(
    operations: list[tuple[object, ...]], fill_priority: int
) -> None:
    s = build_preemptible()
    unmanaged: dict[str, float] = {}
    now = NOW
    sample_be(s, now, unmanaged)
    # Fill every card with lower-class batch jobs (benchmark or maintenance), granted by the
    # policy itself: two in three preemptible, so some cards hold more than the rest can stop.
    low = [Priority.BENCHMARK, Priority.MAINTENANCE][fill_priority % 2]
    for k in range(4 * len(BE_CARDS)):
        request = ask(f"fill{k}", "batch@1" if k % 3 == 0 else "be@1", "tu"[k % 2], low)
        _, priority = validate_request(s, request, gangs=True)
        enqueue(s, request, priority, now)
    for _ in range(4):
        apply_decisions(s, decide(s, now), now, {})
        for key in [k for k, r in s.residents.items() if r.phase == ResidentPhase.LOADING]:
            resident_ready(s, key, 0, now)
        sample_be(s, now, unmanaged)
    assert len(s.leases) >= 2 * len(BE_CARDS)
    for n, op in enumerate(operations):
        kind = op[0]
        if kind == "request":
            for k in range(int(op[3])):  # type: ignore[call-overload]
                request = ask(f"r{n}.{k}", str(op[1]), "tu"[k % 2], priority=op[2], max_duration_s=op[4])
                try:
                    _, priority = validate_request(s, request, gangs=True)
                    enqueue(s, request, priority, now)
                except AdmissionRejected:
                    pass
        elif kind == "release" and s.leases:
            release_lease(s, list(s.leases)[int(op[1]) % len(s.leases)], now, "ok")  # type: ignore[call-overload]
        elif kind == "stopped" and s.preempting:
            stopped = sorted(s.preempting)[int(op[1]) % len(s.preempting)]  # type: ignore[call-overload]
            if stopped in s.leases:
                release_lease(s, stopped, now, "preempted")
        elif kind == "unmanaged":
            card = BE_CARDS[int(op[1])]  # type: ignore[call-overload]
            unmanaged[card] = max(0.0, unmanaged.get(card, 0.0) + float(op[2]))  # type: ignore[arg-type]
        elif kind == "loaded":
            loading = [k for k, r in s.residents.items() if r.phase == ResidentPhase.LOADING]
            if loading:
                resident_ready(s, loading[int(op[1]) % len(loading)], 0, now)  # type: ignore[call-overload]
        elif kind == "wait":
            now += float(op[1])  # type: ignore[arg-type]
        sample_be(s, now, unmanaged)
        fast = decide(s, now)
        assert_fast_is_reference(fast, decide_each(s, now, reuse_settled=False))
        apply_decisions(s, fast, now, {})


def test_a_gang_after_bytes_committed_in_its_pass_takes_the_best_fitting_group() -> None:
    """Bounds kept within a pass (`_gang._Bounds`) must follow the bytes committed since: a
    first gang takes group a, a job pinned to c/0 then has bytes promised there (its runner
    loads), and a second gang of the same shape must still take group c, which now leaves less
    over (0.1 + 4.6 GiB) than group b (4 + 4 GiB). Before the job, c left 9.2 GiB over, more
    than b: a bound not brought up to date stops the search at b."""
    cards = ["a/0", "a/1", "b/0", "b/1", "c/0", "c/1", "c/2"]
    free = {"a/0": 6, "a/1": 6, "b/0": 9, "b/1": 9, "c/0": 9.6, "c/1": 9.6, "c/2": 1}
    gang = {"residency": Residency.NONE, "idle_bytes": 0, "queue_limit": 20}
    s = state(
        [gpu(card, nvlink_group=card[0]) for card in cards],
        [
            deployment("nv2@1", gib=5, gpu_count=2, nvlink_required=True, **gang),
            deployment("pin@1", gib=4.5, accelerators=["c/0"], **gang),
        ],
    )
    for card in cards:
        observe(s, card, external_gib=24 - 1 - free[card])
    for request_id, capability, priority in [
        ("g1", "nv2@1", Priority.INTERACTIVE),
        ("job", "pin@1", Priority.BACKGROUND),
        ("g2", "nv2@1", Priority.BENCHMARK),
    ]:
        _, klass = validate_request(s, ask(request_id, capability, priority=priority), gangs=True)
        enqueue(s, ask(request_id, capability, priority=priority), klass, NOW)
    fast = decide(s, NOW)
    held = {grant.request_id: sorted(grant.lease.accelerators) for grant in fast.grants}
    assert [(load.accelerator, load.for_requests) for load in fast.loads] == [("c/0", ["job"])]
    assert held == {"g1": ["a/0", "a/1"], "g2": ["c/0", "c/1"]}
    assert_fast_is_reference(fast, decide_each(s, NOW, reuse_settled=False))


def test_a_gang_that_may_preempt_nothing_waits_for_work_already_being_stopped() -> None:
    """A maintenance gang may stop no work, but a lease another class's preemption is already
    stopping gives its bytes back whoever waits: the gang waits for that (making room), not
    for room that may never come, in the fast pass as in the reference."""
    cards = ["a/0", "a/1", "b/0", "b/1"]
    gang = {"residency": Residency.NONE, "idle_bytes": 0, "queue_limit": 20}
    s = state(
        [gpu(card, nvlink_group=card[0]) for card in cards],
        [
            deployment("low@1", gib=20, gpu_count=2, nvlink_required=True, preemptible=True, **gang),
            deployment("nvm@1", gib=8, gpu_count=2, nvlink_required=True, **gang),
        ],
        config=PolicyConfig(preempt_min_runtime_s=0.0),
    )
    for card in cards:
        observe(s, card)
    for n in range(2):
        _, klass = validate_request(s, ask(f"low{n}", "low@1", priority=Priority.BENCHMARK), gangs=True)
        enqueue(s, ask(f"low{n}", "low@1", priority=Priority.BENCHMARK), klass, NOW)
    apply_decisions(s, decide(s, NOW), NOW, {})
    assert len(s.leases) == 2
    # Every card: 20 GiB leased, 3 GiB free; the work on b is being stopped.
    stopped = next(lease for lease in s.leases.values() if "b/0" in lease.accelerators)
    s.preempting[stopped.lease_id] = "a higher class needed room"  # an earlier pass's preemption
    _, klass = validate_request(s, ask("m", "nvm@1", priority=Priority.MAINTENANCE), gangs=True)
    enqueue(s, ask("m", "nvm@1", priority=Priority.MAINTENANCE), klass, NOW + 1)
    fast = decide(s, NOW + 1)
    assert [(w.request_id, w.codes) for w in fast.waits] == [("m", (WaitReason.MAKING_ROOM,))]
    assert not fast.preemptions  # nothing new is stopped for it
    assert_fast_is_reference(fast, decide_each(s, NOW + 1, reuse_settled=False))
