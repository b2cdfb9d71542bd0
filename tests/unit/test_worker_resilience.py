"""The worker processes ride out Temporal and Postgres failures: a chaos
round lost 2,089 of 2,105 requests when the control worker exited on an `RPCError: Timeout
expired` from `ensure_scheduler` right after a Temporal restart. Here every outside call of the
control and node workers' loops is a recorder that fails a few times first (RPCError,
TimeoutError, psycopg's OperationalError, ConnectionError): the worker keeps going, backs off
(modelforge/retrying.py) and gets there; and SIGTERM stops a worker with status 0."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from temporalio.service import RPCError, RPCStatusCode

from modelforge import retrying
from modelforge.catalog import example_catalog_path
from modelforge.retrying import Backoff
from modelforge.settings import Settings


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def _line(self, level: str) -> Callable[..., None]:
        return lambda event, **fields: self.lines.append((level, event, fields))

    def __getattr__(self, level: str) -> Callable[..., None]:
        return self._line(level)

    def events(self, name: str) -> list[dict[str, Any]]:
        return [fields for _, event, fields in self.lines if event == name]


def timeout_expired() -> RPCError:
    return RPCError("Timeout expired", RPCStatusCode.DEADLINE_EXCEEDED, b"")


FAILURES: list[Callable[[], Exception]] = [
    timeout_expired,
    lambda: TimeoutError(),
    lambda: psycopg.OperationalError("connection refused"),
    lambda: ConnectionError("reset by peer"),
]


class Flaky:
    """An async call that raises each of `failures` once, then returns `value`."""

    def __init__(self, value: Any = None, failures: list[Callable[[], Exception]] | None = None) -> None:
        self.value = value
        self.failures = list(FAILURES if failures is None else failures)
        self.calls = 0

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)()
        return self.value


async def until(probe: Callable[[], bool], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not probe():
        assert time.monotonic() < deadline, "never happened"
        await asyncio.sleep(0.01)


@pytest.fixture
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retrying, "DEFAULT_BACKOFF", Backoff(initial_s=0.01, cap_s=0.04))


# --- the helper ---------------------------------------------------------------------------------------


def test_the_backoff_doubles_from_1_s_to_a_cap_of_30_s_without_jitter() -> None:
    policy = Backoff()
    assert [policy.delay_s(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert policy.delay_s(10_000) == 30  # no overflow after days of failures
    assert Backoff(0.5, 3).delay_s(4) == 3


async def test_retrying_rides_out_each_kind_of_failure_logging_each() -> None:
    slept: list[float] = []
    log = Log()

    async def sleep(delay: float) -> None:
        slept.append(delay)

    step = Flaky("answer")
    assert await retrying.retrying(step, "ensure_scheduler", logger=log, sleep=sleep, pool="p") == "answer"
    assert step.calls == 5 and slept == [1, 2, 4, 8]
    failed = log.events("retrying")
    assert [f["attempt"] for f in failed] == [1, 2, 3, 4]
    assert failed[0] == {
        "what": "ensure_scheduler",
        "attempt": 1,
        "retry_in_s": 1,
        "error": "RPCError: Timeout expired",
        "pool": "p",
    }
    assert [f["error"].split(":")[0] for f in failed] == [
        "RPCError",
        "TimeoutError",
        "OperationalError",
        "ConnectionError",
    ]
    assert log.events("retry_succeeded") == [{"what": "ensure_scheduler", "attempts": 5, "pool": "p"}]


async def test_retrying_and_supervised_let_a_cancel_through() -> None:
    async def blocked() -> None:
        await asyncio.Event().wait()

    for wrapped in (retrying.retrying(blocked, "x"), retrying.supervised(blocked, "x")):
        task = asyncio.create_task(wrapped)
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_supervised_restarts_a_loop_that_raises_and_starts_afresh_after_a_long_run() -> None:
    slept: list[float] = []
    now = [0.0]
    runs: list[float] = [0.0, 0.0, 0.0, 100.0]  # how long each run lasts before it fails

    async def sleep(delay: float) -> None:
        slept.append(delay)

    async def loop() -> None:
        if not runs:
            return  # the fifth run ends normally: supervised returns
        now[0] += runs.pop(0)
        raise timeout_expired()

    log = Log()
    await retrying.supervised(loop, "pool_scheduler", logger=log, sleep=sleep, clock=lambda: now[0], pool="p")
    assert slept == [1, 2, 4, 1]  # the run of 100 s (past the cap) started the back-off afresh
    assert [f["failures"] for f in log.events("loop_failed")] == [1, 2, 3, 1]
    assert log.events("loop_failed")[0]["loop"] == "pool_scheduler"


# --- the control worker -------------------------------------------------------------------------------


class FakeStore:
    def __init__(self) -> None:
        self.migrate = Flaky([])
        self.closed = False

    async def close(self) -> None:
        self.closed = True


class FakeMetrics:
    polled: list[str] = []

    async def poll(self, pool: str, query: Any, **queries: Any) -> None:
        FakeMetrics.polled.append(pool)
        await asyncio.Event().wait()


class FakeControlWorker:
    """Its first run fails as a Temporal worker does when its namespace check times out."""

    built: list[FakeControlWorker] = []

    def __init__(self, pools: list[str]) -> None:
        self.pools = pools
        self.running = False
        FakeControlWorker.built.append(self)

    def serve_pool(self, pool: str) -> None:
        self.pools.append(pool)

    async def run(self) -> None:
        if len(FakeControlWorker.built) == 1:
            raise timeout_expired()
        self.running = True
        await asyncio.Event().wait()

    async def __aenter__(self) -> FakeControlWorker:  # how the code before the fix used it
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


async def test_the_control_worker_keeps_going_while_ensure_scheduler_and_its_workers_fail(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fast_backoff: None
) -> None:
    from workers import control

    store = FakeStore()
    connected = Flaky(object(), [timeout_expired])
    opened = Flaky(store, [lambda: psycopg.OperationalError("the database system is starting up")])
    handle = object()
    ensured = Flaky(handle, [timeout_expired, timeout_expired, lambda: TimeoutError(), timeout_expired])
    FakeMetrics.polled = []
    FakeControlWorker.built = []

    async def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    monkeypatch.setattr(control, "connect", connected)
    monkeypatch.setattr(control.Store, "open", opened)
    monkeypatch.setattr(control, "register_search_attributes", nothing)
    monkeypatch.setattr(control, "sweep_forever", nothing)
    monkeypatch.setattr(control, "serve_metrics", lambda metrics, settings: 0)
    monkeypatch.setattr(control, "Metrics", FakeMetrics)
    monkeypatch.setattr(control, "ensure_scheduler", ensured)
    monkeypatch.setattr(control, "_status_query", lambda handle: None)
    monkeypatch.setattr(control, "build_control_worker", lambda *a, pools, **k: FakeControlWorker(list(pools)))
    settings = Settings(temporal_address="127.0.0.1:1", database_url="postgresql://x@127.0.0.1:1/x", home=tmp_path)

    worker = asyncio.create_task(control.run(settings, ["pool-a"]))
    try:
        # The scheduler is ensured after four failures, and its status polled from then on.
        await until(lambda: FakeMetrics.polled == ["pool-a"])
        assert ensured.calls == 5 and connected.calls == 2 and opened.calls == 2 and store.migrate.calls == 5
        # The Temporal workers that failed were replaced by fresh ones, serving the pool.
        await until(lambda: len(FakeControlWorker.built) == 2 and FakeControlWorker.built[1].running)
        assert FakeControlWorker.built[1].pools == ["pool-a"]
        assert not worker.done()
    finally:
        worker.cancel()
        with pytest.raises(asyncio.CancelledError):
            await worker
    assert store.closed


# --- the node worker ----------------------------------------------------------------------------------


class FakeRuntime:
    def __init__(self) -> None:
        self.closed = False

    async def close(self) -> None:
        self.closed = True


class FakeTemporalWorker:
    """A Temporal worker whose first run fails (a poll that failed for good)."""

    built = 0

    def __init__(self) -> None:
        FakeTemporalWorker.built += 1
        self.first = FakeTemporalWorker.built == 1
        self.task_queue = "node:box"
        self.stopped = asyncio.Event()

    async def run(self) -> None:
        if self.first:
            raise RuntimeError("Worker failed: poll error")
        await self.stopped.wait()

    async def shutdown(self) -> None:
        self.stopped.set()


async def test_the_node_worker_keeps_going_while_telemetry_and_its_worker_fail(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fast_backoff: None
) -> None:
    from types import SimpleNamespace

    from workers import node

    runtime = FakeRuntime()
    backend = SimpleNamespace(label="simulated", host=None)
    telemetry = Flaky()
    FakeTemporalWorker.built = 0
    monkeypatch.setattr(node, "choose_backend", lambda *args: (backend, {"fake": runtime}))
    monkeypatch.setattr(node, "connect", Flaky(object(), [lambda: ConnectionError("refused")]))
    monkeypatch.setattr(node, "ensure_telemetry", telemetry)
    monkeypatch.setattr(node, "node_activities", lambda *args: object())
    monkeypatch.setattr(node, "node_temporal_worker", lambda *args: FakeTemporalWorker())
    settings = Settings(temporal_address="127.0.0.1:1", home=tmp_path, delegation_sync_s=0)

    worker = asyncio.create_task(node.run(settings, "box", None))
    try:
        await until(lambda: telemetry.calls == 5 and FakeTemporalWorker.built == 2)
        await asyncio.sleep(0.1)
        assert not worker.done() and FakeTemporalWorker.built == 2
    finally:
        worker.cancel()
        with pytest.raises(asyncio.CancelledError):
            await worker
    assert runtime.closed  # no model server outlives its node worker


def test_sigterm_stops_a_node_worker_with_status_0(tmp_path: Path) -> None:
    """While it waits for Temporal (nothing answers), as any time: SIGTERM runs its shutdown
    (model servers stopped, `node_worker_stopped` logged) and it exits 0, not -15."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    env.update(MODELFORGE_HOME=str(tmp_path), MODELFORGE_GPU_BACKEND="simulated")
    env["MODELFORGE_TEMPORAL_ADDRESS"] = "127.0.0.1:1"
    argv = [sys.executable, "-m", "modelforge", "worker", "node", "--node", "gpu-node"]
    argv += ["--simulate-from", str(example_catalog_path())]
    log_path = tmp_path / "node.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "simulated_gpu" not in log_path.read_text():  # past its imports, connecting
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, log_path.read_text()
        assert "node_worker_stopped" in log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
