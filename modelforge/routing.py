"""Pools as shards: which pool a capability's request goes to, when the caller names none.

Each pool has its own scheduler workflow, `scheduler:<pool>`, admitting onto the catalog's
accelerators of that pool only. A pool can serve a capability when it has an accelerator the
deployment may be placed on (its `accelerators` list; empty: any, so every pool). The client
asks each candidate pool's scheduler (the `route` query, answered by `route_info` from its
state) and takes the best by `route_key`: warm with a free slot, then warm, then room to load,
then the fewest requests queued; ties by name.

The pools that exist come from an explicit list (`MODELFORGE_POOLS`, comma-separated) or from
the running schedulers (Temporal visibility), cached for `POOLS_TTL_S`. A capability's choice is
cached for `ROUTE_TTL_S`, so a stream of warm requests pays one round of queries a second, not
one per request. With a single pool there is nothing to choose and nothing is asked for it.

The answer also names the pool's warm node for the capability (`RouteInfo.node`), where a client
with no route of its own starts the request (its worker admits it on a slot lent to it). With a
single pool, or a client bound to one, that is one query of its own (`warm_node`), asked only for
such requests (a new client's first, and after a request with no node route).

"No pool serves it" (CAPABILITY_UNAVAILABLE, no workflow started) is said only when the
schedulers' answers are the catalog's word: a scheduler slow to answer (a Temporal restart, a
busy worker) or still on its old catalog (just after `catalog apply`) once made the gateway
refuse at once what a pool serves. When no answer places the capability, the catalog
decides (`catalog=`, the gateway's store); a client without one refuses, naming the pools that
did not answer (the default pool takes it when no scheduler answered at all).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from modelforge.domain import Catalog
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.identifiers import shown
from modelforge.logging import get_logger
from modelforge.policy import PoolState, PoolStatus, ResidentPhase
from modelforge.policy._budget import budget_from_sums
from modelforge.policy._delegation import holder_id
from modelforge.policy._pass import static_filter, static_reason
from modelforge.policy._state import holder_of
from modelforge.settings import DEFAULT_POOL

if TYPE_CHECKING:
    from temporalio.client import Client

log = get_logger("modelforge.routing")

SCHEDULER_PREFIX = "scheduler:"
# The running pool schedulers, from Temporal visibility.
RUNNING_SCHEDULERS = "WorkflowType='PoolSchedulerWorkflow' AND ExecutionStatus='Running'"
POOLS_TTL_S = 30.0
ROUTE_TTL_S = 1.0
# A pool whose scheduler does not answer the route query within this long is left out this time.
QUERY_TIMEOUT_S = 5.0
# ...and is asked only after the others, for this long.
SILENT_S = 10.0
# The catalog a router reads when no scheduler's answer places a capability is kept this long.
CATALOG_TTL_S = 5.0
# The route query a client sends for the warm node alone (one pool: no pool to choose) waits
# this long at most; unanswered, the request starts on the control queue as before.
NODE_QUERY_TIMEOUT_S = 1.0
# A node holding lent slots says in each sync the longest it may wait before the next (its idle
# back-off's ceiling, 4 s at MODELFORGE_DELEGATION_SYNC_S's default of 1 s); slots not vouched
# for within that and SYNC_LATE_S more (a worker gone quiet) do not make its node the preferred
# one. LENT_SEEN_S: the window for a node that does not say (a release before it did).
LENT_SEEN_S = 5.0
SYNC_LATE_S = 1.0


@dataclass(frozen=True)
class RouteQuery:
    capability: str
    tenant: str = "default"
    # The class asked for (None: the tenant's default): production work needs production cards.
    priority: str | None = None


@dataclass(frozen=True)
class RouteInfo:
    """One pool's answer to `route`: how well it can serve the capability now."""

    pool: str
    # The catalog is loaded (a fresh scheduler reads it first; until then it knows nothing).
    ready: bool = True
    # The pool has an accelerator the deployment may be placed on (whatever the class).
    known: bool = False
    # ...and one the request's class may use (production: production-eligible, measured).
    serves: bool = False
    # Ready instances of the deployment on usable cards, and their free concurrency slots.
    warm: int = 0
    free_slots: int = 0
    # A fresh, healthy card it may use has schedulable bytes for another instance.
    room: bool = False
    # Requests waiting in the pool for this capability, and in all.
    queued: int = 0
    queue_depth: int = 0
    # The node that should take a warm request of the capability ("" when none): one with a
    # ready instance on a fresh card, preferring open slots lent to it (warm-path delegation: its
    # worker admits the request itself), then free concurrency. A client with no route of its
    # own starts the request on that node's task queue. Answers of schedulers before it have none.
    node: str = ""


