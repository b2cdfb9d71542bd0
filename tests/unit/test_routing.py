"""Routing a capability to a pool (the route view in modelforge/policy/_route.py, the asking in
modelforge/routing.py): the choice as a table, each pool's answer from its scheduler state, the
client-side cache, and a gang never spanning pools."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any, cast

import pytest
from temporalio.client import Client
from temporalio.converter import DataConverter

from modelforge import _fastcli
from modelforge.domain import Catalog, Priority, Residency
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.policy import (
    LENT_SEEN_S,
    SYNC_LATE_S,
    PolicyConfig,
    PoolState,
    PoolStatus,
    ResidentPhase,
    RouteInfo,
    RouteQuery,
    SlotSync,
    choose_pool,
    decide,
    enqueue,
    merge_statuses,
    route_info,
    sync_slots,
    validate_request,
)
from modelforge.routing import PoolRouter
from tests.builders import NOW, ask, deployment, gpu, observe, resident, state


def info(pool: str, **kw: Any) -> RouteInfo:
    kw.setdefault("known", True)
    kw.setdefault("serves", True)
    return RouteInfo(pool=pool, **kw)


@pytest.mark.parametrize(
    ("infos", "chosen"),
    [
        # Warm with a free slot beats warm and busy, which beats room to load, whatever the queues.
        ([info("a", warm=1, free_slots=0, queued=0), info("b", warm=1, free_slots=2, queued=9)], "b"),
        ([info("a", room=True), info("b", warm=1, free_slots=0, queued=3)], "b"),
        ([info("a", room=True, queued=5), info("b", queued=0)], "a"),
        # Neither warm nor room: the fewest queued for the capability, then in the whole pool.
        ([info("a", queued=3), info("b", queued=1)], "b"),
        ([info("a", queued=1, queue_depth=9), info("b", queued=1, queue_depth=2)], "b"),
        # Ties by name.
        ([info("b", warm=1, free_slots=1), info("a", warm=1, free_slots=4)], "a"),
        ([info("b"), info("a")], "a"),
        # Only the pools that serve it count, however good the others look.
        ([info("a", serves=False, known=False, warm=3, free_slots=3), info("b", queued=7)], "b"),
        # Known but not for this class (production on a lab pool): the scheduler says why.
        ([info("a", serves=False), RouteInfo(pool="b")], "a"),
        # Nobody knows it; a pool still loading its catalog may: admission waits for it.
        ([RouteInfo(pool="a"), RouteInfo(pool="b", ready=False)], "b"),
        # Nobody serves it.
        ([RouteInfo(pool="a"), RouteInfo(pool="b")], None),
        ([], None),
    ],
)
def test_the_choice(infos: list[RouteInfo], chosen: str | None) -> None:
    assert choose_pool(infos) == chosen


def two_pools() -> PoolState:
    """pool-a: a/0; pool-b: b/0 (not production eligible) and b/1. x@1 placed on a/0 only, y@1 on
    b/0 only, z@1 anywhere; pool-b is the state's own pool."""
    s = state(
        [gpu("a/0", pool="pool-a"), gpu("b/0", pool="pool-b", production=False), gpu("b/1", pool="pool-b")],
        [
            deployment("x@1", gib=4, accelerators=["a/0"]),
            deployment("y@1", gib=4, accelerators=["b/0"], concurrency=2),
            deployment("z@1", gib=4, concurrency=2),
        ],
    )
    s.pool = "pool-b"
    for card in ("a/0", "b/0", "b/1"):
        observe(s, card)
    return s


