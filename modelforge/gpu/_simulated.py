"""A simulated NVML: devices, unmanaged processes over time, and allocations made by the
simulated runtime, so the scheduler sees the same kind of samples a real card produces.
Everything it reports is labelled simulated."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gpu._protocol import DeviceSample, GpuProcess


@dataclass
class SimulatedDevice:
    index: int
    uuid: str
    name: str
    total_bytes: int


@dataclass
class ExternalProcess:
    """An unmanaged process (Ollama, Plex, Tdarr) on a device, present from start_s to end_s
    seconds after the backend started."""

    device_index: int
    pid: int
    name: str
    used_bytes: int
    start_s: float = 0.0
    end_s: float | None = None


class SimulatedGpuBackend:
    label = "simulated"

    def __init__(
        self,
        devices: list[SimulatedDevice],
        external: list[ExternalProcess] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._devices = {d.index: d for d in devices}
        self._external = list(external or [])
        self._allocations: dict[int, tuple[int, int, str]] = {}  # pid -> (device, bytes, name)
        self._clock = clock
        self._started = clock()
        self._lock = threading.Lock()
        self._driver_errors = 0
        self._unreclaimed = 0

    def devices(self) -> list[SimulatedDevice]:
        return list(self._devices.values())

    def allocate(self, device_index: int, pid: int, nbytes: int, name: str) -> None:
        with self._lock:
            device = self._devices.get(device_index)
            if device is None:
                raise ModelForgeError(FailureClass.DRIVER_ERROR, f"no simulated device {device_index}")
            used = self._used(device_index)
            if used + nbytes > device.total_bytes:
                raise ModelForgeError(
                    FailureClass.GPU_OOM,
                    f"simulated device {device_index}: {used} B used + {nbytes} B > {device.total_bytes} B",
                )
            self._allocations[pid] = (device_index, nbytes, name)

    def free(self, pid: int) -> None:
        with self._lock:
            if self._unreclaimed > 0 and pid in self._allocations:
                # The process is gone but the driver still shows its memory (a leaked context).
                self._unreclaimed -= 1
                return
            self._allocations.pop(pid, None)

    def inject_unreclaimed(self, count: int) -> None:
        """The next `count` frees leave their memory held, as a leaked CUDA context would."""
        with self._lock:
            self._unreclaimed = count

    def inject_driver_errors(self, count: int) -> None:
        """The next `count` samples fail as NVML would with a driver fault."""
        with self._lock:
            self._driver_errors = count

    def add_external(self, process: ExternalProcess) -> None:
        with self._lock:
            self._external.append(process)

    def remove_external(self, pid: int) -> None:
        """The unmanaged process exits (a transcode finishes)."""
        with self._lock:
            self._external = [p for p in self._external if p.pid != pid]

    def _active_external(self, device_index: int) -> list[ExternalProcess]:
        elapsed = self._clock() - self._started
        return [
            p
            for p in self._external
            if p.device_index == device_index and p.start_s <= elapsed and (p.end_s is None or elapsed < p.end_s)
        ]

    def _used(self, device_index: int) -> int:
        external = sum(p.used_bytes for p in self._active_external(device_index))
        return external + sum(b for d, b, _ in self._allocations.values() if d == device_index)

    def sample(self) -> list[DeviceSample]:
        with self._lock:
            if self._driver_errors > 0:
                self._driver_errors -= 1
                raise ModelForgeError(FailureClass.DRIVER_ERROR, "simulated NVML driver error (injected)")
            samples = []
            for device in self._devices.values():
                processes = [GpuProcess(p.pid, p.used_bytes, p.name) for p in self._active_external(device.index)]
                processes += [
                    GpuProcess(pid, nbytes, name)
                    for pid, (index, nbytes, name) in self._allocations.items()
                    if index == device.index
                ]
                samples.append(
                    DeviceSample(
                        index=device.index,
                        uuid=device.uuid,
                        name=device.name,
                        total_bytes=device.total_bytes,
                        used_bytes=sum(p.used_bytes for p in processes),
                        processes=processes,
                    )
                )
            return samples
