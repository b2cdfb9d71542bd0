"""Integrity under faults and hostile input, on the real dev server: nothing wedges the pool,
nothing is granted twice, nothing leaks.

- Hostile identifiers sent straight to the scheduler (as an old or hand-written client would)
  are refused REQUEST_INVALID, their refusal lands in the event log escaped, and the pool goes on
  admitting and serving through continue-as-new (the NUL tenant once froze it for good).
- A grant that reaches its holder after the lease was reclaimed is never used: the holder asks
  the scheduler, hears "no", and is admitted again; the slot is never used twice at once.
- An admission the requester already gave up on is refused, never granted to nobody.
- A deployment removed from the catalog has its always_warm resident unloaded.
- Postgres down across continue-as-new: admission never waits on it, nothing is dropped, and
  every event and ledger row lands when it is back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from pathlib import Path
from typing import Any

import pytest
from temporalio import workflow
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, Worker

from activities import AdmissionActivities
from modelforge.catalog import load_catalog_file
from modelforge.events import EventRecord
from modelforge.messages import (
    AdmitBatch,
    AdmitBatchReply,
    CancelSignal,
    LeaseDecision,
    LeaseHeartbeat,
    PreemptSignal,
    ReleaseSignal,
    RequestInput,
    SchedulerInput,
)
from modelforge.policy import AdmissionRequest, PolicyConfig
from modelforge.settings import node_task_queue
from tests.own_postgres import OwnPostgres, reachable
from workers.control import workflow_runner
from workers.stack import Stack, running_stack
from workflows import ALL_WORKFLOWS, CapabilityRequestWorkflow, PoolSchedulerWorkflow
from workflows.request import ADMIT_BUDGET

pytestmark = pytest.mark.workflow

CATALOGS = Path(__file__).resolve().parents[1] / "catalogs"
FENCING = CATALOGS / "fencing.toml"


async def _until(check: Any, within_s: float, every_s: float = 0.2) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        found = await check()
        if found or loop.time() > deadline:
            return found
        await asyncio.sleep(every_s)


async def _run_id(handle: WorkflowHandle[Any, Any]) -> str:
    return str((await handle.describe()).run_id)


async def _admit(stack: Stack, *requests: AdmissionRequest) -> AdmitBatchReply:
    reply: AdmitBatchReply = await stack.scheduler.execute_update(
        "admit_batch", AdmitBatch(requests=list(requests)), result_type=AdmitBatchReply
    )
    return reply


HOSTILE_TENANTS = ["a\x00b", "x\ud800", "line\nbreak", "名前", "t" * 3000, "\u202eevil", " ", ""]


async def test_hostile_identifiers_never_wedge_the_pool(dev_server_env: WorkflowEnvironment, database_url: str) -> None:
    async with running_stack(dev_server_env.client, database_url, max_history_events=150) as stack:
        first_run = await _run_id(stack.scheduler)
        for n, tenant in enumerate(HOSTILE_TENANTS):
            for field, value in (("tenant", tenant), ("request_id", f"r{n}\x00"), ("capability", f"rag\x00{n}@1")):
                fields = {"tenant": "rag", "request_id": f"hostile-{n}-{field}", "capability": "rag.embedding@1"}
                fields[field] = value
                if field == "tenant" and value == "":
                    continue  # empty: the scheduler's default tenant, a valid request
                reply = await _admit(stack, AdmissionRequest(workflow_id=f"wf-{n}-{field}", **fields))
                [answer] = reply.replies
                assert (answer.status, answer.failure) == ("rejected", "REQUEST_INVALID"), (field, value, answer)
        # Enough ordinary requests to take the scheduler through continue-as-new, all served.
        for n in range(20):
            result = await (await stack.start_request("rag.embedding@1", tenant="rag", input={"text": str(n)})).result()
            assert result.output
        assert await _run_id(stack.scheduler) != first_run, "the scheduler never continued as new"
        refused = await stack.events("request_refused", at_least=3 * len(HOSTILE_TENANTS) - 1, within_s=20)
        assert len(refused) >= 3 * len(HOSTILE_TENANTS) - 1
        assert any("\\u0000" in str(e["payload"]) or "\\x00" in e["message"] for e in refused)
        released = await stack.events("lease_released", at_least=20, within_s=20)
        assert len(released) >= 20, "events after the hostile ones never landed"


async def test_an_admission_the_requester_gave_up_on_is_refused(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    async with running_stack(dev_server_env.client, database_url) as stack:
        late = AdmissionRequest(
            request_id="gave-up", workflow_id="wf-gave-up", capability="rag.embedding@1", tenant="rag", admit_by=1.0
        )
        [answer] = (await _admit(stack, late)).replies
        assert (answer.status, answer.failure) == ("rejected", "TIMEOUT")
        status = await stack.status()
        assert status.queue_depth == {} or sum(status.queue_depth.values()) == 0
        assert status.active_leases == 0


async def test_a_grant_that_arrives_after_its_lease_was_reclaimed_is_never_used(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    # stale 3 s: a holder never heard from keeps its lease 15 s (5x). Telemetry stays fresh.
    config = PolicyConfig(stale_lease_s=3.0, freshness_s=300.0, node_silent_s=600.0)
    async with running_stack(
        dev_server_env.client, database_url, catalog_path=FENCING, config=config, adopt_interval_s=3600
    ) as stack:
        holder = await stack.start_request("fence.one@1", tenant="app", input={"simulate_invoke_s": 6})

        async def holding() -> bool:
            return (await stack.status()).active_leases == 1

        assert await _until(holding, 30)
        # The late holder's workflow runs on route-b's queue (a client routed it there) and waits
        # in the queue for the one slot; then route-b's worker goes away.
        late = await stack.start_request("fence.one@1", tenant="app", task_queue=node_task_queue("route-b"))

        async def queued() -> bool:
            return sum((await stack.status()).queue_depth.values()) == 1

        assert await _until(queued, 30)
        await stack.stop_node("route-b")
        third = await stack.start_request("fence.one@1", tenant="app", input={"simulate_invoke_s": 8})
        # The holder ends; the slot is granted to `late`, whose worker cannot hear of it. After
        # 15 s unheard, the lease is reclaimed and the slot goes to `third`.
        assert (await holder.result()).output
        reclaimed = await stack.events("lease_reclaimed", at_least=1, within_s=40)
        assert reclaimed and reclaimed[0]["workflow_id"] == late.id
        assert "limit 15 s" in reclaimed[0]["message"]

        async def third_holds() -> bool:
            return (await stack.status()).active_leases == 1

        assert await _until(third_holds, 20)
        await asyncio.sleep(1.0)  # `third` is invoking
        # route-b comes back while `third` holds the slot: `late` now sees its old grant.
        await stack.start_node("route-b")
        late_result = await late.result()
        third_result = await third.result()
        # It was never used: `late` asked, was told no, and was served on a lease of its own,
        # after `third` (one slot: the two never ran at once).
        assert late_result.lease.lease_id != reclaimed[0]["lease_id"]
        assert late_result.lease.granted_at >= third_result.lease.granted_at + 7.0
        refused = await stack.events("stale_grant_refused", at_least=1)
        assert refused and refused[0]["lease_id"] == reclaimed[0]["lease_id"]

        async def ledger_ended() -> list[dict[str, Any]]:
            rows = [r for r in await stack.store.ledger() if r["capability"] == "fence.one@1"]
            return rows if len(rows) == 4 and all(r["ended_at"] for r in rows) else []

        rows = await _until(ledger_ended, 15)
        intervals = sorted((r["granted_at"], r["ended_at"]) for r in rows if r["ended_at"] is not None)
        assert len(intervals) == len(rows) == 4
        for (_, end), (start, _) in itertools.pairwise(intervals):
            assert start >= end, f"two leases on a concurrency-1 slot at once: {intervals}"


@workflow.defn(name="SilentHolderWorkflow", sandboxed=False)
class _SilentHolder:
    """Stands for a holder cut off from Temporal: it never heartbeats, and records the preempt
    the scheduler sends when the lease's heartbeats come back after the reclaim."""

    def __init__(self) -> None:
        self.preempts: list[PreemptSignal] = []
        self.lease_id = ""

    @workflow.signal
    def lease_decision(self, decision: LeaseDecision) -> None:
        self.lease_id = decision.lease.lease_id if decision.lease else ""

    @workflow.signal
    def preempt(self, signal: PreemptSignal) -> None:
        self.preempts.append(signal)

    @workflow.query
    def granted(self) -> str:
        return self.lease_id

    @workflow.query
    def received(self) -> list[PreemptSignal]:
        return self.preempts

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: False)


