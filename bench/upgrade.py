"""An upgrade and a rollback with traffic flowing, measured: the bench round of the upgrade that
tests/workflow/test_upgrade.py checks once (docs/RELEASING.md, README "Upgrading").

A real dev stack: the Temporal dev server, an embedded Postgres, release 0.1.0's own control
worker (`modelforge worker control` from tests/releases/0.1.0.tar.gz, a process of its own), and
this checkout's node workers with simulated cards (the example catalog and a chat model). Traffic runs all along,
each request a client's (started, then its answer awaited): embeddings at 1 a second (0.3 s
each, concurrency 1) and chat calls at 1 a second (1 s each, concurrency 2), both models
keep_warm, so a steady phase's latency is the warm path's and what a move adds shows (the
streamed chat and the job in flight are the test's). After a warm-up (both models loaded, not
counted), each round:

1. steady on the release (`--steady-s`);
2. the upgrade side by side: this checkout's control worker starts beside the release's, becomes
   current, the scheduler and telemetry continue as new onto it and the loaded models' residency
   runs are pinned to it (`modelforge upgrade`'s steps), the release's requests finish on the
   release, then its worker is retired (SIGTERM);
3. steady on this build;
4. the rollback the same way, to a fresh release worker; the models loaded under this build stay
   on it (an older build is not promised to replay a newer one's runs) and are unloaded as the
   README says (`modelforge residency unload ... --drain`), loading again on demand.

Then once, the stop-the-world upgrade (what `modelforge dev` does after an upgrade): the release's
worker stopped with requests in flight, this build's started and made current, and
`adopt_stranded` moves every run left pinned to the release.

It prints, per phase, the requests started in it and their client-seen latency (p50 / p95 / max)
beside the steady phases' (the ratio), how long the scheduler and telemetry took to move and the
old build to drain, and the checks: every request ended with its answer, each invoke scheduled
once, no lease left held, no scheduler task failed. Exit status 1 when a check fails.

    .venv/bin/python -m bench.upgrade               # 2 rounds, about 3 minutes
    .venv/bin/python -m bench.upgrade --rounds 1 --steady-s 10
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from modelforge.catalog import example_catalog_path
from modelforge.dev import temporal_binary
from modelforge.logging import configure
from modelforge.names import telemetry_id
from modelforge.store import Store
from modelforge.temporal import register_search_attributes
from modelforge.versioning import adopt_stranded, set_current
from tests.release_process import (
    NEXT,
    RELEASE,
    ReleaseWorker,
    drain,
    in_process_control_worker,
    invokes,
    move,
    residents_follow,
)
from workers.control import ControlWorker
from workers.stack import Stack, running_stack

EMBEDDING = "rag.embedding@1"
CHAT = "bench.chat@1"
# The example catalog and a chat model kept warm, so the chat calls' latency is the warm path's.
CHAT_DEPLOYMENT = f"""
[[deployments]]
capability = "{CHAT}"
envelope_bytes = 4294967296
residency = "keep_warm"
ttl_s = 3600
concurrency = 2
load_s = 2.0
runtime = "simulated"
accelerators = ["gpu-node/0"]
"""
# (capability, tenant, seconds an invoke takes, requests a second)
TRAFFIC = ((EMBEDDING, "rag", 0.3, 1.0), (CHAT, "default", 1.0, 1.0))


@dataclass
class Sent:
    phase: str
    handle: WorkflowHandle[Any, Any]
    started: float
    latency_s: float | None = None
    failure: str | None = None


@dataclass
class Traffic:
    """Requests sent at a steady rate, each labelled with the phase it started in."""

    stack: Stack
    phase: str = "warm-up"
    sent: list[Sent] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def _one(self, capability: str, tenant: str, seconds: float) -> None:
        started = time.monotonic()
        handle = await self.stack.start_request(
            capability, tenant=tenant, input={"simulate_invoke_s": seconds}, lease_timeout_s=120
        )
        sent = Sent(self.phase, handle, started)
        self.sent.append(sent)
        try:
            await handle.result()
        except WorkflowFailureError as error:
            sent.failure = str(error.cause)[:120]
        sent.latency_s = time.monotonic() - started

    async def run(self) -> None:
        began = time.monotonic()
        due = [0.0 for _ in TRAFFIC]
        while not self._stop.is_set():
            now = time.monotonic() - began
            for i, (capability, tenant, seconds, rate) in enumerate(TRAFFIC):
                if now >= due[i]:
                    task = asyncio.create_task(self._one(capability, tenant, seconds))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                    due[i] += 1.0 / rate
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


def _figures(latencies: list[float]) -> tuple[float, float, float]:
    ordered = sorted(latencies)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return statistics.median(ordered), p95, ordered[-1]


async def run(rounds: int, steady_s: float) -> bool:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), dev_server_log_level="error"
    )
    import pgserver

    folder = Path(tempfile.mkdtemp(prefix="mf-bench-upgrade-"))
    server = pgserver.get_server(str(folder / "pg"), cleanup_mode="stop")  # type: ignore[attr-defined]
    database_url = server.get_uri()
    client = env.client
    store = await Store.open(database_url)
    releases: list[ReleaseWorker] = []
    ours: list[ControlWorker] = []
    moves: list[str] = []
    try:
        await register_search_attributes(client)
        await store.migrate()
        releases.append(ReleaseWorker(client, database_url, folder / "release"))
        await set_current(client, RELEASE)
        catalog = folder / "catalog.toml"
        catalog.write_text(example_catalog_path().read_text() + CHAT_DEPLOYMENT)
        async with running_stack(client, database_url, catalog, control_in_process=False) as stack:
            traffic = Traffic(stack)
            sending = asyncio.create_task(traffic.run())
            await asyncio.sleep(8.0)  # both models loaded (4 s on the simulated card)
            traffic.phase = "steady on the release"
            for round_ in range(1, rounds + 1):
                await asyncio.sleep(steady_s)
                # The upgrade, side by side.
                traffic.phase = "upgrade (side by side)"
                ours.append(await in_process_control_worker(client, store, NEXT))
                moved_s = await move(stack, NEXT)
                residents = await residents_follow(stack, RELEASE, NEXT)
                drained_s = await drain(stack, RELEASE.build_id)
                await releases[-1].stop()
                moves.append(
                    f"round {round_} upgrade: scheduler+telemetry on {NEXT.build_id} in {moved_s:.1f} s,"
                    f" {residents} loaded models' runs pinned to it, {RELEASE.build_id}'s last run ended"
                    f" {drained_s:.1f} s later"
                )
                traffic.phase = "steady on this build"
                await asyncio.sleep(steady_s)
                # The rollback, the same way.
                traffic.phase = "rollback (side by side)"
                releases.append(ReleaseWorker(client, database_url, folder / "release"))
                moved_s = await move(stack, RELEASE)
                unloaded = await residents_follow(stack, NEXT, RELEASE)
                drained_s = await drain(stack, NEXT.build_id)
                await ours.pop().__aexit__(None, None, None)
                moves.append(
                    f"round {round_} rollback: scheduler+telemetry on {RELEASE.build_id} in {moved_s:.1f} s,"
                    f" {unloaded} models loaded under {NEXT.build_id} unloaded (drained), its last run ended"
                    f" {drained_s:.1f} s later"
                )
                traffic.phase = "steady on the release"
            await asyncio.sleep(steady_s / 2)
            # Stop the world: the release's worker stopped with work in flight, this build's in its place.
            traffic.phase = "stop-the-world upgrade"
            stopped = time.monotonic()
            await releases[-1].stop()
            ours.append(await in_process_control_worker(client, store, NEXT))
            await set_current(client, NEXT)
            long_lived = [stack.scheduler.id, *(telemetry_id(node) for node in stack.backends)]
            adopted = await adopt_stranded(client, NEXT, long_lived)
            adopted_s = time.monotonic() - stopped
            drained_s = await drain(stack, RELEASE.build_id)
            moves.append(
                f"stop-the-world: {len(adopted)} runs left pinned to {RELEASE.build_id} followed {NEXT.build_id}"
                f" ({len(adopted) - len(long_lived)} requests and residency runs), {adopted_s:.1f} s after the"
                f" release's worker stopped; its last run ended {drained_s:.1f} s later"
            )
            traffic.phase = "steady on this build"
            await asyncio.sleep(steady_s / 2)
            await traffic.stop()
            await sending
            # The checks.
            sent = traffic.sent
            # Answered: invoked once; refused or failed: at most once.
            twice = [s.handle.id for s in sent if (await invokes(s.handle)) not in ((0, 1) if s.failure else (1,))]
            failed = [f"{s.phase}: {s.failure}" for s in sent if s.failure]
            status = await stack.status()
            held = sum(r.active_leases for r in status.residents) + sum(status.queue_depth.values())
            history = await stack.scheduler.fetch_history()
            task_failures = sum(1 for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED)
    finally:
        for worker in ours:
            await worker.__aexit__(None, None, None)
        for release in releases:
            if release.process.poll() is None:
                await release.stop()
        await store.close()
        await env.shutdown()
        server.cleanup()

    steady = [s.latency_s for s in sent if s.phase.startswith("steady") and s.latency_s is not None]
    steady_p50, steady_p95, _ = _figures(steady)
    print(f"\nupgrade and rollback with traffic flowing: {rounds} round(s), {len(sent)} requests\n")
    print(f"{'phase':<28} {'requests':>8} {'p50 s':>7} {'p95 s':>7} {'max s':>7} {'p50/steady':>10} {'p95/steady':>10}")
    phases = [phase for phase in dict.fromkeys(s.phase for s in sent) if phase != "warm-up"]
    for phase in phases:
        latencies = [s.latency_s for s in sent if s.phase == phase and s.latency_s is not None]
        p50, p95, worst = _figures(latencies)
        print(
            f"{phase:<28} {len(latencies):>8} {p50:>7.2f} {p95:>7.2f} {worst:>7.2f}"
            f" {p50 / steady_p50:>9.2f}x {p95 / steady_p95:>9.2f}x"
        )
    print()
    for line in moves:
        print(f"  {line}")
    outcomes = Counter("answered" if s.failure is None else "failed" for s in sent)
    print(f"\n  requests: {dict(outcomes)}; invoked other than once: {len(twice)}")
    print(f"  leases held or queued at the end: {held}; scheduler tasks failed (this run): {task_failures}")
    for line in failed[:10]:
        print(f"  failed: {line}")
    return not failed and not twice and held == 0 and task_failures == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steady-s", type=float, default=20.0, help="seconds of traffic between moves")
    args = parser.parse_args()
    configure(logging.WARNING)  # the stack's event lines would bury the figures
    return 0 if asyncio.run(run(args.rounds, args.steady_s)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