def _production(catalog: Catalog, tenant: str, priority: str | None) -> bool:
    """Whether the request's class follows the production rules (as far as the route needs to
    know: the scheduler resolves the class for real, and refuses what is wrong with it)."""
    known = catalog.tenant(tenant)
    asked = priority or (known.default_priority if known is not None else "")
    klass = catalog.priority_class(asked)
    if klass is None:
        klass = next((k for k in catalog.classes.values() if k.level == asked), None)
    return klass is not None and klass.production


def route_info(state: PoolState, query: RouteQuery, now: float, *, ready: bool = True) -> RouteInfo:
    """The scheduler's `route` query: one walk over the pool's residents, leases and queue."""
    pool = state.pool
    if not ready:
        return RouteInfo(pool=pool, ready=False)
    deployment = state.catalog.deployment_for(query.capability)
    if deployment is None:
        return RouteInfo(pool=pool)
    if not static_filter(state, deployment, False)[0]:
        return RouteInfo(pool=pool)
    production = _production(state.catalog, query.tenant, query.priority)
    usable = set(static_filter(state, deployment, production)[0])
    queued = sum(1 for q in state.queue if q.capability == query.capability)
    if not usable:
        return RouteInfo(pool=pool, known=True, queued=queued, queue_depth=len(state.queue))
    freshness = state.config.freshness_s

    def fresh(accelerator: str) -> bool:
        runtime = state.accelerators.get(accelerator)
        return (
            runtime is not None
            and runtime.healthy
            and runtime.observation is not None
            and now - runtime.observation.received_at <= freshness
        )

    warm = free = 0
    resident_sum: dict[str, int] = {}
    # The best node for a warm request so far, by `_node_key`.
    best: tuple[bool, bool, int, str] | None = None
    lent: dict[str, int] | None = None
    for resident in state.residents.values():
        resident_sum[resident.accelerator] = resident_sum.get(resident.accelerator, 0) + resident.bytes
        if (
            resident.deployment == deployment.deployment_id
            and resident.phase == ResidentPhase.READY
            and resident.accelerator in usable
            and fresh(resident.accelerator)
        ):
            warm += 1
            spare = max(0, deployment.concurrency - resident.active_leases)
            free += spare
            if resident.key in state.draining:
                continue  # takes no new lease: no node to send requests to
            if lent is None:
                lent = _open_lent_slots(state, now)
            key = _node_key(resident.node, lent.get(resident.key, 0), spare)
            best = key if best is None or key < best else best
    room = False
    if not free:  # the choice never looks at room when a slot is free
        leased_sum: dict[str, int] = {}
        for lease in state.leases.values():
            for accelerator_id in lease.accelerators:
                leased_sum[accelerator_id] = leased_sum.get(accelerator_id, 0) + lease.bytes
        cards = 0
        for accelerator in state.catalog.accelerators:
            if accelerator.id not in usable or not fresh(accelerator.id):
                continue
            budget = budget_from_sums(
                accelerator,
                state.accelerators[accelerator.id],
                resident_sum.get(accelerator.id, 0),
                leased_sum.get(accelerator.id, 0),
                state.config,
                now,
            )
            if budget.schedulable_bytes >= deployment.envelope_bytes:
                cards += 1
                if cards >= max(1, deployment.gpu_count):
                    room = True
                    break
    return RouteInfo(
        pool=pool,
        known=True,
        serves=True,
        warm=warm,
        free_slots=free,
        room=room,
        queued=queued,
        queue_depth=len(state.queue),
        node=best[-1] if best is not None else "",
    )