def test_a_pool_serves_what_may_be_placed_on_its_cards() -> None:
    s = two_pools()
    assert route_info(s, RouteQuery("x@1", "t"), NOW) == RouteInfo(pool="pool-b")  # a/0 only
    assert route_info(s, RouteQuery("nothing@1", "t"), NOW) == RouteInfo(pool="pool-b")
    y = route_info(s, RouteQuery("y@1", "t"), NOW)
    assert (y.known, y.serves, y.warm, y.room) == (True, True, 0, True)
    # Production may not use b/0: pool-b knows y@1 but cannot serve it for production.
    production = route_info(s, RouteQuery("y@1", "t", Priority.PRODUCTION.value), NOW)
    assert (production.known, production.serves) == (True, False)
    assert route_info(s, RouteQuery("z@1", "t", Priority.PRODUCTION.value), NOW).serves  # on b/1
    assert route_info(s, RouteQuery("y@1", "t"), NOW, ready=False) == RouteInfo(pool="pool-b", ready=False)


def test_a_pool_reports_warm_instances_free_slots_room_and_queue() -> None:
    s = two_pools()
    resident(s, "y@1", "b/0", 4, leases=1)
    observe(s, "b/0", managed_gib=4, loaded=["y@1@b/0"])
    y = route_info(s, RouteQuery("y@1", "t"), NOW)
    assert (y.warm, y.free_slots) == (1, 1)
    # Both slots taken: warm, no free slot; room is looked at (b/0 has 24 - 1 - 4 - 4 free).
    s.residents["y@1@b/0"].active_leases = 2
    y = route_info(s, RouteQuery("y@1", "t"), NOW)
    assert (y.warm, y.free_slots, y.room) == (1, 0, True)
    # Loading is not warm.
    s.residents["y@1@b/0"].phase = ResidentPhase.LOADING
    assert route_info(s, RouteQuery("y@1", "t"), NOW).warm == 0
    s.residents["y@1@b/0"].phase = ResidentPhase.READY
    # A stale card's instance takes no new lease: not warm, and no room there either.
    later = NOW + s.config.freshness_s + 1
    y = route_info(s, RouteQuery("y@1", "t"), later)
    assert (y.warm, y.room) == (0, False)
    # No room: 24 - 1 reserve - 20 of someone else's model leaves 3 GiB, short of y's 4.
    s2 = two_pools()
    resident(s2, "z@1", "b/0", 20, residency=Residency.ALWAYS_WARM)
    observe(s2, "b/0", managed_gib=20, loaded=["z@1@b/0"])
    assert route_info(s2, RouteQuery("y@1", "t"), NOW).room is False
    enqueue(s2, ask("q1", "y@1"), "interactive", NOW)
    enqueue(s2, ask("q2", "z@1"), "interactive", NOW)
    y = route_info(s2, RouteQuery("y@1", "t"), NOW)
    assert (y.queued, y.queue_depth) == (1, 2)


def test_the_warm_node_is_one_with_a_ready_instance_preferring_lent_slots_then_free_ones() -> None:
    """`RouteInfo.node`: where a client with no route of its own starts a warm request."""
    s = state(
        [gpu("n1/0"), gpu("n2/0"), gpu("n3/0")],
        [deployment("w@1", gib=2, concurrency=4), deployment("other@1", gib=2)],
    )
    for card in ("n1/0", "n2/0", "n3/0"):
        observe(s, card)
    assert route_info(s, RouteQuery("w@1", "t"), NOW).node == ""  # nothing loaded: no node
    resident(s, "w@1", "n3/0", 2, phase=ResidentPhase.LOADING)
    resident(s, "other@1", "n1/0", 2)
    assert route_info(s, RouteQuery("w@1", "t"), NOW).node == ""  # loading, or another model
    busy = resident(s, "w@1", "n1/0", 2, leases=4)
    assert route_info(s, RouteQuery("w@1", "t"), NOW).node == "n1"  # warm, if busy
    resident(s, "w@1", "n2/0", 2, leases=1)
    assert route_info(s, RouteQuery("w@1", "t"), NOW).node == "n2"  # a free slot beats none
    # n1 is lent two slots (warm-path delegation): its worker admits the request itself.
    busy.active_leases = 2
    reply, _ = sync_slots(s, SlotSync(node="n1", boot="b1", wanted=["w@1"]), NOW)
    assert len(reply.lent) == 1  # 4 - 2 in use - 1 kept back
    assert route_info(s, RouteQuery("w@1", "t"), NOW).node == "n1"
    # A node that stopped vouching for its slots (its worker gone quiet) is not preferred for them.
    assert route_info(s, RouteQuery("w@1", "t"), NOW + LENT_SEEN_S + 1).node == "n2"
    # Slots closed (no new request on them) do not count either.
    for slot in s.slots.values():
        slot.open = False
    assert route_info(s, RouteQuery("w@1", "t"), NOW).node == "n2"
    # A stale card, or a draining instance, takes no new lease: not a node to send requests to.
    s.draining["w@1@n2/0"] = NOW
    assert route_info(s, RouteQuery("w@1", "t"), NOW).node == "n1"
    later = NOW + s.config.freshness_s + 1
    assert route_info(s, RouteQuery("w@1", "t"), later).node == ""


