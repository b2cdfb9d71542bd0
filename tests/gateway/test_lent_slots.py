"""An idle model whose node holds lent slots (warm-path delegation) through the gateway, live:
`/api/ps` and `/v1/status` list it with no active lease (its slots apart,
for an operator's eyes only), and an operator's unload without drain takes the slots back and
unloads it, where it answered EVICTION_NOT_ALLOWED ("holds 7 active lease(s)") before."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.client import ModelForgeClient
from modelforge.gateway import GatewayConfig
from tests.gateway.serving import serve
from workers.stack import running_stack

pytestmark = pytest.mark.workflow

SOLO = Path(__file__).resolve().parents[1] / "catalogs" / "delegation.toml"
CAPABILITY = "route.embed@1"
OPS_KEY = "sk-ops-0123456789abcdef"
APP_KEY = "sk-app-0123456789abcdef"


async def test_an_idle_delegated_model_shows_no_active_lease_and_an_operator_unloads_it(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    config = GatewayConfig(api_keys={OPS_KEY: "ops", APP_KEY: "app"}, operator_tenants=frozenset({"ops"}))
    async with running_stack(dev_server_env.client, database_url, catalog_path=SOLO, delegation_sync_s=0.3) as stack:
        client = ModelForgeClient(dev_server_env.client)
        node = ""
        for _ in range(150):  # load it, route to its node, until the node is lent slots
            served = await client.request(CAPABILITY, input={"text": "warm"}, tenant="app")
            assert served.ok and served.lease is not None, served
            node = served.lease.node
            if stack.slots[node].free_slots(CAPABILITY) > 0:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the node was never lent a slot")
        lent = stack.slots[node].free_slots(CAPABILITY)
        assert lent == 7  # all but the one kept back for the scheduler's own admissions
        async for gateway in serve(stack, config):
            ops = {"Authorization": f"Bearer {OPS_KEY}"}
            async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30, headers=ops) as http:
                # Idle, with 7 slots lent to its node (given back after 10 s idle: well within).
                [model] = (await http.get("/api/ps")).json()["models"]
                assert model["name"] == f"{CAPABILITY}:latest" and model["modelforge"]["active_leases"] == 0, model
                status = (await http.get("/v1/status")).json()
                [resident] = status["residents"]
                assert (resident["active_leases"], resident["lent_slots"]) == (0, lent), resident
                assert status["active_leases"] == 0 and resident["expires_at"] is not None
                # The tenant sees its model, none of the node's slots.
                app = {"Authorization": f"Bearer {APP_KEY}"}
                [mine] = (await http.get("/v1/status", headers=app)).json()["residents"]
                assert (mine["active_leases"], mine["lent_slots"]) == (0, 0)
                # An operator's unload, no drain: the slots are taken back and it is unloaded.
                unload = await http.post("/v1/residency", json={"action": "unload", "deployment": CAPABILITY})
                assert unload.status_code == 200, unload.text
                assert unload.json()["ok"], unload.json()
                for _ in range(100):
                    if not (await http.get("/api/ps")).json()["models"]:
                        break
                    await asyncio.sleep(0.1)
                else:
                    pytest.fail("still loaded 10 s after the operator's unload")
        assert stack.slots[node].free_slots(CAPABILITY) == 0
        unloaded = await stack.events("unload", at_least=1, within_s=10)
        assert [e["deployment"] for e in unloaded] == [CAPABILITY]
        [draining] = await stack.events("resident_draining", at_least=1, within_s=10)
        assert "free lent slot" in draining["message"]
