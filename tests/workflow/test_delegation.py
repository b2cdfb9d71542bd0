"""Warm-path delegation: a node lent slots of a ready resident admits the warm requests routed to
it without a scheduler round trip, reports them in batches, and gives the slots back whenever
the scheduler needs them (modelforge/policy/_delegation.py, activities/_delegation.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from activities._delegation import NodeSlots
from modelforge.client import ModelForgeClient, Result
from modelforge.messages import RequestResult
from modelforge.policy import PolicyConfig, PoolState
from modelforge.settings import node_task_queue
from workers.stack import Stack, running_stack

pytestmark = pytest.mark.workflow

CATALOG = Path(__file__).resolve().parents[1] / "catalogs" / "routing.toml"
SOLO = Path(__file__).resolve().parents[1] / "catalogs" / "delegation.toml"  # one card: waits are for it
CAPABILITY = "route.embed@1"
SYNC_S = 0.3


async def _until(check: object, within_s: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while loop.time() < deadline:
        if await check():  # type: ignore[operator]
            return True
        await asyncio.sleep(0.1)
    return False


async def _history_length(stack: Stack) -> int:
    described = await stack.scheduler.describe()
    return int(described.raw_description.workflow_execution_info.history_length)


async def _warm_up(client: ModelForgeClient, stack: Stack) -> str:
    """Load the model, route the client to its node and wait for the node to be lent slots."""
    first = await client.request(CAPABILITY, input={"text": "a"}, tenant="app")
    assert first.ok and first.lease is not None, first
    node = first.lease.node

    async def lent() -> bool:
        probe = await client.request(CAPABILITY, input={"text": "probe"}, tenant="app")
        assert probe.ok, probe
        return stack.slots[node].free_slots(CAPABILITY) > 0

    # A bound for a hang, not a latency: each probe is a whole request, seconds apiece in a full
    # parallel suite on two cores (15 s ran out there once).
    holder = stack.slots[node]
    assert await _until(lent, within_s=60), f"the node was never lent a slot ({holder.syncs} syncs)"
    return node


async def _updates_since(stack: Stack, first_event: int) -> dict[str, int]:
    """The scheduler's updates (by name) accepted after history event `first_event`."""
    counts: dict[str, int] = {}
    async for event in stack.scheduler.fetch_history_events():
        if event.event_id > first_event and event.HasField("workflow_execution_update_accepted_event_attributes"):
            name = event.workflow_execution_update_accepted_event_attributes.accepted_request.input.name
            counts[name] = counts.get(name, 0) + 1
    return counts


def _delegated(result: Result | RequestResult) -> bool:
    return bool(result.timings.get("delegated"))


