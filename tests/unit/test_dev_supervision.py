"""`modelforge dev` looks after its workers: a worker that dies is
restarted, after a back-off, and given up on after repeated quick deaths; a stop leaves nothing
a worker started running (a node worker's model servers run in sessions of their own); and on a
loaded host the start waits while the workers it waits for are progressing, naming the slow one,
instead of giving up after a fixed 120 s."""

from __future__ import annotations

import io
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from modelforge import dev, retrying
from modelforge.catalog import example_catalog_path
from modelforge.failures import ModelForgeError
from modelforge.runtimes._process import alive
from modelforge.settings import Settings


@pytest.fixture
def printed(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    out = io.StringIO()
    monkeypatch.setattr(dev, "console", Console(file=out, width=300))
    monkeypatch.setattr(retrying, "DEFAULT_BACKOFF", retrying.Backoff(initial_s=0.05, cap_s=0.2))
    return out


def _stack(tmp_path: Path) -> dev.DevStack:
    settings = Settings(home=tmp_path)
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    return dev.DevStack(settings, example_catalog_path(), 0)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_worker_that_dies_is_restarted_and_one_that_keeps_dying_is_given_up_on(
    tmp_path: Path, printed: io.StringIO
) -> None:
    stack = _stack(tmp_path)
    try:
        stack._spawn("worker-control", _python("import time; time.sleep(60)"), dict(os.environ))
        stack._spawn("worker-node-box", _python("print('cannot start: no such card', flush=True); exit(3)"), {})
        steady = stack.children["worker-control"].pid
        deadline = time.monotonic() + 30
        with pytest.raises(ModelForgeError) as gave_up:
            while time.monotonic() < deadline:
                stack.watch()
                time.sleep(0.02)
        text = printed.getvalue()
        assert text.count("worker-node-box exited with 3") == dev.MAX_QUICK_DEATHS - 1
        assert text.count("restarted worker-node-box") == dev.MAX_QUICK_DEATHS - 1
        assert "restarting it in" in text
        message = gave_up.value.message
        assert f"the {dev.MAX_QUICK_DEATHS}th time in a row" in message and "not restarting it again" in message
        assert message.endswith(": cannot start: no such card")  # the log's last line
        # The one still running was never touched.
        assert stack.children["worker-control"].pid == steady and "worker-control" not in text
    finally:
        stack.stop()


def test_a_stop_stops_what_a_worker_left_running_in_a_session_of_its_own(tmp_path: Path, printed: io.StringIO) -> None:
    """As a node worker killed before it stopped its model servers (each in a session of its
    own, out of reach of a signal to the worker's group)."""
    child = tmp_path / "server.pid"
    worker = (
        "import subprocess, sys, time\n"
        "server = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True)\n"
        f"open({str(child)!r}, 'w').write(str(server.pid))\n"
        "time.sleep(300)\n"
    )
    stack = _stack(tmp_path)
    stack._spawn("worker-node-box", _python(worker), dict(os.environ))
    deadline = time.monotonic() + 30
    while not child.exists() or not child.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    server = int(child.read_text())
    try:
        assert alive(server)
        stack.stop()
        assert not alive(server)
        assert "stopped what worker-node-box left running" in printed.getvalue()
        assert list(stack.settings.run_dir.glob("*.pid")) == []
    finally:
        if alive(server):
            os.killpg(server, signal.SIGKILL)


class SlowStack:
    """A DevStack as `_wait_ready` sees it: workers progressing (or not), none dying."""

    def __init__(self, progressing: bool) -> None:
        self.progressing = progressing
        self.children = {"worker-control": None, "worker-node-gpu-node": None}
        self.logs = Path("/logs")
        self.watched = 0

    def watch(self) -> None:
        self.watched += 1

    def progressed(self, name: str) -> bool:
        return self.progressing

    def describe(self, name: str) -> str:
        return f"{name}: alive (importing)"


def _temporal(monkeypatch: pytest.MonkeyPatch, fresh_after_s: float) -> None:
    from modelforge import client as client_module

    ready_at = time.monotonic() + fresh_after_s

    class Client:
        router = SimpleNamespace(pools_ttl_s=0.0)

        async def status(self) -> Any:
            fresh = time.monotonic() >= ready_at
            return SimpleNamespace(accelerators=[SimpleNamespace(node="gpu-node", fresh=fresh)])

    async def connect(settings: Any) -> Client:
        return Client()

    monkeypatch.setattr(client_module.ModelForgeClient, "connect", connect)


async def test_the_start_waits_past_the_stall_time_while_the_workers_progress(
    monkeypatch: pytest.MonkeyPatch, printed: io.StringIO
) -> None:
    _temporal(monkeypatch, fresh_after_s=2.0)
    monkeypatch.setattr(dev, "REPORT_S", 0.5)
    stack = SlowStack(progressing=True)
    started = time.monotonic()
    await dev._wait_ready(Settings(), ["gpu-node"], stack, stall_s=0.5, max_s=30)  # type: ignore[arg-type]
    assert time.monotonic() - started >= 2.0 and stack.watched > 0  # dead workers looked after meanwhile
    # Meanwhile it said what it waits for, and on whom.
    assert "still starting" in printed.getvalue() and "worker-node-gpu-node: alive (importing)" in printed.getvalue()


async def test_the_start_gives_up_on_a_worker_that_makes_no_progress_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    _temporal(monkeypatch, fresh_after_s=3600)
    stack = SlowStack(progressing=False)
    started = time.monotonic()
    with pytest.raises(ModelForgeError) as gave_up:
        await dev._wait_ready(Settings(), ["gpu-node"], stack, stall_s=0.5, max_s=30)  # type: ignore[arg-type]
    assert time.monotonic() - started < 5
    message = gave_up.value.message
    assert "(no progress for 0.5 s)" in message
    assert "waiting for telemetry from ['gpu-node']" in message and "worker-node-gpu-node: alive" in message


async def test_the_start_gives_up_at_the_bound_even_while_progressing(monkeypatch: pytest.MonkeyPatch) -> None:
    _temporal(monkeypatch, fresh_after_s=3600)
    with pytest.raises(ModelForgeError) as gave_up:
        await dev._wait_ready(Settings(), ["gpu-node"], SlowStack(True), stall_s=0.5, max_s=1.0)  # type: ignore[arg-type]
    assert "1 s passed" in gave_up.value.message
