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
from modelforge.names import RUNNING_SCHEDULERS, pool_of_scheduler, scheduler_id
from modelforge.policy import RouteInfo, RouteQuery, catalog_pools, choose_pool
from modelforge.settings import DEFAULT_POOL

if TYPE_CHECKING:
    from temporalio.client import Client

log = get_logger("modelforge.routing")

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


def pools_from_env() -> list[str]:
    """MODELFORGE_POOLS: the pools to route among, comma-separated (unset: the running schedulers)."""
    return _names(os.environ.get("MODELFORGE_POOLS", "").split(","))


def _names(names: Sequence[str]) -> list[str]:
    return sorted({name.strip() for name in names if name.strip()})


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
                pool = pool_of_scheduler(execution.id)
                if pool is not None:
                    found.append(pool)
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
            info: RouteInfo = await self.client.get_workflow_handle(scheduler_id(pool)).query(
                "route", query, result_type=RouteInfo, rpc_timeout=timeout
            )
        except (RPCError, WorkflowQueryFailedError) as error:
            return str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        return info
