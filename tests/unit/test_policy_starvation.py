"""A level's `starvation_bound_s`: a request of it that has waited longer than the bound while
capacity for it exists reserves the card it needs (`_placement._reserve_starved`, the gang
reservation's rule in `_reservation`): later work of its class and of lower classes may no
longer take the bytes it waits for there; higher classes still go first (class order is
unchanged). Without a bound, the policy decides exactly as before."""

from __future__ import annotations

import pytest

from modelforge.catalog import CatalogError, parse_catalog
from modelforge.domain import Catalog, GiB, PriorityLevel, Queue, Residency
from modelforge.policy import (
    Decisions,
    PoolState,
    ResidentPhase,
    apply_decisions,
    decide,
    enqueue,
    release_lease,
    resident_unloaded,
    validate_request,
)
from tests.builders import NOW, ask, deployment, gpu, observe, resident, tenant

STEP_S = 10.0
BOUND_S = 300.0


def levels(bound: float | None) -> list[Queue]:
    return [
        Queue(
            name="default",
            levels=[
                PriorityLevel("production", 50, preempts=["background"], production=True),
                PriorityLevel("background", 30, starvation_bound_s=bound),
            ],
        )
    ]


def pool(small_gib: float, small_idle_gib: float, bound: float | None, queues: bool = True) -> PoolState:
    """One 24 GiB card (23 usable). `small@1` is ready there, its 8 slots held by background
    leases; `big@1` (10 GiB, a background load) waits for room from NOW + 1. `queues` off: the
    built-in classes, as a catalog without [[queues]] has them."""
    s = PoolState(
        pool="default",
        catalog=Catalog(
            accelerators=[gpu("n/0")],
            deployments=[
                deployment("big@1", gib=10, residency=Residency.LOAD_ON_DEMAND, queue_limit=1000),
                deployment(
                    "small@1",
                    gib=small_gib,
                    idle_bytes=int(small_idle_gib * GiB),
                    concurrency=8,
                    residency=Residency.LOAD_ON_DEMAND,
                    queue_limit=1000,
                ),
            ],
            tenants=[tenant("t"), tenant("u")],
            queues=levels(bound) if queues else [],
        ),
    )
    resident(s, "small@1", "n/0", small_idle_gib, residency=Residency.LOAD_ON_DEMAND)
    observe(s, "n/0", managed_gib=small_idle_gib, loaded=["small@1@n/0"])
    for n in range(8):
        submit(s, f"s-{n}", "small@1", "background", NOW)
    apply_decisions(s, decide(s, NOW), NOW, {})
    assert len(s.leases) == 8
    submit(s, "big", "big@1", "background", NOW + 1, tenant_name="u")
    return s


def submit(s: PoolState, request_id: str, capability: str, priority: str, at: float, tenant_name: str = "t") -> None:
    request = ask(request_id, capability, tenant_name=tenant_name, priority=priority, lease_timeout_s=7200)  # type: ignore[arg-type]
    _, resolved = validate_request(s, request)
    enqueue(s, request, resolved, at)


def stream(s: PoolState, steps: int, priority: str = "background") -> list[tuple[float, Decisions]]:
    """Every STEP_S one small lease ends and another small request arrives; every decision."""
    trace = []
    for k in range(1, steps + 1):
        at = NOW + 1 + k * STEP_S
        oldest = min(s.leases.values(), key=lambda lease: lease.granted_at, default=None)
        if oldest is not None and oldest.capability == "small@1":
            release_lease(s, oldest.lease_id, at, "ok")
        submit(s, f"s{k}", "small@1", priority, at)
        managed = sum(r.bytes for r in s.residents.values()) / GiB
        observe(s, "n/0", managed_gib=managed, loaded=list(s.residents), at=at)
        decisions = decide(s, at)
        trace.append((at, decisions))
        apply_decisions(s, decisions, at, {})
        for key in [k for k, r in s.residents.items() if r.phase == ResidentPhase.UNLOADING]:
            resident_unloaded(s, key, True, "")
        if any(load.for_requests == ["big"] for load in decisions.loads):
            break
    return trace


def big_served_after(trace: list[tuple[float, Decisions]]) -> float | None:
    for at, decisions in trace:
        if any(load.for_requests == ["big"] for load in decisions.loads):
            return at - (NOW + 1)
    return None


def waits_of(decisions: Decisions, request_id: str) -> list[str]:
    return [w.reason for w in decisions.waits if w.request_id == request_id]


