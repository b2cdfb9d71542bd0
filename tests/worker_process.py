"""`modelforge worker control` run as an operator runs it, in a process of its own, for tests that
kill it, restart Temporal under it, or run another release's code in it. A helper module: tests
import it, never each other."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def control_worker_env(temporal_address: str, database_url: str, home: Path, **extra: str) -> dict[str, str]:
    """This environment less every MODELFORGE_ setting, then the worker's own: the Temporal
    server, the database, its home, and ports of its own (tests run side by side share none;
    the Temporal SDK's metrics are off), then `extra`."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    environ.update(
        MODELFORGE_TEMPORAL_ADDRESS=temporal_address,
        MODELFORGE_DATABASE_URL=database_url,
        MODELFORGE_METRICS_PORT=str(free_port()),
        MODELFORGE_TEMPORAL_METRICS_ADDRESS="off",
        MODELFORGE_HOME=str(home),
        **extra,
    )
    return environ


def start_control_worker(environ: dict[str, str], log: Path, cwd: Path | None = None) -> subprocess.Popen[bytes]:
    """`python -m modelforge worker control` with `environ`, its output appended to `log`."""
    with log.open("ab") as output:
        return subprocess.Popen(
            [sys.executable, "-m", "modelforge", "worker", "control"],
            cwd=cwd,
            env=environ,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