async def test_warm_requests_run_on_delegated_slots_and_cost_the_scheduler_almost_nothing(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    async with running_stack(
        dev_server_env.client, database_url, catalog_path=CATALOG, delegation_sync_s=SYNC_S
    ) as stack:
        client = ModelForgeClient(dev_server_env.client)
        node = await _warm_up(client, stack)
        slots = stack.slots[node]
        lent = slots.free_slots(CAPABILITY)
        # One slot of the 8 is kept back for admissions that do not reach the node's worker.
        assert lent == 7
        before = await _history_length(stack)
        results = [await client.request(CAPABILITY, input={"text": f"t{i}"}, tenant="app") for i in range(20)]
        assert all(r.ok for r in results), [r for r in results if not r.ok]
        assert all(_delegated(r) for r in results), [r.timings for r in results]
        # The answer and the lease are the request's own, as with a lease from the scheduler.
        assert all(r.lease is not None and r.lease.tenant == "app" and r.lease.node == node for r in results)
        assert {r.lease.priority for r in results if r.lease} == {"interactive"}
        # No admission round trip: the scheduler's history grew by the node's syncs (one update
        # each, whatever the number of requests) and its event writes, not per request.
        await asyncio.sleep(SYNC_S * 3)
        updates = await _updates_since(stack, before)
        assert "admit_batch" not in updates and "admit" not in updates, updates
        assert set(updates) == {"delegation_sync"}, updates
        grown = await _history_length(stack) - before
        # (each sync: a workflow task and its update, 5 events; each event write, about once a
        # second: 6 events)
        assert grown <= 6 * updates["delegation_sync"] + 30, (grown, updates)
        # Reported in the node's syncs: every request is in the event log and the lease ledger.
        events = await stack.events("invoke", at_least=22, within_s=10)
        ids = {e["request_id"] for e in events if e["payload"].get("delegated")}
        assert {r.request_id for r in results} <= ids
        # Each told as a scheduler-granted one is: granted (with its wait), then released.
        granted = await stack.events("lease_granted", at_least=22, within_s=10)
        delegated = {e["request_id"]: e for e in granted if e["payload"].get("delegated")}
        assert {r.request_id for r in results} <= set(delegated)
        assert all(e["payload"]["tenant"] == "app" and e["payload"]["waited_s"] >= 0 for e in delegated.values())
        ledger = {row["request_id"]: row for row in await stack.store.ledger()}
        assert all(ledger[r.request_id]["granted_at"] is not None for r in results)
        # Never more in flight than the concurrency: slots plus the scheduler's own leases.
        status = await stack.status()
        [resident] = [r for r in status.residents if r.deployment.startswith("route.embed")]
        assert resident.active_leases <= 8


async def test_a_request_waiting_at_the_scheduler_gets_the_slots_back_within_a_sync(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    async with running_stack(dev_server_env.client, database_url, catalog_path=SOLO, delegation_sync_s=SYNC_S) as stack:
        routed = ModelForgeClient(dev_server_env.client)
        node = await _warm_up(routed, stack)
        slots = stack.slots[node]
        assert slots.free_slots(CAPABILITY) == 7
        # Two slow requests that do not reach the node's worker (started on the control queue,
        # as a client's whose scheduler named no warm node): the first takes the slot kept back,
        # the second waits at the scheduler, which closes the node's slots; the node gives back
        # the free ones at its next sync and the waiting request is granted one of them.
        slow = {"text": "slow", "simulate_invoke_s": 2.0}
        loop = asyncio.get_running_loop()
        started = loop.time()
        handles = [await stack.start_request(CAPABILITY, input=slow, tenant="app") for _ in range(2)]
        first, second = await asyncio.gather(*(handle.result() for handle in handles))
        assert first.lease is not None and second.lease is not None, (first, second)
        assert not _delegated(first) and not _delegated(second)
        waited = max(first.timings["lease_s"], second.timings["lease_s"])
        assert waited < SYNC_S * 4 + 1.0, f"the waiting request got its lease after {waited:.2f} s"
        assert loop.time() - started < 2.0 + SYNC_S * 4 + 2.0
        closed = await stack.events("slot_closed", at_least=7, within_s=10)
        assert any("waits at the scheduler" in e["message"] for e in closed), [e["message"] for e in closed]
        returned = await stack.events("slot_returned", at_least=7, within_s=10)
        assert len(returned) >= 7
        # Nothing waits any more: the node is lent slots again when its requests ask.
        assert await _until(lambda: _lent_again(routed, slots), within_s=10)


async def _lent_again(client: ModelForgeClient, slots: NodeSlots) -> bool:
    result = await client.request(CAPABILITY, input={"text": "again"}, tenant="app")
    assert result.ok, result
    return _delegated(result)


async def test_a_restarted_node_worker_is_never_lent_its_previous_lifes_slots(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    # One node: after the restart the model can only come back there (with two, the scheduler
    # may load it on the other, and the new life is never tested).
    async with running_stack(dev_server_env.client, database_url, catalog_path=SOLO, delegation_sync_s=SYNC_S) as stack:
        client = ModelForgeClient(dev_server_env.client)
        node = await _warm_up(client, stack)
        old = stack.slots[node]
        old_slots = set(old._slots)
        assert len(old_slots) == 7
        await stack.restart_node(node)
        new = stack.slots[node]
        assert new.boot != old.boot

        served_on: set[str] = set()  # the slots the new life's delegated requests ran on

        async def new_life_lent() -> bool:
            result = await client.request(CAPABILITY, input={"text": "after"}, tenant="app")
            assert result.ok, result
            if _delegated(result) and result.lease is not None:
                assert result.lease.node == node, result.lease
                served_on.add(result.lease.lease_id)
            return _delegated(result)

        assert await _until(new_life_lent, within_s=20)
        assert served_on and not served_on & old_slots, "a slot of the old life was kept or lent again"
        # Whatever the scheduler still lends this node is the new life's (an idle node gives its
        # slots back at once, so the state may already hold none).
        state = await stack.scheduler.query("state", result_type=PoolState)
        lent = {lease_id: slot for lease_id, slot in state.slots.items() if slot.node == node}
        assert not set(lent) & old_slots, "a slot of the old life was kept or lent again"
        assert {slot.boot for slot in lent.values()} <= {new.boot}
        [resident] = [r for r in state.residents.values() if r.node == node]
        assert resident.active_leases == sum(1 for lease in state.leases.values() if lease.resident_key == resident.key)
        assert resident.active_leases <= 8


async def test_a_new_clients_first_request_to_a_warm_capability_starts_on_its_node(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    """A client process that never served the capability asks its pool's scheduler for the warm
    node (`RouteInfo.node`): its first request is admitted by that node on a lent slot. With the
    node's worker gone, a new client's request started there is still answered (the control
    worker adopts the silent node's queue) and admitted on the other node."""
    config = PolicyConfig(freshness_s=5.0)
    async with running_stack(
        dev_server_env.client,
        database_url,
        catalog_path=CATALOG,
        config=config,
        telemetry_interval_s=0.5,
        adopt_interval_s=0.5,
        delegation_sync_s=SYNC_S,
    ) as stack:
        node = await _warm_up(ModelForgeClient(dev_server_env.client), stack)
        for text in ("first", "second"):
            fresh = ModelForgeClient(dev_server_env.client)  # a new process: no route of its own
            result = await fresh.request(CAPABILITY, input={"text": text}, tenant="app")
            assert result.ok, result
            assert await _task_queue(stack, result.workflow_id) == node_task_queue(node)
            assert _delegated(result), result.timings
            assert result.lease is not None and result.lease.node == node

        # The node's worker stops; its telemetry is still fresh for a few seconds, so a new
        # client's request starts on its queue, where nobody polls until the control worker
        # adopts it: it is then admitted on the other node (the silent node's card goes stale).
        await stack.stop_node(node)
        loop = asyncio.get_running_loop()
        began = loop.time()
        late = ModelForgeClient(dev_server_env.client)
        result = await asyncio.wait_for(late.request(CAPABILITY, input={"text": "late"}, tenant="app"), 90)
        assert result.ok, result
        assert await _task_queue(stack, result.workflow_id) == node_task_queue(node)
        assert result.lease is not None and result.lease.node != node
        print(f"answered {loop.time() - began:.1f} s after its node's worker stopped")
        # Its card stale, the node is not named any more: the next new client starts on the
        # control queue (or the other node, where the capability is warm now).
        after = await ModelForgeClient(dev_server_env.client).request(CAPABILITY, input={"text": "x"}, tenant="app")
        assert after.ok, after
        assert await _task_queue(stack, after.workflow_id) != node_task_queue(node)


async def _task_queue(stack: Stack, workflow_id: str) -> str:
    return (await stack.client.get_workflow_handle(workflow_id).describe()).task_queue
