"""The keep-warm decision on a real Temporal server, with time skipped: lease, load once,
functional health check, invoke, release, keep warm for 901 s, then eviction by the TTL timer."""

from __future__ import annotations

import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.domain import GiB
from workers.stack import running_stack

pytestmark = pytest.mark.workflow

EMBEDDING = "rag.embedding@1"
ENVELOPE = 1_216_348_160


def resident(status, capability=EMBEDDING):  # type: ignore[no-untyped-def]
    return [r for r in status.residents if r.capability == capability]


async def test_request_loads_once_then_stays_warm_until_ttl(
    time_skipping_env: WorkflowEnvironment, database_url: str
) -> None:
    async with running_stack(time_skipping_env.client, database_url) as stack:
        first = await (await stack.start_request(EMBEDDING, tenant="rag", input={"text": "hello"})).result()
        assert first.output["simulated"] is True
        assert first.lease.accelerator == "gpu-node/0"  # production: never the desktop

        status = await stack.status()
        [warm] = resident(status)
        assert (warm.state, warm.bytes, warm.active_leases) == ("ready", ENVELOPE, 0)
        gpu = next(a for a in status.accelerators if a.id == "gpu-node/0")
        assert gpu.resident_bytes == ENVELOPE
        assert gpu.external_bytes == 6 * GiB
        assert gpu.leased_bytes == 0

        # A second request reuses the resident model: no second load.
        await (await stack.start_request(EMBEDDING, tenant="rag", input={"text": "again"})).result()
        events = await stack.events("load", at_least=1)  # the event log trails by a few seconds
        assert len(events) == 1

        # 900 s idle after the last use: still warm. Past 901 s: unloaded and reclaimed.
        await time_skipping_env.sleep(880)
        assert resident(await stack.status())
        await time_skipping_env.sleep(60)
        assert resident(await stack.status()) == []
        gpu = next(a for a in (await stack.status()).accelerators if a.id == "gpu-node/0")
        assert gpu.resident_bytes == 0


async def test_each_use_resets_the_ttl(time_skipping_env: WorkflowEnvironment, database_url: str) -> None:
    async with running_stack(time_skipping_env.client, database_url) as stack:
        await (await stack.start_request(EMBEDDING, tenant="rag")).result()
        await time_skipping_env.sleep(600)
        await (await stack.start_request(EMBEDDING, tenant="rag")).result()
        # 600 + 400 = 1000 s after the first use, but only 400 s after the second: still warm.
        await time_skipping_env.sleep(400)
        assert resident(await stack.status())
        # 400 + 560 = 960 s after the second use (> 901 s): evicted by the timer.
        await time_skipping_env.sleep(560)
        assert resident(await stack.status()) == []
