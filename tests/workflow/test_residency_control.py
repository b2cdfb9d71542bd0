"""Residency on demand through the scheduler (`modelforge load|unload|pin|unpin`, the gateway's
/v1/residency): a model loaded before anyone asks, pinned against eviction and TTL, unloaded at
once when idle, refused while leases are active unless drained, and a drain that finishes when
the last lease ends. Every refusal is typed and changes nothing; every action is an event."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from typer.testing import CliRunner

from modelforge.messages import ResidencyControl, ResidencyControlReply
from tests.gateway.serving import CATALOG, serve
from workers.stack import Stack, running_stack

pytestmark = pytest.mark.workflow


async def _control(stack: Stack, action: str, deployment: str, **fields: Any) -> ResidencyControlReply:
    reply: ResidencyControlReply = await stack.scheduler.execute_update(
        "residency_control",
        ResidencyControl(action=action, deployment=deployment, actor="test", **fields),
        result_type=ResidencyControlReply,
    )
    return reply


async def _resident(stack: Stack, capability: str) -> Any:
    return next((r for r in (await stack.status()).residents if r.capability == capability), None)


async def _until(check: Any, within_s: float) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        found = await check()
        if found or loop.time() > deadline:
            return found
        await asyncio.sleep(0.2)


async def test_load_pin_unpin_and_unload_on_demand(dev_server_env: WorkflowEnvironment, database_url: str) -> None:
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        assert await _resident(stack, "chat.small@1") is None
        loaded = await _control(stack, "load", "chat.small@1")
        assert loaded.ok, loaded

        async def ready() -> Any:
            resident = await _resident(stack, "chat.small@1")
            return resident if resident is not None and resident.state == "ready" else None

        resident = await _until(ready, 30)
        assert resident is not None and resident.active_leases == 0, "the load's own lease was not given back"
        again = await _control(stack, "load", "chat.small@1")
        assert again.ok and "already resident" in again.message

        pinned = await _control(stack, "pin", "chat.small@1")
        assert pinned.ok and (await _resident(stack, "chat.small@1")).residency == "always_warm"
        unpinned = await _control(stack, "unpin", "chat.small@1")
        assert unpinned.ok and (await _resident(stack, "chat.small@1")).residency == "keep_warm"

        # Typed refusals that change nothing.
        unknown = await _control(stack, "pin", "no.such@1")
        assert (unknown.ok, unknown.failure) == (False, "REQUEST_INVALID")
        with pytest.raises(WorkflowUpdateFailedError) as bad:
            await _control(stack, "evict-everything", "chat.small@1")
        assert isinstance(bad.value.cause, ApplicationError) and bad.value.cause.type == "REQUEST_INVALID"

        unloaded = await _control(stack, "unload", "chat.small@1")
        assert unloaded.ok, unloaded

        async def gone() -> bool:
            return await _resident(stack, "chat.small@1") is None

        assert await _until(gone, 30), "an idle model asked to unload stayed"
        for kind in ("load_asked", "resident_pinned", "resident_unpinned", "unload_requested"):
            assert await stack.events(kind, at_least=1, within_s=10), f"no {kind} event"


async def test_unload_with_active_leases_is_refused_unless_drained(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        holder = await stack.start_request("chat.small@1", tenant="default", input={"simulate_invoke_s": 6})

        async def busy() -> Any:
            resident = await _resident(stack, "chat.small@1")
            return resident is not None and resident.active_leases == 1

        assert await _until(busy, 30)
        refused = await _control(stack, "unload", "chat.small@1")
        assert (refused.ok, refused.failure) == (False, "EVICTION_NOT_ALLOWED") and "drain" in refused.message
        assert (await _resident(stack, "chat.small@1")).state == "ready"
        draining = await _control(stack, "unload", "chat.small@1", drain=True)
        assert draining.ok and "draining" in draining.message
        # A new request does not join a draining model: it waits, and is served after a new load.
        later = await stack.start_request("chat.small@1", tenant="default")
        assert (await holder.result()).output
        assert (await later.result()).output
        events = await stack.events("resident_draining", at_least=1, within_s=10)
        assert events and events[0]["deployment"] == "chat.small@1"
        unloads = await stack.events("unload_requested", at_least=1, within_s=20)
        assert any(e["message"].startswith("drained") for e in unloads), unloads


async def test_the_cli_loads_pins_and_unloads(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    from modelforge import cli

    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        env = {
            "MODELFORGE_TEMPORAL_ADDRESS": dev_server_env.client.service_client.config.target_host,
            "MODELFORGE_HOME": str(tmp_path),
            "MODELFORGE_POOLS": "default",
        }
        runner = CliRunner()

        async def run(*args: str) -> Any:
            return await asyncio.to_thread(runner.invoke, cli.app, list(args), env=env)

        loaded = await run("load", "chat.small@1")
        assert loaded.exit_code == 0, loaded.output

        async def ready() -> Any:
            resident = await _resident(stack, "chat.small@1")
            return resident is not None and resident.state == "ready"

        assert await _until(ready, 30)
        pinned = await run("pin", "chat.small@1", "--json")
        assert pinned.exit_code == 0 and json.loads(pinned.stdout)["ok"], pinned.output
        holder = await stack.start_request("chat.small@1", tenant="default", input={"simulate_invoke_s": 4})

        async def busy() -> Any:
            resident = await _resident(stack, "chat.small@1")
            return resident is not None and resident.active_leases == 1

        assert await _until(busy, 30)
        refused = await run("unload", "chat.small@1")
        assert refused.exit_code == 1 and "EVICTION_NOT_ALLOWED" in refused.output
        drained = await run("unload", "chat.small@1", "--drain")
        assert drained.exit_code == 0 and "draining" in drained.output
        assert (await holder.result()).output

        async def gone() -> bool:
            return await _resident(stack, "chat.small@1") is None

        assert await _until(gone, 30)
        unknown = await run("pin", "no.such@1")
        assert unknown.exit_code == 1 and "REQUEST_INVALID" in unknown.output


async def test_the_gateway_takes_residency_operations_from_operators_only(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    from modelforge.gateway import GatewayConfig

    ops_key, app_key = "sk-ops-0123456789abcdef", "sk-app-0123456789abcdef"
    config = GatewayConfig(api_keys={ops_key: "ops", app_key: "default"}, operator_tenants=frozenset({"ops"}))
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        async for gateway in serve(stack, config):
            async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as http:
                body = {"action": "load", "deployment": "chat.small@1"}
                denied = await http.post("/v1/residency", json=body, headers={"Authorization": f"Bearer {app_key}"})
                assert denied.status_code == 403 and denied.json()["failure_class"] == "REQUEST_INVALID"
                anonymous = await http.post("/v1/residency", json=body)
                assert anonymous.status_code == 401
                ops = {"Authorization": f"Bearer {ops_key}"}
                loaded = await http.post("/v1/residency", json=body, headers=ops)
                assert loaded.status_code == 200 and loaded.json()["ok"], loaded.text

                async def ready() -> Any:
                    resident = await _resident(stack, "chat.small@1")
                    return resident is not None and resident.state == "ready"

                assert await _until(ready, 30)
                bad = await http.post("/v1/residency", json={"action": "evict", "deployment": "x@1"}, headers=ops)
                assert bad.status_code == 400
                pin_unknown = {"action": "pin", "deployment": "no.such@1"}
                unknown = await http.post("/v1/residency", json=pin_unknown, headers=ops)
                assert unknown.status_code == 400 and unknown.json()["failure_class"] == "REQUEST_INVALID"
                gone = await http.post(
                    "/v1/residency", json={"action": "unload", "deployment": "chat.small@1"}, headers=ops
                )
                assert gone.status_code == 200 and gone.json()["ok"], gone.text


TWO_CARDS = """
[[accelerators]]
id = "gpu-node/0"
node = "gpu-node"
model = "Simulated RTX 3090 24GB"
total_bytes = 25769803776
simulated = true

