"""The real backend on nvidia-ml-py. NVML errors become DRIVER_ERROR."""

from __future__ import annotations

import threading
from typing import Any

from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gpu._protocol import DeviceSample, GpuProcess


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlGpuBackend:
    label = "nvml"

    def __init__(self) -> None:
        import pynvml

        self._nvml = pynvml
        self._lock = threading.Lock()
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as error:
            raise ModelForgeError(FailureClass.DRIVER_ERROR, f"nvmlInit failed: {error}") from error

    @staticmethod
    def available() -> bool:
        try:
            import pynvml

            pynvml.nvmlInit()
            count = int(pynvml.nvmlDeviceGetCount())
            pynvml.nvmlShutdown()
            return count > 0
        except Exception:
            return False

    def sample(self) -> list[DeviceSample]:
        nvml = self._nvml
        with self._lock:
            try:
                samples = []
                for index in range(nvml.nvmlDeviceGetCount()):
                    handle = nvml.nvmlDeviceGetHandleByIndex(index)
                    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                    processes: dict[int, GpuProcess] = {}
                    for getter in (
                        nvml.nvmlDeviceGetComputeRunningProcesses,
                        nvml.nvmlDeviceGetGraphicsRunningProcesses,
                    ):
                        for proc in getter(handle):
                            used = int(proc.usedGpuMemory or 0)
                            previous = processes.get(int(proc.pid))
                            processes[int(proc.pid)] = GpuProcess(
                                int(proc.pid), max(used, previous.used_bytes if previous else 0)
                            )
                    # Not every card reports these (NOT_SUPPORTED): each reads as 0 on its own,
                    # never failing the sample.
                    try:
                        utilization = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                    except nvml.NVMLError:
                        utilization = 0.0
                    try:
                        temperature = float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
                    except nvml.NVMLError:
                        temperature = 0.0
                    samples.append(
                        DeviceSample(
                            index=index,
                            uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                            name=_text(nvml.nvmlDeviceGetName(handle)),
                            total_bytes=int(memory.total),
                            used_bytes=int(memory.used),
                            processes=list(processes.values()),
                            utilization_pct=utilization,
                            temperature_c=temperature,
                        )
                    )
                return samples
            except nvml.NVMLError as error:
                raise ModelForgeError(FailureClass.DRIVER_ERROR, f"NVML: {error}") from error
