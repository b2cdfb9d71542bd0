"""Sustained load: a steady stream of requests at a fixed rate for N minutes on
the real Temporal dev server, with the control and a simulated node worker in this process.

    .venv/bin/python -m bench.sustained [--minutes 10] [--rate 8] [--max-history 2000]

Every 30 s it prints: requests started and finished, failures by class, the scheduler's current
history length and how many times it continued-as-new, and this process's resident memory (the
workers live in it). At the end it checks, side by side in the same run:
- every request ended (success or a typed failure), none lost;
- the scheduler's history stayed under --max-history (continue-as-new bounds it);
- worker memory in the second half grew by at most --memory-bound-mib over its first-half peak.
Pick --rate at or under the throughput `bench/orchestration.py` measures on the machine.

Edge mode: the sustained edge of two configurations, side by side in one run (one dev server,
one Postgres, one process for the control worker, the node workers and the load):

    .venv/bin/python -m bench.sustained --edge [--pools 2] [--step-s 20] [--rates 4,8,12,...]
        [--drain-s 3] [--p50-max-s 1] [--baseline routed|control] [--first admitted|delegated]

  (a) admitted: a single pool (the first), every request admitted by its scheduler: routed
      `ModelForgeClient` requests to `bench.admitted@1`, a twin never lent to its node (its
      leases add a byte), so each one is an admission round trip through the scheduler
      (`--baseline control`: started on the control queue instead, as the CLI does);
  (b) delegated: routed requests to `bench.embed@1`, lent to the node, which admits warm
      requests itself and reports them in one `delegation_sync` update a second. With
      `--pools N` (2-4) the catalog has N pools, each with its own scheduler and node, the
      capability deployed in all; the load is split round-robin over one client bound to each
      pool (so each pool's node keeps its own slots warm; the router would send nearly all of it
      to the pool that wins the tie). (a) always uses one pool of the same stack.
For each, the offered rate steps up through --rates (open loop: arrivals on a fixed schedule,
whatever has finished), each step --step-s seconds, and stops at the first step that fails.
A step PASSES when, for the requests it started:
  - every one succeeded (no failure of any class, none left running);
  - the finish rate kept up with arrivals: all of them ended within --drain-s (default 3 s) of
    the step's last arrival. A step that finishes a fraction f of what arrives ends with a
    backlog that takes about (1 - f) / f x step-s to clear at that pace: with 20 s steps, any f
    under about 0.87 fails here, and a slower growth shows in the p50 (about half that backlog
    time of queueing at the median);
  - p50 latency (start call to result, in the client) is at most --p50-max-s (default 1 s).
The edge is the highest rate that passed. It prints, each step: achieved arrival rate, finish
rate over the step, p50/p99 latency, the share of requests delegated, and each scheduler's
history events per request and per second (history length deltas from the step's start to its
requests' end plus 1.5 syncs, so the node's report of them is counted; telemetry and syncs
included). The dev server runs with limit.historyCount.suggestContinueAsNew=1000000 and
limit.historySize.suggestContinueAsNew at 40 MiB (the syncs' replies pass the 4 MB default in a
few minutes), and the schedulers with max_history_events=1,000,000, so no run continues as new
and the deltas add up.
  (c) bare (unless --no-ceiling): the same steps with bare one-activity workflows on a worker of
      their own in this process, no ModelForge at all: the ceiling of every path on this
      machine. When 4x edge(a) is past it, no path can meet the target here, and it says so.
At the end: edge(b)/edge(a) against the target (>= 4x), and the delegated path's
events per request (<= 1) and per second of its busiest scheduler (<= 20) at its edge, each PASS
or MISS. (a) runs first unless --first delegated: whichever runs second inherits a longer
scheduler history, a fuller in-memory Temporal store and a warmer Python heap; run both orders
when the ratio is close to the target.

What one small machine can show: everything here shares its CPUs: the Temporal dev server
(with its in-memory store), Postgres, the control worker, every node worker, the sync loops and
the load generator itself (one Python event loop, which also runs the workers). On 2 cores the
edge found is where that whole set saturates, usually the Python process or the dev server, not
the scheduler's own limit, and the ratio understates what N pools on N machines would do: the
pools here add schedulers but no CPU. A step's arrivals lag their schedule when the process is
saturated (the printed achieved rate shows it). Run it on a quiet machine; numbers taken while
other work runs are not the edge.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from modelforge.client import ModelForgeClient
from modelforge.dev import temporal_binary
from modelforge.logging import configure
from modelforge.temporal import register_search_attributes
from workers.stack import Stack, running_stack
from workflows._common import SCHEDULER_TASK_TIMEOUT

CATALOG = Path(__file__).parent / "catalogs" / "throughput.toml"
CAPABILITY = "bench.embed@1"


async def _one(stack: Stack, outcomes: Counter[str]) -> None:
    handle = await stack.start_request(CAPABILITY, tenant="bench", request_id=uuid.uuid4().hex[:12])
    try:
        await handle.result()
        outcomes["ok"] += 1
    except WorkflowFailureError as error:
        cause = error.cause
        outcomes[cause.type if isinstance(cause, ApplicationError) and cause.type else "UNTYPED"] += 1


async def _history(stack: Stack) -> tuple[int, int]:
    """(events in the scheduler's current run, runs so far)."""
    described = await stack.scheduler.describe()
    length = described.raw_description.workflow_execution_info.history_length
    runs = 0
    async for _ in stack.client.list_workflows('WorkflowId = "scheduler:default"'):
        runs += 1
    return int(length), runs


async def run(minutes: float, rate: float, max_history: int, memory_bound_mib: float, database_url: str) -> int:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), dev_server_log_level="error"
    )
    process = psutil.Process(os.getpid())
    try:
        await register_search_attributes(env.client)
        async with running_stack(
            env.client, database_url, catalog_path=CATALOG, max_history_events=max_history
        ) as stack:
            outcomes: Counter[str] = Counter()
            tasks: list[asyncio.Task[None]] = []
            started = time.monotonic()
            duration = minutes * 60
            next_report = started + 30
            memory: list[tuple[float, float]] = []
            longest = 0
            print(f"sustained load: {rate:g} requests/s for {minutes:g} min, scheduler history bound {max_history}")
            sent = 0
            while (now := time.monotonic()) < started + duration:
                due = int((now - started) * rate)
                while sent < due:
                    tasks.append(asyncio.create_task(_one(stack, outcomes)))
                    sent += 1
                if now >= next_report:
                    length, runs = await _history(stack)
                    longest = max(longest, length)
                    rss = process.memory_info().rss / 2**20
                    memory.append((now - started, rss))
                    done = sum(outcomes.values())
                    print(
                        f"{now - started:6.0f} s  started {sent:6d}  ended {done:6d}  {dict(outcomes)}  "
                        f"scheduler history {length} (run {runs})  RSS {rss:.0f} MiB"
                    )
                    next_report += 30
                await asyncio.sleep(0.02)
            await asyncio.gather(*tasks)
            length, runs = await _history(stack)
            longest = max(longest, length)
            ended = sum(outcomes.values())
            print(f"\nended {ended} of {sent}: {dict(outcomes)}; scheduler runs {runs}, longest history {longest}")
            ok = True
            ok &= _check("every request ended, none lost", ended == sent, f"{ended} of {sent}")
            ok &= _check("no untyped failure", outcomes["UNTYPED"] == 0, str(outcomes["UNTYPED"]))
            ok &= _check("scheduler history bounded", longest <= max_history + 200, f"longest {longest}")
            half = duration / 2
            first = max((rss for t, rss in memory if t <= half), default=0.0)
            second = max((rss for t, rss in memory if t > half), default=first)
            ok &= _check(
                f"worker memory growth <= {memory_bound_mib:g} MiB",
                second - first <= memory_bound_mib,
                f"first-half peak {first:.0f} MiB, second-half peak {second:.0f} MiB",
            )
            return 0 if ok else 1
    finally:
        await env.shutdown()