@pytest.mark.parametrize(
    ("within_s", "quiet_s", "preferred"),
    [
        # MODELFORGE_DELEGATION_SYNC_S = 2: an idle node may wait 8 s between syncs, and its slots
        # stay its own: it is still the node to start a warm request on 8.5 s after it vouched.
        (8.0, 8.5, True),
        (8.0, 8.0 + SYNC_LATE_S + 0.5, False),  # later than it said, and a moment more: gone quiet
        # The default pace (1 s, up to 4 s idle): as before, about 5 s.
        (4.0, 4.5, True),
        (4.0, 6.0, False),
        # A node of a release that does not say: LENT_SEEN_S.
        (0.0, LENT_SEEN_S - 0.5, True),
        (0.0, LENT_SEEN_S + 0.5, False),
        # Nonsense said (not finite, negative): read as not said. Past the slots' validity: capped.
        (float("nan"), LENT_SEEN_S + 0.5, False),
        (-3.0, LENT_SEEN_S - 0.5, True),
        (1e9, 29.0, True),
        (1e9, 30.0 + SYNC_LATE_S + 0.5, False),  # stale_lease_s / 2 = 30 s: the slots' validity
    ],
)
def test_a_nodes_lent_slots_count_for_routing_as_long_as_it_said_it_may_stay_silent(
    within_s: float, quiet_s: float, preferred: bool
) -> None:
    # Cards reported on for longer than the test looks (freshness_s): only the slots' vouch ages.
    config = PolicyConfig(freshness_s=3600.0, stale_lease_s=60.0)
    s = state([gpu("n1/0"), gpu("n2/0")], [deployment("w@1", gib=2, concurrency=4)], config=config)
    for card in ("n1/0", "n2/0"):
        observe(s, card)
    resident(s, "w@1", "n1/0", 2)
    resident(s, "w@1", "n2/0", 2, leases=1)  # warm, one slot in use: the other choice
    reply, _ = sync_slots(s, SlotSync(node="n1", boot="b1", wanted=["w@1"], within_s=within_s), NOW)
    assert reply.lent
    # Its next sync vouches for the slots, saying the same.
    sync_slots(s, SlotSync(node="n1", boot="b1", held=[x.lease_id for x in reply.lent], within_s=within_s), NOW + 1)
    later = NOW + 1 + quiet_s
    assert (route_info(s, RouteQuery("w@1", "t"), later).node == "n1") is preferred


def test_route_answers_with_and_without_the_node_stay_readable() -> None:
    """RouteInfo is a payload: a scheduler of an older release answers without `node` (read as
    none), and a client of an older release reads a newer answer, ignoring the field."""
    converter = DataConverter.default.payload_converter
    [old_answer] = converter.to_payloads([{"pool": "p", "known": True, "serves": True, "warm": 1}])
    assert converter.from_payloads([old_answer], [RouteInfo])[0] == RouteInfo(pool="p", known=True, serves=True, warm=1)

    @dataclass(frozen=True)
    class OldRouteInfo:
        pool: str
        warm: int = 0

    [new_answer] = converter.to_payloads([RouteInfo(pool="p", warm=2, node="n1")])
    assert converter.from_payloads([new_answer], [OldRouteInfo])[0] == OldRouteInfo(pool="p", warm=2)
    assert converter.from_payloads([new_answer], [RouteInfo])[0].node == "n1"


