"""The replay guard (workers/replay_guard.py): a scheduler history that no worker can replay is
found and moved out of before it wedges the pool, and a run already wedged is reset.

- A recorded scheduler history of this release with two commands of one task in the other order
  (the fault the chaos bench caught after a Temporal restart mid-task: bench/evidence/) is
  flagged by the real replayer with the worker's own code, and its reset point is the end of the
  task before the bad commands; the history as recorded is not flagged.
- A live scheduler told its history is unreplayable continues as new from its cached state:
  the lease it holds, the request waiting behind it and the event log all survive, and the pool
  goes on serving.
- A run that really is wedged (every workflow task fails with a nondeterminism error because
  the code that wrote its history is gone) is reset by the guard and completes.
- A reset past a grant (the chaos bench's moment: a queued request granted in the lost part of
  the history, its lease run out in the reset run) leaves a lease the scheduler no longer knows
  while its ledger row is open and its holder invokes: the reset run reclaims it, closes the
  row and stops the holder, which asks again; and it grants nothing before that audit has
  answered, so a request queued behind gets the slot only once the forgotten lease is closed.
- What no ledger audit can see: an admission the lost run answered `queued` is sent again by the
  guard and decided by signal (before, the reset run granted it in a reply nobody read and its
  requester waited out its lease timeout), and a grant whose ledger row was never written is
  named to the reset run by the guard, written and reclaimed before its room is given again.
"""

from __future__ import annotations

import asyncio
import json
import tomllib
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from temporalio import workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHistory
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker
from temporalio.workflow import NondeterminismError

from modelforge.domain import resident_key
from modelforge.names import RESIDENCY_WORKFLOW_TYPE
from modelforge.policy import PolicyConfig
from tests.invoke_log import most_at_once
from workers.control import workflow_runner
from workers.replay_guard import ReplayGuard, replayer_check, reset_point
from workers.stack import running_stack
from workflows import PoolSchedulerWorkflow

pytestmark = pytest.mark.workflow

ROOT = Path(__file__).resolve().parents[2]
EVIDENCE = ROOT / "bench" / "evidence" / "scheduler_update_order_nde.json"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
GOOD = ROOT / "tests" / "histories" / VERSION / "scheduler.json"
FENCING = ROOT / "tests" / "catalogs" / "fencing.toml"
REORDERED = {"EVENT_TYPE_ACTIVITY_TASK_SCHEDULED", "EVENT_TYPE_TIMER_STARTED"}


def _commands_reordered(text: str) -> tuple[str, int]:
    """A recorded history with the first activity and timer a task started next to each other
    in the other order (their event ids, and the later events naming them, follow), as a worker
    answering from a stale cached run writes them; and the id of the first of the two."""
    history = json.loads(text)
    events = history["events"]
    for i in range(len(events) - 1):
        first, second = events[i], events[i + 1]
        if {first["eventType"], second["eventType"]} != REORDERED:
            continue
        moved = {str(first["eventId"]): str(second["eventId"]), str(second["eventId"]): str(first["eventId"])}
        first["eventId"], second["eventId"] = second["eventId"], first["eventId"]
        events[i], events[i + 1] = second, first
        for event in events[i + 2 :]:
            kind = event["eventType"]
            for attributes in event.values():
                if not isinstance(attributes, dict):
                    continue
                if "ACTIVITY" in kind and str(attributes.get("scheduledEventId")) in moved:
                    attributes["scheduledEventId"] = moved[str(attributes["scheduledEventId"])]
                if "TIMER" in kind and str(attributes.get("startedEventId")) in moved:
                    attributes["startedEventId"] = moved[str(attributes["startedEventId"])]
        return json.dumps(history), int(second["eventId"])
    raise AssertionError("no task started an activity and a timer next to each other")


