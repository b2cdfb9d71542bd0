"""The dry run against the real admission right after it, on a live stack: the agreement figure
of bench/verdicts.py's part 2, taken where the two answers do not come from one state and one
function but from a query of the running scheduler and, a moment later, the admission a client's
real request got (other traffic in between, as for any caller).

A real dev stack (the Temporal dev server, an embedded Postgres, the control worker and a node
worker with a simulated 24 GiB card, in this process, as bench/whatif_fidelity.py runs them;
catalog bench/catalogs/whatif_fidelity.toml: a chat model at concurrency 2, an embedding model at
1, a lab model loaded on demand) serves background chat and embedding traffic that keeps the
card busy, and a case runs every `--every-s`:

1. `modelforge.verdicts.admission_check` for a mixed request (every capability and its tenant,
   one in five with a deadline of 5 or 60 s, a capability no catalog has, an unknown tenant
   every 20th): `now`, `later` or `never`;
2. at once, the same request for real through `ModelForgeClient.request` (routed, started,
   admitted as any client's), and what its admission answered, read from its own workflow:
   `now` when it was granted a lease at admission (a lease the scheduler granted in its reply,
   or a slot its node lent it), `later` when it was queued, `never` when it was refused.

It prints the agreement, the real answers by kind, the disagreements (the first ten), and the
scheduler's history events during a burst of checks beside the same time without them (a check
is a query: it must add none).

    .venv/bin/python -m bench.verdicts_live              # 1,000 cases
    .venv/bin/python -m bench.verdicts_live --cases 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from modelforge.client import ModelForgeClient
from modelforge.dev import temporal_binary
from modelforge.logging import configure
from modelforge.names import request_workflow_id
from modelforge.temporal import register_search_attributes
from modelforge.verdicts import CheckSpec, admission_check
from workers.stack import Stack, running_stack

CATALOG = Path(__file__).parent / "catalogs" / "whatif_fidelity.toml"
TENANT_OF = {"chat@1": "app", "embed@1": "rag", "lab@1": "lab", "giant@1": "app"}


async def _background(client: ModelForgeClient, stop: asyncio.Event, seed: int) -> Counter[str]:
    """Chat calls at 0.3/s of 2-4 s on its 2 slots and embeddings at 0.25/s of 1-2 s on its 1:
    with the cases' own calls, the card busy and queues that come and go."""
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    running: set[asyncio.Task[None]] = set()

    async def one(capability: str, seconds: float) -> None:
        result = await client.request(
            capability, {"simulate_invoke_s": seconds}, tenant=TENANT_OF[capability], lease_timeout_s=60
        )
        outcomes[result.failure_class or "ok"] += 1

    next_at = {"chat@1": 0.0, "embed@1": 0.0}
    began = time.monotonic()
    while not stop.is_set():
        now = time.monotonic() - began
        for capability, rate, low, high in (("chat@1", 0.3, 2.0, 4.0), ("embed@1", 0.25, 1.0, 2.0)):
            if now >= next_at[capability]:
                task = asyncio.create_task(one(capability, rng.uniform(low, high)))
                running.add(task)
                task.add_done_callback(running.discard)
                next_at[capability] = now + rng.expovariate(rate)
        await asyncio.sleep(0.05)
    await asyncio.gather(*running, return_exceptions=True)
    return outcomes


def _case(rng: random.Random, case: int) -> CheckSpec:
    capability = rng.choice(["chat@1", "chat@1", "embed@1", "lab@1", "giant@1"])
    tenant = "nobody" if case % 20 == 0 else TENANT_OF[capability]
    deadline = rng.choice([None, None, None, None, 5.0, 60.0])
    return CheckSpec(capability=capability, tenant=tenant, deadline_s=deadline, lease_timeout_s=60)


async def _admission_answer(handle: WorkflowHandle[Any, Any], task: asyncio.Task[Any]) -> str:
    """What the request's admission answered, from its own workflow: the admit call's reply in
    its history (granted, queued or rejected), or a slot its node lent it (no admit call: `now`);
    `never` for a request refused before any workflow started (the client's own checks)."""
    for _ in range(400):
        if task.done() and not task.result().ok and not await _exists(handle):
            return "never"
        try:
            history = await handle.fetch_history()
        except RPCError:
            await asyncio.sleep(0.025)
            continue
        for event in history.events:
            if event.event_type == EventType.EVENT_TYPE_MARKER_RECORDED:
                details = event.marker_recorded_event_attributes.details
                for payload in (p for key in details for p in details[key].payloads):
                    reply = _json(payload.data)
                    if isinstance(reply, dict) and reply.get("status") in ("granted", "queued", "rejected"):
                        return {"granted": "now", "queued": "later", "rejected": "never"}[reply["status"]]
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED:
                return "never"
            if (
                event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
                and event.activity_task_scheduled_event_attributes.activity_type.name == "invoke"
            ):
                return "now"  # on a lent slot: it never asked the scheduler
        await asyncio.sleep(0.025)
    return "unknown"


