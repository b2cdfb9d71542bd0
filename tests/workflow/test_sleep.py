"""Sleep-aware making room end to end (simulated runtime, real Temporal and Postgres): a model
that can sleep is put to sleep for another one, and woken, not loaded again, when asked for."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from workers.stack import running_stack

pytestmark = pytest.mark.workflow

CATALOG = Path(__file__).parent.parent / "catalogs" / "sleep.toml"


async def test_a_model_is_put_to_sleep_for_another_and_woken_for_its_next_request(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        first = await (await stack.start_request("big.chat@1", tenant="app", lease_timeout_s=60)).result()
        assert first.lease.accelerator == "sleep-node/0"

        # 24 - 1 reserve - 16 = 7 GiB < 12: big.chat@1 sleeps (keeping 1.6 GiB), small.chat@1 loads.
        small = await (await stack.start_request("small.chat@1", tenant="app", lease_timeout_s=60)).result()
        assert small.lease.accelerator == "sleep-node/0"
        [asleep] = await stack.events("resident_asleep", at_least=1)
        assert asleep["deployment"] == "big.chat@1"
        assert asleep["payload"]["bytes"] < 2 * 1024**3
        assert await stack.events("unload", at_least=1, within_s=0.5) == []  # nothing unloaded yet

        # Asked again: waking needs 14.4 GiB, 23 - 1.6 - 12 = 9.4 are free, small.chat@1 is idle
        # and cannot sleep: it is unloaded, and big.chat@1 woken, not loaded a second time.
        again = await (await stack.start_request("big.chat@1", tenant="app", lease_timeout_s=60)).result()
        assert again.lease.accelerator == "sleep-node/0"
        [awake] = await stack.events("resident_awake", at_least=1)
        assert awake["deployment"] == "big.chat@1"
        loads = [e["deployment"] for e in await stack.events("load", at_least=2)]
        assert sorted(loads) == ["big.chat@1", "small.chat@1"]
        [unloaded] = await stack.events("unload", at_least=1)
        assert unloaded["deployment"] == "small.chat@1"
        # Waking (0.3 s) instead of loading (3 s): the second lease came far sooner than the first.
        assert again.timings["lease_s"] < first.timings["lease_s"] - 1.0
