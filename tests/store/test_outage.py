"""Postgres down for 30 s during a burst: admission and invocation go on, and once the database
is back every event and ledger row is there (writes are durable, retried activities)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from temporalio.testing import WorkflowEnvironment

from tests.own_postgres import OwnPostgres, reachable
from workers.stack import running_stack

pytestmark = pytest.mark.workflow

OUTAGE_S = 30.0
BURST = 20


async def test_a_30_second_database_outage_loses_nothing(
    dev_server_env: WorkflowEnvironment, outage_postgres: OwnPostgres
) -> None:
    url = outage_postgres.server.get_uri()
    async with running_stack(dev_server_env.client, url, telemetry_interval_s=2.0, snapshot_interval_s=5.0) as stack:
        # Warm up: the embedding model is resident before the outage, so the burst measures
        # admission and invocation, not a load.
        await (await stack.start_request("rag.embedding@1", tenant="rag")).result()
        await stack.events("lease_released", at_least=1)

        await asyncio.to_thread(outage_postgres.stop)
        down_at = time.monotonic()
        down_wall = time.time()
        assert not reachable(url)
        handles = []
        for n in range(BURST):
            capability = "rag.embedding@1" if n % 2 == 0 else "chat.small@1"
            handles.append(await stack.start_request(capability, tenant="rag" if n % 2 == 0 else "default"))
        results = await asyncio.gather(*(h.result() for h in handles))
        served_while_down = time.monotonic() - down_at
        # Every request of the burst was admitted, invoked and released with the database down.
        assert len(results) == BURST and served_while_down < OUTAGE_S
        assert not reachable(url)
        await asyncio.sleep(OUTAGE_S - served_while_down)
        await asyncio.to_thread(outage_postgres.start)
        assert outage_postgres.server.get_uri() == url

        leases = {r.lease.lease_id for r in results}

        async def ledger_complete() -> list[dict[str, Any]]:
            rows = [r for r in await stack.store.ledger() if r["lease_id"] in leases]
            return rows if len(rows) == BURST and all(r["ended_at"] for r in rows) else []

        loop = asyncio.get_running_loop()
        deadline = loop.time() + 90  # the store retry backs off to 30 s between attempts
        rows: list[dict[str, Any]] = []
        while not rows and loop.time() < deadline:
            await asyncio.sleep(1.0)
            try:
                rows = await ledger_complete()
            except Exception:  # the test's own pool reconnects too
                rows = []
        assert len(rows) == BURST, f"ledger rows after the outage: {len(rows)} of {BURST}"
        assert all(r["outcome"] == "ok" for r in rows)
        granted = [
            e for e in await stack.store.list_events(kind="lease_granted", limit=1000) if e["lease_id"] in leases
        ]
        released = [
            e for e in await stack.store.list_events(kind="lease_released", limit=1000) if e["lease_id"] in leases
        ]
        # Exactly once each: retried writes inserted nothing twice.
        assert sorted(e["lease_id"] for e in granted) == sorted(leases)
        assert sorted(e["lease_id"] for e in released) == sorted(leases)
        # Snapshots taken while the database was down were written after it came back.
        snapshots = await stack.store.snapshots(accelerator="gpu-node/0", limit=1000)
        during = [s for s in snapshots if down_wall + 1 <= s["at"].timestamp() <= down_wall + OUTAGE_S - 1]
        assert during, "no snapshot from the outage window reached the database"