async def _exists(handle: WorkflowHandle[Any, Any]) -> bool:
    try:
        await handle.describe()
        return True
    except RPCError:
        return False


def _json(data: bytes) -> object:
    try:
        return json.loads(data)
    except ValueError:
        return None


async def _history_cost(stack: Stack, client: ModelForgeClient, checks: int) -> str:
    """The scheduler's history events while `checks` dry runs are asked back to back, by type: a
    check is a query and must add none, so every event there should be a telemetry signal and
    the workflow task that handled it (retried across a continue-as-new)."""
    for _ in range(5):
        run_id = (await stack.scheduler.describe()).run_id
        handle = stack.client.get_workflow_handle(stack.scheduler.id, run_id=run_id)
        before = len((await handle.fetch_history()).events)
        began = time.monotonic()
        for _ in range(checks):
            await admission_check(client, CheckSpec(capability="chat@1", tenant="app"))
        took = time.monotonic() - began
        if (await stack.scheduler.describe()).run_id != run_id:
            continue
        events = (await handle.fetch_history()).events[before:]
        kinds = Counter(EventType.Name(event.event_type).removeprefix("EVENT_TYPE_").lower() for event in events)
        signals = [
            e.workflow_execution_signaled_event_attributes.signal_name
            for e in events
            if e.HasField("workflow_execution_signaled_event_attributes")
        ]
        other = {
            k: v for k, v in kinds.items() if not k.startswith("workflow_task_") and k != "workflow_execution_signaled"
        }
        return (
            f"scheduler history while {checks} dry runs were asked ({took:.1f} s): {len(events)} events,"
            f" signals {dict(Counter(signals))} and their workflow tasks; anything else: {other or 'none'}"
        )
    return "scheduler history: continued as new during every try; not measured"


async def run(cases: int, every_s: float, seed: int) -> bool:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), dev_server_log_level="error"
    )
    import pgserver

    folder = tempfile.mkdtemp(prefix="mf-verdicts-live-")
    server = pgserver.get_server(folder, cleanup_mode="stop")  # type: ignore[attr-defined]
    try:
        await register_search_attributes(env.client)
        async with running_stack(env.client, server.get_uri(), catalog_path=CATALOG, telemetry_interval_s=2.0) as stack:
            client = ModelForgeClient(env.client, pools=["default"])
            history_line = await _history_cost(stack, client, 300)
            print(history_line, flush=True)
            stop = asyncio.Event()
            background = asyncio.create_task(_background(client, stop, seed))
            await asyncio.sleep(10.0)  # the card busy before the first case
            rng = random.Random(seed)
            agree, real_answers, mismatches = 0, Counter[str](), list[str]()
            cases_running: set[asyncio.Task[Any]] = set()
            began = time.monotonic()
            for case in range(cases):
                spec = _case(rng, case)
                check = await admission_check(client, spec)
                request_id = uuid.uuid4().hex[:16]
                task = asyncio.create_task(
                    client.request(
                        spec.capability,
                        {"simulate_invoke_s": round(rng.uniform(0.1, 0.5), 2)},
                        tenant=spec.tenant,
                        deadline_s=spec.deadline_s,
                        lease_timeout_s=spec.lease_timeout_s,
                        request_id=request_id,
                    )
                )
                cases_running.add(task)
                task.add_done_callback(cases_running.discard)
                handle = env.client.get_workflow_handle(request_workflow_id(spec.capability, request_id))
                real = await _admission_answer(handle, task)
                real_answers[real] += 1
                if check.answer == real:
                    agree += 1
                elif len(mismatches) < 10:
                    mismatches.append(
                        f"{spec.capability} {spec.tenant} deadline {spec.deadline_s}: dry run {check.answer}"
                        f" ({check.failure or check.action or ''}: {check.message[:90]}), real {real}"
                    )
                if (case + 1) % 100 == 0:
                    print(f"   {case + 1} cases, {agree} agree, {time.monotonic() - began:.0f} s", flush=True)
                await asyncio.sleep(every_s)
            stop.set()
            outcomes = await background
            ended = await asyncio.gather(*cases_running, return_exceptions=True)
    finally:
        await env.shutdown()
        server.cleanup()
    share = agree / cases
    print(
        f"\ndry run vs the real admission right after, {cases:,} mixed cases on a live stack:"
        f" {agree}/{cases} agree ({share:.1%}; target 99%)"
    )
    print("   real answers: " + ", ".join(f"{k} {v}" for k, v in sorted(real_answers.items())))
    print(f"   background traffic: {dict(outcomes)}; cases still running at the end: {len(ended)}")
    print(f"   {history_line}")
    for line in mismatches:
        print(f"   mismatch: {line}")
    return share >= 0.99


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--every-s", type=float, default=0.5, help="pause between cases")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    configure(logging.WARNING)  # the stack's event lines would bury the figures
    return 0 if asyncio.run(run(args.cases, args.every_s, args.seed)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