async def test_the_unreplayable_history_is_flagged_and_a_good_one_is_not() -> None:
    from temporalio.converter import DataConverter

    check = replayer_check([PoolSchedulerWorkflow], workflow_runner(), DataConverter.default)
    text, bad_event = _commands_reordered(GOOD.read_text())
    bad = WorkflowHistory.from_json("scheduler:default", text)
    failure = await check(bad)
    assert isinstance(failure, NondeterminismError)
    assert f"HistoryEvent(id: {bad_event}," in str(failure)
    # The bad commands start at `bad_event`, written by the task that completed just before it:
    # the run restarts just before that task's commands, with its inputs applied again.
    completed = [
        event.event_id
        for event in bad.events
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and event.event_id < bad_event
    ]
    assert reset_point(bad, failure) == completed[-1]
    good = WorkflowHistory.from_json("scheduler:default", GOOD.read_text())
    assert await check(good) is None


async def test_a_run_written_by_a_newer_release_is_left_alone_not_rebased() -> None:
    """In a rolling upgrade a worker of the older release may check a run a newer one started:
    it holds patch markers this code does not know (here the chaos bench's evidence, written by
    a scheduler with patches this release does not have), and its replay fails here as it must.
    The guard leaves it alone (the newer workers run it) instead of rebasing or resetting it."""
    from temporalio.converter import DataConverter

    from workers.replay_guard import patch_ids
    from workflows.scheduler import SCHEDULER_PATCHES

    newer = WorkflowHistory.from_json("scheduler:default", EVIDENCE.read_text())
    assert patch_ids(newer) - SCHEDULER_PATCHES
    strict = replayer_check([PoolSchedulerWorkflow], workflow_runner(), DataConverter.default)
    assert isinstance(await strict(newer), NondeterminismError), "this code cannot replay it"
    guarded = replayer_check([PoolSchedulerWorkflow], workflow_runner(), DataConverter.default, SCHEDULER_PATCHES)
    assert await guarded(newer) is None
    # A fault in a run of this release is still one.
    bad = WorkflowHistory.from_json("scheduler:default", _commands_reordered(GOOD.read_text())[0])
    assert isinstance(await guarded(bad), NondeterminismError)


def test_every_patch_a_recorded_scheduler_history_holds_is_one_this_release_knows() -> None:
    from workers.replay_guard import patch_ids
    from workflows.scheduler import SCHEDULER_PATCHES

    seen: set[str] = set()
    for path in sorted((ROOT / "tests" / "histories").glob("*/scheduler*.json")):
        seen |= patch_ids(WorkflowHistory.from_json("scheduler:default", path.read_text()))
    assert seen <= SCHEDULER_PATCHES, seen - SCHEDULER_PATCHES


