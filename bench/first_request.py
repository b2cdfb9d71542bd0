"""A new client's first request to a warm capability: started on the control queue (before: the
client knew a node only from a finished request's `route`) against started on the warm node the
pool's scheduler names in its `route` answer (`RouteInfo.node`), where the node admits it on a
slot its scheduler lent it (warm-path delegation). Side by side, interleaved, in one run.

    flock /tmp/modelforge-bench.lock .venv/bin/python -m bench.first_request [--n 40]

Each round makes two brand-new `ModelForgeClient`s (a new process's: no route of their own, no
cached pool list) and times each one's first request end to end (pools read from visibility,
the route query, the start, the result); the "before" client is told no warm node (its
`PoolRouter.warm_node` answers "", as today's code had none), the "after" one asks as shipped.
A third line: a client's second request (its remembered route), for reference.

It starts everything it needs, as bench/orchestration.py does: the Temporal dev server (in
memory), an embedded Postgres (or MODELFORGE_DATABASE_URL), the control worker and a simulated
node worker syncing its slots every second (MODELFORGE_DELEGATION_SYNC_S's default).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from modelforge.client import ModelForgeClient, Result
from modelforge.dev import temporal_binary
from modelforge.payloads import with_payload_store
from modelforge.settings import DEFAULT_MAX_PAYLOAD_BYTES, DEFAULT_PAYLOAD_THRESHOLD_BYTES
from modelforge.temporal import register_search_attributes
from workers.stack import running_stack

CATALOG = Path(__file__).parent / "catalogs" / "throughput.toml"
CAPABILITY = "bench.embed@1"
SYNC_S = 1.0  # MODELFORGE_DELEGATION_SYNC_S's default


def old_client(client: Client) -> ModelForgeClient:
    """A client as before RouteInfo.node: with no route of its own it starts on the control queue."""
    requests = ModelForgeClient(client)

    async def no_node(pool: str, capability: str, tenant: str = "default", priority: str | None = None) -> str:
        return ""

    requests.router.warm_node = no_node  # type: ignore[method-assign]
    return requests


async def one(requests: ModelForgeClient) -> tuple[float, Result]:
    started = time.perf_counter()
    result = await requests.request(CAPABILITY, input={"text": "x"}, tenant="bench", lease_timeout_s=120)
    elapsed = time.perf_counter() - started
    if not result.ok:
        raise SystemExit(f"a benchmark request failed: {result.failure_class}: {result.message}")
    return elapsed, result


async def run(n: int, database_url: str) -> None:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), dev_server_log_level="error"
    )
    scratch = tempfile.TemporaryDirectory()
    try:
        client = with_payload_store(
            env.client, Path(scratch.name) / "payloads", DEFAULT_PAYLOAD_THRESHOLD_BYTES, DEFAULT_MAX_PAYLOAD_BYTES
        )
        await register_search_attributes(client)
        async with running_stack(client, database_url, catalog_path=CATALOG, delegation_sync_s=SYNC_S):
            # Warm: the model loaded, the node lent its slots, workers and connections settled.
            warm = ModelForgeClient(client)
            for _ in range(100):
                if (await one(warm))[1].timings.get("delegated"):
                    break
                await asyncio.sleep(0.1)
            else:
                raise SystemExit("the node was never lent slots")
            for _ in range(5):
                await one(old_client(client))
                await one(ModelForgeClient(client))
            times: dict[str, list[float]] = {"before": [], "after": [], "second": []}
            delegated = {"before": 0, "after": 0}
            for i in range(n):
                # Interleaved, alternating which goes first, so drift hits both alike.
                order = ("before", "after") if i % 2 == 0 else ("after", "before")
                for name in order:
                    requests = old_client(client) if name == "before" else ModelForgeClient(client)
                    elapsed, result = await one(requests)
                    times[name].append(elapsed)
                    delegated[name] += bool(result.timings.get("delegated"))
                    if name == "after":
                        times["second"].append((await one(requests))[0])
            print(f"a new client's first request to a warm capability, over {n} (ms):", flush=True)
            labels = {
                "before": "before (control queue)",
                "after": "after (warm node)",
                "second": "a client's 2nd request",
            }
            for name, values in times.items():
                ordered = sorted(values)
                p90 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]
                share = f"  delegated {delegated[name]}/{n}" if name in delegated else ""
                print(
                    f"  {labels[name]:<24} p50 {statistics.median(values) * 1000:6.1f}"
                    f"  p90 {p90 * 1000:6.1f}  mean {statistics.fmean(values) * 1000:6.1f}{share}",
                    flush=True,
                )
    finally:
        await env.shutdown()
        scratch.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=40)
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