def _check(label: str, ok: bool, detail: str) -> bool:
    print(f"- {label}: {detail} -> {'met' if ok else 'MISSED'}")
    return ok


# --- edge mode ---------------------------------------------------------------------------------

ADMITTED = "bench.admitted@1"  # never lent: admitted by the scheduler every time
DEFAULT_RATES = "4,8,12,16,24,32,48,64,96,128,192,256"
SYNC_S = 1.0  # MODELFORGE_DELEGATION_SYNC_S's default
LEASE_TIMEOUT_S = 30.0  # a request that waits this long for a lease fails (the step with it)
LEFTOVER_S = 120.0  # how long a failed step's requests may take to end before the run gives up
EDGE_TARGET = 4.0
EVENTS_PER_REQUEST_TARGET = 1.0
EVENTS_PER_S_TARGET = 20.0


def pools_catalog(pools: int, directory: Path) -> tuple[Path, list[str]]:
    """The throughput catalog for `pools` pools (a file written under `directory` when more than
    one): each pool one simulated 80 GiB card on a node of its own, `bench.embed@1` deployable in
    every pool, `bench.admitted@1` only in the first."""
    if pools == 1:
        return CATALOG, ["default"]
    names = [f"pool-{chr(ord('a') + i)}" for i in range(pools)]
    text = CATALOG.read_text()
    head, _, deployments = text.partition("[[deployments]]")
    cards = "".join(
        f'[[accelerators]]\nid = "bench-{name}/0"\nnode = "bench-{name}"\npool = "{name}"\n'
        'model = "Simulated 80GB"\ntotal_bytes = 85899345920\nproduction_eligible = true\nsimulated = true\n\n'
        for name in names
    )
    deployments = "[[deployments]]" + deployments
    marker = 'capability = "bench.admitted@1"\n'
    assert marker in deployments, "bench/catalogs/throughput.toml changed: bench.admitted@1 not found"
    deployments = deployments.replace(marker, marker + f'accelerators = ["bench-{names[0]}/0"]\n')
    assert "[[accelerators]]" in head
    path = directory / f"throughput-{pools}-pools.toml"
    path.write_text(f"# Written by bench/sustained.py --edge --pools {pools}.\n\n{cards}{deployments}")
    return path, names


