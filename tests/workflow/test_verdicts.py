"""Verdicts on the real dev server: a queued request's verdict is readable by query (by pool and
by request id, through modelforge/verdicts.py and the CLI), names what it waits for, changes
when the blocking lease ends, and the dry run answers without a history event."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from temporalio.testing import WorkflowEnvironment
from typer.testing import CliRunner

from modelforge.client import ModelForgeClient
from modelforge.verdicts import CheckSpec, admission_check, pool_verdicts, request_verdict
from workers.stack import Stack, running_stack

pytestmark = pytest.mark.workflow

CATALOG = Path(__file__).resolve().parents[1] / "catalogs" / "queueing.toml"
JOB = "train.pinned@1"


async def _leased(stack: Stack) -> None:
    while not (await stack.status()).active_leases:
        await asyncio.sleep(0.1)


async def _queued(client: ModelForgeClient, count: int) -> list[Any]:
    for _ in range(100):
        found = await pool_verdicts(client, "default")
        if len(found) >= count and all(v.message for v in found):
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"fewer than {count} decided verdicts: {found}")


async def _history_length(stack: Stack) -> int:
    return (await stack.scheduler.describe()).raw_description.workflow_execution_info.history_length


async def test_a_queued_requests_verdict_is_readable_and_follows_the_blocking_lease(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    from modelforge import cli

    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        client = ModelForgeClient(stack.client, pool="default")
        # The holder runs 15 s (long enough for every look below), bounded by a 60 s max_duration.
        holder = await stack.start_request(
            JOB, tenant="lab", request_id="holder", max_duration_s=60.0, input={"simulate_invoke_s": 15}
        )
        await _leased(stack)
        # The holder takes the resident's one slot (concurrency 1): two more jobs wait, one behind the other.
        second = await stack.start_request(
            JOB, tenant="lab", request_id="second", lease_timeout_s=60, input={"simulate_invoke_s": 5}
        )
        await _queued(client, 1)  # second is in the queue before third asks
        third = await stack.start_request(JOB, tenant="lab", request_id="third", lease_timeout_s=60)
        first_look = await _queued(client, 2)
        assert [v.request_id for v in first_look] == ["second", "third"]
        waiting = first_look[0]
        assert (waiting.reason, waiting.position_in_class, waiting.class_depth) == ("concurrency_full", 1, 2)
        assert any(h.kind == "lease" and "holder" in h.who for h in waiting.held_by), waiting.held_by
        # Nothing measured yet: the holder's max_duration bounds when its room comes back; a
        # bound, given as one, never as the ETA.
        assert (waiting.eta_basis, waiting.eta_quality, waiting.eta_s) == ("queue_service", "bound", None), waiting
        assert waiting.eta_at_most_s is not None and 40.0 <= waiting.eta_at_most_s <= 61.0
        by_id = await request_verdict(client, "third")
        assert by_id is not None and by_id.position_in_class == 2
        assert json.loads(json.dumps(by_id.to_json()))["position"]["in_class"] == 2

        # The dry run: later (it would wait), never for what cannot be served; no history event.
        before = await _history_length(stack)
        later = await admission_check(client, CheckSpec(JOB, tenant="lab"))
        never = await admission_check(client, CheckSpec("nothing.here@1", tenant="lab"))
        assert later.answer == "later" and later.verdict is not None and later.verdict.reason == "concurrency_full"
        # Behind both that wait (a query runs at the time third was queued: no tie puts it first).
        assert (later.verdict.position_in_class, later.verdict.class_depth) == (3, 3), later.verdict
        assert (never.answer, never.failure) == ("never", "CAPABILITY_UNAVAILABLE")
        assert await _history_length(stack) == before
        assert len(await pool_verdicts(client, "default")) == 2  # the probe was never queued

        # The CLI reads the same verdicts.
        env = {
            "MODELFORGE_TEMPORAL_ADDRESS": dev_server_env.client.service_client.config.target_host,
            "MODELFORGE_HOME": str(tmp_path),
            "MODELFORGE_POOLS": "default",
            "COLUMNS": "200",  # an operator's terminal: the table's columns whole
        }
        runner = CliRunner()

        async def run(*args: str) -> Any:
            return await asyncio.to_thread(runner.invoke, cli.app, list(args), env=env)

        listed = await run("queue", "--json")
        assert listed.exit_code == 0, listed.output
        assert [v["request_id"] for v in json.loads(listed.stdout)] == ["second", "third"]
        table = await run("queue")
        assert table.exit_code == 0 and "concurrency_full" in table.stdout and "third" in table.stdout, table.output
        why = await run("why", "second")
        assert why.exit_code == 0 and "position: 1 of 2" in why.stdout and "holder" in why.stdout, why.output
        assert "eta: at most" in why.stdout and "max_duration" in why.stdout, why.output
        assert "<=" in table.stdout, table.output  # the queue's eta column: an upper bound
        gone = await run("why", "nobody-waits")
        assert gone.exit_code == 1 and "not waiting" in gone.stdout
        dry = await run("request", JOB, "--tenant", "lab", "--dry-run", "--json")
        assert dry.exit_code == 0 and json.loads(dry.stdout)["answer"] == "later", dry.output
        dry_never = await run("request", "nothing.here@1", "--tenant", "lab", "--dry-run")
        assert dry_never.exit_code == 1 and "never" in dry_never.stdout, dry_never.output

        # The holder's lease ends: `second` is granted, `third` moves up and waits on it now.
        await holder.result()
        for _ in range(100):
            moved = await request_verdict(client, "third")
            if moved is not None and moved.position_in_class == 1:
                break
            await asyncio.sleep(0.1)
        assert moved is not None and (moved.position_in_class, moved.class_depth) == (1, 1)
        assert any("second" in h.who for h in moved.held_by), moved.held_by
        assert await request_verdict(client, "second") is None
        await second.result()
        await third.result()
        # Their first verdicts were bounds, no ETA: their grants have no error to say.
        grants = {e["request_id"]: e for e in await stack.events("lease_granted", at_least=3)}
        assert "eta_error_s" not in grants["second"]["payload"], grants["second"]
        # With service measured now (three runs), one that waits gets an ETA, and its grant says
        # how far off it was.
        # (Through the client, as an application sends it: it measures the input.)
        again = asyncio.create_task(client.request(JOB, {"simulate_invoke_s": 3}, tenant="lab", request_id="again"))
        await _leased(stack)
        fourth = await stack.start_request(JOB, tenant="lab", request_id="fourth", lease_timeout_s=60)
        [waits] = await _queued(client, 1)
        assert (waits.request_id, waits.eta_quality, waits.eta_samples) == ("fourth", "measured", 3), waits
        assert waits.eta_s is not None and waits.eta_at_most_s is None
        assert (await again).ok
        await fourth.result()
        grants = {e["request_id"]: e for e in await stack.events("lease_granted", at_least=5)}
        assert "eta_error_s" in grants["fourth"]["payload"] and grants["fourth"]["payload"]["eta_reason"]
        # What it asked for, its input's size included (the record's what-if replays it).
        assert grants["again"]["payload"]["input_bytes"] == len(json.dumps({"simulate_invoke_s": 3}))
