"""The devices of one node as its activities and runtimes see them: the GPUs (NVML, real or
simulated) and, when declared, the host CPU. Runtimes that only pretend to use a device (the
simulated runtime, or a real process on a simulated card) record their bytes here so samples
show them exactly as NVML would show a real allocation."""

from __future__ import annotations

from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gpu._host import CPU_DEVICE_INDEX, HostMemoryDevice
from modelforge.gpu._protocol import DeviceSample, GpuBackend
from modelforge.gpu._simulated import SimulatedGpuBackend


class NodeDevices:
    def __init__(self, gpus: GpuBackend, host: HostMemoryDevice | None = None) -> None:
        self.gpus = gpus
        self.host = host
        self.label = gpus.label

    @property
    def simulated_gpus(self) -> bool:
        return isinstance(self.gpus, SimulatedGpuBackend)

    def sample(self) -> list[DeviceSample]:
        samples = self.gpus.sample()
        if self.host is not None:
            samples.append(self.host.sample())
        return samples

    def allocate(self, device_index: int, pid: int, nbytes: int, name: str) -> None:
        """Record bytes that a simulated device, or the host budget, should show for `name`."""
        if device_index == CPU_DEVICE_INDEX:
            if self.host is None:
                raise ModelForgeError(FailureClass.CAPABILITY_UNAVAILABLE, "this node declares no cpu device")
            self.host.allocate(pid, nbytes, name)
        elif isinstance(self.gpus, SimulatedGpuBackend):
            self.gpus.allocate(device_index, pid, nbytes, name)
        # A real card needs no record: NVML reports what the process holds.

    def free(self, device_index: int, pid: int, name: str) -> None:
        if device_index == CPU_DEVICE_INDEX:
            if self.host is not None:
                self.host.free(name)
        elif isinstance(self.gpus, SimulatedGpuBackend):
            self.gpus.free(pid)

    def process_bytes(self, device_index: int, pids: set[int]) -> int:
        """What NVML (or the host budget) attributes to these processes on one device."""
        return sum(p.used_bytes for d in self.sample() if d.index == device_index for p in d.processes if p.pid in pids)