async def test_an_invoke_whose_lease_was_reclaimed_is_stopped_when_its_heartbeat_returns(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    # stale 2 s: a holder never heard from keeps its lease 10 s (5x), then it is reclaimed.
    config = PolicyConfig(stale_lease_s=2.0, freshness_s=300.0, node_silent_s=600.0)
    client = dev_server_env.client
    async with (
        running_stack(client, database_url, catalog_path=FENCING, config=config, adopt_interval_s=3600) as stack,
        Worker(client, task_queue="silent-holder", workflows=[_SilentHolder]),
    ):
        holder = await client.start_workflow("SilentHolderWorkflow", id="silent-holder-1", task_queue="silent-holder")
        [answer] = (
            await _admit(
                stack,
                AdmissionRequest(request_id="cut-off", workflow_id=holder.id, capability="fence.one@1", tenant="app"),
            )
        ).replies
        assert answer.status in ("granted", "queued")

        async def granted() -> str:
            return answer.lease.lease_id if answer.lease else await holder.query("granted", result_type=str)

        lease_id = await _until(granted, 30)
        assert lease_id, "never granted"
        reclaimed = await stack.events("lease_reclaimed", at_least=1, within_s=40)
        assert reclaimed and reclaimed[0]["lease_id"] == lease_id
        # The node (or the holder) is heard again: the invoke it is still running must stop.
        await stack.scheduler.signal("lease_heartbeat", LeaseHeartbeat(lease_id=lease_id, request_id="cut-off"))

        async def preempted() -> list[PreemptSignal]:
            return await holder.query("received", result_type=list[PreemptSignal])

        received = await _until(preempted, 20)
        assert len(received) == 1
        assert received[0].lease_id == lease_id and received[0].grace_s == 0.0
        stopped = await stack.events("reclaimed_invoke_stopped", at_least=1, within_s=20)
        assert stopped and stopped[0]["workflow_id"] == holder.id
        # Only once: a second heartbeat for the same lease sends nothing more.
        await stack.scheduler.signal("lease_heartbeat", LeaseHeartbeat(lease_id=lease_id, request_id="cut-off"))
        await asyncio.sleep(2.0)
        assert len(await preempted()) == 1
        await holder.terminate("test over")


async def test_a_lease_the_scheduler_does_not_hold_is_stopped_at_its_heartbeat_and_its_row_ends_at_its_release(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    # A grant whose run was reset away (the replay guard, an operator) after its ledger row was
    # written: the scheduler now holds nothing of it, while its holder runs on. Its heartbeat
    # stops the holder at once (its room may be granted again), and its release closes the row
    # at the release, not at the next audit up to a minute later (the ledger would show the
    # lease and the one granted in its room at once).
    client = dev_server_env.client
    async with (
        running_stack(client, database_url, catalog_path=FENCING, adopt_interval_s=3600) as stack,
        Worker(client, task_queue="silent-holder", workflows=[_SilentHolder]),
    ):
        holder = await client.start_workflow(
            "SilentHolderWorkflow", id="request:fence.one@1:forgotten", task_queue="silent-holder"
        )
        granted_at = time.time() - 5.0
        await stack.store.record_events(
            [
                EventRecord(
                    event_id="grant-of-a-reset-run",
                    at=granted_at,
                    kind="lease_granted",
                    request_id="forgotten",
                    lease_id="default.forgotten.1",
                    deployment="fence.one@1",
                    workflow_id=holder.id,
                    payload={"pool": "default", "tenant": "app", "capability": "fence.one@1", "bytes": 1024},
                )
            ]
        )
        beat = LeaseHeartbeat(lease_id="default.forgotten.1", request_id="forgotten", holder=holder.id)
        await stack.scheduler.signal("lease_heartbeat", beat)

        async def preempted() -> list[PreemptSignal]:
            return await holder.query("received", result_type=list[PreemptSignal])

        [stop] = await _until(preempted, 20)
        assert stop.lease_id == "default.forgotten.1" and stop.grace_s == 0.0
        stopped = await stack.events("unheld_invoke_stopped", at_least=1, within_s=20)
        assert stopped[0]["workflow_id"] == holder.id
        # A heartbeat naming no holder stops nothing.
        await stack.scheduler.signal("lease_heartbeat", LeaseHeartbeat(lease_id="default.other.2", request_id="x"))
        released_at = time.time()
        release = ReleaseSignal(lease_id="default.forgotten.1", request_id="forgotten", outcome="PREEMPTED")
        await stack.scheduler.signal("release", release)

        async def row_closed() -> dict[str, Any] | None:
            [row] = await stack.store.ledger(lease_id="default.forgotten.1")
            return row if row["ended_at"] is not None else None

        row = await _until(row_closed, 20)
        assert row is not None, "the row of a lease the scheduler does not hold stayed open after its release"
        assert abs(row["ended_at"].timestamp() - released_at) < 3.0, "it ends at its release, not at an audit"
        assert row["outcome"] == "PREEMPTED", "the holder's own outcome"
        assert row["held_s"] == pytest.approx(row["ended_at"].timestamp() - granted_at, abs=0.01)
        # The release is news once: a repeated release and a heartbeat that crossed it change
        # nothing (no second end, no second stop).
        await stack.scheduler.signal("release", release)
        await stack.scheduler.signal("lease_heartbeat", beat)
        await asyncio.sleep(2.0)
        ends = [e for e in await stack.events("lease_released", at_least=1) if e["lease_id"] == "default.forgotten.1"]
        assert len(ends) == 1 and "not held by this run" in ends[0]["message"]
        assert ends[0]["payload"]["unheld"] is True
        assert len(await preempted()) == 1
        await holder.terminate("test over")


@pytest.mark.parametrize("let_go_by", ["release", "cancel"])
async def test_a_lease_granted_in_a_released_room_starts_no_earlier_than_its_holder_let_go(
    dev_server_env: WorkflowEnvironment, database_url: str, let_go_by: str
) -> None:
    # A workflow task retried after a Temporal restart reads its first attempt's start as its
    # time, which may precede the releases it applies (13 s in a chaos round). Here a holder's
    # let-go time reads 8 s past the scheduler's task time, as there. Its row ends when it let
    # go (not at the earlier task time: its GPU-seconds are all counted), and the lease granted
    # in its room starts no earlier: the ledger never shows the two at once, even when a reset
    # applies the release again at its let-go time beside the grant its history kept. A holder
    # that gave up (its lease timeout, a failed confirmation) says when by its cancel: a cancel
    # applied again by a reset run, heard later than the lost run heard it, showed 24 GiB on a
    # 24 GiB card in a chaos round's ledger while the lost run had granted its room at once.
    client = dev_server_env.client
    async with (
        running_stack(client, database_url, catalog_path=FENCING, adopt_interval_s=3600) as stack,
        Worker(client, task_queue="silent-holder", workflows=[_SilentHolder]),
    ):
        holders = [
            await client.start_workflow(
                "SilentHolderWorkflow", id=f"request:fence.one@1:{name}", task_queue="silent-holder"
            )
            for name in ("first", "second")
        ]

        async def granted(holder: WorkflowHandle[Any, Any]) -> str:
            return str(await holder.query("granted"))

        for holder in holders:
            asked = AdmissionRequest(
                request_id=holder.id.rpartition(":")[2], workflow_id=holder.id, capability="fence.one@1", tenant="app"
            )
            [answer] = (await _admit(stack, asked)).replies
            assert answer.status in ("granted", "queued"), answer
        first_lease = await _until(lambda: granted(holders[0]), 30)
        assert first_lease and not await granted(holders[1]), "one slot: the second waits"
        let_go = time.time() + 8.0
        if let_go_by == "release":
            signal: Any = ReleaseSignal(lease_id=first_lease, request_id="first", outcome="ok", ended_at=let_go)
        else:
            signal = CancelSignal(request_id="first", reason="LEASE_TIMEOUT: gave up", sent_at=let_go)
        await stack.scheduler.signal(let_go_by, signal)
        second_lease = await _until(lambda: granted(holders[1]), 30)
        assert second_lease

        async def rows() -> dict[str, dict[str, Any]]:
            found = {row["lease_id"]: row for row in await stack.store.ledger() if row["capability"] == "fence.one@1"}
            return found if first_lease in found and second_lease in found and found[first_lease]["ended_at"] else {}

        ledger = await _until(rows, 20)
        assert ledger, "the two leases' rows never landed"
        first, second = ledger[first_lease], ledger[second_lease]
        assert first["ended_at"].timestamp() == pytest.approx(let_go, abs=0.01), "it ends when its holder let go"
        assert second["granted_at"] >= first["ended_at"], "granted before its room was let go"
        for holder in holders:
            await holder.terminate("test over")


async def test_a_deployment_removed_from_the_catalog_is_unloaded(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    async with running_stack(dev_server_env.client, database_url, catalog_path=FENCING) as stack:

        async def pinned_ready() -> bool:
            residents = (await stack.status()).residents
            return any(r.capability == "fence.pinned@1" and r.state == "ready" for r in residents)

        assert await _until(pinned_ready, 30), "the always_warm model never loaded"
        catalog, _ = load_catalog_file(FENCING)
        smaller = dataclasses.replace(
            catalog, deployments=[d for d in catalog.deployments if d.capability != "fence.pinned@1"]
        )
        await stack.store.apply_catalog(smaller)
        await stack.scheduler.signal(PoolSchedulerWorkflow.catalog_changed)

        async def gone() -> bool:
            return not any(r.capability == "fence.pinned@1" for r in (await stack.status()).residents)

        assert await _until(gone, 30), "a removed always_warm model stayed resident"
        unload = await stack.events("unload_requested", at_least=1)
        assert any("removed from the catalog" in e["message"] for e in unload)
        # The card's memory is schedulable again.
        status = await stack.status()
        card = next(a for a in status.accelerators if a.id == "route-b/0")
        assert card.resident_bytes == 0


async def test_status_says_the_catalog_is_loading_and_a_request_sent_then_is_served_after(
    dev_server_env: WorkflowEnvironment, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After `catalog apply`, until the scheduler has read the new catalog its admissions answer
    SCHEDULER_STATE_STALE (retryable) while its cards are still the old catalog's: `status`
    says so, and a request sent in that window waits and is served once the catalog is in."""
    async with running_stack(dev_server_env.client, database_url) as stack:
        assert not (await stack.status()).catalog_loading
        let_load = asyncio.Event()
        load = stack.store.load_catalog

        async def held_load() -> Any:  # the control worker's `load_catalog` activity reads this
            await let_load.wait()
            return await load()

        monkeypatch.setattr(stack.store, "load_catalog", held_load)
        await stack.scheduler.signal(PoolSchedulerWorkflow.catalog_changed)

        async def loading() -> bool:
            return (await stack.status()).catalog_loading

        assert await _until(loading, 30), "status never said the catalog was loading"
        sent = await stack.start_request("rag.embedding@1", tenant="rag", input={"text": "in the window"})
        await asyncio.sleep(1.0)
        status = await stack.status()
        assert status.catalog_loading and status.accelerators, "the cards it had stay shown"
        assert not any(status.queue_depth.values()), "admitted before the catalog was in"
        let_load.set()

        async def loaded() -> bool:
            return not (await stack.status()).catalog_loading

        assert await _until(loaded, 30), "status still says loading after the catalog came"
        result = await sent.result()  # (a failed request raises)
        assert result.lease is not None and result.output, result


async def test_postgres_down_across_continue_as_new_freezes_nothing_and_loses_nothing(
    dev_server_env: WorkflowEnvironment,
    outage_postgres: OwnPostgres,
) -> None:
    url = outage_postgres.server.get_uri()
    async with running_stack(dev_server_env.client, url, max_history_events=120, snapshot_interval_s=5.0) as stack:
        await (await stack.start_request("rag.embedding@1", tenant="rag")).result()
        await asyncio.to_thread(outage_postgres.stop)
        assert not reachable(url)
        first_run = await _run_id(stack.scheduler)
        leases: list[str] = []
        slowest = 0.0
        runs = {first_run}
        for n in range(30):
            started = time.monotonic()
            handle = await stack.start_request("rag.embedding@1", tenant="rag", input={"text": str(n)})
            result = await asyncio.wait_for(handle.result(), timeout=30)
            slowest = max(slowest, time.monotonic() - started)
            leases.append(result.lease.lease_id)
            runs.add(await _run_id(stack.scheduler))
        # Admission never waited on the database, continue-as-new included.
        assert len(runs) >= 3, "the scheduler did not continue as new during the outage"
        assert slowest < 10.0, f"a request took {slowest:.1f} s with Postgres down"
        assert not reachable(url)
        await asyncio.to_thread(outage_postgres.start)

        async def ledger_whole() -> list[dict[str, Any]]:
            try:
                rows = [r for r in await stack.store.ledger(limit=10_000) if r["lease_id"] in leases]
            except Exception:  # the test's own pool reconnects too
                return []
            return rows if len(rows) == len(leases) and all(r["ended_at"] for r in rows) else []

        rows = await _until(ledger_whole, 120, every_s=1.0)
        assert rows and len(rows) == len(leases), "ledger rows written during the outage were lost"
        events = await stack.store.list_events(kind="lease_granted", limit=1000)
        granted = [e for e in events if e["lease_id"] in leases]
        assert sorted(e["lease_id"] for e in granted) == sorted(leases), "a grant event was lost or doubled"


async def test_an_event_write_retried_through_an_outage_does_not_wake_the_scheduler(
    dev_server_env: WorkflowEnvironment,
    outage_postgres: OwnPostgres,
) -> None:
    # With Postgres down the event write is retried by Temporal (STORE_RETRY), in flight for as
    # long as the outage lasts. The scheduler used to arm its wake-up timer for the next write
    # anyway, find the write still in flight, and arm it again: two wake-ups a second, about
    # 10 history events a second, for nothing. Its completion is what wakes it now.
    url = outage_postgres.server.get_uri()
    async with running_stack(dev_server_env.client, url, snapshot_interval_s=0.0) as stack:
        await (await stack.start_request("rag.embedding@1", tenant="rag")).result()
        await asyncio.to_thread(outage_postgres.stop)
        try:
            # Records (and an urgent one: a refusal) while the write cannot land.
            await (await stack.start_request("rag.embedding@1", tenant="rag", input={"text": "x"})).result()
            refused = await stack.start_request("rag.embedding@1", tenant="nobody-has-this-tenant")
            with pytest.raises(WorkflowFailureError):
                await refused.result()
            await asyncio.sleep(2.0)  # that write is in flight and failing by now
            # Records buffered behind the write in flight: their write is due, and waits.
            await (await stack.start_request("rag.embedding@1", tenant="rag", input={"text": "y"})).result()
            before = (await stack.scheduler.describe()).history_length
            await asyncio.sleep(12.0)
            grown = (await stack.scheduler.describe()).history_length - before
        finally:
            await asyncio.to_thread(outage_postgres.start)
        # What remains: an observe signal per node every 10 s and its workflow task.
        assert grown / 12.0 < 2.0, f"the scheduler wrote {grown} history events in 12 idle seconds of an outage"
        refusals = await stack.events("request_refused", at_least=1, within_s=60)
        assert refusals, "the refusal recorded during the outage was lost"


async def test_an_admission_the_scheduler_never_answers_fails_typed_and_its_history_replays(
    dev_server_env: WorkflowEnvironment,
) -> None:
    # A scheduler no worker runs: the admission update is never answered. The request ends
    # TIMEOUT within its admission budget, and its history replays (a local activity ended by
    # Temporal's schedule-to-close timeout wrote one the SDK could not replay: the request was
    # wedged, found by bench/chaos.py).
    client = dev_server_env.client
    await client.start_workflow(
        PoolSchedulerWorkflow.run, SchedulerInput(pool="silent"), id="scheduler:silent", task_queue="nobody-serves"
    )
    queue = "admit-timeout"
    admission = AdmissionActivities(client)
    async with Worker(
        client,
        task_queue=queue,
        workflows=ALL_WORKFLOWS,
        activities=admission.activities(),
        workflow_runner=workflow_runner(),
    ):
        started = time.monotonic()
        handle = await client.start_workflow(
            CapabilityRequestWorkflow.run,
            RequestInput(request_id="unanswered", capability="rag.embedding@1", pool="silent"),
            id="request:rag.embedding@1:unanswered",
            task_queue=queue,
        )
        with pytest.raises(WorkflowFailureError) as failed:
            await handle.result()
        assert isinstance(failed.value.cause, ApplicationError) and failed.value.cause.type == "TIMEOUT"
        # (ended by the admission budget, which outlasts one timed-out scheduler task)
        assert time.monotonic() - started < ADMIT_BUDGET.total_seconds() + 30
    history = await handle.fetch_history()
    replay = await Replayer(workflows=ALL_WORKFLOWS, workflow_runner=workflow_runner()).replay_workflow(
        history, raise_on_replay_failure=False
    )
    assert replay.replay_failure is None, replay.replay_failure