def test_a_gang_never_spans_pools() -> None:
    """A 2-card gang: pool-a has one card of its own (the other pool's two are not its to use),
    so it is refused there; in pool-b it lands on b/0 and b/1, never on a/0."""
    accelerators = [gpu("a/0", pool="pool-a"), gpu("b/0", pool="pool-b"), gpu("b/1", pool="pool-b")]
    gang = deployment("gang@1", gib=8, residency=Residency.NONE, idle_bytes=0, gpu_count=2)
    for pool, granted in (("pool-a", None), ("pool-b", ["b/0", "b/1"])):
        s = state(accelerators, [gang])
        s.pool = pool
        for card in ("a/0", "b/0", "b/1"):
            observe(s, card)
        request = ask("g", "gang@1")
        _, priority = validate_request(s, request, gangs=True)
        enqueue(s, request, priority, NOW)
        decisions = decide(s, NOW)
        if granted is None:
            assert not decisions.grants
            [reject] = decisions.rejects
            assert reject.failure == FailureClass.INSUFFICIENT_SCHEDULABLE_VRAM
            assert "the pool has 1" in reject.message
        else:
            [grant] = decisions.grants
            assert sorted(grant.lease.accelerators) == granted


def test_merged_status_sums_queues_and_keeps_every_card() -> None:
    a = PoolStatus(pool="a", now=1.0, queue_depth={"interactive": 1}, active_leases=2, classes=["interactive"])
    b = PoolStatus(pool="b", now=2.0, queue_depth={"interactive": 2, "batch": 1}, active_leases=1, classes=["batch"])
    merged = merge_statuses([a, b])
    assert merged.pool == "a,b" and merged.now == 2.0 and merged.active_leases == 3
    assert merged.queue_depth == {"interactive": 3, "batch": 1} and merged.classes == ["interactive", "batch"]
    assert merge_statuses([a]) is a
    # One pool still loading its catalog: the merged status says so (its admissions answer stale).
    assert not merged.catalog_loading
    assert merge_statuses([a, dataclasses.replace(b, catalog_loading=True)]).catalog_loading


def test_the_fast_paths_merged_status_is_merge_statuses() -> None:
    a = PoolStatus(pool="a", now=1.0, queue_depth={"interactive": 1}, active_leases=2, classes=["interactive"])
    b = PoolStatus(pool="b", now=2.0, queue_depth={"batch": 1}, tenant_leases={"t": 1}, catalog_loading=True)
    for pools in ([a, b], [b, a], [a], [b]):
        merged = _fastcli._merged([dataclasses.asdict(s) for s in pools])
        assert merged == dataclasses.asdict(merge_statuses(pools))


class FakeHandle:
    def __init__(self, fake: FakeTemporal, pool: str) -> None:
        self.fake, self.pool = fake, pool

    async def query(self, name: str, query: RouteQuery, **kwargs: Any) -> RouteInfo:
        self.fake.queries.append(self.pool)
        await asyncio.sleep(self.fake.delay_s)
        answer = self.fake.answers[self.pool]
        if isinstance(answer, Exception):
            raise answer
        return answer


class FakeTemporal:
    """The two calls the router makes: visibility's list and a scheduler's `route` query, each
    query answered after `delay_s` (long enough for concurrent callers to share a round)."""

    delay_s = 0.01

    def __init__(self, answers: dict[str, RouteInfo | Exception]) -> None:
        self.answers = answers
        self.queries: list[str] = []
        self.lists = 0

    def get_workflow_handle(self, workflow_id: str) -> FakeHandle:
        return FakeHandle(self, workflow_id.removeprefix("scheduler:"))

    async def list_workflows(self, query: str, **kwargs: Any) -> Any:
        self.lists += 1

        class Execution:
            def __init__(self, id: str) -> None:
                self.id = id

        for pool in self.answers:
            yield Execution(f"scheduler:{pool}")


