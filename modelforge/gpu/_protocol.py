from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int
    name: str = ""


@dataclass(frozen=True)
class DeviceSample:
    index: int
    uuid: str
    name: str
    total_bytes: int
    used_bytes: int
    processes: list[GpuProcess] = field(default_factory=list)
    utilization_pct: float = 0.0
    temperature_c: float = 0.0
    healthy: bool = True
    health_reason: str = ""
    # Cards NVLink joins share a group id (NVML topology); "" for none.
    nvlink_group: str = ""


class GpuBackend(Protocol):
    """What the node worker needs of NVML. `label` is shown to users: "nvml" or "simulated"."""

    label: str

    def sample(self) -> list[DeviceSample]:
        """One sample of every device; raises ModelForgeError(DRIVER_ERROR) when NVML fails."""
        ...
