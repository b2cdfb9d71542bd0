"""Sustained load: a steady stream of requests at a fixed rate for N minutes on
the real Temporal dev server, with the control and a simulated node worker in this process.

    .venv/bin/python bench/sustained.py [--minutes 10] [--rate 8] [--max-history 2000]

Every 30 s it prints: requests started and finished, failures by class, the scheduler's current
history length and how many times it continued-as-new, and this process's resident memory (the
workers live in it). At the end it checks, side by side in the same run:
- every request ended (success or a typed failure), none lost;
- the scheduler's history stayed under --max-history (continue-as-new bounds it);
- worker memory in the second half grew by at most --memory-bound-mib over its first-half peak.
Pick --rate at or under the throughput `bench/orchestration.py` measures on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import psutil
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modelforge.dev import temporal_binary
from modelforge.temporal import register_search_attributes
from tests.harness import Stack, running_stack

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=8.0, help="requests started per second")
    parser.add_argument("--max-history", type=int, default=2000, help="the scheduler's continue-as-new bound")
    parser.add_argument("--memory-bound-mib", type=float, default=64.0)
    args = parser.parse_args()
    external = os.environ.get("MODELFORGE_DATABASE_URL")
    if external:
        sys.exit(asyncio.run(run(args.minutes, args.rate, args.max_history, args.memory_bound_mib, external)))
    import pgserver

    with tempfile.TemporaryDirectory() as pgdata:
        server = pgserver.get_server(pgdata, cleanup_mode="stop")
        try:
            code = asyncio.run(run(args.minutes, args.rate, args.max_history, args.memory_bound_mib, server.get_uri()))
        finally:
            server.cleanup()
    sys.exit(code)


if __name__ == "__main__":
    main()