async def test_the_router_caches_a_choice_briefly_and_shares_one_round() -> None:
    fake = FakeTemporal({"pool-a": info("pool-a"), "pool-b": info("pool-b", warm=1, free_slots=1)})
    now = [0.0]
    router = PoolRouter(cast(Client, fake), clock=lambda: now[0])
    # Ten concurrent requests: one discovery, one query per pool.
    chosen = await asyncio.gather(*(router.choose("z@1", "t") for _ in range(10)))
    assert chosen == ["pool-b"] * 10
    assert sorted(fake.queries) == ["pool-a", "pool-b"] and fake.lists == 1
    now[0] = 0.5  # within a second: the cached answer
    assert await router.choose("z@1", "t") == "pool-b" and len(fake.queries) == 2
    fake.answers["pool-a"] = info("pool-a", warm=1, free_slots=3)
    now[0] = 1.5  # past it: asked again (pool-a wins the tie by name now)
    assert await router.choose("z@1", "t") == "pool-a" and len(fake.queries) == 4
    assert fake.lists == 1  # the pools are read again only after 30 s
    now[0] = 31.0
    await router.choose("z@1", "t")
    assert fake.lists == 2


async def test_the_router_says_which_capability_no_pool_serves() -> None:
    fake = FakeTemporal({"pool-a": RouteInfo(pool="pool-a"), "pool-b": RouteInfo(pool="pool-b")})
    with pytest.raises(ModelForgeError) as raised:
        await PoolRouter(cast(Client, fake)).choose("nothing@1")
    assert raised.value.failure == FailureClass.CAPABILITY_UNAVAILABLE
    assert "nothing@1" in raised.value.message and "pool-a, pool-b" in raised.value.message


async def test_one_pool_is_never_asked_and_a_silent_pool_is_asked_last() -> None:
    single = FakeTemporal({"default": RouteInfo(pool="default")})
    assert await PoolRouter(cast(Client, single)).choose("anything@1") == "default"
    assert single.queries == []
    from temporalio.service import RPCError, RPCStatusCode

    fake = FakeTemporal(
        {"pool-a": RPCError("deadline", RPCStatusCode.DEADLINE_EXCEEDED, b""), "pool-b": info("pool-b")}
    )
    router = PoolRouter(cast(Client, fake), route_ttl_s=0)
    assert await router.choose("z@1") == "pool-b"
    assert sorted(fake.queries) == ["pool-a", "pool-b"]
    fake.queries.clear()
    assert await router.choose("z@1") == "pool-b"
    assert fake.queries == ["pool-b"]  # pool-a was silent: not waited for while pool-b serves
    fake.answers["pool-b"] = RouteInfo(pool="pool-b")
    fake.queries.clear()
    # Asked at last, and it still does not answer: a router without a catalog cannot tell that
    # pool-a serves z@1, so the refusal names the pool that did not answer (with a catalog, the
    # catalog decides: below).
    with pytest.raises(ModelForgeError) as raised:
        await router.choose("z@1")
    assert fake.queries == ["pool-b", "pool-a"]
    assert "pool pool-a did not answer" in raised.value.message


class SlowHandle(FakeHandle):
    """A scheduler whose worker is busy or whose Temporal restarts: the route query is answered
    after `delay` seconds, so past the router's rpc_timeout it ends as the SDK ends it."""

    async def query(self, name: str, query: RouteQuery, **kwargs: Any) -> RouteInfo:
        from temporalio.service import RPCError, RPCStatusCode

        delay = cast(SlowTemporal, self.fake).delays.get(self.pool, 0.0)
        if delay > kwargs["rpc_timeout"].total_seconds():
            self.fake.queries.append(self.pool)
            await asyncio.sleep(kwargs["rpc_timeout"].total_seconds())
            raise RPCError("Timeout expired", RPCStatusCode.DEADLINE_EXCEEDED, b"")
        await asyncio.sleep(delay)
        return await super().query(name, query, **kwargs)