def _open_lent_slots(state: PoolState, now: float) -> dict[str, int]:
    """Resident key -> slots lent to its node that are open and free (held by the node, not by a
    request), of nodes that vouched for them within the time they said (LENT_SEEN_S if unsaid)."""
    counts: dict[str, int] = {}
    for lease_id, slot in state.slots.items():
        lease = state.leases.get(lease_id)
        if (
            lease is not None
            and slot.open
            and lease.workflow_id == holder_id(slot.node)
            and now - state.lease_seen.get(lease_id, -math.inf) <= _vouch_window(slot.within_s)
            and holder_of(state, lease) is not None  # a slot of a resident's earlier life serves none
        ):
            counts[lease.resident_key] = counts.get(lease.resident_key, 0) + 1
    return counts


def _vouch_window(within_s: float) -> float:
    return within_s + SYNC_LATE_S if within_s > 0 else LENT_SEEN_S


def _node_key(node: str, lent: int, spare: int) -> tuple[bool, bool, int, str]:
    """Smaller is better: open lent slots, then free concurrency, then the most of both, by name."""
    return (not lent, not spare, -(lent + spare), node)


def route_key(info: RouteInfo) -> tuple[bool, bool, bool, int, int, str]:
    """Smaller is better: warm with a free slot, warm, room to load, fewest queued, by name."""
    return (
        not (info.warm and info.free_slots > 0),
        not info.warm,
        not info.room,
        info.queued,
        info.queue_depth,
        info.pool,
    )


def choose_pool(infos: Sequence[RouteInfo]) -> str | None:
    """The pool for the request, or None when no pool serves the capability. Pools that serve it
    for the request's class first; else one that knows it (its scheduler then says why the class
    cannot have it, card by card); else a pool still loading its catalog (the admission retries
    until it has it)."""
    for eligible in (
        [i for i in infos if i.serves],
        [i for i in infos if i.known],
    ):
        if eligible:
            return min(eligible, key=route_key).pool
    loading = sorted(i.pool for i in infos if not i.ready)
    return loading[0] if loading else None


def catalog_pools(catalog: Catalog, capability: str) -> set[str]:
    """The pools the catalog lets the capability's deployment be placed in (whatever the class:
    its scheduler says card by card why a class cannot have it; a CPU device only when the
    deployment's placement list names it, as the policy's static filter has it)."""
    deployment = catalog.deployment_for(capability)
    if deployment is None:
        return set()
    return {card.pool for card in catalog.accelerators if not static_reason(card, deployment, False)}


def pools_from_env() -> list[str]:
    """MODELFORGE_POOLS: the pools to route among, comma-separated (unset: the running schedulers)."""
    return _names(os.environ.get("MODELFORGE_POOLS", "").split(","))


def _names(names: Sequence[str]) -> list[str]:
    return sorted({name.strip() for name in names if name.strip()})


def merge_statuses(statuses: Sequence[PoolStatus]) -> PoolStatus:
    """Several pools' status as one: every accelerator and resident, queues and leases summed.
    `pool` lists the pools, comma-separated."""
    if len(statuses) == 1:
        return statuses[0]
    depth: dict[str, int] = {}
    classes: list[str] = []
    for status in statuses:
        for name, count in status.queue_depth.items():
            depth[name] = depth.get(name, 0) + count
        classes += [c for c in status.classes if c not in classes]
    return PoolStatus(
        pool=",".join(s.pool for s in statuses),
        now=max((s.now for s in statuses), default=0.0),
        accelerators=[a for s in statuses for a in s.accelerators],
        residents=[r for s in statuses for r in s.residents],
        queue_depth=depth,
        active_leases=sum(s.active_leases for s in statuses),
        capabilities=[c for s in statuses for c in s.capabilities],
        classes=classes,
        lent_slots=sum(s.lent_slots for s in statuses),
        tenant_leases=_summed([s.tenant_leases for s in statuses]),
        tenant_queue_depth={
            tenant: _summed([s.tenant_queue_depth.get(tenant, {}) for s in statuses])
            for tenant in dict.fromkeys(t for s in statuses for t in s.tenant_queue_depth)
        },
    )