@dataclass
class Step:
    rate: float
    sent: int = 0
    # From the step's start to one interval after its last arrival (step_s when on schedule),
    # and to its last request's end.
    arrival_s: float = 0.0
    finish_s: float = 0.0
    outcomes: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    delegated: int = 0
    late: int = 0  # not ended within drain_s of the last arrival
    lost: int = 0  # not ended within LEFTOVER_S either
    events: dict[str, int] = field(default_factory=dict)  # scheduler history events by pool
    events_s: float = 0.0  # the interval the events were counted over

    def p(self, q: float) -> float:
        if not self.latencies:
            return float("inf")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def passed(self, p50_max_s: float) -> bool:
        return (
            self.sent > 0
            and self.outcomes["ok"] == self.sent
            and not self.late
            and not self.lost
            and statistics.median(self.latencies) <= p50_max_s
        )

    def events_per_request(self) -> float:
        return sum(self.events.values()) / max(1, self.sent)

    def events_per_s(self) -> float:
        """The busiest scheduler's history events per second."""
        return max(self.events.values(), default=0) / max(self.events_s, 1e-9)


Send = Callable[[], Awaitable[tuple[bool, str]]]


async def _lengths(stack: Stack) -> dict[str, int]:
    lengths: dict[str, int] = {}
    for pool, scheduler in stack.schedulers.items():
        described = await scheduler.describe()
        lengths[pool] = int(described.raw_description.workflow_execution_info.history_length)
    return lengths