class SlowTemporal(FakeTemporal):
    def __init__(self, answers: dict[str, RouteInfo | Exception], delays: dict[str, float]) -> None:
        super().__init__(answers)
        self.delays = delays

    def get_workflow_handle(self, workflow_id: str) -> FakeHandle:
        return SlowHandle(self, workflow_id.removeprefix("scheduler:"))


def three_pools_catalog() -> Catalog:
    """x@1 may be placed on pool-c's card only; y@1 nowhere a pool has (no card of its list)."""
    return Catalog(
        accelerators=[gpu("a/0", pool="pool-a"), gpu("b/0", pool="pool-b"), gpu("c/0", pool="pool-c")],
        deployments=[deployment("x@1", accelerators=["c/0"]), deployment("y@1", accelerators=["gone/0"])],
    )


async def test_a_slow_scheduler_of_the_pool_that_serves_it_is_not_read_as_no_pool() -> None:
    """A scheduler slow to answer (a catalog apply, a Temporal restart) made
    the router refuse at once with 'no pool serves capability' although its pool serves it. The
    request now goes to the pool the catalog places it in, and waits in its admission."""
    reads = [0]

    async def catalog() -> Catalog:
        reads[0] += 1
        return three_pools_catalog()

    # pool-c serves x@1 but its scheduler does not answer in time; pool-a does not answer either
    # (and would win by name); pool-b answers that it does not know x@1.
    fake = SlowTemporal(
        {"pool-a": RouteInfo(pool="pool-a"), "pool-b": RouteInfo(pool="pool-b"), "pool-c": info("pool-c")},
        delays={"pool-a": 5.0, "pool-c": 5.0},
    )
    router = PoolRouter(cast(Client, fake), query_timeout_s=0.05, route_ttl_s=0, catalog=catalog)
    assert await router.choose("x@1", "t") == "pool-c"
    assert sorted(fake.queries) == ["pool-a", "pool-b", "pool-c"]
    # Again while both are silent (asked last): still pool-c, the catalog read once meanwhile.
    assert await router.choose("x@1", "t") == "pool-c" and reads[0] == 1
    # A capability the catalog places in no pool is still refused, named: that is the truth.
    for nothing in ("y@1", "nothing@1"):
        with pytest.raises(ModelForgeError) as raised:
            await router.choose(nothing, "t")
        assert raised.value.failure == FailureClass.CAPABILITY_UNAVAILABLE
        assert f"no pool serves capability '{nothing}'" in raised.value.message
    # The scheduler answers again: its answer routes, as before.
    fake.delays.clear()
    router._silent_until.clear()
    fake.answers["pool-a"] = info("pool-a", warm=1, free_slots=1)
    assert await router.choose("x@1", "t") == "pool-a"


async def test_schedulers_still_on_the_old_catalog_do_not_refuse_what_the_catalog_serves() -> None:
    """Just after `catalog apply` added x@1, every scheduler answers from its old catalog until it
    has reloaded: the catalog's pool takes the request (its admission retries while stale)."""

    async def catalog() -> Catalog:
        return three_pools_catalog()

    fake = FakeTemporal({pool: RouteInfo(pool=pool) for pool in ("pool-a", "pool-b", "pool-c")})
    assert await PoolRouter(cast(Client, fake), catalog=catalog).choose("x@1", "t") == "pool-c"
    # Without a catalog to read, every scheduler's word is all there is: no pool serves it.
    with pytest.raises(ModelForgeError):
        await PoolRouter(cast(Client, fake)).choose("x@1", "t")

    async def unreadable() -> Catalog:
        raise OSError("the store is down")

    # A catalog that cannot be read decides nothing: the schedulers' answers stand.
    with pytest.raises(ModelForgeError):
        await PoolRouter(cast(Client, fake), catalog=unreadable).choose("x@1", "t")