[[accelerators]]
id = "gpu-node/1"
node = "gpu-node"
model = "Simulated RTX 3090 24GB"
total_bytes = 25769803776
simulated = true

[[external]]
accelerator = "gpu-node/1"
name = "someone else's job"
bytes = 22548578304

[[deployments]]
capability = "chat.small@1"
envelope_bytes = 4294967296
residency = "keep_warm"
concurrency = 2

[[deployments]]
capability = "pinned.only@1"
envelope_bytes = 1073741824
residency = "keep_warm"
concurrency = 1
accelerators = ["gpu-node/0"]

[[tenants]]
name = "default"
default_priority = "interactive"
max_priority = "interactive"
"""


async def _fresh(stack: Stack) -> bool:
    cards = (await stack.status()).accelerators
    return len(cards) == 2 and all(card.fresh for card in cards)


async def test_load_on_a_named_accelerator_or_a_typed_refusal_that_changes_nothing(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    catalog = tmp_path / "two_cards.toml"
    catalog.write_text(TWO_CARDS)
    async with running_stack(dev_server_env.client, database_url, catalog_path=catalog) as stack:
        assert await _until(lambda: _fresh(stack), 30), "the cards never reported"
        # Placement alone would choose either card: the operator names one.
        loaded = await _control(stack, "load", "chat.small@1", accelerator="gpu-node/0")
        assert loaded.ok and loaded.residents == ["chat.small@1@gpu-node/0"], loaded

        async def ready() -> Any:
            resident = await _resident(stack, "chat.small@1")
            return resident if resident is not None and resident.state == "ready" else None

        resident = await _until(ready, 30)
        assert resident is not None and resident.accelerator == "gpu-node/0"
        again = await _control(stack, "load", "chat.small@1", accelerator="gpu-node/0")
        assert again.ok and "already resident" in again.message

        before = await stack.status()
        # A card its placement list excludes, and one not in the pool at all: REQUEST_INVALID.
        excluded = await _control(stack, "load", "pinned.only@1", accelerator="gpu-node/1")
        assert (excluded.ok, excluded.failure) == (False, "REQUEST_INVALID"), excluded
        assert "placement list" in excluded.message
        unknown = await _control(stack, "load", "chat.small@1", accelerator="gpu-node/9")
        assert (unknown.ok, unknown.failure) == (False, "REQUEST_INVALID"), unknown
        # A full card: refused with the numbers, and no room is made.
        full = await _control(stack, "load", "chat.small@1", accelerator="gpu-node/1")
        assert (full.ok, full.failure) == (False, "CAPABILITY_UNAVAILABLE"), full
        assert "4294967296 B" in full.message and "schedulable" in full.message
        after = await stack.status()
        seen = [(r.deployment, r.accelerator, r.state) for r in after.residents]
        assert seen == [(r.deployment, r.accelerator, r.state) for r in before.residents]
        assert not any(r.accelerator == "gpu-node/1" for r in after.residents)
        asked = await stack.events("load_asked", at_least=4, within_s=10)
        refused = [e for e in asked if e["accelerator"] == "gpu-node/1"]
        assert any(e["failure_class"] == "CAPABILITY_UNAVAILABLE" for e in refused), asked


async def test_the_cli_loads_on_a_named_accelerator(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    from modelforge import cli

    catalog = tmp_path / "two_cards.toml"
    catalog.write_text(TWO_CARDS)
    async with running_stack(dev_server_env.client, database_url, catalog_path=catalog) as stack:
        assert await _until(lambda: _fresh(stack), 30), "the cards never reported"
        env = {
            "MODELFORGE_TEMPORAL_ADDRESS": dev_server_env.client.service_client.config.target_host,
            "MODELFORGE_HOME": str(tmp_path),
            "MODELFORGE_POOLS": "default",
        }
        runner = CliRunner()

        async def run(*args: str) -> Any:
            return await asyncio.to_thread(runner.invoke, cli.app, list(args), env=env)

        full = await run("load", "chat.small@1", "--accelerator", "gpu-node/1")
        assert full.exit_code == 1 and "CAPABILITY_UNAVAILABLE" in full.output, full.output
        excluded = await run("load", "pinned.only@1", "--accelerator", "gpu-node/1")
        assert excluded.exit_code == 1 and "REQUEST_INVALID" in excluded.output, excluded.output
        loaded = await run("load", "pinned.only@1", "--accelerator", "gpu-node/0", "--json")
        assert loaded.exit_code == 0 and json.loads(loaded.stdout)["residents"] == ["pinned.only@1@gpu-node/0"]

        async def ready() -> Any:
            resident = await _resident(stack, "pinned.only@1")
            return resident is not None and resident.state == "ready" and resident.accelerator == "gpu-node/0"

        assert await _until(ready, 30)
