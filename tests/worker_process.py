"""`modelforge worker control` run as an operator runs it, in a process of its own, for tests that
kill it, restart Temporal under it, or run another release's code in it. A helper module: tests
import it, never each other."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

# Ports handed to servers a test starts are picked from here, below the kernel's ephemeral range:
# a port picked from that range (bind to 0) may be given to any process's outbound connection
# (to Postgres, to Temporal) between the pick and the server's own bind. It was: a Temporal dev
# server of `modelforge dev` exited with its UI port "address already in use" in a full run.
_PICK_FROM = 20_000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def free_port() -> int:
    """A loopback port free now, for a server a test starts (`_PICK_FROM`). Chosen by the
    system's randomness, not `random`'s: test processes side by side may share its seed."""
    high = _ephemeral_low() - 1
    if high - _PICK_FROM >= 1_000:
        pick = random.SystemRandom()
        for _ in range(200):
            port = pick.randint(_PICK_FROM, high)
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as probe:  # no room below the ephemeral range: the kernel's pick
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