async def test_the_warm_node_of_one_pool_is_asked_once_a_second_and_never_waited_on_twice() -> None:
    fake = FakeTemporal({"default": RouteInfo(pool="default", known=True, serves=True, warm=1, node="n1")})
    now = [0.0]
    router = PoolRouter(cast(Client, fake), clock=lambda: now[0])
    # Ten first requests at once: one query, one answer for all.
    nodes = await asyncio.gather(*(router.warm_node("default", "w@1", "t") for _ in range(10)))
    assert nodes == ["n1"] * 10 and fake.queries == ["default"]
    now[0] = 0.5
    assert await router.warm_node("default", "w@1", "t") == "n1" and len(fake.queries) == 1
    router.forget("w@1")  # a failed request: asked again
    assert await router.warm_node("default", "w@1", "t") == "n1" and len(fake.queries) == 2
    # A scheduler that does not answer: no node, and not asked again for a while.
    from temporalio.service import RPCError, RPCStatusCode

    fake.answers["default"] = RPCError("deadline", RPCStatusCode.DEADLINE_EXCEEDED, b"")
    now[0] = 2.0
    assert await router.warm_node("default", "w@1", "t") == ""
    assert await router.warm_node("default", "w@1", "t") == "" and len(fake.queries) == 3
    # Several pools: the node comes with the round that chose the pool (no query of its own).
    two = FakeTemporal({"pool-a": info("pool-a"), "pool-b": info("pool-b", warm=1, free_slots=1, node="n9")})
    routed = PoolRouter(cast(Client, two))
    assert await routed.choose("z@1", "t") == "pool-b"
    assert await routed.warm_node("pool-b", "z@1", "t") == "n9" and len(two.queries) == 2


async def test_a_long_lived_router_forgets_expired_answers() -> None:
    """The gateway's router lives for weeks and sees many tenant and class pairs: what it keeps
    is what was asked within about two route TTLs, not everything it was ever asked."""
    fake = FakeTemporal({"pool-a": info("pool-a", warm=1, node="n1"), "pool-b": info("pool-b")})
    now = [0.0]
    router = PoolRouter(cast(Client, fake), clock=lambda: now[0])
    single = FakeTemporal({"default": RouteInfo(pool="default", known=True, serves=True, warm=1, node="n1")})
    bound = PoolRouter(cast(Client, single), clock=lambda: now[0])
    fake.delay_s = single.delay_s = 0.0  # 2,400 rounds: what is kept matters here, not when
    for second in range(600):
        now[0] = float(second)
        for tenant in (f"tenant-{second}-a", f"tenant-{second}-b"):
            assert await router.choose("z@1", tenant) == "pool-a"
            assert await bound.warm_node("default", "w@1", tenant) == "n1"
    assert len(router._routes) <= 6, len(router._routes)
    assert len(bound._nodes) <= 6, len(bound._nodes)


async def test_a_caller_that_gives_up_does_not_cancel_the_others_answer() -> None:
    fake = FakeTemporal({"pool-a": info("pool-a"), "pool-b": info("pool-b", warm=1, free_slots=1)})
    router = PoolRouter(cast(Client, fake))
    first = asyncio.create_task(router.choose("z@1"))
    second = asyncio.create_task(router.choose("z@1"))
    await asyncio.sleep(0.001)  # both wait on the one round of queries
    first.cancel()
    assert await second == "pool-b"
    with pytest.raises(asyncio.CancelledError):
        await first
    assert sorted(fake.queries) == ["pool-a", "pool-b"]


def test_the_control_worker_command_takes_several_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from modelforge import cli
    from workers import control

    served: list[list[str]] = []

    async def run(settings: object, pools: Any = ()) -> None:
        served.append(list(pools))

    monkeypatch.setattr(control, "run", run)
    monkeypatch.setattr(cli, "_settings", lambda: None)
    runner = CliRunner()
    assert runner.invoke(cli.app, ["worker", "control", "--pool", "pool-a", "--pool", "pool-b"]).exit_code == 0
    assert runner.invoke(cli.app, ["worker", "control"]).exit_code == 0
    assert served == [["pool-a", "pool-b"], []]  # none given: every pool the catalog names
