"""The scheduler writes its event log lazily (workflows/scheduler.py): a routine record (a grant,
a release) waits until the oldest has waited EVENT_WRITE_WAIT_S, so a pool with traffic pays one
`record_events` activity every 5 s instead of every second; an urgent one (a refusal, a
preemption, anything with a failure class or an alert) goes within about a second and takes the
routine ones along. What an operator reads in `modelforge events` trails by up to about 5 s, and
never by that for what they act on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.client import ModelForgeClient
from workers.stack import running_stack
from workflows.scheduler import EVENT_WRITE_WAIT_S, URGENT_EVENT_KINDS

pytestmark = pytest.mark.workflow

CATALOG = Path(__file__).parent.parent / "catalogs" / "burst.toml"
CAPABILITY = "bench.embed@1"


async def test_routine_events_wait_and_an_urgent_one_takes_them_along(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    assert "request_refused" in URGENT_EVENT_KINDS
    loop = asyncio.get_running_loop()
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        client = ModelForgeClient(stack.client)
        # The first request loads the model; once its grant is written the buffer is empty.
        warm = await client.request(CAPABILITY, {"simulate_invoke_s": 0}, tenant="bench", request_id="warm-up")
        assert warm.ok, warm
        await stack.events("lease_granted", at_least=1, within_s=EVENT_WRITE_WAIT_S + 8)
        await asyncio.sleep(1.5)
        first = await client.request(CAPABILITY, {"simulate_invoke_s": 0}, tenant="bench", request_id="routine-1")
        assert first.ok, first
        answered = loop.time()
        # Routine: not written within 2 s of the answer (once a second, it would have been)...
        await asyncio.sleep(2.0)
        granted = [e for e in await stack.store.list_events(kind="lease_granted") if e["request_id"] == "routine-1"]
        assert granted == [], "a routine grant was written within 2 s: the event log is not lazy"
        # ...and written once the oldest record has waited EVENT_WRITE_WAIT_S.
        granted = await stack.events("lease_granted", at_least=2, within_s=EVENT_WRITE_WAIT_S + 8)
        assert [e["request_id"] for e in granted] == ["warm-up", "routine-1"]
        assert loop.time() - answered >= EVENT_WRITE_WAIT_S - 2.5

        # A routine grant, then an urgent refusal right after it (a priority above the tenant's
        # ceiling): both are written within about a second of the refusal, long before the
        # grant's EVENT_WRITE_WAIT_S.
        second = await client.request(CAPABILITY, {"simulate_invoke_s": 0}, tenant="bench", request_id="routine-2")
        assert second.ok, second
        asked = loop.time()
        refused = await client.request(
            CAPABILITY, {"simulate_invoke_s": 0}, tenant="bench", priority="production", request_id="urgent-1"
        )
        assert refused.failure_class == "REQUEST_INVALID", refused
        refusals = await stack.events("request_refused", at_least=1, within_s=EVENT_WRITE_WAIT_S + 8)
        written = loop.time()
        assert [e["request_id"] for e in refusals] == ["urgent-1"], refusals
        grants = [e["request_id"] for e in await stack.store.list_events(kind="lease_granted")]
        assert "routine-2" in grants, "the urgent write did not take the routine grant along"
        assert written - asked < EVENT_WRITE_WAIT_S - 1.0, f"the urgent refusal took {written - asked:.1f} s"