async def _step(stack: Stack, send: Send, rate: float, step_s: float, drain_s: float) -> Step:
    step = Step(rate)
    ends: list[float] = []

    async def one() -> None:
        began = time.monotonic()
        try:
            ok, detail = await send()
        except Exception as error:  # a raise is a failure of the step like any other
            ok, detail = False, type(error).__name__
        ended = time.monotonic()
        ends.append(ended)
        step.latencies.append(ended - began)
        if ok:
            step.outcomes["ok"] += 1
            step.delegated += detail == "delegated"
        else:
            step.outcomes[detail] += 1

    before = await _lengths(stack)
    counted_from = time.monotonic()
    tasks: list[asyncio.Task[None]] = []
    started = time.monotonic()
    count = max(1, round(rate * step_s))
    while step.sent < count:
        due = min(count, 1 + int((time.monotonic() - started) * rate))
        while step.sent < due:
            tasks.append(asyncio.create_task(one()))
            step.sent += 1
        if step.sent < count:
            await asyncio.sleep(min(0.01, max(0.0, started + step.sent / rate - time.monotonic())))
    last_arrival = time.monotonic()
    step.arrival_s = last_arrival - started + 1 / rate
    _, pending = await asyncio.wait(tasks, timeout=drain_s)
    step.late = len(pending)
    if pending:
        _, pending = await asyncio.wait(pending, timeout=LEFTOVER_S)
        step.lost = len(pending)
        for task in pending:  # the client stops waiting; its workflow ends on its own
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if step.lost:
            step.outcomes["LOST"] += step.lost
    step.finish_s = (max(ends) if ends else time.monotonic()) - started
    await asyncio.sleep(SYNC_S * 1.5)  # the node's next sync reports the delegated ones
    after = await _lengths(stack)
    step.events_s = time.monotonic() - counted_from
    step.events = {pool: after[pool] - before[pool] for pool in after}
    return step


def _show(name: str, step: Step, p50_max_s: float) -> None:
    failed = {k: v for k, v in step.outcomes.items() if k != "ok"}
    per_s = ", ".join(f"{pool} {events / step.events_s:.1f}/s" for pool, events in sorted(step.events.items()))
    print(
        f"  {name:<9} {step.rate:6g}/s  arrived {step.sent / max(step.arrival_s, 1e-9):6.1f}/s"
        f"  finished {step.sent / max(step.finish_s, 1e-9):6.1f}/s"
        f"  p50 {step.p(0.5) * 1000:7.0f} ms  p99 {step.p(0.99) * 1000:7.0f} ms"
        f"  delegated {step.delegated / step.sent:4.0%}"
        f"  sched events/req {step.events_per_request():5.2f} ({per_s})"
        + (f"  failed {failed}" if failed else "")
        + (f"  {step.late} not ended in the drain window" if step.late else "")
        + ("  PASS" if step.passed(p50_max_s) else "  FAIL"),
        flush=True,
    )


async def _edge_of(
    stack: Stack, name: str, send: Send, rates: list[float], step_s: float, drain_s: float, p50_max_s: float
) -> tuple[float, Step | None]:
    """The highest passing rate of `rates`, stepping up until one fails, and its step."""
    edge, at_edge = 0.0, None
    for rate in rates:
        step = await _step(stack, send, rate, step_s, drain_s)
        _show(name, step, p50_max_s)
        if not step.passed(p50_max_s):
            break
        edge, at_edge = rate, step
    await _settle(stack)
    return edge, at_edge


