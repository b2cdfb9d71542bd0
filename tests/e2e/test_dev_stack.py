"""The whole embedded stack as a user runs it: `modelforge dev` in a fresh MODELFORGE_HOME, then
the CLI against it, then Ctrl-C, then a second start that keeps histories and rows."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.dev_process import Dev, running

pytestmark = pytest.mark.e2e

ENVELOPE = 1_216_348_160
GiB = 1024**3


@pytest.fixture
def dev(tmp_path: Path) -> Iterator[Dev]:
    with running(tmp_path / "home") as stack:
        yield stack


def _gpu(status: object) -> dict[str, object]:
    assert isinstance(status, dict)
    return next(a for a in status["accelerators"] if a["id"] == "gpu-node/0")


def test_request_end_to_end_then_restart_keeps_history(dev: Dev) -> None:
    result = dev.json("request", "rag.embedding@1", "--tenant", "rag", "--input", '{"text": "hello"}')
    assert isinstance(result, dict)
    assert result["ok"] is True and result["output"]["simulated"] is True
    assert result["lease"]["accelerator"] == "gpu-node/0"
    request_id = result["request_id"]

    # status counts the resident model and the simulated Ollama's 6 GiB as external.
    gpu = _gpu(dev.json("status"))
    assert gpu["resident_bytes"] == ENVELOPE
    assert gpu["external_bytes"] == 6 * GiB
    assert gpu["simulated"] is True
    # 24 GiB - 6 GiB external - 1,216,348,160 resident - 0 leased - 1 GiB reserve
    assert gpu["schedulable_bytes"] == 24 * GiB - 6 * GiB - ENVELOPE - 0 - 1 * GiB

    [warm] = dev.json("ps")  # type: ignore[misc]
    assert (warm["deployment"], warm["state"], warm["residency"]) == ("rag.embedding@1", "ready", "keep_warm")
    assert 800 < warm["ttl_left_s"] <= 901

    # The event log, read back from Postgres, tells the story of the request. Writes are
    # asynchronous (never on the admission path), so give them a moment.
    wanted = {"lease_granted", "load", "health_check", "invoke", "lease_released"}
    deadline = time.monotonic() + 30
    while True:
        events = dev.json("events")
        assert isinstance(events, list)
        kinds = {e["kind"] for e in events if e["request_id"] in ("", request_id)}
        if wanted <= kinds or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert wanted <= kinds
    granted = next(e for e in events if e["kind"] == "lease_granted")
    assert granted["request_id"] == request_id and granted["accelerator"] == "gpu-node/0"

    # Failures print their class and exit non-zero.
    unknown = dev.cli("request", "vision.ocr@9")
    assert unknown.returncode == 1 and "CAPABILITY_UNAVAILABLE" in unknown.stderr
    bad = dev.cli("request", "rag.embedding@1", "--input", "[1, 2")
    assert bad.returncode == 1 and "REQUEST_INVALID" in bad.stderr
    desktop_only = dev.cli("request", "lab.experiment@1", "--tenant", "lab", "--priority", "production")
    assert desktop_only.returncode == 1
    assert "CAPABILITY_UNAVAILABLE" in desktop_only.stderr and "production_eligible=false" in desktop_only.stderr
    ceiling = dev.cli("request", "rag.embedding@1", "--priority", "production")  # tenant default: interactive
    assert ceiling.returncode == 1 and "REQUEST_INVALID" in ceiling.stderr

    # Ctrl-C stops every process it started; a second start keeps the histories and the rows.
    assert dev.stop() == 0
    assert list((dev.home / "run").glob("*.pid")) == []
    down = dev.cli("status")
    assert down.returncode != 0 and dev.env["MODELFORGE_TEMPORAL_ADDRESS"] in down.stderr
    assert len(down.stderr.strip().splitlines()) == 1

    dev.start()
    events_after = dev.json("events", "--request-id", request_id)
    assert isinstance(events_after, list) and any(e["kind"] == "lease_granted" for e in events_after)
    again = dev.json("request", "rag.embedding@1", "--tenant", "rag")
    assert isinstance(again, dict) and again["ok"] is True


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1.0):
        return True
    return False


@contextlib.contextmanager
def _pgserver_lock_held_elsewhere() -> Iterator[None]:
    """pgserver's machine-wide lock held by another process for the block (at most a minute)."""
    with subprocess.Popen(
        [sys.executable, "-c", HOLD_PGSERVER_LOCK], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            yield
        finally:
            holder.kill()


HOLD_PGSERVER_LOCK = """
import warnings, sys, select
warnings.filterwarnings("ignore")
from pgserver.postgres_server import PostgresServer
with PostgresServer._lock:
    print("held", flush=True)
    select.select([sys.stdin], [], [], 60)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_dev_stops_on_a_signal_even_with_sigint_inherited_ignored(tmp_path: Path, sig: int) -> None:
    """Started from a shell that ignores SIGINT (a background job, nohup), `dev` still stops on
    SIGINT (and SIGTERM), stopping everything it started and freeing its ports, within seconds
    even while another program on the machine holds the lock all pgserver users share (it starts
    a Postgres of its own): the stop waited for it (a minute in CI)."""
    with running(tmp_path / "home", ignore_sigint=True) as stack:
        temporal_port = int(stack.env["MODELFORGE_TEMPORAL_ADDRESS"].rpartition(":")[2])
        assert _listening(temporal_port) and _listening(stack.ui_port)
        with _pgserver_lock_held_elsewhere():
            started = time.monotonic()
            assert stack.stop(sig) == 0, "".join(stack.output)
            assert time.monotonic() - started < 30, "".join(stack.output)
        assert "stopping..." in "".join(stack.output)
        assert list((stack.home / "run").glob("*.pid")) == []
        assert not (stack.home / "pgdata" / "postmaster.pid").exists()
        deadline = time.monotonic() + 10
        while (_listening(temporal_port) or _listening(stack.ui_port)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _listening(temporal_port) and not _listening(stack.ui_port)


def test_a_second_ctrl_c_while_dev_stops_leaves_nothing_running(tmp_path: Path) -> None:
    """Ctrl-C pressed twice (the second while the stack stops): `dev` still stops everything it
    started; the second cut its stop short and left the embedded Postgres running."""
    with running(tmp_path / "home") as stack:
        assert stack.process is not None
        stack.process.send_signal(signal.SIGINT)
        time.sleep(0.3)
        assert stack.stop(signal.SIGINT) == 0, "".join(stack.output)
        assert list((stack.home / "run").glob("*.pid")) == []
        assert not (stack.home / "pgdata" / "postmaster.pid").exists(), "Postgres left running"


# A simulated card and the project's toy model server (subprocess_http): a real child process of
# the node worker, in a session of its own.
TOY_CATALOG = f"""
[[accelerators]]
id = "box/0"
node = "box"
model = "Simulated L4 24GB"
total_bytes = 25769803776
simulated = true

[[deployments]]
capability = "toy.embedding@1"
envelope_bytes = 2147483648
idle_bytes = 1073741824
residency = "keep_warm"
runtime = "subprocess_http"
command = [{json.dumps(sys.executable)}, "-m", "modelforge.runtimes.toy_server", "--port", "{{port}}"]
runtime_config = {{ api = "openai_embeddings", ready_timeout_s = "60" }}
accelerators = ["box/0"]

[[tenants]]
name = "default"
default_priority = "interactive"
max_priority = "interactive"
"""


def _alive(pid: int) -> bool:
    from modelforge.runtimes._process import alive

    return alive(pid)


def _model_server(dev: Dev, within_s: float = 120.0) -> int:
    """The toy server's pid once a request through it answered (asked again while the node
    worker is starting)."""
    deadline = time.monotonic() + within_s
    while True:
        done = dev.cli("request", "toy.embedding@1", "--input", '{"text": "hello"}', "--json")
        if done.returncode == 0 and json.loads(done.stdout)["ok"]:
            break
        assert time.monotonic() < deadline, done.stderr + done.stdout + "".join(dev.output)
        time.sleep(1.0)
    [pid_file] = (dev.home / "runtime-logs" / "box").glob("*.pid")
    return int(json.loads(pid_file.read_text())["pid"])


def test_a_node_worker_stops_its_model_server_on_sigterm_and_dev_restarts_it(tmp_path: Path) -> None:
    """SIGTERM to a node worker stops the model server it started before it exits; `dev`
    restarts the worker (it did not ask it to stop), which serves again; stopping `dev`
    stops the new server too."""
    catalog = tmp_path / "toy.toml"
    catalog.write_text(TOY_CATALOG)
    with running(tmp_path / "home", args=("--catalog", str(catalog))) as dev:
        first = _model_server(dev)
        worker = int((dev.home / "run" / "worker-node-box.pid").read_text())
        os.kill(worker, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while _alive(worker):
            assert time.monotonic() < deadline, "the node worker did not stop on SIGTERM"
            time.sleep(0.05)
        # Stopped by the worker itself, before it exited (not by its restart's reaping).
        assert not _alive(first), "the model server outlived its node worker"
        while "restarted worker-node-box" not in "".join(dev.output):
            assert time.monotonic() < deadline + 30, "".join(dev.output)
            time.sleep(0.2)
        assert "worker-node-box exited with 0: restarting it in 1 s" in "".join(dev.output)
        second = _model_server(dev)
        assert second != first and _alive(second)
        assert dev.stop(signal.SIGTERM) == 0, "".join(dev.output)
        assert not _alive(second)
        assert list((dev.home / "run").glob("*.pid")) == []
