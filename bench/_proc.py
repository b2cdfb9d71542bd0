"""CPU seconds of this process and of the Temporal dev server it started, from /proc: what a
benchmark's workflows cost where, beside how fast they went (on 2 cores a burst is CPU-bound,
so its throughput follows the CPU each workflow costs)."""

from __future__ import annotations

import os
import time
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User and system CPU seconds of a process, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def dev_server_pid() -> int:
    """The dev server this process started (its child, `temporal server start-dev`)."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes()
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == me and b"start-dev" in command:
            return int(entry.name)
    raise SystemExit("the Temporal dev server this benchmark started was not found in /proc")


class CpuMeter:
    """CPU seconds spent between `start` and `stop`: this process (Python and the SDK's core
    threads) and the dev server."""

    def __init__(self) -> None:
        self.server = dev_server_pid()
        self.mine = self.theirs = 0.0
        self._at = (0.0, 0.0)

    def start(self) -> None:
        self._at = (time.process_time(), cpu_s(self.server))

    def stop(self) -> None:
        self.mine += time.process_time() - self._at[0]
        self.theirs += cpu_s(self.server) - self._at[1]