def _summed(counts: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for one in counts:
        for name, count in one.items():
            total[name] = total.get(name, 0) + count
    return total


@dataclass
class _Cached:
    pool: str
    until: float
    # The pool's warm node for the capability ("" none), from the same answer.
    node: str = ""


class PoolRouter:
    """The client's side: the pools that exist and each capability's pool, briefly cached.
    `pools`: an explicit list (else the running schedulers, read again every `pools_ttl_s`)."""

    def __init__(
        self,
        client: Client,
        pools: Sequence[str] = (),
        *,
        pools_ttl_s: float = POOLS_TTL_S,
        route_ttl_s: float = ROUTE_TTL_S,
        query_timeout_s: float = QUERY_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        catalog: Callable[[], Awaitable[Catalog]] | None = None,
    ) -> None:
        self.client = client
        # Where the catalog comes from (the gateway's store), read only when no scheduler's
        # answer places a capability (`_catalog_choice`); None: not read.
        self.catalog_source = catalog
        self._catalog: Catalog | None = None
        self._catalog_until = -math.inf
        self.pools_given = _names(pools)
        self.pools_ttl_s = pools_ttl_s
        self.route_ttl_s = route_ttl_s
        self.query_timeout_s = query_timeout_s
        self.clock = clock
        self._pools: list[str] = []
        self._pools_until = -math.inf
        self._pools_lock: asyncio.Lock | None = None
        self._routes: dict[tuple[str, str, str | None], _Cached] = {}
        self._asking: dict[tuple[str, str, str | None], asyncio.Future[str]] = {}
        # The warm node of a pool the client did not ask to choose (one pool, or a bound client):
        # (pool, capability, tenant, class) -> answer, and the rounds under way.
        self._nodes: dict[tuple[str, str, str, str | None], _Cached] = {}
        self._asking_node: dict[tuple[str, str, str, str | None], asyncio.Future[str]] = {}
        # Pools whose scheduler did not answer, until when they are left out of the rounds (a
        # scheduler no worker serves would otherwise cost every round the query timeout).
        self._silent_until: dict[str, float] = {}
        # Expired entries are dropped at most once a route_ttl_s, when an answer is kept: a
        # long-lived client (the gateway) sees many tenant and class pairs over its life.
        self._prune_at = -math.inf

    def _prune(self) -> None:
        now = self.clock()
        if now < self._prune_at:
            return
        self._prune_at = now + self.route_ttl_s
        self._routes = {key: cached for key, cached in self._routes.items() if cached.until > now}
        self._nodes = {key: cached for key, cached in self._nodes.items() if cached.until > now}
        for pool in [p for p, until in self._silent_until.items() if until <= now]:
            del self._silent_until[pool]

    async def pools(self) -> list[str]:
        """The pools to route among: given, or the running schedulers (default when none runs)."""
        if self.pools_given:
            return self.pools_given
        if self.clock() < self._pools_until:
            return self._pools
        if self._pools_lock is None:
            self._pools_lock = asyncio.Lock()
        async with self._pools_lock:
            if self.clock() >= self._pools_until:
                running = await self._running_pools()
                self._pools = running or [DEFAULT_POOL]
                # None running yet (a stack starting): look again soon, not in half a minute.
                self._pools_until = self.clock() + (self.pools_ttl_s if running else min(self.pools_ttl_s, 1.0))
        return self._pools

    async def _running_pools(self) -> list[str]:
        from temporalio.service import RPCError

        found: list[str] = []
        try:
            async for execution in self.client.list_workflows(
                RUNNING_SCHEDULERS, rpc_timeout=timedelta(seconds=self.query_timeout_s)
            ):
                if execution.id.startswith(SCHEDULER_PREFIX):
                    found.append(execution.id.removeprefix(SCHEDULER_PREFIX))
        except RPCError as error:  # no visibility (the time-skipping test server): the default pool
            log.debug("pool_discovery_failed", error=f"{error.status.name}: {error.message}")
        return _names(found)

    def forget(self, capability: str) -> None:
        """Drop a capability's cached choice (its request failed: ask again next time)."""
        for key in [k for k in self._routes if k[0] == capability]:
            del self._routes[key]
        for node_key in [k for k in self._nodes if k[1] == capability]:
            del self._nodes[node_key]

    async def choose(self, capability: str, tenant: str = "default", priority: str | None = None) -> str:
        """The pool for a request; CAPABILITY_UNAVAILABLE when no pool serves the capability.
        Concurrent callers for one capability share one round of queries."""
        pools = await self.pools()
        if len(pools) == 1:
            return pools[0]
        key = (capability, tenant, priority)
        cached = self._routes.get(key)
        if cached is not None and self.clock() < cached.until:
            return cached.pool
        asking = self._asking.get(key)
        if asking is None:
            # A task of its own: a caller that gives up does not cancel the others' answer.
            asking = asyncio.ensure_future(self._ask_and_keep(key, pools, RouteQuery(capability, tenant, priority)))
            self._asking[key] = asking
            asking.add_done_callback(lambda done: self._done_asking(key, done))
        return await asyncio.shield(asking)

    async def _ask_and_keep(self, key: tuple[str, str, str | None], pools: list[str], query: RouteQuery) -> str:
        pool, node = await self._ask(pools, query)
        self._prune()
        self._routes[key] = _Cached(pool, self.clock() + self.route_ttl_s, node)
        return pool

    async def warm_node(self, pool: str, capability: str, tenant: str = "default", priority: str | None = None) -> str:
        """The node of `pool` that should take a warm request of the capability (`RouteInfo.node`),
        or "" when none is, or its scheduler does not answer within NODE_QUERY_TIMEOUT_S (then it
        is not asked again for SILENT_S). The answer of the round that chose the pool when there
        was one; else one query, cached and shared as `choose`'s rounds are."""
        now = self.clock()
        chosen = self._routes.get((capability, tenant, priority))
        if chosen is not None and chosen.pool == pool and now < chosen.until:
            return chosen.node
        key = (pool, capability, tenant, priority)
        cached = self._nodes.get(key)
        if cached is not None and now < cached.until:
            return cached.node
        if self._silent_until.get(pool, -math.inf) > now:
            return ""
        asking = self._asking_node.get(key)
        if asking is None:
            asking = asyncio.ensure_future(self._ask_node(key, RouteQuery(capability, tenant, priority)))
            self._asking_node[key] = asking
            asking.add_done_callback(lambda done: self._done_asking_node(key, done))
        return await asyncio.shield(asking)

    async def _ask_node(self, key: tuple[str, str, str, str | None], query: RouteQuery) -> str:
        pool = key[0]
        answer = await self._route(pool, query, timeout_s=min(self.query_timeout_s, NODE_QUERY_TIMEOUT_S))
        if isinstance(answer, str):
            self._silent_until[pool] = self.clock() + SILENT_S
            return ""
        self._silent_until.pop(pool, None)
        self._prune()
        self._nodes[key] = _Cached(pool, self.clock() + self.route_ttl_s, answer.node)
        return answer.node

    def _done_asking_node(self, key: tuple[str, str, str, str | None], done: asyncio.Future[str]) -> None:
        if self._asking_node.get(key) is done:
            del self._asking_node[key]
        if not done.cancelled():
            done.exception()

    def _done_asking(self, key: tuple[str, str, str | None], done: asyncio.Future[str]) -> None:
        if self._asking.get(key) is done:
            del self._asking[key]
        if not done.cancelled():
            done.exception()  # retrieved: no "never retrieved" warning when every caller left

    async def _ask(self, pools: list[str], query: RouteQuery) -> tuple[str, str]:
        """One round of route queries. Pools that did not answer lately are asked only when the
        others leave no choice (a scheduler no worker serves costs a round the query timeout)."""
        now = self.clock()
        quiet = [pool for pool in pools if self._silent_until.get(pool, -math.inf) > now]
        first = [pool for pool in pools if pool not in quiet]
        answers = dict(zip(first, await asyncio.gather(*(self._route(p, query) for p in first)), strict=True))
        chosen = choose_pool([a for a in answers.values() if isinstance(a, RouteInfo)])
        if chosen is None and quiet:
            answers |= dict(zip(quiet, await asyncio.gather(*(self._route(p, query) for p in quiet)), strict=True))
        for pool, answer in answers.items():
            if isinstance(answer, str):
                self._silent_until[pool] = self.clock() + SILENT_S
            else:
                self._silent_until.pop(pool, None)
        infos = [a for a in answers.values() if isinstance(a, RouteInfo)]
        chosen = chosen or choose_pool(infos)
        if chosen is not None:
            return chosen, next((info.node for info in infos if info.pool == chosen), "")
        silent = {pool: answer for pool, answer in answers.items() if isinstance(answer, str)}
        # No answer names a pool for it. That is "no pool serves it" only when every scheduler
        # answered from the catalog of now: one that is slow (a Temporal restart, a busy worker)
        # says nothing, and one still reloading after a catalog apply answers from the old
        # catalog. The catalog decides then; the request waits in that pool's admission (which
        # retries while its scheduler reloads) rather than being refused at once.
        fallback = await self._catalog_choice(pools, query.capability, silent, bool(infos))
        if fallback is not None:
            log.info("route_by_catalog", capability=query.capability, pool=fallback, silent=sorted(silent))
            return fallback, ""
        detail = "; ".join(f"pool {p} did not answer: {why}" for p, why in sorted(silent.items()))
        raise ModelForgeError(
            FailureClass.CAPABILITY_UNAVAILABLE,
            f"no pool serves capability {shown(query.capability)} (pools: {', '.join(pools)})"
            + (f"; {detail}" if detail else ""),
        )

    async def _catalog_choice(
        self, pools: list[str], capability: str, silent: dict[str, str], answered: bool
    ) -> str | None:
        """The pool to send a request to that no scheduler's answer placed: one the catalog
        places the capability in, the pools that did not answer first (then by name). Without a
        catalog to read, the default pool when no scheduler answered at all. None: no pool
        serves it (as far as this router can tell)."""
        catalog = await self._read_catalog()
        if catalog is None:
            # No catalog to tell: only when no scheduler answered at all (one of a release without
            # the route query, mid-upgrade) is the default pool a fair guess; otherwise the
            # refusal names the pools that did not answer, for the caller to retry.
            return DEFAULT_POOL if not answered and DEFAULT_POOL in silent else None
        placed = catalog_pools(catalog, capability)
        candidates = [pool for pool in pools if pool in placed]
        if not candidates:
            return None
        return min(candidates, key=lambda pool: (pool not in silent, pool))

    async def _read_catalog(self) -> Catalog | None:
        """The catalog as of at most CATALOG_TTL_S ago (the last one read when the store does not
        answer); None without a source or before any read succeeded."""
        if self.catalog_source is None:
            return None
        if self._catalog is None or self.clock() >= self._catalog_until:
            try:
                self._catalog = await self.catalog_source()
                self._catalog_until = self.clock() + CATALOG_TTL_S
            except Exception as error:  # the store is down: the last catalog read, if any
                log.warning("route_catalog_unreadable", error=f"{type(error).__name__}: {error}"[:300])
        return self._catalog

    async def _route(self, pool: str, query: RouteQuery, timeout_s: float | None = None) -> RouteInfo | str:
        """The pool's answer, or why there is none."""
        from temporalio.client import WorkflowQueryFailedError
        from temporalio.service import RPCError

        timeout = timedelta(seconds=self.query_timeout_s if timeout_s is None else timeout_s)
        try:
            info: RouteInfo = await self.client.get_workflow_handle(f"{SCHEDULER_PREFIX}{pool}").query(
                "route", query, result_type=RouteInfo, rpc_timeout=timeout
            )
        except (RPCError, WorkflowQueryFailedError) as error:
            return str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        return info
