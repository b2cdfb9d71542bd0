"""The host CPU as a declared device (`kind = "cpu"` in the catalog): a memory budget for models
that run on the CPU, such as the built-in embedding runtime on a machine without a GPU.

It is declared, never a fallback: a node serves one only when configured to, and the catalog
never makes it production eligible. Its external usage is host memory the budget assumed and the
host no longer has (MemAvailable below the unmanaged part of the budget): other programs
crowding the host count against it as unmanaged processes crowd a GPU."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from modelforge.gpu._protocol import DeviceSample, GpuProcess

CPU_DEVICE_INDEX = -1
"""The device index of the host CPU in samples and load inputs (`<node>/cpu`)."""


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    for line in meminfo.read_text(encoding="ascii").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"{meminfo} has no MemAvailable line")


class HostMemoryDevice:
    def __init__(self, node: str, budget_bytes: int, available: Callable[[], int] = mem_available_bytes) -> None:
        if budget_bytes <= 0:
            raise ValueError("a cpu device needs a positive memory budget")
        self.node = node
        self.budget_bytes = budget_bytes
        self._available = available
        self._lock = threading.Lock()
        # name -> (pid, bytes): in-process models share the worker's pid, so names are the keys.
        self._allocations: dict[str, tuple[int, int]] = {}

    def allocate(self, pid: int, nbytes: int, name: str) -> None:
        with self._lock:
            self._allocations[name] = (pid, nbytes)

    def free(self, name: str) -> None:
        with self._lock:
            self._allocations.pop(name, None)

    def sample(self) -> DeviceSample:
        with self._lock:
            processes = [GpuProcess(pid, nbytes, name) for name, (pid, nbytes) in self._allocations.items()]
        managed = sum(p.used_bytes for p in processes)
        crowded = max(0, (self.budget_bytes - managed) - self._available())
        if crowded:
            processes.append(GpuProcess(0, crowded, "host memory used by other programs"))
        return DeviceSample(
            index=CPU_DEVICE_INDEX,
            uuid=f"CPU-{self.node}",
            name="CPU (host memory)",
            total_bytes=self.budget_bytes,
            used_bytes=min(self.budget_bytes, managed + crowded),
            processes=processes,
        )