async def test_a_live_scheduler_with_an_unreplayable_history_moves_to_a_clean_run(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    config = PolicyConfig(stale_lease_s=30.0, freshness_s=300.0, node_silent_s=600.0)
    async with running_stack(
        dev_server_env.client, database_url, catalog_path=FENCING, config=config, adopt_interval_s=3600
    ) as stack:
        holder = await stack.start_request("fence.one@1", tenant="app", input={"simulate_invoke_s": 12})

        async def holder_holds() -> bool:
            return (await stack.status()).active_leases == 1

        # Started together, either could reach the scheduler first: the second is started only
        # once the slow one holds the card's one slot.
        assert await _until(holder_holds, 30)
        waiting = await stack.start_request("fence.one@1", tenant="app")

        async def one_holds_one_waits() -> bool:
            status = await stack.status()
            return status.active_leases == 1 and sum(status.queue_depth.values()) == 1

        assert await _until(one_holds_one_waits, 30)
        old_run = (await stack.scheduler.describe()).run_id
        verdicts: list[str] = []

        async def says_unreplayable(history: WorkflowHistory) -> Exception | None:
            # The guard's I/O is injected: this stands for the real replayer finding the fault
            # the chaos bench found (its own test is above); everything else here is real.
            verdicts.append(history.workflow_id)
            return NondeterminismError("[TMPRL1100] Nondeterminism error: HistoryEvent(id: 12, TimerStarted)")

        guard = ReplayGuard(stack.client, ["scheduler:default"], says_unreplayable, rebase_wait_s=20)
        [outcome] = await guard.check_all()
        assert outcome.outcome == "rebased", outcome
        assert verdicts == ["scheduler:default"]
        new = await stack.scheduler.describe()
        assert new.run_id != old_run
        status = await stack.status()
        assert status.active_leases == 1, "the lease held across the move was lost"
        assert sum(status.queue_depth.values()) == 1, "the waiting request was lost"
        assert (await holder.result()).output
        assert (await waiting.result()).output, "the request queued before the move was never granted"
        after = await stack.start_request("fence.one@1", tenant="app")
        assert (await after.result()).output
        rebased = await stack.events("scheduler_rebased", at_least=1, within_s=20)
        assert rebased and "cannot be replayed" in rebased[0]["message"]
        released = await stack.events("lease_released", at_least=3, within_s=20)
        assert len(released) >= 3


# Holders heard from stay held for 30 s and unheard ones for 150 s: neither rule of silence
# reclaims anything in these tests, so a row closed here was closed by the reset run's audit.
SILENCE_RECLAIMS_NOTHING = PolicyConfig(stale_lease_s=30.0, freshness_s=300.0, node_silent_s=600.0)


async def _reset_past_a_grant(stack: Any, queued_behind: Any = None) -> tuple[Any, Any, str, dict[str, Any]]:
    """The chaos bench's moment: a request (the second) queued behind the first, granted when it
    ends and running long, and the scheduler reset to the task before that grant once the
    second's lease timeout has run out (so the reset run refuses it rather than granting it
    again: the grant made before is forgotten). `queued_behind`: awaited right after the second
    starts (it queues more behind it, before the grant). The first and second requests, the
    forgotten lease and its ledger row once closed."""
    first = await stack.start_request("fence.one@1", tenant="app", input={"simulate_invoke_s": 3})

    async def first_holds() -> bool:
        return (await stack.status()).active_leases == 1

    assert await _until(first_holds, 30)
    second = await stack.start_request("fence.one@1", tenant="app", lease_timeout_s=8, input={"simulate_invoke_s": 15})
    submitted = asyncio.get_running_loop().time()
    if queued_behind is not None:
        await queued_behind()

    async def second_granted() -> list[dict[str, Any]]:
        rows = await stack.store.ledger()
        return [r for r in rows if r["request_id"] == second.id.rsplit(":", 1)[1]]

    [row] = await _until(second_granted, 30)
    lease_id = row["lease_id"]
    assert row["ended_at"] is None
    run_id = (await stack.scheduler.describe()).run_id or ""
    history = await stack.client.get_workflow_handle("scheduler:default", run_id=run_id).fetch_history()
    grant = next(
        e.event_id
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED
        and e.signal_external_workflow_execution_initiated_event_attributes.workflow_execution.workflow_id == second.id
    )
    point = max(
        e.event_id
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and e.event_id < grant
    )
    await asyncio.sleep(max(0.0, submitted + 9.5 - asyncio.get_running_loop().time()))
    guard = ReplayGuard(stack.client, ["scheduler:default"], _never_called)
    await guard.reset("scheduler:default", run_id, point, "a test resets past a grant")
    assert (await stack.scheduler.describe()).run_id != run_id

    async def row_closed() -> dict[str, Any] | None:
        [now] = await stack.store.ledger(lease_id=lease_id)
        return now if now["ended_at"] is not None else None

    closed = await _until(row_closed, 30)
    assert closed is not None, f"the ledger row of {lease_id}, forgotten by the reset, stayed open"
    assert "no longer held" in closed["outcome"]
    reclaimed = [e for e in await stack.events("lease_reclaimed", at_least=1) if e["lease_id"] == lease_id]
    assert reclaimed and reclaimed[0]["workflow_id"] == second.id
    return first, second, lease_id, closed


async def _no_lease_left(stack: Any) -> None:
    async def idle() -> bool:
        return (await stack.status()).active_leases == 0

    assert await _until(idle, 30)

    async def closed() -> bool:  # the release events are written after the scheduler's pass
        return all(r["ended_at"] is not None for r in await stack.store.ledger())

    await _until(closed, 30)
    rows = await stack.store.ledger()
    assert [r["lease_id"] for r in rows if r["ended_at"] is None] == []


async def test_a_reset_past_a_grant_reclaims_the_lease_it_forgot(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    async with running_stack(
        dev_server_env.client,
        database_url,
        catalog_path=FENCING,
        config=SILENCE_RECLAIMS_NOTHING,
        adopt_interval_s=3600,
    ) as stack:
        first, second, lease_id, _ = await _reset_past_a_grant(stack)
        # Its holder was stopped at once (preempted with no grace, not after its invoke) and
        # asked again: it ran on a lease of its own.
        result = await asyncio.wait_for(second.result(), timeout=60)
        assert result.timings["preemptions"] == 1, result.timings
        assert result.lease.lease_id != lease_id
        assert (await first.result()).output
        after = await stack.start_request("fence.one@1", tenant="app")
        assert (await after.result()).output
        await _no_lease_left(stack)


async def test_a_reset_run_grants_nothing_before_its_audit_has_answered(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request queued behind the second (before the grant the reset forgets): the reset run
    finds the card's one slot free and must not give it away before its audit has reclaimed the
    forgotten lease (seen in a chaos round: the room granted again at once, the ledger showing it
    held twice for 16 s), nor before the second's holder, told to stop, has stopped its invoke
    (seen in a later round: the card ran it beside the next grant's for 0.3 s)."""
    invoke_log = tmp_path / "invokes.jsonl"
    monkeypatch.setenv("MODELFORGE_SIMULATED_INVOKE_LOG", str(invoke_log))
    async with running_stack(
        dev_server_env.client,
        database_url,
        catalog_path=FENCING,
        config=SILENCE_RECLAIMS_NOTHING,
        adopt_interval_s=3600,
    ) as stack:
        third: list[Any] = []

        async def queue_a_third() -> None:
            async def second_queued() -> bool:  # so that the third queues behind it
                return sum((await stack.status()).queue_depth.values()) == 1

            assert await _until(second_queued, 30)
            third.append(await stack.start_request("fence.one@1", tenant="app", input={"simulate_invoke_s": 1}))

            async def queued() -> bool:  # the second and the third
                return sum((await stack.status()).queue_depth.values()) == 2

            assert await _until(queued, 30)

        first, second, _, closed = await _reset_past_a_grant(stack, queued_behind=queue_a_third)
        assert (await asyncio.wait_for(third[0].result(), timeout=60)).output

        async def third_granted() -> list[dict[str, Any]]:  # the ledger trails the answer by a write
            return [r for r in await stack.store.ledger() if r["request_id"] == third[0].id.rsplit(":", 1)[1]]

        [row] = await _until(third_granted, 30)
        assert row["granted_at"] >= closed["ended_at"], (row["granted_at"], closed["ended_at"])
        # The second, stopped at the reclaim, asked again and ran after the third.
        result = await asyncio.wait_for(second.result(), timeout=60)
        assert result.timings["preemptions"] == 1, result.timings
        assert result.lease.lease_id != row["lease_id"]
        assert (await first.result()).output
        await _no_lease_left(stack)
        # The card's own record: the forgotten lease's invoke had stopped before the third's
        # started, one at a time on the one slot.
        assert most_at_once(invoke_log, resident_key("fence.one@1", "route-a/0")) == 1, invoke_log.read_text()


async def test_a_reset_sends_its_admissions_again_and_reclaims_a_grant_never_written(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    """The two things a reset discards that no audit of the ledger can see (both seen in the
    chaos round): an admission the lost run answered `queued` and the reset run, deciding it
    again, granted in a reply nobody reads (its requester waited for a word until its lease
    timeout, the slot held for nobody); and a grant whose `lease_granted` was never written (the
    lost run's event writes are lazy), so its holder invoked on room given again. Here the
    fourth (interactive) arrives while the second (background) holds the slot, and the
    second's ledger row and grant event are deleted before the reset, as a write lost with the
    run. The reset run must admit the fourth by signal and serve it, and reclaim the second's
    lease (its row written now, then closed) before giving the slot to anyone."""
    async with running_stack(
        dev_server_env.client,
        database_url,
        catalog_path=FENCING,
        config=SILENCE_RECLAIMS_NOTHING,
        adopt_interval_s=3600,
    ) as stack:
        first = await stack.start_request("fence.one@1", tenant="app", input={"simulate_invoke_s": 3})

        async def first_holds() -> bool:
            return (await stack.status()).active_leases == 1

        assert await _until(first_holds, 30)
        second = await stack.start_request(
            "fence.one@1", tenant="app", priority="background", lease_timeout_s=8, input={"simulate_invoke_s": 15}
        )
        submitted = asyncio.get_running_loop().time()
        second_id = second.id.rsplit(":", 1)[1]

        async def second_granted() -> list[dict[str, Any]]:
            return [r for r in await stack.store.ledger() if r["request_id"] == second_id]

        [row] = await _until(second_granted, 30)
        lease_id = row["lease_id"]
        fourth = await stack.start_request(
            "fence.one@1", tenant="app", lease_timeout_s=60, input={"simulate_invoke_s": 1}
        )

        async def fourth_queued() -> bool:
            return sum((await stack.status()).queue_depth.values()) == 1

        assert await _until(fourth_queued, 30)
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            await conn.execute("DELETE FROM lease_ledger WHERE lease_id = %s", (lease_id,))
            await conn.execute("DELETE FROM events WHERE lease_id = %s AND kind = 'lease_granted'", (lease_id,))
        run_id = (await stack.scheduler.describe()).run_id or ""
        history = await stack.client.get_workflow_handle("scheduler:default", run_id=run_id).fetch_history()
        grant = next(
            e.event_id
            for e in history.events
            if e.event_type == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED
            and e.signal_external_workflow_execution_initiated_event_attributes.workflow_execution.workflow_id
            == second.id
        )
        point = max(
            e.event_id
            for e in history.events
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and e.event_id < grant
        )
        await asyncio.sleep(max(0.0, submitted + 9.5 - asyncio.get_running_loop().time()))
        reset_at = asyncio.get_running_loop().time()
        await ReplayGuard(stack.client, ["scheduler:default"], _never_called).reset(
            "scheduler:default", run_id, point, "a test resets past a grant never written"
        )
        # Served, by signal, well before its lease timeout (60 s): before, it waited all of it.
        assert (await asyncio.wait_for(fourth.result(), timeout=45)).output
        assert asyncio.get_running_loop().time() - reset_at < 30

        async def row_closed() -> dict[str, Any] | None:
            rows = await stack.store.ledger(lease_id=lease_id)
            return rows[0] if rows and rows[0]["ended_at"] is not None else None

        closed = await _until(row_closed, 30)
        assert closed is not None, f"the lost grant {lease_id} has no ledger row, or it stayed open"
        assert "no longer held" in closed["outcome"]
        [granted] = [e for e in await stack.events("lease_granted", at_least=1) if e["lease_id"] == lease_id]
        assert granted["payload"]["forgotten"] is True

        async def fourth_granted() -> list[dict[str, Any]]:  # the ledger trails the grant by a write
            return [r for r in await stack.store.ledger() if r["request_id"] == fourth.id.rsplit(":", 1)[1]]

        [served] = await _until(fourth_granted, 30)
        assert served["granted_at"] >= closed["ended_at"], (served["granted_at"], closed["ended_at"])
        # The second, stopped at the reclaim, asked again and ran on a lease of its own.
        result = await asyncio.wait_for(second.result(), timeout=60)
        assert result.timings["preemptions"] == 1, result.timings
        assert result.lease.lease_id != lease_id
        assert (await first.result()).output
        await _no_lease_left(stack)


def _slow_fence_catalog(tmp_path: Path, fast: bool = False) -> Path:
    """The fencing catalog with fence.one loading in 8 s (a reset lands while it loads), and,
    when `fast`, fence.fast@1 on the same card loading in 0.2 s."""
    text = FENCING.read_text()
    one = 'load_s = 0.2\naccelerators = ["route-a/0"]'
    assert text.count(one) == 1
    text = text.replace(one, 'load_s = 8\naccelerators = ["route-a/0"]')
    if fast:
        text += """
[[deployments]]
capability = "fence.fast@1"
envelope_bytes = 2147483648        # 2 GiB
residency = "keep_warm"
ttl_s = 3600
load_s = 0.2
accelerators = ["route-a/0"]
measured_on = ["Simulated 24GB"]
runtime = "simulated"
"""
    catalog = tmp_path / "slow_load.toml"
    catalog.write_text(text)
    return catalog


async def _residency_started(stack: Any, run_id: str, capability: str, within_s: float = 30) -> tuple[int, str]:
    """The event id that started the scheduler run's residency of `capability`, and its id."""
    scheduler = stack.client.get_workflow_handle("scheduler:default", run_id=run_id)

    async def started() -> tuple[int, str] | None:
        for event in (await scheduler.fetch_history()).events:
            if event.event_type == EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_STARTED:
                child = event.child_workflow_execution_started_event_attributes
                if child.workflow_execution.workflow_id.startswith(f"resident:{capability}:"):
                    return child.initiated_event_id, child.workflow_execution.workflow_id
        return None

    found = await _until(started, within_s)
    assert found is not None, f"no residency was started for {capability}"
    return found


async def _reset_before(stack: Any, run_id: str, initiated: int) -> list[Any]:
    """Reset the scheduler's run to the end of the workflow task before event `initiated`, by
    the replay guard; the events of the run's history as it was."""
    history = await stack.client.get_workflow_handle("scheduler:default", run_id=run_id).fetch_history()
    point = max(
        e.event_id
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and e.event_id < initiated
    )
    await ReplayGuard(stack.client, ["scheduler:default"], _never_called).reset(
        "scheduler:default", run_id, point, "a test resets past the start of a load"
    )
    assert (await stack.scheduler.describe()).run_id != run_id
    return [e for e in history.events if e.event_id > point]


async def _residencies(stack: Any, capability: str) -> dict[str, str]:
    """Each residency run of `capability`: its status, and its result once closed."""
    runs: dict[str, str] = {}
    async for run in stack.client.list_workflows(f"WorkflowType = '{RESIDENCY_WORKFLOW_TYPE}'"):
        if run.id.startswith(f"resident:{capability}:"):
            status = run.status.name if run.status is not None else "?"
            if status == "COMPLETED":
                status += ": " + str(await stack.client.get_workflow_handle(run.id).result())
            runs[run.id] = status
    return runs


async def test_a_reset_past_a_load_adopts_the_residency_it_started(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    """A reset past the start of a load (seen once in a 15-minute chaos round, a request refused
    `RESIDENCY_CONFLICT`): the reset run decides the same load again, with the same residency
    id (the load counter rewound with it), while the residency the lost run started is still
    loading. Its start is refused (that run exists); before, the refusal was taken for a failed
    load and the request waiting on it was refused, while the model went on loading on the card
    for nobody. The reset run adopts the running residency: the request is served from it, the
    card loads the model once, and a later request finds it warm."""
    async with running_stack(
        dev_server_env.client,
        database_url,
        catalog_path=_slow_fence_catalog(tmp_path),
        config=SILENCE_RECLAIMS_NOTHING,
        adopt_interval_s=3600,
    ) as stack:
        request = await stack.start_request("fence.one@1", tenant="app", lease_timeout_s=60)
        run_id = (await stack.scheduler.describe()).run_id or ""
        initiated, residency_id = await _residency_started(stack, run_id, "fence.one@1")
        assert await stack.client.get_workflow_handle(residency_id).query("phase") == "loading"
        discarded = await _reset_before(stack, run_id, initiated)
        # Served from the residency the lost run started (before: refused RESIDENCY_CONFLICT).
        result = await asyncio.wait_for(request.result(), timeout=45)
        assert result.output
        assert result.lease.resident_key == resident_key("fence.one@1", "route-a/0")
        [resident] = [r for r in (await stack.status()).residents if r.capability == "fence.one@1"]
        assert (resident.state, resident.workflow_id) == ("ready", residency_id)
        # The always-warm model of the other card, when its start was decided in the same pass
        # (the request came before the first pass) or later, is adopted too, not loaded again.
        pinned_started = [
            e.start_child_workflow_execution_initiated_event_attributes.workflow_id
            for e in discarded
            if e.event_type == EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED
        ]
        pinned_started.remove(residency_id)
        heard = await stack.events("residency_adopted", at_least=1 + len(pinned_started))
        adopted = {e["deployment"]: e for e in heard}
        assert adopted["fence.one@1"]["workflow_id"] == residency_id
        assert "its start was refused" in adopted["fence.one@1"]["message"]
        for pinned_id in pinned_started:
            assert adopted["fence.pinned@1"]["workflow_id"] == pinned_id
            # By its report, or, when the reset came before its report, by its start refused.
            message = adopted["fence.pinned@1"]["message"]
            assert "heard loaded" in message or "its start was refused" in message, message

            async def pinned_ready() -> bool:
                [pinned] = [r for r in (await stack.status()).residents if r.capability == "fence.pinned@1"]
                return pinned.state == "ready" and pinned.workflow_id == pinned_id  # noqa: B023

            assert await _until(pinned_ready, 20)
        # The card loaded it once: one residency run of the model, and the next request is warm.
        after = await stack.start_request("fence.one@1", tenant="app")
        assert (await asyncio.wait_for(after.result(), timeout=30)).output
        assert await _residencies(stack, "fence.one@1") == {residency_id: "RUNNING"}
        if pinned_started:
            assert await _residencies(stack, "fence.pinned@1") == dict.fromkeys(pinned_started, "RUNNING")
        await _no_lease_left(stack)


async def test_a_reset_past_two_loads_decided_again_under_other_ids_loads_each_once(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    """Two loads on one card past the reset point: a fast model's (loaded and served before the
    reset), then a slow one's (still loading). The reset run adopts the fast one by its report
    (reapplied with the reset) and decides the slow one again with the load counter rewound: under
    another residency id than the one still loading, so its start succeeds. The card must not
    load the slow model twice (before, two loads of one key at once loaded it twice, one copy
    known to nobody), and the residency that lost its key must end, not wait for commands for
    ever (its report was ignored): the node shares the load under way, and the residency whose
    key another holds is told it is lost (it ends without unloading the model the other
    shares). The slow request is served, one residency of each model is left."""
    async with running_stack(
        dev_server_env.client,
        database_url,
        catalog_path=_slow_fence_catalog(tmp_path, fast=True),
        config=SILENCE_RECLAIMS_NOTHING,
        adopt_interval_s=3600,
    ) as stack:
        fast = await stack.start_request("fence.fast@1", tenant="app", lease_timeout_s=60)
        assert (await asyncio.wait_for(fast.result(), timeout=30)).output
        run_id = (await stack.scheduler.describe()).run_id or ""
        initiated, fast_id = await _residency_started(stack, run_id, "fence.fast@1")
        slow = await stack.start_request("fence.one@1", tenant="app", lease_timeout_s=60)
        _, lost_id = await _residency_started(stack, run_id, "fence.one@1")
        assert await stack.client.get_workflow_handle(lost_id).query("phase") == "loading"
        await _reset_before(stack, run_id, initiated)
        assert (await asyncio.wait_for(slow.result(), timeout=45)).output
        residents = {r.capability: r for r in (await stack.status()).residents}
        assert (residents["fence.fast@1"].state, residents["fence.fast@1"].workflow_id) == ("ready", fast_id)
        slow_id = residents["fence.one@1"].workflow_id
        assert residents["fence.one@1"].state == "ready" and slow_id != lost_id

        async def settled() -> dict[str, str] | None:
            runs = await _residencies(stack, "fence.one@1")
            return runs if runs.get(lost_id, "").startswith("COMPLETED") else None

        runs = await _until(settled, 30)
        assert runs is not None, await _residencies(stack, "fence.one@1")
        assert runs[slow_id] == "RUNNING" and runs[lost_id].startswith("COMPLETED: lost"), runs
        assert len(runs) == 2, runs
        assert await _residencies(stack, "fence.fast@1") == {fast_id: "RUNNING"}

        # The node loaded the slow model once: its one load, 8 s, shared by both residencies.
        async def slow_loads() -> list[str]:  # the event log trails the workflows by a moment
            loads = await stack.events("load", at_least=1)
            return [e["workflow_id"] for e in loads if e["deployment"] == "fence.one@1"]

        assert await _until(slow_loads, 10) == [slow_id]
        await _no_lease_left(stack)


async def _never_called(history: WorkflowHistory) -> Exception | None:
    raise AssertionError("the test resets the run itself")


# A workflow whose code changes under a running execution, as a stale cache's commands do: the
# history written by the first version cannot be replayed by the second, so every workflow task
# of the second fails with a nondeterminism error, for good.
@workflow.defn(name="GuardToyWorkflow", sandboxed=False)
class _WroteTheHistory:
    def __init__(self) -> None:
        self._go = False

    @workflow.signal
    def go(self) -> None:
        self._go = True

    @workflow.signal
    def poke(self) -> None:
        pass

    @workflow.run
    async def run(self) -> str:
        await workflow.wait_condition(lambda: self._go)
        await workflow.sleep(3600)  # TimerStarted
        return "first"


@workflow.defn(name="GuardToyWorkflow", sandboxed=False)
class _ReplaysIt:
    def __init__(self) -> None:
        self._go = False

    @workflow.signal
    def go(self) -> None:
        self._go = True

    @workflow.signal
    def poke(self) -> None:
        pass

    @workflow.run
    async def run(self) -> str:
        await workflow.wait_condition(lambda: self._go)
        workflow.upsert_memo({"took": "the other path"})  # where the history has TimerStarted
        await workflow.sleep(0.1)
        return "after reset"


async def test_a_wedged_run_is_reset_and_completes(dev_server_env: WorkflowEnvironment) -> None:
    client = dev_server_env.client
    queue = f"guard-{uuid.uuid4()}"
    workflow_id = f"guard-toy-{uuid.uuid4()}"
    async with Worker(client, task_queue=queue, workflows=[_WroteTheHistory]):
        handle = await client.start_workflow("GuardToyWorkflow", id=workflow_id, task_queue=queue)
        await handle.signal("go")
        await _until(lambda: _has_timer(client, workflow_id), 10)
    # A fresh worker with the other code: it has nothing cached and must replay.
    async with Worker(client, task_queue=queue, workflows=[_ReplaysIt]):
        await handle.signal("poke")

        async def failing() -> bool:
            pending = (await handle.describe()).raw_description.pending_workflow_task
            return pending.attempt >= 2

        assert await _until(failing, 30), "the run never wedged"
        guard = ReplayGuard(
            client,
            [workflow_id],
            replayer_check([_ReplaysIt], workflow_runner(), client.data_converter),
            rebase_wait_s=2,
        )
        [outcome] = await guard.check_all()
        assert outcome.outcome == "reset", outcome
        result = await asyncio.wait_for(client.get_workflow_handle(workflow_id).result(), timeout=30)
        assert result == "after reset"


async def _has_timer(client: Client, workflow_id: str) -> bool:
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    return any(event.HasField("timer_started_event_attributes") for event in history.events)


async def _until(check: Any, within_s: float, every_s: float = 0.2) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        found = await check()
        if found or loop.time() > deadline:
            return found
        await asyncio.sleep(every_s)


async def test_checks_follow_an_outage_and_the_interval() -> None:
    rounds: list[float] = []
    health = iter([True, True, False, False, True] + [True] * 1000)

    class _Guard(ReplayGuard):
        async def _reachable(self) -> bool:
            return next(health)

        async def check_all(self) -> list[Any]:
            rounds.append(asyncio.get_running_loop().time())
            return []

    guard = _Guard(None, [], None, interval_s=10.0, health_interval_s=0.01, after_outage_s=(0.05, 0.1))  # type: ignore[arg-type]
    task = asyncio.create_task(guard.run())
    await asyncio.sleep(0.6)
    task.cancel()
    # No round in the first interval (it starts 5 s in), then two right after the outage ended.
    assert len(rounds) == 2, rounds
