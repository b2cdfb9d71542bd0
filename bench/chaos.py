"""Chaos: a stream of requests against two models whose leases carry bytes, on one simulated card,
while faults hit at random moments: kill -9 of the control worker, kill -9 of the node worker, the
Temporal server stopped and restarted, Postgres stopped and started. The scheduler continues as
new every few dozen events (--history-limit), so faults land around continue-as-new too. With
--reset-every S, the scheduler's run is also reset a few workflow tasks back every S seconds or
so (its own random stream, so the other faults keep their schedule): what the replay guard does
to a run whose history no worker can replay (a nondeterminism error after a Temporal restart,
which no bench can cause at will), through the guard's own reset, so the grants and admissions
the reset discards (and the ledger audit, the readmits and the lost grants that recover them)
are exercised every round.

    .venv/bin/python -m bench.chaos [--minutes 10] [--rate 3] [--seed 1] [--fault-every 12]
                                    [--lease-timeout 120] [--reset-every 0]

Every part is real and started here, each in a process of its own: the Temporal dev server
(persisting to a file, so it can be restarted), an embedded Postgres (pgserver), `modelforge worker
control` and `modelforge worker node --simulate-from` (the one simulated part: the card). Then an
invariant checker reads the lease ledger, the event log and the capacity snapshots:

- at no instant more leases on a model than its concurrency, nor more invokes really running on
  the simulated card than that (the node's own record of when each invoke ran);
- at no instant more leased bytes on the card than it can hold next to a resident model;
- no snapshot where resident + leased + external bytes exceed the card;
- every request ended with a typed outcome (success or a failure class), none lost: once the
  arrivals stop, the round waits for the longest a request may legitimately take (its lease
  timeout, an admission's budget and an invoke: `settle_window_s`), and a request still
  running after that is lost, named with its phase;
- no ledger row left open, and every lease granted and released has its events.

It prints the faults injected, the continue-as-new count, the outcomes and every violation, and
exits 1 on any violation. tests/faults/test_chaos.py runs a bounded round of it in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle, WorkflowHistory
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError, TerminatedError, TimeoutError
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from modelforge.catalog import load_catalog_file
from modelforge.dev import temporal_binary
from modelforge.domain import Accelerator, Catalog
from modelforge.failures import FailureClass
from modelforge.messages import RequestInput, SchedulerInput
from modelforge.policy import PolicyConfig, PoolStatus
from modelforge.settings import CONTROL_TASK_QUEUE
from modelforge.store import Store
from modelforge.temporal import WORKER_RETRY, register_search_attributes
from workers.control import ensure_scheduler
from workers.replay_guard import ReplayGuard
from workflows import CapabilityRequestWorkflow, PoolSchedulerWorkflow
from workflows._common import request_workflow_id, scheduler_id
from workflows.request import ADMIT_BUDGET

ROOT = Path(__file__).resolve().parent.parent
CATALOG = ROOT / "tests" / "catalogs" / "chaos.toml"
CAPABILITIES = ("chaos.slot@1", "chaos.big@1")
FAULTS = ("kill_control", "kill_node", "restart_temporal", "stop_postgres")
FAILURE_CLASSES = {f.value for f in FailureClass}
# The longest simulated invoke a request asks for (uniform from 0.2 s).
LONGEST_INVOKE_S = 3.0


def settle_window_s(lease_timeout_s: float) -> float:
    """How long after the last arrival a request may legitimately still run: its admission call
    (up to ADMIT_BUDGET through a stalled scheduler), a wait in the queue up to its lease timeout
    (and the requester's own 5 s past it), then its invoke, with a minute of margin for the
    faults that keep hitting until the last arrival (a restart in progress, a node coming
    back). A request running longer than this waited past every bound it was given."""
    return ADMIT_BUDGET.total_seconds() + lease_timeout_s + 5.0 + LONGEST_INVOKE_S + 60.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class ChaosReport:
    seconds: float = 0.0
    requests: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    continued_as_new: int = 0
    leases: int = 0
    invokes: int = 0
    violations: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [
            f"chaos: {self.seconds:.0f} s, {self.requests} requests, {self.leases} leases, {self.invokes} invokes ran",
            f"faults: {dict(sorted(self.faults.items()))} ({sum(self.faults.values())} in all)",
            f"scheduler continued as new {self.continued_as_new} times",
            f"outcomes: {dict(sorted(self.outcomes.items()))}",
            f"violations: {len(self.violations)}",
            *(f"  VIOLATION {v}" for v in self.violations),
        ]


class Parts:
    """The real parts, each its own process, stopped and started on demand."""

    def __init__(self, workdir: Path, history_limit: int, stale_lease_s: float) -> None:
        self.workdir = workdir
        self.history_limit = history_limit
        self.stale_lease_s = stale_lease_s
        self.port = _free_port()
        self.temporal: WorkflowEnvironment | None = None
        self.postgres: Any = None
        self.url = ""
        self.control: subprocess.Popen[bytes] | None = None
        self.node: subprocess.Popen[bytes] | None = None
        self.client: Client | None = None

    async def start(self) -> None:
        import pgserver

        self.postgres = await asyncio.to_thread(pgserver.get_server, str(self.workdir / "pg"), cleanup_mode="stop")
        self.url = self.postgres.get_uri()
        catalog, _ = load_catalog_file(CATALOG)
        store = await Store.open(self.url)
        try:
            await store.migrate()
            await store.apply_catalog(catalog)
        finally:
            await store.close()
        await self.start_temporal()
        assert self.temporal is not None
        await register_search_attributes(self.temporal.client)
        self.client = await Client.connect(f"127.0.0.1:{self.port}", retry_config=WORKER_RETRY)
        # Started here with a low history limit, so continue-as-new comes often; the control
        # worker finds it running (its own start is USE_EXISTING).
        await ensure_scheduler(
            self.client,
            "default",
            SchedulerInput(
                pool="default",
                config=PolicyConfig(stale_lease_s=self.stale_lease_s),
                max_history_events=self.history_limit,
                snapshot_interval_s=2.0,
                reconcile_interval_s=5.0,
            ),
        )
        self.control = self._spawn("control", ["worker", "control"])
        self.node = self._spawn("node", ["worker", "node", "--node", "chaos-node", "--simulate-from", str(CATALOG)])

    async def start_temporal(self) -> None:
        self.temporal = await WorkflowEnvironment.start_local(
            dev_server_existing_path=temporal_binary(),
            port=self.port,
            dev_server_log_level="error",
            dev_server_extra_args=["--db-filename", str(self.workdir / "temporal.db")],
        )

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
        environ.update(
            MODELFORGE_TEMPORAL_ADDRESS=f"127.0.0.1:{self.port}",
            MODELFORGE_DATABASE_URL=self.url,
            MODELFORGE_METRICS_PORT=str(_free_port()),
            MODELFORGE_HOME=str(self.workdir / "home"),
            MODELFORGE_GPU_BACKEND="simulated",
            # The simulated card's ground truth: when each invoke really ran, under which lease.
            MODELFORGE_SIMULATED_INVOKE_LOG=str(self.workdir / "invokes.jsonl"),
        )
        with (self.workdir / f"{name}.log").open("ab") as log:
            return subprocess.Popen(  # noqa: S603 (an argument list of our own)
                [sys.executable, "-m", "modelforge", *args],
                env=environ,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=str(ROOT),
                start_new_session=True,
            )

    @staticmethod
    def _kill(process: subprocess.Popen[bytes] | None) -> None:
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)

    async def kill_control(self, down_s: float) -> None:
        self._kill(self.control)
        await asyncio.sleep(down_s)
        self.control = self._spawn("control", ["worker", "control"])

    async def kill_node(self, down_s: float) -> None:
        self._kill(self.node)
        await asyncio.sleep(down_s)
        self.node = self._spawn("node", ["worker", "node", "--node", "chaos-node", "--simulate-from", str(CATALOG)])

    async def restart_temporal(self, down_s: float) -> None:
        assert self.temporal is not None
        await self.temporal.shutdown()
        await asyncio.sleep(down_s)
        await self.start_temporal()

    async def stop_postgres(self, down_s: float) -> None:
        import pgserver

        server = self.postgres
        await asyncio.to_thread(
            pgserver.pg_ctl, ["-w", "-m", "fast", "stop"], pgdata=server.pgdata, user=server.system_user
        )
        await asyncio.sleep(down_s)
        await asyncio.to_thread(server.ensure_postgres_running)

    async def reset_scheduler(self, tasks_back: int) -> str:
        """The replay guard's reset of the scheduler's running run to the end of the workflow
        task `tasks_back` tasks before its last (as after a nondeterminism error); what it did."""
        assert self.client is not None
        workflow_id = scheduler_id("default")
        run_id = (await self.client.get_workflow_handle(workflow_id).describe(rpc_timeout=_seconds(10))).run_id or ""
        history = await self.client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        completed = [e.event_id for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED]
        if len(completed) < 2:
            return "skipped: the run is too young"
        point = completed[max(0, len(completed) - 1 - tasks_back)]
        guard = ReplayGuard(self.client, [workflow_id], _resets_only)
        if not await guard.reset(workflow_id, run_id, point, f"chaos: reset {tasks_back} tasks back"):
            return "skipped: the run continued as new meanwhile"
        return f"run {run_id[:8]} reset to event {point} of {len(history.events)}"

    async def stop(self) -> None:
        self._kill(self.control)
        self._kill(self.node)
        if self.temporal is not None:
            with contextlib.suppress(Exception):
                await self.temporal.shutdown()
        if self.postgres is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.postgres.cleanup)


async def _retrying(call: Callable[[], Awaitable[Any]], until: float) -> Any:
    """A client call that rides out a Temporal restart (the call itself retries too)."""
    while True:
        try:
            return await call()
        except RPCError:
            if time.monotonic() > until:
                raise
            await asyncio.sleep(1.0)


async def _one_request(client: Client, n: int, rng: random.Random, give_up_at: float, lease_timeout_s: float) -> str:
    capability = CAPABILITIES[n % 3 == 2]  # two slot requests for each big one
    request_id = f"chaos-{n}"
    request = RequestInput(
        request_id=request_id,
        capability=capability,
        input={"simulate_invoke_s": round(rng.uniform(0.2, LONGEST_INVOKE_S), 2)},
        tenant="chaos",
        lease_timeout_s=lease_timeout_s,
    )

    async def start() -> WorkflowHandle[Any, Any]:
        # The request id is the workflow id: a start retried after a lost reply attaches.
        return await client.start_workflow(
            CapabilityRequestWorkflow.run,
            request,
            id=request_workflow_id(capability, request_id),
            task_queue=CONTROL_TASK_QUEUE,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        )

    try:
        handle = await _retrying(start, give_up_at)
        await _retrying(handle.result, give_up_at)
    except WorkflowFailureError as error:
        cause = error.cause
        if isinstance(cause, ApplicationError) and cause.type in FAILURE_CLASSES:
            return str(cause.type)
        if isinstance(cause, TimeoutError | TerminatedError):
            return f"UNTYPED:{type(cause).__name__}"
        return f"UNTYPED:{cause}"
    except RPCError as error:
        return f"LOST:{error}"
    return "ok"


async def _never_ended(client: Client, n: int) -> str:
    """What a request still running at the give-up was doing: its phase and age."""
    capability = CAPABILITIES[n % 3 == 2]
    handle = client.get_workflow_handle(request_workflow_id(capability, f"chaos-{n}"))
    try:
        described = await handle.describe(rpc_timeout=_seconds(5))
        phase = await handle.query(CapabilityRequestWorkflow.phase, rpc_timeout=_seconds(5))
    except Exception as error:
        return f"LOST:never ended (chaos-{n}: {type(error).__name__})"
    age = time.time() - described.start_time.timestamp()
    return f"LOST:never ended (chaos-{n}: {described.status.name if described.status else '?'}, {phase}, {age:.0f} s)"


async def _count_runs(client: Client, stop: asyncio.Event, runs: set[str]) -> None:
    handle = client.get_workflow_handle(scheduler_id("default"))
    while not stop.is_set():
        with contextlib.suppress(Exception):
            runs.add(str((await handle.describe(rpc_timeout=_seconds(3))).run_id))
        await asyncio.sleep(0.5)


def _seconds(n: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=n)


async def _faults(parts: Parts, rng: random.Random, every_s: float, stop_at: float, report: ChaosReport) -> None:
    while True:
        await asyncio.sleep(rng.uniform(0.5 * every_s, 1.5 * every_s))
        if time.monotonic() > stop_at:
            return
        fault = rng.choice(FAULTS)
        down_s = {
            "kill_control": rng.uniform(1, 8),
            "kill_node": rng.uniform(1, 8),
            "restart_temporal": rng.uniform(2, 10),
            "stop_postgres": rng.uniform(3, 20),
        }[fault]
        print(f"  [{time.strftime('%H:%M:%S')}] {fault} for {down_s:.1f} s", flush=True)
        await getattr(parts, fault)(down_s)
        report.faults[fault] += 1


async def _resets_only(history: WorkflowHistory) -> Exception | None:
    raise AssertionError("the chaos bench resets the run itself; it never asks the guard to check")


async def _resets(parts: Parts, rng: random.Random, every_s: float, stop_at: float, report: ChaosReport) -> None:
    """`Parts.reset_scheduler` every `every_s` seconds or so, 1 to 12 workflow tasks back."""
    while True:
        await asyncio.sleep(rng.uniform(0.5 * every_s, 1.5 * every_s))
        if time.monotonic() > stop_at:
            return
        tasks_back = rng.randint(1, 12)
        try:
            done = await parts.reset_scheduler(tasks_back)
        except Exception as error:  # Temporal restarting: the next one tries again
            done = f"failed: {type(error).__name__}: {str(error)[:120]}"
        print(f"  [{time.strftime('%H:%M:%S')}] reset_scheduler {tasks_back} tasks back: {done}", flush=True)
        if not done.startswith(("skipped", "failed")):
            report.faults["reset_scheduler"] += 1


async def scheduler_wedged(client: Client) -> str:
    """Why the scheduler cannot make progress (its workflow task keeps failing, as after a
    nondeterminism error), or "" when it can."""
    try:
        described = await client.get_workflow_handle(scheduler_id("default")).describe(rpc_timeout=_seconds(10))
    except Exception as error:
        return f"cannot describe the scheduler: {error}"
    pending = described.raw_description.pending_workflow_task
    if pending.attempt > 2:
        history = await client.get_workflow_handle(scheduler_id("default"), run_id=described.run_id).fetch_history()
        failed = [e for e in history.events if e.HasField("workflow_task_failed_event_attributes")]
        why = failed[-1].workflow_task_failed_event_attributes.failure.message if failed else "unknown"
        return f"scheduler run {described.run_id} stuck: workflow task attempt {pending.attempt}: {why[:300]}"
    return ""


async def _settle(parts: Parts, store: Store, within_s: float) -> list[dict[str, Any]]:
    """The ledger once every lease ended and every event landed (or what is there at the end)."""
    assert parts.client is not None
    deadline = time.monotonic() + within_s
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        try:
            status: PoolStatus = await parts.client.get_workflow_handle(scheduler_id("default")).query(
                PoolSchedulerWorkflow.status, rpc_timeout=_seconds(5)
            )
            rows = await store.ledger(limit=100_000)
            if status.active_leases == 0 and all(r["ended_at"] for r in rows):
                return rows
        except Exception:
            pass
        await asyncio.sleep(2.0)
    return rows


def _sweep(intervals: list[tuple[float, float, int]]) -> tuple[int, float, int, float]:
    """The most intervals at one instant and when, and the most weight at one instant and when
    (an end before a start at a tie): each its own moment, the first it was reached."""
    points = sorted([(s, 1, w) for s, _, w in intervals] + [(e, -1, -w) for _, e, w in intervals])
    count = weight = best_count = best_weight = 0
    count_at = weight_at = 0.0
    for moment, step, w in points:
        count += step
        weight += w
        if count > best_count:
            best_count, count_at = count, moment
        if weight > best_weight:
            best_weight, weight_at = weight, moment
    return best_count, count_at, best_weight, weight_at


def _lease_room(catalog: Catalog) -> tuple[Accelerator, int]:
    """The card, and its smallest model's bytes: at no instant may more lease bytes be held
    on it than its total less those (a resident model beside them)."""
    return catalog.accelerators[0], min(d.resident_bytes for d in catalog.deployments)


def check_invokes(path: Path, report: ChaosReport) -> None:
    """What really ran on the card: never more invokes of a model at once than its concurrency,
    nor more of their lease bytes than the card holds beside its smallest model, whatever the
    ledger says (a lease reclaimed and then used anyway shows here, not there; a ledger row
    stamped by a clock that lagged shows there, not here)."""
    catalog, _ = load_catalog_file(CATALOG)
    card, idle = _lease_room(catalog)
    # The resident key an invoke names -> its deployment.
    deployments = {f"{d.deployment_id}@{a.id}": d for d in catalog.deployments for a in catalog.accelerators}
    concurrency = {key: d.concurrency for key, d in deployments.items()}
    lease_bytes = {key: d.lease_extra_bytes for key, d in deployments.items()}
    by_key: dict[str, list[tuple[float, float, int]]] = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                ran = json.loads(line)
                if not ran["lease_id"]:
                    continue  # a health check's probe, under no lease
                by_key.setdefault(ran["key"], []).append((float(ran["start"]), float(ran["end"]), 1))
    report.invokes = sum(len(v) for v in by_key.values())
    for key, ran in sorted(by_key.items()):
        most, at, _, _ = _sweep(ran)
        if most > concurrency.get(key, 0):
            report.violations.append(
                f"{most} invokes of {key} ran at once at {at:.3f} (concurrency {concurrency.get(key)})"
            )
    weighed = [(start, end, lease_bytes.get(key, 0)) for key, ran in by_key.items() for start, end, _ in ran]
    _, _, most_bytes, at = _sweep(weighed)
    if most_bytes > card.total_bytes - idle:
        report.violations.append(
            f"{most_bytes / 2**30:.1f} GiB of invokes' lease bytes ran at once at {at:.3f} on the card"
            f" ({card.total_bytes / 2**30:.0f} GiB, a {idle / 2**30:.0f} GiB model beside them)"
        )


async def check_invariants(store: Store, rows: list[dict[str, Any]], report: ChaosReport) -> None:
    catalog, _ = load_catalog_file(CATALOG)
    card, idle = _lease_room(catalog)
    open_rows = [r["lease_id"] for r in rows if r["ended_at"] is None]
    if open_rows:
        report.violations.append(f"{len(open_rows)} ledger rows left open: {open_rows[:5]}")
    ended = [r for r in rows if r["ended_at"] is not None and r["granted_at"] is not None]
    report.leases = len(rows)
    for deployment in catalog.deployments:
        mine = [
            (r["granted_at"].timestamp(), r["ended_at"].timestamp(), 1)
            for r in ended
            if r["deployment"] == deployment.deployment_id
        ]
        most, at, _, _ = _sweep(mine)
        if most > deployment.concurrency:
            # The rows held at that instant, so the report says which one is late.
            held = [
                f"{r['lease_id']} {r['granted_at'].timestamp() - at:+.1f}..{r['ended_at'].timestamp() - at:+.1f} s"
                f" {r['outcome']}"
                for r in ended
                if r["deployment"] == deployment.deployment_id
                and r["granted_at"].timestamp() <= at < r["ended_at"].timestamp()
            ]
            report.violations.append(
                f"{most} leases on {deployment.capability} at {at:.3f} (concurrency {deployment.concurrency}): "
                + "; ".join(held)
            )
    leased = [(r["granted_at"].timestamp(), r["ended_at"].timestamp(), int(r["bytes"] or 0)) for r in ended]
    _, _, most_bytes, at = _sweep(leased)
    if most_bytes > card.total_bytes - idle:
        held = [
            f"{r['lease_id']} {int(r['bytes'] or 0) / 2**30:g} GiB"
            f" {r['granted_at'].timestamp() - at:+.1f}..{r['ended_at'].timestamp() - at:+.1f} s {r['outcome']}"
            for r in ended
            if r["granted_at"].timestamp() <= at < r["ended_at"].timestamp() and r["bytes"]
        ]
        report.violations.append(
            f"{most_bytes / 2**30:.1f} GiB leased at {at:.3f} on a {card.total_bytes / 2**30:.0f} GiB card "
            f"that holds a {idle / 2**30:.0f} GiB model: " + "; ".join(held)
        )
    for snapshot in await store.snapshots(limit=100_000):
        used = snapshot["resident_bytes"] + snapshot["leased_bytes"] + snapshot["external_bytes"]
        if used > snapshot["total_bytes"]:
            report.violations.append(f"snapshot at {snapshot['at']}: {used} bytes in use on {snapshot['total_bytes']}")
    granted = {e["lease_id"] for e in await store.list_events(kind="lease_granted", limit=100_000)}
    released = {e["lease_id"] for e in await store.list_events(kind="lease_released", limit=100_000)}
    ledger = {r["lease_id"] for r in rows}
    if ledger - granted:
        report.violations.append(f"{len(ledger - granted)} leases without a lease_granted event")
    if released - granted:
        report.violations.append(f"{len(released - granted)} leases released without a lease_granted event")
    if granted - released:
        report.violations.append(f"{len(granted - released)} leases granted and never released")


async def run_chaos(
    seconds: float,
    rate: float,
    seed: int,
    fault_every_s: float,
    history_limit: int = 200,
    stale_lease_s: float = 6.0,
    lease_timeout_s: float = 120.0,
    workdir: Path | None = None,
    reset_every_s: float = 0.0,
) -> ChaosReport:
    rng = random.Random(seed)  # arrivals and inputs
    fault_rng = random.Random(seed * 7919 + 1)  # its own: the same faults in the same order each run
    report = ChaosReport()
    with contextlib.ExitStack() as cleanup:
        if workdir is None:
            workdir = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="modelforge-chaos-")))
        workdir.mkdir(parents=True, exist_ok=True)  # a --workdir given is made if it is not there
        parts = Parts(workdir, history_limit, stale_lease_s)
        started = time.monotonic()
        try:
            await parts.start()
            assert parts.client is not None
            stop_at = started + seconds
            give_up_at = stop_at + settle_window_s(lease_timeout_s)
            runs: set[str] = set()
            stop = asyncio.Event()
            counter = asyncio.create_task(_count_runs(parts.client, stop, runs))
            faults = asyncio.create_task(_faults(parts, fault_rng, fault_every_s, stop_at, report))
            # Their own stream: a round with resets keeps the other faults' schedule.
            reset_rng = random.Random(seed * 104729 + 3)
            resets = (
                asyncio.create_task(_resets(parts, reset_rng, reset_every_s, stop_at, report))
                if reset_every_s > 0
                else None
            )
            requests: list[asyncio.Task[str]] = []
            n = 0
            while time.monotonic() < stop_at:
                request = _one_request(parts.client, n, random.Random(rng.random()), give_up_at, lease_timeout_s)
                requests.append(asyncio.create_task(request))
                n += 1
                await asyncio.sleep(rng.expovariate(rate))
            await faults
            if resets is not None:
                await resets
            remaining = max(1.0, give_up_at - time.monotonic())
            done, pending = await asyncio.wait(requests, timeout=remaining)
            for task in pending:
                task.cancel()
            report.requests = len(requests)
            for n, task in enumerate(requests):
                ended = task in done and not task.cancelled()
                outcome = task.result() if ended else await _never_ended(parts.client, n)
                report.outcomes[outcome.split(":")[0] if outcome.startswith(("LOST", "UNTYPED")) else outcome] += 1
                if outcome.startswith(("LOST", "UNTYPED")):
                    report.violations.append(f"a request ended without a typed outcome: {outcome[:200]}")
            store = await Store.open(parts.url)
            try:
                rows = await _settle(parts, store, within_s=120.0)
                await check_invariants(store, rows, report)
                check_invokes(workdir / "invokes.jsonl", report)
                wedged = await scheduler_wedged(parts.client)
                if wedged:
                    report.violations.append(wedged)
            finally:
                await store.close()
            stop.set()
            await counter
            report.continued_as_new = max(0, len(runs) - 1)
        finally:
            report.seconds = time.monotonic() - started
            await parts.stop()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=3.0, help="requests per second (Poisson arrivals)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fault-every", type=float, default=12.0, help="mean seconds between faults")
    parser.add_argument("--history-limit", type=int, default=200, help="the scheduler's continue-as-new bound")
    parser.add_argument(
        "--lease-timeout",
        type=float,
        default=120.0,
        help="each request's lease timeout (s); the round waits for it (and more) after the last arrival",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="keep logs and data here")
    parser.add_argument(
        "--reset-every",
        type=float,
        default=0.0,
        help="mean seconds between resets of the scheduler's run, as the replay guard's (0: none)",
    )
    args = parser.parse_args()
    report = asyncio.run(
        run_chaos(
            args.minutes * 60,
            args.rate,
            args.seed,
            args.fault_every,
            args.history_limit,
            lease_timeout_s=args.lease_timeout,
            workdir=args.workdir,
            reset_every_s=args.reset_every,
        )
    )
    print("\n".join(report.lines()))
    raise SystemExit(1 if report.violations else 0)


if __name__ == "__main__":
    main()