@pytest.mark.parametrize(
    ("small_gib", "small_idle_gib", "what_is_kept"),
    [
        # Each small lease adds 2 GiB: the next small request takes the 2 GiB the last one gave
        # back, so the card never has the big model's 10 GiB free (5 free, 7 for a moment).
        (4, 2, "lease bytes"),
        # The small model holds 14 GiB and its leases add nothing: its slots never all empty, so
        # it is never idle and never unloaded for the big one (9 free).
        (14, 14, "a busy resident"),
    ],
)
@pytest.mark.parametrize("bound", [None, BOUND_S])
def test_a_large_request_overtaken_by_a_stream_of_small_ones_is_served_within_the_bound(
    small_gib: float, small_idle_gib: float, what_is_kept: str, bound: float | None
) -> None:
    s = pool(small_gib, small_idle_gib, bound)
    trace = stream(s, steps=200)  # 2,000 s
    served_after = big_served_after(trace)
    if bound is None:
        assert served_after is None, f"{what_is_kept}: without a bound it waits forever"
        return
    assert served_after is not None, what_is_kept
    # A few steps past the bound: the small leases drain, then the big model loads (after the
    # idle small model is unloaded where it held the bytes).
    assert BOUND_S <= served_after <= BOUND_S + 12 * STEP_S, served_after
    past = [d for at, d in trace if at - (NOW + 1) >= BOUND_S]
    [first] = waits_of(past[0], "big")
    assert "starved: waited 300 s, past its class's starvation bound: reserved n/0" in first
    refused = [r for d in past for r in d.waits if r.request_id.startswith("s")]
    assert refused and "n/0: starved: big waits past its class's starvation bound" in refused[0].reason
    if what_is_kept == "a busy resident":
        assert any(u.resident_key == "small@1@n/0" for d in past for u in d.unloads)


def test_production_still_overtakes_a_reserved_lower_class_request() -> None:
    """Class order is unchanged: production requests are placed before the starving background
    request in every pass, so they keep joining the small model and taking the bytes it gives
    back, while the big background request waits with its reservation."""
    s = pool(4, 2, BOUND_S)
    trace = stream(s, steps=100, priority="production")
    assert big_served_after(trace) is None
    past = [d for at, d in trace if at - (NOW + 1) >= BOUND_S]
    assert past
    for decisions in past:
        assert [g.request_id for g in decisions.grants if g.request_id.startswith("s")], "production is granted"
    reasons = [reason for d in past for reason in waits_of(d, "big")]
    assert reasons and all("past its class's starvation bound: reserved n/0" in r for r in reasons)


def test_no_bound_decides_exactly_as_the_built_in_classes() -> None:
    """Off (the default): every decision is what a catalog without the setting gets."""
    off = stream(pool(4, 2, None), steps=60)
    built_in = stream(pool(4, 2, None, queues=False), steps=60)
    assert [d for _, d in off] == [d for _, d in built_in]


def test_below_the_bound_nothing_is_reserved() -> None:
    s = pool(4, 2, BOUND_S)
    for _, decisions in stream(s, steps=int(BOUND_S / STEP_S) - 1):
        assert all("starved" not in w.reason for w in decisions.waits)


LEVEL = {"name": "low", "priority": 10}


@pytest.mark.parametrize(
    ("bound", "fragment"),
    [
        (0, "greater than 0"),
        (-60, "greater than 0"),
        (float("inf"), "finite number"),
        (float("nan"), "finite number"),
        (10 * 24 * 3600, "less than or equal to 604800"),
        ("soon", "'soon'"),
    ],
)
def test_a_bad_starvation_bound_is_a_catalog_error_naming_the_field(bound: object, fragment: str) -> None:
    data = {"queues": [{"name": "default", "levels": [{**LEVEL, "starvation_bound_s": bound}]}]}
    with pytest.raises(CatalogError) as raised:
        parse_catalog(data)
    assert "queues.0.levels.0.starvation_bound_s" in raised.value.message
    assert fragment in raised.value.message
    assert raised.value.failure.value == "REQUEST_INVALID"


def test_the_bound_reads_into_the_class() -> None:
    data = {
        "queues": [{"name": "default", "levels": [{**LEVEL, "starvation_bound_s": 900}, {"name": "x", "priority": 5}]}]
    }
    catalog, _ = parse_catalog(data)
    assert catalog.classes["low"].starvation_bound_s == 900.0
    assert catalog.classes["x"].starvation_bound_s is None