async def _settle(stack: Stack, within_s: float = 180.0) -> None:
    """Wait until no request waits at any scheduler: the failing step's backlog must not be the
    next configuration's (a request waiting at the scheduler takes lent slots back)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        depths = [sum((await stack.status(pool)).queue_depth.values()) for pool in stack.schedulers]
        if not any(depths):
            return
        await asyncio.sleep(1.0)
    print(f"  (the schedulers still had requests waiting after {within_s:.0f} s)", flush=True)


async def _warm(send: Send, want: str, tries: int = 40) -> None:
    """Warm a path: models loaded, connections settled; `want` ("delegated"): until a request
    comes back delegated (the node is lent its slots at its first sync after asking)."""
    for _ in range(tries):
        ok, detail = await send()
        if not ok:
            raise SystemExit(f"a warm-up request failed: {detail}")
        if not want or detail == want:
            return
        await asyncio.sleep(SYNC_S / 4)
    raise SystemExit(f"no warm-up request came back {want} in {tries} tries")


def _routed(requests: ModelForgeClient, capability: str) -> Send:
    async def send() -> tuple[bool, str]:
        result = await requests.request(
            capability, input={"text": "x"}, tenant="bench", lease_timeout_s=LEASE_TIMEOUT_S
        )
        if not result.ok:
            return False, result.failure_class or "UNTYPED"
        return True, "delegated" if result.timings.get("delegated") else "admitted"

    return send


def _round_robin(sends: list[Send]) -> Send:
    turn = iter(range(1 << 62))

    async def send() -> tuple[bool, str]:
        return await sends[next(turn) % len(sends)]()

    return send


def _from_control_queue(stack: Stack, pool: str) -> Send:
    async def send() -> tuple[bool, str]:
        handle = await stack.start_request(
            ADMITTED, tenant="bench", input={"text": "x"}, lease_timeout_s=LEASE_TIMEOUT_S, pool=pool
        )
        try:
            await handle.result()
        except WorkflowFailureError as error:
            cause = error.cause
            return False, cause.type if isinstance(cause, ApplicationError) and cause.type else "UNTYPED"
        return True, "admitted"

    return send


async def run_edge(
    pools: int,
    rates: list[float],
    step_s: float,
    drain_s: float,
    p50_max_s: float,
    baseline: str,
    first_phase: str,
    database_url: str,
    ceiling: bool = True,
) -> int:
    # Warnings and worse only: an info line per lease, written by the process that also runs the
    # workers and the load, would cost the edge what it measures.
    configure(logging.WARNING)
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(),
        dev_server_log_level="error",
        # One scheduler run per pool for the whole benchmark, so history deltas add up.
        # (Temporal also suggests it past 4 MB of history, which the syncs' replies reach.)
        dev_server_extra_args=[
            "--dynamic-config-value",
            "limit.historyCount.suggestContinueAsNew=1000000",
            "--dynamic-config-value",
            f"limit.historySize.suggestContinueAsNew={40 * 1024 * 1024}",
        ],
    )
    try:
        client = env.client
        await register_search_attributes(client)
        with tempfile.TemporaryDirectory() as directory:
            catalog, names = pools_catalog(pools, Path(directory))
            async with running_stack(
                client,
                database_url,
                catalog_path=catalog,
                pools=names,
                delegation_sync_s=SYNC_S,
                max_history_events=1_000_000,
            ) as stack:
                first = names[0]
                admitted = (
                    _routed(ModelForgeClient(client, first), ADMITTED)
                    if baseline == "routed"
                    else _from_control_queue(stack, first)
                )
                per_pool = [_routed(ModelForgeClient(client, pool), CAPABILITY) for pool in names]
                delegated = _round_robin(per_pool)
                print(
                    f"edge: {step_s:g} s steps at {', '.join(f'{r:g}' for r in rates)} requests/s; a step passes"
                    f" when every request succeeded, all ended within {drain_s:g} s of the last arrival, and"
                    f" p50 <= {p50_max_s * 1000:.0f} ms",
                    flush=True,
                )

                async def phase_a() -> tuple[float, Step | None]:
                    print(
                        f"(a) admitted: pool {first}, {ADMITTED} "
                        f"({'routed, never lent' if baseline == 'routed' else 'started on the control queue'})",
                        flush=True,
                    )
                    await _warm(admitted, "")
                    for _ in range(10):
                        await admitted()
                    return await _edge_of(stack, "admitted", admitted, rates, step_s, drain_s, p50_max_s)

                async def phase_b() -> tuple[float, Step | None]:
                    print(f"(b) delegated: {CAPABILITY} over {len(names)} pool(s) ({', '.join(names)})", flush=True)
                    for send in per_pool:
                        await _warm(send, "delegated")
                    for _ in range(10):
                        await delegated()
                    return await _edge_of(stack, "delegated", delegated, rates, step_s, drain_s, p50_max_s)

                if first_phase == "admitted":
                    edge_a, _ = await phase_a()
                    edge_b, at_edge = await phase_b()
                else:
                    edge_b, at_edge = await phase_b()
                    edge_a, _ = await phase_a()
                edge_c = await _bare_edge(stack, rates, step_s, drain_s, p50_max_s) if ceiling else None
                # The whole run, the steps past each edge included: how near the longest scheduler
                # task came to its timeout (SCHEDULER_TASK_TIMEOUT; a control worker dying mid-task
                # stalls the pool that long, so it is kept no longer than slow passes need).
                for pool, handle in stack.schedulers.items():
                    longest, timed_out, tasks = await _scheduler_tasks(client, handle.id)
                    print(
                        f"scheduler {pool}: {tasks} workflow tasks, longest {longest:.2f} s, {timed_out} timed out"
                        f" (task timeout {SCHEDULER_TASK_TIMEOUT.total_seconds():g} s)"
                    )
        top = " (passed every step: a lower bound, add higher --rates)"
        print(f"\nedge (a) admitted, 1 pool: {edge_a:g} requests/s{top if edge_a == rates[-1] else ''}")
        print(f"edge (b) delegated, {len(names)} pool(s): {edge_b:g} requests/s{top if edge_b == rates[-1] else ''}")
        if edge_c is not None:
            print(f"edge (c) bare one-activity workflows, the ceiling here: {edge_c:g} requests/s")
        ok = True
        ratio = edge_b / edge_a if edge_a else float("inf") if edge_b else 0.0
        ok &= _verdict(f"edge(b)/edge(a) >= {EDGE_TARGET:g}", ratio >= EDGE_TARGET and edge_a > 0, f"{ratio:.2f}x")
        if edge_c is not None and edge_a:
            wanted = EDGE_TARGET * edge_a
            if not edge_c:
                where = "(bare workflows passed no step)"
            elif wanted <= edge_c:
                where = f"is within what bare workflows sustain on this machine ({edge_c:g}/s)"
            else:
                where = (
                    f"is past what bare workflows sustain on this machine ({edge_c:g}/s): no path reaches it"
                    f" here; delegated / bare {edge_b / edge_c:.2f}x"
                )
            print(f"- {EDGE_TARGET:g} x edge(a) = {wanted:g} requests/s {where}")
        if at_edge is not None:
            ok &= _verdict(
                f"scheduler events per delegated request at the edge <= {EVENTS_PER_REQUEST_TARGET:g}",
                at_edge.events_per_request() <= EVENTS_PER_REQUEST_TARGET,
                f"{at_edge.events_per_request():.2f}",
            )
            ok &= _verdict(
                f"events/s of the busiest scheduler at the edge <= {EVENTS_PER_S_TARGET:g}",
                at_edge.events_per_s() <= EVENTS_PER_S_TARGET,
                f"{at_edge.events_per_s():.1f}",
            )
        else:
            ok &= _verdict("the delegated path passed a step", False, "none passed")
        return 0 if ok else 1
    finally:
        await env.shutdown()


async def _scheduler_tasks(client: Client, workflow_id: str) -> tuple[float, int, int]:
    """(the longest workflow task from start to completion in s, how many timed out, how many
    completed) over every run of the scheduler (a run may continue as new mid-step)."""
    longest, timed_out, tasks = 0.0, 0, 0
    async for execution in client.list_workflows(f'WorkflowId = "{workflow_id}"'):
        started: dict[int, float] = {}
        handle = client.get_workflow_handle(workflow_id, run_id=execution.run_id)
        async for event in handle.fetch_history_events():
            at = event.event_time.ToDatetime().timestamp()
            if event.HasField("workflow_task_started_event_attributes"):
                started[event.event_id] = at
            elif event.HasField("workflow_task_completed_event_attributes"):
                began = started.get(event.workflow_task_completed_event_attributes.started_event_id)
                if began is not None:
                    longest, tasks = max(longest, at - began), tasks + 1
            elif event.HasField("workflow_task_timed_out_event_attributes"):
                timed_out += 1
    return longest, timed_out, tasks


async def _bare_edge(stack: Stack, rates: list[float], step_s: float, drain_s: float, p50_max_s: float) -> float:
    """(c) The same steps with bare one-activity workflows (bench/orchestration.py's, on a worker
    of their own in this process): what this machine sustains with no ModelForge at all, the
    ceiling every path here is under."""
    from temporalio.worker import Worker

    from bench.orchestration import BARE_QUEUE, BareWorkflow, bare_echo

    client = stack.client
    print("(c) bare: one-activity workflows, no ModelForge (the ceiling on this machine)", flush=True)

    async def send() -> tuple[bool, str]:
        await client.execute_workflow(
            BareWorkflow.run, {"text": "x"}, id=f"bare-{uuid.uuid4().hex}", task_queue=BARE_QUEUE
        )
        return True, "bare"

    async with Worker(client, task_queue=BARE_QUEUE, workflows=[BareWorkflow], activities=[bare_echo]):
        for _ in range(10):
            await send()
        edge, _ = await _edge_of(stack, "bare", send, rates, step_s, drain_s, p50_max_s)
    return edge


def _verdict(label: str, ok: bool, detail: str) -> bool:
    print(f"- {label}: {detail} -> {'PASS' if ok else 'MISS'}")
    return ok


def _rates(text: str) -> list[float]:
    rates = sorted({float(part) for part in text.split(",") if part.strip()})
    if not rates or rates[0] <= 0:
        raise argparse.ArgumentTypeError("rates: positive numbers, comma-separated")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=8.0, help="requests started per second")
    parser.add_argument("--max-history", type=int, default=2000, help="the scheduler's continue-as-new bound")
    parser.add_argument("--memory-bound-mib", type=float, default=64.0)
    edge = parser.add_argument_group("edge mode (module docstring)")
    edge.add_argument("--edge", action="store_true", help="find the sustained edge, admitted vs delegated")
    edge.add_argument("--pools", type=int, choices=(1, 2, 3, 4), default=1, help="pools for the delegated path")
    edge.add_argument("--step-s", type=float, default=20.0, help="seconds per rate step")
    edge.add_argument("--rates", type=_rates, default=_rates(DEFAULT_RATES), help="requests/s, comma-separated")
    edge.add_argument("--drain-s", type=float, default=3.0, help="a step's requests end within this of its last")
    edge.add_argument("--p50-max-s", type=float, default=1.0)
    edge.add_argument("--baseline", choices=("routed", "control"), default="routed", help="how (a) starts requests")
    edge.add_argument(
        "--first", choices=("admitted", "delegated"), default="admitted", help="which edge is found first"
    )
    edge.add_argument(
        "--no-ceiling", action="store_true", help="skip (c), the bare workflows' edge (the machine's ceiling)"
    )
    args = parser.parse_args()

    def measure(database_url: str) -> int:
        if args.edge:
            return asyncio.run(
                run_edge(
                    args.pools,
                    args.rates,
                    args.step_s,
                    args.drain_s,
                    args.p50_max_s,
                    args.baseline,
                    args.first,
                    database_url,
                    ceiling=not args.no_ceiling,
                )
            )
        return asyncio.run(run(args.minutes, args.rate, args.max_history, args.memory_bound_mib, database_url))

    external = os.environ.get("MODELFORGE_DATABASE_URL")
    if external:
        sys.exit(measure(external))
    import pgserver

    with tempfile.TemporaryDirectory() as pgdata:
        server = pgserver.get_server(pgdata, cleanup_mode="stop")
        try:
            code = measure(server.get_uri())
        finally:
            server.cleanup()
    sys.exit(code)


if __name__ == "__main__":
    main()
